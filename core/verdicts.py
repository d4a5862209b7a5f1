"""The self-check's verdicts: which fused ops passed their byte-for-byte check on this GPU, kept in memory and on
disk, and what the forward paths ask of them (:func:`op_refusal`).

A verdict covers the probe sets a model's patch runs (core/probes.py for the NVFP4 Linear, models/*/probes.py for
a model's fused ops). It is cached on disk beside the kernel cache, keyed by the GPU, driver build, torch, CUDA
runtime, comfy-kitchen, the kernel sources and build defines, this pack's Python, the ComfyUI version and the
source of the ComfyUI code each probe set reproduces; a change of any of them re-runs the check.

``H3_FUSED_NVFP4_SELFCHECK``: ``auto`` (default: run once per key, then use the cached verdict), ``force`` (run
again, ignore the cache), ``skip`` (no checks: tests and benchmarks that check parity themselves). Any other value
is logged once and read as ``auto``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, Mapping

import torch

from .. import comfy_adapter
from ..kernels import cuda_ops, runtime
from ..kernels.backend import FusedOps, backend_for

log = logging.getLogger("h3_fused_nvfp4")

SELFCHECK_ENV = "H3_FUSED_NVFP4_SELFCHECK"
MODES = ("auto", "force", "skip")
REPORT_COMMAND = "python <ComfyUI>/custom_nodes/<this pack>/report.py"
VERDICT_FILE_MAX_BYTES = 1 << 20
PACK_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED_FOLDERS = ("core", "kernels", "models", "nodes")
SHIPPED_FILES = ("__init__.py", "layout.py", "comfy_adapter.py", "version.py")

Probe = Callable[[FusedOps, torch.device], "str | None"]


class NotApplicable(Exception):
    """Raised by a probe whose op does not run on this device or these tensors (the op is then not checked)."""


@dataclasses.dataclass(frozen=True)
class ProbeSet:
    """The probes of one family of fused ops. ``comfy_source`` hashes the ComfyUI code they reproduce;
    ``shares_global_scale``: ops that compute ComfyUI's dynamic scale with the shared reduction (off too when the
    ``global_scale`` probe fails: a random probe can round its one scale the right way by luck);
    ``shares_global_scale_f16``: the same for the fp16 reduction and its probe ``global_scale_f16``; ``aliases``:
    ops checked by another op's probe (name -> that probe's name)."""

    name: str
    probes: Mapping[str, Probe]
    comfy_source: Callable[[], str]
    shares_global_scale: tuple[str, ...] = ()
    shares_global_scale_f16: tuple[str, ...] = ()
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    needs_fp4_gemm: tuple[str, ...] = ()


_warned_mode = set()


def mode() -> str:
    value = os.environ.get(SELFCHECK_ENV, "auto").strip().lower()
    if value in MODES:
        return value
    if value not in _warned_mode:
        _warned_mode.add(value)
        log.warning("H3 fused NVFP4: %s=%r is not one of %s; using auto", SELFCHECK_ENV, value, ", ".join(MODES))
    return "auto"


@dataclasses.dataclass
class OpResult:
    ok: bool | None  # None: not applicable here
    detail: str
    ms: float = 0.0


@dataclasses.dataclass
class Verdict:
    key: dict
    ops: dict[str, OpResult]
    seconds: float
    origin: str  # "ran", "cached" or "skipped"
    block: str = "pending"  # "pending" | "passed" | "failed"
    block_detail: str = ""

    def failed(self) -> dict[str, OpResult]:
        return {name: r for name, r in self.ops.items() if r.ok is False}

    def summary(self) -> str:
        if self.origin == "skipped":
            return f"self-check skipped ({SELFCHECK_ENV}=skip)"
        failed = self.failed()
        checked = [n for n, r in self.ops.items() if r.ok is not None]
        where = f"{self.seconds * 1000:.0f} ms" if self.origin == "ran" else "cached verdict"
        if not failed:
            text = f"self-check passed ({len(checked)} ops bit-identical to ComfyUI's, {where})"
        else:
            text = (f"self-check FAILED for {', '.join(failed)} ({where}): those ops run ComfyUI's path. "
                    + " ".join(f"{n}: {r.detail}." for n, r in failed.items()) + f" Please report: {REPORT_COMMAND}")
        if self.block == "failed":
            text += f"; block check FAILED ({self.block_detail}): the model runs ComfyUI's path"
        elif self.block == "passed":
            text += "; block check passed"
        return text

    def to_json(self) -> dict:
        return {"key": self.key, "ops": {k: dataclasses.asdict(v) for k, v in self.ops.items()},
                "seconds": self.seconds, "block": self.block, "block_detail": self.block_detail}

    @classmethod
    def from_json(cls, data, key: dict, ops_checked: set[str]) -> "Verdict | None":
        """The verdict a cache file holds for ``key``, or None when the file is of any other shape or does not give
        a result for exactly the ops ``ops_checked`` (an op left out would run unchecked)."""
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("ops"), dict):
            return None
        if set(data["ops"]) != ops_checked:
            return None
        ops = {}
        for name, entry in data["ops"].items():
            if not (isinstance(entry, dict) and "ok" in entry and type(entry["ok"]) in (bool, type(None))
                    and isinstance(entry.get("detail"), str)):
                return None
            ms = entry.get("ms", 0.0)
            ops[name] = OpResult(entry["ok"], entry["detail"], float(ms) if isinstance(ms, (int, float)) else 0.0)
        block, detail = data.get("block", "pending"), data.get("block_detail", "")
        seconds = data.get("seconds", 0.0)
        if block not in ("pending", "passed", "failed") or not isinstance(detail, str):
            return None
        return cls(key, ops, float(seconds) if isinstance(seconds, (int, float)) else 0.0, "cached", block, detail)


# ---- the key -----------------------------------------------------------------------------------------------

def package_version(name: str) -> str:
    """An installed distribution's version, or "not installed"."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def pack_source_digest() -> str:
    """Hash of this pack's shipped Python that the verdict vouches for: an edited or updated pack re-runs the check."""
    digest = hashlib.sha256()
    paths = [PACK_ROOT / name for name in SHIPPED_FILES]
    for folder in SHIPPED_FOLDERS:
        paths += sorted((PACK_ROOT / folder).rglob("*.py"))
    for path in paths:
        digest.update(path.relative_to(PACK_ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def environment_key(device: torch.device, probe_sets: tuple[ProbeSet, ...]) -> dict:
    key = {"device": str(device), "torch": torch.__version__, "cuda_runtime": str(torch.version.cuda),
           "comfy_kitchen": package_version("comfy-kitchen"), "kernels": runtime.source_digest()[:16],
           "defines": repr(tuple(cuda_ops.kernel_defines(source) for source in runtime.SOURCES)),
           "pack": pack_source_digest(), "comfyui": comfy_adapter.comfyui_version(),
           "probes": {s.name: s.comfy_source() for s in probe_sets}}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key.update(gpu=props.name, capability=f"{props.major}.{props.minor}", driver=runtime.driver_version())
    return key


def _cache_path(key: dict) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return runtime.cache_dir() / "selfcheck" / f"{digest}.json"


def checked_ops(probe_sets: tuple[ProbeSet, ...]) -> set[str]:
    """Every op a verdict of these probe sets gives a result for: each probe's and each alias's."""
    return {name for s in probe_sets for name in (*s.probes, *s.aliases)}


def _load_cached(key: dict, probe_sets: tuple[ProbeSet, ...]) -> Verdict | None:
    path = _cache_path(key)
    runtime.warn_if_shared(path.parent)  # others could plant a passing verdict there
    data = runtime.read_cache_file(path, VERDICT_FILE_MAX_BYTES)
    if data is None:
        return None
    try:
        verdict = Verdict.from_json(json.loads(data), key, checked_ops(probe_sets))
    except (ValueError, RecursionError):  # not JSON; nested deeper than the parser goes
        verdict = None
    if verdict is None:
        log.warning("H3 fused NVFP4: ignoring the self-check verdict file %s (not a verdict of this pack); the "
                    "check runs again", path)
    return verdict


def _store(verdict: Verdict) -> None:
    try:
        runtime.atomic_write(_cache_path(verdict.key), json.dumps(verdict.to_json(), indent=1).encode())
    except OSError as exc:  # a read-only cache folder: the check runs again next time
        log.debug("could not store the self-check verdict: %s", exc)


# ---- running the probes ------------------------------------------------------------------------------------

def fp4_gemm_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def run_probes(backend: FusedOps, device: torch.device, probe_sets: tuple[ProbeSet, ...]) -> dict[str, OpResult]:
    """Run every probe of ``probe_sets`` (none raises: an exception is a failed check with its reason)."""
    results: dict[str, OpResult] = {}
    for probe_set in probe_sets:
        for name, probe in probe_set.probes.items():
            if name in probe_set.needs_fp4_gemm and not fp4_gemm_available(device):
                results[name] = OpResult(None, "no FP4 GEMM on this device (ComfyUI keeps NVFP4 layers in bf16 here)")
                continue
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    diff = probe(backend, device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                results[name] = OpResult(diff is None, diff or "bit-identical")
            except NotApplicable as exc:
                results[name] = OpResult(None, f"not applicable: {exc}")
            except Exception as exc:  # the check must report, not raise
                results[name] = OpResult(False, f"the check raised {type(exc).__name__}: {exc}")
            results[name].ms = (time.perf_counter() - t0) * 1000
        for alias, source in probe_set.aliases.items():
            if source in results:
                results[alias] = OpResult(results[source].ok, results[source].detail, 0.0)
    return results


# ---- verdicts per device -----------------------------------------------------------------------------------

_verdicts: dict[str, Verdict] = {}
_probe_sets: dict[str, tuple[ProbeSet, ...]] = {}
_lock = threading.Lock()
_generation = 0  # bumped whenever a verdict changes: forward plans (core/plan.py) are rebuilt then


def generation() -> int:
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


def kernel_verdict(device: torch.device, probe_sets: tuple[ProbeSet, ...], backend: FusedOps | None = None) -> Verdict:
    """The self-check verdict for ``device`` and these probe sets: from memory, the disk cache, or a run now."""
    device = torch.device(device)
    memory_key = f"{device}|{','.join(s.name for s in probe_sets)}"
    with _lock:
        verdict = _verdicts.get(memory_key)
        if verdict is not None:
            return verdict
        key = environment_key(device, probe_sets)
        if mode() == "skip":
            verdict = Verdict(key, {}, 0.0, "skipped", block="passed")
        else:
            verdict = _load_cached(key, probe_sets) if mode() == "auto" else None
            if verdict is None:
                t0 = time.perf_counter()
                ops = run_probes(backend or backend_for(device), device, probe_sets)
                verdict = Verdict(key, ops, time.perf_counter() - t0, "ran")
                _store(verdict)
        _verdicts[memory_key] = verdict
        _probe_sets[memory_key] = probe_sets
        _changed()
    level = logging.WARNING if verdict.failed() or verdict.block == "failed" else logging.INFO
    log.log(level, "H3 fused NVFP4: %s", verdict.summary())
    return verdict


def forget_verdicts() -> None:
    """Drop the in-memory verdicts (tests; the next kernel_verdict() reads the disk cache or runs again)."""
    with _lock:
        _verdicts.clear()
        _probe_sets.clear()
        _changed()


def _device_verdicts(device: torch.device):
    prefix = f"{device}|"
    return [(v, _probe_sets[k]) for k, v in list(_verdicts.items()) if k.startswith(prefix)]


BLOCK_OP_PREFIX = "block:"


def block_op(probe_set: str) -> str:
    """The op of the block check of the family whose probe set is named ``probe_set`` (its verdict is the
    ``block`` field of the verdicts that cover that probe set)."""
    return BLOCK_OP_PREFIX + probe_set


def declared_ops(device: torch.device) -> tuple[str, ...]:
    """Every op the probe sets of ``device``'s verdicts declare (their probes and aliases) and their families'
    block checks."""
    ops: dict[str, None] = {}
    for _, probe_sets in _device_verdicts(device):
        for probe_set in probe_sets:
            ops.update(dict.fromkeys((*probe_set.probes, *probe_set.aliases, block_op(probe_set.name))))
    return tuple(ops)


def op_refusal(device: torch.device, op: str) -> str | None:
    """Why the self-check turned ``op`` off on ``device`` (None: allowed, or not checked in this process)."""
    for verdict, probe_sets in _device_verdicts(device):
        if op.startswith(BLOCK_OP_PREFIX):
            if verdict.block == "failed" and any(block_op(s.name) == op for s in probe_sets):
                return f"the block self-check found a difference: {verdict.block_detail}"
            continue
        names = [op]
        if any(op in s.shares_global_scale for s in probe_sets):
            names.append("global_scale")
        if any(op in s.shares_global_scale_f16 for s in probe_sets):
            names.append("global_scale_f16")
        for name in names:
            result = verdict.ops.get(name)
            if result is not None and result.ok is False:
                return f"the self-check found {name} differs from ComfyUI's op ({result.detail})"
    return None


def record_block_verdict(device: torch.device, probe_set: str, ok: bool, detail: str, compared: bool) -> None:
    """Keep a block check's outcome with the device's verdicts that cover ``probe_set`` (the family's): a real
    difference holds for that family's blocks on the device."""
    with _lock:
        for verdict, probe_sets in _device_verdicts(device):
            if verdict.origin != "skipped" and compared and any(s.name == probe_set for s in probe_sets):
                verdict.block, verdict.block_detail = ("passed" if ok else "failed"), detail
                _store(verdict)
        _changed()
    if ok:
        log.info("H3 fused NVFP4: block self-check passed (%s)", detail)
    else:
        log.warning("H3 fused NVFP4: block self-check FAILED: %s. This model runs ComfyUI's path from now on. "
                    "Please report: %s", detail, REPORT_COMMAND)
