"""First-use parity self-check: the fused ops against ComfyUI's own ops, byte for byte, on the user's GPU.

Two levels:

* **Kernel check** (:func:`kernel_verdict`, at patch time): every fused op on small probe tensors - random rows
  plus ties, zeros, -0.0, scale underflow, NaN, +-Inf, subnormals, rows that are not a multiple of 16 or 128, a
  strided view - against ComfyUI's op sequence: ``QuantizedTensor.from_float(h, "TensorCoreNVFP4Layout")``
  after ComfyUI's RMSNorm module, ``_mod_scale_shift``, SwiGLU (``comfy.ops``) and ``_mod_gate``; comfy-kitchen's
  ``rms_rope_split_half_``; on compute capability >= 10 the fused Linear against the stock NVFP4 Linear forward.
* **Block check** (:func:`check_block`, at the first forward of a patched model): the first patched block runs
  ComfyUI's stock block and the fused block on (a prefix of) that call's real input and compares the outputs;
  that call returns the stock result. One host sync, on that call only, never during CUDA-graph capture.

A differing byte turns the fused path off for that op (or for the model after a block mismatch), with the op, the
first differing index and both values in the log and on the node's text. Verdicts are cached on disk beside the
kernel cache, keyed by the GPU, driver build, torch, CUDA runtime, comfy-kitchen, the kernel sources and build
defines, this pack's Python, the ComfyUI version and the source of the ComfyUI code the fused path reproduces (H3
forwards and helpers, NVFP4 Linear, RMSNorm, quantizer); a change of any of them re-runs the check.

``H3_FUSED_NVFP4_SELFCHECK``: ``auto`` (default: run once per key, then use the cached verdict), ``force`` (run
again, ignore the cache), ``skip`` (no checks: tests and benchmarks that check parity themselves).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import sys
import threading
import time

import torch

from ..layout import NVFP4_LAYOUT
from . import comfy_env

log = logging.getLogger("h3_fused_nvfp4")

SELFCHECK_ENV = "H3_FUSED_NVFP4_SELFCHECK"
REPORT_COMMAND = "python <ComfyUI>/custom_nodes/<this pack>/report.py"
# Op names: what a failure turns off (integration code asks op_refusal(device, op) before using a kernel).
KERNEL_OPS = ("global_scale", "pack", "pack_modulate", "pack_norm", "pack_swiglu", "gated_residual", "rms_norm",
              "rms_rope", "linear")
# Ops that compute ComfyUI's dynamic global scale with the shared reduction: off too when "global_scale" fails
# (a random probe can round its one scale the right way by luck; the global_scale probe cannot).
USES_GLOBAL_SCALE = ("pack", "pack_modulate", "pack_norm", "pack_swiglu", "rms_norm")


def mode() -> str:
    value = os.environ.get(SELFCHECK_ENV, "auto").strip().lower()
    return value if value in ("auto", "force", "skip") else "auto"


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
            return "self-check skipped (H3_FUSED_NVFP4_SELFCHECK=skip)"
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


# ---- the key -----------------------------------------------------------------------------------------------

def _driver_version() -> str:
    """The driver build (NVML, e.g. "580.159.04"); the CUDA API version where NVML is missing."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlInit_v2() == 0 and nvml.nvmlSystemGetDriverVersion(buf, 96) == 0:
            return buf.value.decode()
    except (OSError, AttributeError):
        pass
    try:
        from ..kernels import runtime

        value = ctypes.c_int()
        runtime.driver().cuDriverGetVersion(ctypes.byref(value))
        return f"cuda {value.value // 1000}.{value.value % 1000 // 10}"
    except Exception:  # no driver: CPU
        return "none"


def package_version(name: str) -> str:
    """An installed distribution's version, or "not installed"."""
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "not installed"


def _comfy_class_sources(cls) -> list[str]:
    """Source of ``cls`` and of every ComfyUI class it inherits from (a subclass alone may be two lines)."""
    return [inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("comfy")]


