"""Patching a ComfyUI model on a ModelPatcher clone: every NVFP4 Linear takes the fused pack, and a model family
with block fusions (models/) adds its own patches on top.

Object patches are applied by ComfyUI when the model is loaded for sampling and undone when it is unloaded, per
clone, so a graph can hold a fused and a stock clone of one model side by side (the Toggle node). Nothing here
changes a class or a module-level function. Before patching, the kernels are built and self-checked on the load
device (core/verdicts.py); an op that fails runs ComfyUI's path.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .. import comfy_adapter
from ..kernels import cuda_ops, runtime
from ..layout import PACK_DTYPE_NAMES
from . import verdicts
from .linear import FusedNVFP4Linear, PackPatch, gemm_mode, is_nvfp4_linear
from .probes import LINEAR_PROBES
from .verdicts import ProbeSet, Verdict

log = logging.getLogger("h3_fused_nvfp4")

STATE_KEY = "h3_fused_nvfp4"  # transformer_options entry describing what this pack did to a clone
SCOPES = ("block", "linears")  # block: a family's block fusions too; linears: each NVFP4 Linear's pack only


@dataclass
class FamilyPatches:
    """What a model family's fusion adds: its object patches (key below ``diffusion_model.`` -> callable; its
    fused Linears among them), a description for the summary, and ``prepare(verdict)``: called once the self-check
    verdict is known, returns why the family's patches must not be used (None: they may). ``block_dtypes``: the
    compute dtypes its block patches take (None: any); a model computing in another dtype gets only the fused
    Linears, and the summary says why."""

    patches: dict[str, object]
    description: str
    prepare: Callable[[Verdict], "str | None"] = lambda verdict: None
    block_dtypes: tuple[torch.dtype, ...] | None = None

    def dtype_refusal(self, compute_dtype: torch.dtype | None) -> str | None:
        """Why the block patches stay off for a model computing in ``compute_dtype`` (None: they may run)."""
        if self.block_dtypes is None or compute_dtype is None or compute_dtype in self.block_dtypes:
            return None
        takes = " or ".join(PACK_DTYPE_NAMES.get(d, str(d)) for d in self.block_dtypes)
        computes = PACK_DTYPE_NAMES.get(compute_dtype, str(compute_dtype).removeprefix("torch."))
        return (f"block fusion off: its kernels take {takes} and this model computes in {computes}, so ComfyUI's "
                "blocks run (their NVFP4 Linears keep the fused pack)")


class ModelFamily(Protocol):
    name: str
    probe_sets: tuple[ProbeSet, ...]

    def build(self, diffusion_model, scope: str) -> FamilyPatches | None:
        """The family's patches for this model, or None when the model is not of this family."""


@dataclass
class PatchReport:
    """What a patch call did; ``summary()`` is the one log/UI line."""

    mode: str
    applied: bool
    reason: str = ""
    family: str = ""
    blocks: str = ""  # the family fusion's description ("50 DiT + 2 refiner blocks"), empty without one
    block_note: str = ""  # why the family's block patches stay off on this model (its compute dtype), if they do
    layers: list[str] = field(default_factory=list)
    static_layers: int = 0
    left: dict[str, str] = field(default_factory=dict)  # NVFP4 Linear -> why it stays on ComfyUI's path
    device: str = ""
    kernels: str = ""
    gemm: str = ""
    selfcheck: str = ""

    def summary(self) -> str:
        if not self.applied:
            return f"H3 fused NVFP4: model left as ComfyUI runs it ({self.mode}): {self.reason}"
        what = f"{self.family} model: "
        if self.blocks:
            what = f"patched {self.blocks}" + (f" ({self.block_note}), " if self.block_note else ", ")
        text = (f"H3 fused NVFP4: {what}{len(self.layers)} NVFP4 layers ({len(self.layers) - self.static_layers} "
                f"dynamic-scale, {self.static_layers} static input_scale)")
        if self.left:
            counts = collections.Counter(self.left.values())
            text += f", {len(self.left)} left on ComfyUI's path (" + "; ".join(
                f"{n}: {reason}" for reason, n in counts.most_common()) + ")"
        return (text + f", scope {self.mode}, {self.device}, GEMM {self.gemm}, kernels {self.kernels}"
                + (f"; {self.selfcheck}" if self.selfcheck else ""))