def block_source_hash() -> str:
    """Hash of the source of the ComfyUI code the fused ops reproduce or replace: the H3 forwards and helpers, the
    NVFP4 Linear and RMSNorm classes and ComfyUI's NVFP4 quantizer."""
    parts = []
    try:
        import comfy.ldm.minimax.model as m
        import comfy.ops
        import comfy.quant_ops

        objects = [m.DiTBlock.forward, m.Attention.forward, m.MLP.forward, m.AdalnProj.forward, m._mod_scale_shift,
                   m._mod_gate, m._mod_row, getattr(comfy.ops, "linear_input_act", None),
                   getattr(comfy.ops, "_eager_input_act", None), getattr(comfy.ops, "_swiglu_eager", None)]
        for obj in objects:
            if obj is not None:
                parts.append(inspect.getsource(obj))
        ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.bfloat16)
        for cls in (ops.Linear, ops.RMSNorm, comfy.quant_ops.TensorCoreNVFP4Layout):
            parts += _comfy_class_sources(cls)
    except Exception as exc:  # no ComfyUI H3 (tests of the pack alone): the hash says so
        parts.append(f"unavailable: {type(exc).__name__}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def pack_source_digest() -> str:
    """Hash of this pack's Python that the verdict vouches for (the integration, the kernels' host code, the CPU
    twin): an edited or updated pack re-runs the check."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    paths = [root / "__init__.py", root / "layout.py"]
    for folder in ("integration", "kernels", "reference"):
        paths += sorted((root / folder).glob("*.py"))
    for path in paths:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def environment_key(device: torch.device) -> dict:
    from ..kernels import ops, runtime

    key = {"device": str(device), "torch": torch.__version__, "cuda_runtime": str(torch.version.cuda),
           "comfy_kitchen": package_version("comfy-kitchen"), "kernels": runtime.source_digest()[:16],
           "defines": repr((ops.kernel_defines(), ops.kernel_defines("h3_rms_rope.cu"))),
           "pack": pack_source_digest(), "comfyui": comfy_env.comfyui_version(), "h3_code": block_source_hash()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key.update(gpu=props.name, capability=f"{props.major}.{props.minor}", driver=_driver_version())
    return key


def _cache_path(key: dict):
    from ..kernels import runtime

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return runtime.cache_dir() / "selfcheck" / f"{digest}.json"


def _load_cached(key: dict) -> Verdict | None:
    path = _cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        ops = {k: OpResult(**v) for k, v in data["ops"].items()}
        return Verdict(key, ops, float(data.get("seconds", 0.0)), "cached", data.get("block", "pending"),
                       data.get("block_detail", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(verdict: Verdict) -> None:
    from ..kernels import runtime

    try:
        runtime.atomic_write(_cache_path(verdict.key), json.dumps(verdict.to_json(), indent=1).encode())
    except OSError as exc:  # a read-only cache folder: the check runs again next time
        log.debug("could not store the self-check verdict: %s", exc)


# ---- byte comparison ---------------------------------------------------------------------------------------

def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def first_difference(what: str, fused: torch.Tensor, comfy: torch.Tensor) -> str | None:
    """None if the two tensors hold the same bytes, else where they first differ and both values."""
    if tuple(fused.shape) != tuple(comfy.shape) or fused.dtype != comfy.dtype:
        return f"{what}: shape/dtype {tuple(fused.shape)} {fused.dtype} vs ComfyUI's {tuple(comfy.shape)} {comfy.dtype}"
    a, b = _as_bytes(fused), _as_bytes(comfy)
    ne = (a != b).nonzero()
    if ne.numel() == 0:
        return None
    item = fused.element_size()
    i = int(ne[0]) // item
    flat_f, flat_c = fused.detach().contiguous().reshape(-1), comfy.detach().contiguous().reshape(-1)
    fv, cv = flat_f[i], flat_c[i]
    show = (lambda v: f"{float(v.float()):.9g}") if fused.is_floating_point() else (lambda v: f"0x{int(v):02x}")
    index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), tuple(fused.shape))) if fused.dim() else ()
    return (f"{what} differs at index {index} (fused {show(fv)}, ComfyUI {show(cv)}; "
            f"{ne.numel()} bytes differ)")


def _compare_packed(label, packed, qt) -> str | None:
    return (first_difference(f"{label} global scale", packed.global_scale.reshape(-1), qt._params.scale.reshape(-1))
            or first_difference(f"{label} codes", packed.qdata, qt._qdata)
            or first_difference(f"{label} block scales", packed.block_scales.view(torch.uint8),
                                qt._params.block_scale.view(torch.uint8)))


# ---- probe tensors -----------------------------------------------------------------------------------------

def _bf16(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).to(device)


def probe_activations(device, k: int = 1056, seed: int = 7) -> dict[str, tuple[torch.Tensor, float | None]]:
    """Named probe activations and the static scale each is packed with (None: dynamic)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = 129  # not a multiple of 16 or 128
    random = (torch.randn((rows, k), generator=gen) * 2.0).to(torch.bfloat16).to(device)
    # Hard cases, static scale 1 so that E2M1 boundaries are exact ties: one 16-block per pattern.
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    patterns = [
        ties,
        [0.0] * 16,
        [-0.0] * 16,
        [1e-30] * 8 + [-1e-30] * 8,                          # block scale underflows to 0
        [2.0 ** -130, -(2.0 ** -133)] * 8,                   # bf16 subnormals
        [3.0e38, -3.0e38] + [1.0] * 14,                      # huge
        [float("nan")] + [1.0] * 15,
        [float("inf"), -1.0] + [0.5] * 14,
        [float("-inf")] + [0.0] * 15,
        [0.125 * (i - 8) for i in range(16)],
    ]
    hard = torch.zeros((33, 512), dtype=torch.float32)
    hard[:] = torch.randn((33, 512), generator=gen)
    for r, pattern in enumerate(patterns):
        hard[r, 16 * r:16 * r + 16] = torch.tensor(pattern)
        hard[r + len(patterns), 16 * (r + 1):16 * (r + 1) + 16] = torch.tensor(pattern) * 0.5
    hard = hard.to(torch.bfloat16).to(device)
    wide = (torch.randn((40, k + 64), generator=gen)).to(torch.bfloat16).to(device)
    finite_hard = torch.nan_to_num(hard.float(), nan=0.0, posinf=5.0, neginf=-5.0).to(torch.bfloat16)
    return {
        "random rows, dynamic scale": (random, None),
        "random rows, static scale": (random, 2.0 / 2688 * 1.5),
        "hard cases, static scale 1": (hard, 1.0),
        "hard cases without NaN/inf, dynamic scale": (finite_hard.to(device), None),
        "hard cases with NaN/inf, dynamic scale": (hard, None),
        "strided view, dynamic scale": (wide[:, 32:32 + k], None),
    }


def _modulation_probe(device, rows: int, k: int, seed: int):
    """Modulation tables, ComfyUI-style segments (with a per-token row tensor) and the matching int32 index."""
    from ..layout import Modulation

    gen = torch.Generator(device="cpu").manual_seed(seed)
    table_rows = 6
    scale = (torch.randn((table_rows, k), generator=gen) * 0.5).to(torch.bfloat16).to(device)
    shift = (torch.randn((table_rows, k), generator=gen) * 0.5).to(torch.bfloat16).to(device)
    a, b = rows // 4, rows // 2
    per_token = torch.randint(0, table_rows, (rows - b,), generator=gen).to(device)
    segments = [(0, a, 1), (a, b, 4), (b, rows, per_token)]
    index = torch.empty(rows, dtype=torch.int32)
    index[:a], index[a:b] = 1, 4
    index[b:] = per_token.cpu().to(torch.int32)
    return Modulation(scale, shift, index.to(device)), segments, scale, shift


def _comfy_h3():
    import comfy.ldm.minimax.model as m

    return m


def _comfy_rms_norm(k: int, weight: torch.Tensor, eps: float):
    """ComfyUI's RMSNorm module of an NVFP4 checkpoint (mixed-precision ops), holding ``weight``."""
    import comfy.ops

    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.bfloat16, disabled=[])
    norm = ops.RMSNorm(k, eps=eps, dtype=torch.bfloat16, device=weight.device)
    norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return norm


def _from_float(h: torch.Tensor, scale):
    from comfy.quant_ops import QuantizedTensor

    s = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=h.device)
    return QuantizedTensor.from_float(h.contiguous(), NVFP4_LAYOUT, scale=s)


def _static(scale, device):
    return None if scale is None else torch.tensor([scale], dtype=torch.float32, device=device)


# ---- the kernel probes -------------------------------------------------------------------------------------
# Each probe returns None (bit-identical), a description of the first difference, or raises NotApplicable.

class NotApplicable(Exception):
    pass


def scale_rounding_amaxes(count: int = 12) -> list[float]:
    """bf16 amax values whose ComfyUI scale ``amax * fp32(1/2688)`` rounds to bf16 upward (half of them) and
    downward: any change of that rounding changes the scale of one of them."""
    inv = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    up, down = [], []
    bits = 0x3F80  # bf16 1.0, then every following bf16 value
    while len(up) < count // 2 or len(down) < count // 2:
        bits += 1
        value = torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16)
        low = int((value.float() * inv).view(torch.int32)) & 0xFFFF
        if low > 0x8000 and len(up) < count // 2:
            up.append(float(value))
        elif 0 < low < 0x8000 and len(down) < count // 2:
            down.append(float(value))
    return up + down


def _check_global_scale(backend, device) -> str | None:
    gen = torch.Generator(device="cpu").manual_seed(5)
    for amax in scale_rounding_amaxes():
        x = (torch.rand((17, 32), generator=gen) * 2 - 1) * amax * 0.9
        x[5, 7] = -amax
        x = x.to(torch.bfloat16).to(device)
        diff = _compare_packed(f"dynamic scale of amax {amax}", backend.pack_nvfp4(x), _from_float(x, None))
        if diff:
            return diff
    return None