# ---- finding the Linears -----------------------------------------------------------------------------------

def nvfp4_linears(diffusion_model) -> dict[str, torch.nn.Module]:
    """Name (below ``diffusion_model.``) -> module of every NVFP4 Linear of the model."""
    return {name: module for name, module in diffusion_model.named_modules() if name and is_nvfp4_linear(module)}


def family_name(model_patcher, diffusion_model) -> str:
    """ComfyUI's name of the model's family (its model config class), else the diffusion model's class."""
    config = getattr(getattr(model_patcher, "model", None), "model_config", None)
    return type(config).__name__ if config is not None else type(diffusion_model).__name__


# ---- device and kernels ------------------------------------------------------------------------------------

def device_description(device: torch.device) -> str:
    if device.type != "cuda":
        return f"device {device} (Python reference backend)"
    props = torch.cuda.get_device_properties(device)
    return f"GPU {props.name} sm_{props.major}{props.minor}"


def load_device(model_patcher) -> torch.device:
    device = getattr(model_patcher, "load_device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def kernel_status(device: torch.device) -> tuple[bool, str]:
    """Build (or load from cache) the kernels for ``device`` now, so a failure is known at load time."""
    if device.type != "cuda":
        return True, "not needed (Python reference backend)"
    try:
        modules = [cuda_ops.module_for(device, source) for source in runtime.SOURCES]
        flavour = " (Blackwell path, emulated instructions)" if cuda_ops.emulating_blackwell() else ""
        return True, f"ready for {modules[0].arch}{flavour} (NVRTC {'.'.join(map(str, runtime.nvrtc_version()))})"
    except runtime.KernelBuildError as exc:
        return False, f"build failed: {exc}"


def gemm_description(device: torch.device, compute_dtype: torch.dtype | None) -> str:
    """The GEMM the fused Linears call on ``device`` for a model computing in ``compute_dtype`` (None: unknown)."""
    if gemm_mode(device) == "nvfp4":
        return "cuBLASLt NVFP4"
    if compute_dtype is None:
        layers, emulation = "the model's compute dtype", "dequantize + matmul in the model's compute dtype"
    else:
        layers = PACK_DTYPE_NAMES.get(compute_dtype, str(compute_dtype).removeprefix("torch."))
        emulation = f"dequantize + {layers} matmul"
    if device.type == "cuda":
        return (f"none on this GPU (no FP4 tensor cores): ComfyUI keeps NVFP4 layers in {layers} here, so the fused "
                f"path only runs when NVFP4 compute is forced on, with an emulated GEMM ({emulation})")
    return f"emulated ({emulation})"


# ---- the clone's state -------------------------------------------------------------------------------------

def our_patch_keys(model_patcher) -> list[str]:
    return [k for k, v in model_patcher.object_patches.items() if isinstance(v, PackPatch)]


def remove_patches(model_patcher) -> int:
    keys = our_patch_keys(model_patcher)
    for key in keys:
        del model_patcher.object_patches[key]
    return len(keys)


def set_state(model_patcher, **state) -> None:
    topts = model_patcher.model_options.setdefault("transformer_options", {})
    topts[STATE_KEY] = dict(state)


def patch_state(model_patcher) -> dict:
    return model_patcher.model_options.get("transformer_options", {}).get(STATE_KEY, {})


def patched_scope(model_patcher, default: str = "block") -> str:
    """The scope the model was patched with (kept by the Toggle unless it is told otherwise)."""
    scope = patch_state(model_patcher).get("scope", default)
    return scope if scope in SCOPES else default


# ---- patching ----------------------------------------------------------------------------------------------

def build_patches(diffusion_model, scope: str, families: tuple[ModelFamily, ...]):
    """``(patches, family, family_patches)``: a fused Linear for every NVFP4 Linear, the first matching family's
    patches on top (its own fused Linears replace the plain ones). No side effects."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    family, found = None, None
    for candidate in families:
        found = candidate.build(diffusion_model, scope)
        if found is not None:
            family = candidate
            break
    patches: dict[str, object] = {}
    for name, layer in nvfp4_linears(diffusion_model).items():
        patches[f"{name}.forward"] = FusedNVFP4Linear(layer, name)
    if found is not None:
        patches.update(found.patches)
    return patches, family, found


def apply_fused(model_patcher, scope: str, families: tuple[ModelFamily, ...], *,
                allow_reference_backend: bool = False) -> tuple[object, PatchReport]:
    """Return ``(clone, report)``: a clone of ``model_patcher`` with the fused path patched in.

    The input patcher is never modified. On a model without NVFP4 layers, a GPU the kernels cannot be built for,
    or a CPU device (unless ``allow_reference_backend``), the clone runs ComfyUI's path and the report says why.
    """
    clone = model_patcher.clone()
    remove_patches(clone)
    device = load_device(clone)
    diffusion_model = clone.get_model_object("diffusion_model")
    patches, family, found = build_patches(diffusion_model, scope, families)
    report = PatchReport(mode=scope, applied=False,
                         family=family.name if family else family_name(clone, diffusion_model),
                         blocks=found.description if found else "", device=device_description(device))
    linears = {key: p for key, p in patches.items() if isinstance(p, FusedNVFP4Linear)}
    for patch in linears.values():
        reason = patch.static_refusal()
        if reason is not None:
            report.left[patch.name] = reason
        else:
            report.layers.append(patch.name)
            report.static_layers += not patch.dynamic_scale()
    report.applied = bool(report.layers)
    if not linears:
        report.reason = f"{report.family} ({type(diffusion_model).__name__}) has no NVFP4-quantized Linear"
    elif not report.layers:
        report.reason = f"none of its {len(linears)} NVFP4 Linears can take the fused path: " + "; ".join(
            sorted(set(report.left.values())))
    if report.applied and device.type != "cuda" and not allow_reference_backend:
        report.applied, report.reason = False, f"no CUDA device ({device}); the fused kernels need an NVIDIA GPU"
    if report.applied:
        ok, report.kernels = kernel_status(device)
        if not ok:
            report.applied, report.reason = False, f"kernels unavailable on {report.device}: {report.kernels}"
    if report.applied:
        probe_sets = family.probe_sets if family is not None else (LINEAR_PROBES,)
        verdict = verdicts.kernel_verdict(device, probe_sets)
        report.selfcheck = verdict.summary()
        refusal = found.prepare(verdict) if found is not None else None
        if refusal is not None:
            report.applied, report.reason = False, refusal
    if report.applied:
        compute_dtype = comfy_adapter.model_compute_dtype(clone)
        report.gemm = gemm_description(device, compute_dtype)
        blocks = found is not None and any(not isinstance(v, FusedNVFP4Linear) for v in found.patches.values())
        report.block_note = (found.dtype_refusal(compute_dtype) if blocks else None) or ""
        for key, value in patches.items():
            if report.block_note and not isinstance(value, FusedNVFP4Linear):
                continue  # the family's block patches stay off: its fused Linears (and the others) are patched
            clone.add_object_patch(f"diffusion_model.{key}", value)
    set_state(clone, mode="fused" if report.applied else "comfy", scope=scope, summary=report.summary())
    (log.info if report.applied else log.warning)(report.summary())
    return clone, report


def apply_comfy(model_patcher):
    """A clone that runs exactly ComfyUI's stock path (this pack's object patches removed)."""
    clone = model_patcher.clone()
    removed = remove_patches(clone)
    summary = f"H3 fused NVFP4: ComfyUI's own NVFP4 path selected ({removed} patches removed from this clone)"
    set_state(clone, mode="comfy", scope=patched_scope(model_patcher), summary=summary)
    log.info(summary)
    return clone, summary


def executing_node_id():
    return comfy_adapter.executing_node_id()