def _check_pack(backend, device) -> str | None:
    for label, (x, scale) in probe_activations(device).items():
        packed = backend.pack_nvfp4(x, static_scale=_static(scale, device))
        diff = _compare_packed(label, packed, _from_float(x, scale))
        if diff:
            return diff
    return None


def _check_pack_modulate(backend, device) -> str | None:
    m = _comfy_h3()
    for label, (x, scale) in list(probe_activations(device).items())[:4]:
        modulation, segments, sc, sh = _modulation_probe(device, x.shape[0], x.shape[1], seed=11)
        h = m._mod_scale_shift(x.clone(), sh, sc, segments)
        packed = backend.pack_nvfp4(x, static_scale=_static(scale, device), modulation=modulation)
        diff = _compare_packed(f"modulated {label}", packed, _from_float(h, scale))
        if diff:
            return diff
    return None


def _norm_probe(device, k: int, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = 37
    x = torch.randn((rows, k), generator=gen)
    x[1] *= torch.exp(2 * torch.randn(k, generator=gen))        # heavy-tailed row
    x[2, ::97] = 3.0e3                                          # outliers
    x[3] = 0.0                                                  # all-zero row: rstd = rsqrt(eps)
    x[4] *= 1e-3
    x = x.to(torch.bfloat16).to(device)
    weight = (1.0 + torch.randn(k, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    return x, weight


def _check_rms_norm(backend, device) -> str | None:
    """RMSNorm statistics (+ the next projection's amax) against ComfyUI's RMSNorm, modulation and quantizer;
    also the gated residual pass that produces them. At H3's width and another one (the reduction depends on K)."""
    from ..layout import RmsNorm

    m = _comfy_h3()
    for k in (5376, 1040):
        x, weight = _norm_probe(device, k, seed=k)
        comfy_norm = _comfy_rms_norm(k, weight, 1e-5)
        reason = backend.rms_norm_support(x, weight)
        if reason is not None:
            return f"width {k}: {reason}"
        modulation, segments, sc, sh = _modulation_probe(device, x.shape[0], k, seed=13)
        # statistics + amax, then the normalized, modulated pack (dynamic scale)
        norm = RmsNorm(weight, 1e-5, torch.empty(x.shape[0], dtype=torch.float32, device=device))
        g = torch.empty(1, dtype=torch.float32, device=device)
        backend.norm_statistics(x, norm, modulation=modulation, global_scale_out=g)
        packed = backend.pack_nvfp4(x, global_scale=g, modulation=modulation, norm=norm)
        h = m._mod_scale_shift(comfy_norm(x), sh, sc, segments)
        diff = _compare_packed(f"normalized and modulated, width {k}", packed, _from_float(h, None))
        if diff:
            return diff
        # the gated residual producing the statistics, static-scale pack after it
        gen = torch.Generator(device="cpu").manual_seed(k + 1)
        other = torch.randn(x.shape, generator=gen).to(torch.bfloat16).to(device)
        gate_table = (torch.randn((6, k), generator=gen) * 0.3).to(torch.bfloat16).to(device)
        x_fused, x_comfy = x.clone(), x.clone()
        backend.gated_residual_(x_fused, other, gate_table, modulation.mod_index, next_norm=norm,
                                next_modulation=modulation, global_scale_out=g)
        m._mod_gate(x_comfy, gate_table, other, segments)
        diff = first_difference(f"gated residual with statistics, width {k}", x_fused, x_comfy)
        if diff:
            return diff
        packed = backend.pack_nvfp4(x_fused, global_scale=g, modulation=modulation, norm=norm)
        h = m._mod_scale_shift(comfy_norm(x_comfy), sh, sc, segments)
        diff = _compare_packed(f"pack after the residual's statistics, width {k}", packed, _from_float(h, None))
        if diff:
            return diff
    return None


def _check_pack_swiglu(backend, device) -> str | None:
    import comfy.ops

    swiglu = getattr(comfy.ops, "_swiglu_eager", None)
    for label, (y, scale) in probe_activations(device).items():
        half = y.shape[1] // 2
        h = swiglu(y.clone()) if swiglu else torch.nn.functional.silu(y[:, :half]).mul_(y[:, half:])
        packed = backend.pack_nvfp4(y, static_scale=_static(scale, device), swiglu=True)
        diff = _compare_packed(f"SwiGLU {label}", packed, _from_float(h, scale))
        if diff:
            return diff
    return None


def _check_gated_residual(backend, device) -> str | None:
    m = _comfy_h3()
    x, _ = probe_activations(device)["random rows, dynamic scale"]
    gen = torch.Generator(device="cpu").manual_seed(17)
    other = torch.randn(x.shape, generator=gen).to(torch.bfloat16).to(device)
    modulation, segments, gate, _ = _modulation_probe(device, x.shape[0], x.shape[1], seed=19)
    fused, comfy = x.clone(), x.clone()
    backend.gated_residual_(fused, other, gate, modulation.mod_index)
    m._mod_gate(comfy, gate, other, segments)
    return first_difference("gated residual", fused, comfy)


def _check_rms_rope(backend, device) -> str | None:
    import comfy_kitchen as ck

    gen = torch.Generator(device="cpu").manual_seed(23)
    s, heads, dim = 37, 4, 128
    qkv = (torch.randn((s, 3 * heads * dim), generator=gen) * 2).to(torch.bfloat16).to(device)
    angles = torch.rand((s, 48), generator=gen) * 40
    freqs = _comfy_h3().rope_rotation_table(torch.cat((angles, angles), -1), torch.bfloat16).to(device)
    qw = (1 + torch.randn(dim, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    kw = (1 + torch.randn(dim, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    fused, comfy = qkv.clone(), qkv.clone()
    views = []
    for buf in (fused, comfy):
        q, k, _ = buf.split(heads * dim, dim=-1)
        views.append((q.view(1, s, heads, dim), k.view(1, s, heads, dim)))
    reason = backend.rms_rope_support(*views[0], freqs, qw, kw, 96)
    if reason is not None:
        raise NotApplicable(reason)  # the block uses comfy-kitchen's op for such tensors
    backend.rms_rope_split_half_(*views[0], freqs, qw, kw, 1e-5, 96)
    ck.rms_rope_split_half_(*views[1], freqs, qw, kw, epsilon=1e-5, rot_dim=96)
    return first_difference("q/k after RMSNorm + RoPE", fused, comfy)


def _check_linear(backend, device) -> str | None:
    """The fused NVFP4 Linear (pack + device-alpha GEMM) against the stock NVFP4 Linear forward."""
    from . import synthetic
    from .linear import FusedNVFP4Linear

    layer = synthetic.make_nvfp4_linear(5376, 256, seed=29, device=device)
    fused = FusedNVFP4Linear(layer, "self-check linear")
    x, _ = probe_activations(device, k=5376)["random rows, dynamic scale"]
    with torch.inference_mode():
        stock, out = layer(x), fused(x)
    if fused.calls_fused != 1:
        return "the fused Linear refused the probe"
    return first_difference("NVFP4 Linear output", out, stock)


PROBES = {
    "global_scale": _check_global_scale,
    "pack": _check_pack,
    "pack_modulate": _check_pack_modulate,
    "rms_norm": _check_rms_norm,
    "pack_swiglu": _check_pack_swiglu,
    "gated_residual": _check_gated_residual,
    "rms_rope": _check_rms_rope,
    "linear": _check_linear,
}


def run_kernel_checks(backend, device: torch.device) -> dict[str, OpResult]:
    """Run every probe (none raises: an exception is a failed check with its reason)."""
    results: dict[str, OpResult] = {}
    for name, probe in PROBES.items():
        if name == "linear" and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 10):
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
    # pack_norm is the pack half of rms_norm's probe
    results["pack_norm"] = OpResult(results["rms_norm"].ok, results["rms_norm"].detail, 0.0)
    return results


# ---- verdicts per device -----------------------------------------------------------------------------------

_verdicts: dict[str, Verdict] = {}
_lock = threading.Lock()


def kernel_verdict(device: torch.device, backend=None) -> Verdict:
    """The self-check verdict for ``device``: from memory, the disk cache, or a run now (then cached)."""
    device = torch.device(device)
    with _lock:
        verdict = _verdicts.get(str(device))
        if verdict is not None:
            return verdict
        key = environment_key(device)
        if mode() == "skip":
            verdict = Verdict(key, {}, 0.0, "skipped", block="passed")
        else:
            verdict = _load_cached(key) if mode() == "auto" else None
            if verdict is None:
                if backend is None:
                    from .linear import backend_for

                    backend = backend_for(torch.empty(0, device=device))
                t0 = time.perf_counter()
                ops = run_kernel_checks(backend, device)
                verdict = Verdict(key, ops, time.perf_counter() - t0, "ran")
                _store(verdict)
        _verdicts[str(device)] = verdict
    level = logging.WARNING if verdict.failed() or verdict.block == "failed" else logging.INFO
    log.log(level, "H3 fused NVFP4: %s", verdict.summary())
    return verdict


def forget_verdicts() -> None:
    """Drop the in-memory verdicts (tests; the next kernel_verdict() reads the disk cache or runs again)."""
    with _lock:
        _verdicts.clear()


def op_refusal(device: torch.device, op: str) -> str | None:
    """Why the self-check turned ``op`` off on ``device`` (None: allowed, or not checked in this process)."""
    verdict = _verdicts.get(str(device))
    if verdict is None:
        return None
    if op == "block":
        return None if verdict.block != "failed" else f"the block self-check found a difference: {verdict.block_detail}"
    for name in (op, "global_scale") if op in USES_GLOBAL_SCALE else (op,):
        result = verdict.ops.get(name)
        if result is not None and result.ok is False:
            return f"the self-check found {name} differs from ComfyUI's op ({result.detail})"
    return None


# ---- the block check ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class BlockVerdict:
    ok: bool
    detail: str
    compared: bool = True  # False: the check could not run (e.g. out of memory); nothing is cached then


def clip_segments(segments, rows: int) -> list:
    clipped = []
    for a, b, row in segments:
        if a >= rows:
            break
        b2 = min(b, rows)
        clipped.append((a, b2, row[: b2 - a] if isinstance(row, torch.Tensor) else row))
    return clipped


def check_block(fused_block, x, t_emb, mod_segments, rope_freqs, options: dict, max_rows: int) -> BlockVerdict:
    """ComfyUI's stock block against the fused block on the first ``max_rows`` rows of this call's input."""
    rows = min(x.shape[0], max_rows)
    segments = clip_segments(mod_segments, rows)
    rope = rope_freqs[:, :rows] if rope_freqs is not None else None
    xs = x[:rows]
    detail = None
    for attempt in range(2):  # a first call can differ inside ComfyUI's emulated GEMM path: compare a second time
        with fused_block.unpatched():
            stock = fused_block.stock_forward(xs.clone(), t_emb, segments, rope, transformer_options=dict(options))
        fused = fused_block.fused_forward(xs.clone(), t_emb, segments, rope, dict(options), None, handoff=False)
        detail = first_difference(f"{fused_block.name} output ({rows} rows)", fused, stock)
        if detail is None:
            return BlockVerdict(True, f"{fused_block.name}: {rows} rows bit-identical"
                                + (" on the second comparison" if attempt else ""))
    return BlockVerdict(False, detail)


def record_block_verdict(state, device: torch.device, verdict: BlockVerdict) -> None:
    state.block_check = "passed" if verdict.ok else "failed"
    state.block_check_detail = verdict.detail
    kv = _verdicts.get(str(device))
    if kv is not None and kv.origin != "skipped" and verdict.compared:  # a real difference holds for the device
        kv.block, kv.block_detail = state.block_check, verdict.detail
        _store(kv)
    if verdict.ok:
        log.info("H3 fused NVFP4: block self-check passed (%s)", verdict.detail)
    else:
        log.warning("H3 fused NVFP4: block self-check FAILED: %s. This model runs ComfyUI's path from now on. "
                    "Please report: %s", verdict.detail, REPORT_COMMAND)
    _notify_node(state, ("block self-check passed: " if verdict.ok else "block self-check FAILED, ComfyUI's path "
                         "runs: ") + verdict.detail)


def _notify_node(state, text: str) -> None:
    """Show ``text`` on the node that patched the model (ComfyUI's progress text), where a server runs."""
    node_id = state.node_id
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if node_id is None or instance is None or not hasattr(instance, "send_progress_text"):
        return
    try:
        instance.send_progress_text(f"H3 fused NVFP4: {text}", node_id)
    except Exception:  # the UI is a courtesy; the log has the message
        pass
