"""Find MiniMax H3 blocks in a ComfyUI model and patch them, on a ModelPatcher clone, with object patches.

Object patches are applied by ComfyUI when the model is loaded for sampling and undone when it is unloaded, per
clone, so a graph can hold a fused and a stock clone of one model side by side (the Toggle node). Nothing here
changes a class or a module-level function.

Patched keys (``diffusion_model.`` prefix):

    blocks.{i}.forward                        FusedDiTBlock      (scope "block")
    blocks.{i}.attn.forward                   FusedAttention     (scope "block": RMSNorm+RoPE kernel)
    blocks.{i}.mlp.forward                    FusedSwigluMLP     (SwiGLU folded into fc2's pack)
    token_refiner.blocks.{i}.mlp.forward      FusedSwigluMLP
    ...{attn.qkv_proj,attn.out_proj,mlp.fc1,mlp.fc2}.forward   FusedNVFP4Linear, NVFP4 layers only

Matching is structural (attribute names and Linear shapes of ComfyUI's comfy/ldm/minimax/model.py, and the module
helpers the fused block calls for its fallbacks); only NVFP4-quantized Linears are patched. Before patching, the
kernels are built and self-checked on the load device (core/verdicts.py with the probes of core/probes.py and models/h3/probes.py); an op that fails runs ComfyUI's
path, and the first patched block checks the whole block on the first forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ... import comfy_adapter
from ...core import verdicts
from ...core.calibration import attach_recorder
from ...core.linear import FusedNVFP4Linear, gemm_mode, is_nvfp4_linear
from ...core.probes import LINEAR_PROBES
from ...kernels import cuda_ops, runtime
from .attention import FusedAttention
from .block import FusedDiTBlock, ModelState
from .mlp import FusedSwigluMLP
from .probes import H3_PROBES
from .structure import LINEAR_PATHS, submodule, find_h3_blocks, nvfp4_layers

log = logging.getLogger("h3_fused_nvfp4")

STATE_KEY = "h3_fused_nvfp4"  # transformer_options entry describing what this pack did to a clone
SCOPES = ("block", "linears")
PATCH_TYPES = (FusedNVFP4Linear, FusedSwigluMLP, FusedDiTBlock, FusedAttention)
PROBE_SETS = (LINEAR_PROBES, H3_PROBES)  # what the self-check runs before this model's kernels are used


@dataclass
class PatchReport:
    """What a patch call did; ``summary()`` is the one log/UI line."""

    mode: str
    applied: bool
    reason: str = ""
    dit_blocks: int = 0
    refiner_blocks: int = 0
    layers: list[str] = field(default_factory=list)
    static_layers: int = 0
    device: str = ""
    kernels: str = ""
    gemm: str = ""
    selfcheck: str = ""

    def summary(self) -> str:
        if not self.applied:
            return f"H3 fused NVFP4: model left as ComfyUI runs it ({self.mode}): {self.reason}"
        return (
            f"H3 fused NVFP4: patched {self.dit_blocks} DiT + {self.refiner_blocks} refiner blocks, "
            f"{len(self.layers)} NVFP4 layers ({len(self.layers) - self.static_layers} dynamic-scale, "
            f"{self.static_layers} static input_scale), scope {self.mode}, {self.device}, GEMM {self.gemm}, "
            f"kernels {self.kernels}" + (f"; {self.selfcheck}" if self.selfcheck else "")
        )


# ---- patching ----------------------------------------------------------------------------------------------

def _device_description(device: torch.device) -> str:
    if device.type != "cuda":
        return f"device {device} (Python reference backend)"
    props = torch.cuda.get_device_properties(device)
    return f"GPU {props.name} sm_{props.major}{props.minor}"


def build_patches(diffusion_model, scope: str = "block") -> tuple[dict[str, object], PatchReport]:
    """Object patches (key below ``diffusion_model.`` -> value) for every matched block; no side effects."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    report = PatchReport(mode=scope, applied=False)
    blocks = find_h3_blocks(diffusion_model)
    if not blocks:
        report.reason = f"{type(diffusion_model).__name__} has no MiniMax H3 transformer blocks"
        return {}, report
    patches: dict[str, object] = {}
    state = ModelState()
    previous = None  # the fused DiT block just before, for the norm-statistics hand-over
    for blk in blocks:
        fused = {}
        for path in LINEAR_PATHS:
            layer = submodule(blk.module, path)
            if is_nvfp4_linear(layer):
                name = f"{blk.prefix}.{path}"
                fused[path] = FusedNVFP4Linear(layer, name)
                patches[f"{name}.forward"] = fused[path]
                report.layers.append(name)
                report.static_layers += getattr(layer, "input_scale", None) is not None
        if not fused:
            previous = None
            continue
        mlp = FusedSwigluMLP(blk.module.mlp, f"{blk.prefix}.mlp", fused.get("mlp.fc1"), fused.get("mlp.fc2"))
        patches[f"{blk.prefix}.mlp.forward"] = mlp
        if blk.kind == "dit":
            report.dit_blocks += 1
            if scope == "block":
                attention = FusedAttention(blk.module.attn, f"{blk.prefix}.attn", fused.get("attn.qkv_proj"))
                index = int(blk.prefix.rsplit(".", 1)[1])
                block = FusedDiTBlock(blk.module, blk.prefix, index, attention, mlp, state)
                if previous is not None and previous.index == index - 1:
                    previous.next = block
                patches[f"{blk.prefix}.forward"] = block
                patches[f"{blk.prefix}.attn.forward"] = attention
                previous = block
        else:
            report.refiner_blocks += 1
    if not report.layers:
        report.reason = f"found {len(blocks)} H3 blocks but no NVFP4-quantized Linear in them"
        return {}, report
    report.applied = True
    return patches, report


def _load_device(model_patcher) -> torch.device:
    device = getattr(model_patcher, "load_device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def kernel_status(device: torch.device) -> tuple[bool, str]:
    """Build (or load from cache) the kernels for ``device`` now, so a failure is known at load time."""
    if device.type != "cuda":
        return True, "not needed (Python reference backend)"
    try:
        modules = [cuda_ops.module_for(device, source) for source in runtime.SOURCES]
        mod = modules[0]
        flavour = " (Blackwell path, emulated instructions)" if cuda_ops.emulating_blackwell() else ""
        return True, f"ready for {mod.arch}{flavour} (NVRTC {'.'.join(map(str, runtime.nvrtc_version()))})"
    except runtime.KernelBuildError as exc:
        return False, f"build failed: {exc}"


def our_patch_keys(model_patcher) -> list[str]:
    return [k for k, v in model_patcher.object_patches.items() if isinstance(v, PATCH_TYPES)]


def remove_patches(model_patcher) -> int:
    keys = our_patch_keys(model_patcher)
    for key in keys:
        del model_patcher.object_patches[key]
    return len(keys)


def _set_state(model_patcher, **state) -> None:
    topts = model_patcher.model_options.setdefault("transformer_options", {})
    topts[STATE_KEY] = dict(state)


def patch_state(model_patcher) -> dict:
    return model_patcher.model_options.get("transformer_options", {}).get(STATE_KEY, {})


def apply_fused(model_patcher, scope: str = "block", *, allow_reference_backend: bool = False):
    """Return ``(clone, report)``: a clone of ``model_patcher`` with the fused H3 path patched in.

    The input patcher is never modified. On a non-H3 model, a model without NVFP4 layers, a GPU the kernels
    cannot be built for, or a CPU device (unless ``allow_reference_backend``), the clone runs ComfyUI's path
    and the report says why.
    """
    clone = model_patcher.clone()
    remove_patches(clone)
    device = _load_device(clone)
    diffusion_model = clone.get_model_object("diffusion_model")
    patches, report = build_patches(diffusion_model, scope)
    report.device = _device_description(device)
    if report.applied:
        if device.type != "cuda" and not allow_reference_backend:
            report.applied, report.reason = False, f"no CUDA device ({device}); the fused kernels need an NVIDIA GPU"
        else:
            ok, report.kernels = kernel_status(device)
            if not ok:
                report.applied, report.reason = False, f"kernels unavailable on {report.device}: {report.kernels}"
    if report.applied:
        verdict = verdicts.kernel_verdict(device, PROBE_SETS)
        report.selfcheck = verdict.summary()
        state = next((p.state for p in patches.values() if isinstance(p, FusedDiTBlock)), None)
        if verdict.block == "failed":
            report.applied, report.reason = False, report.selfcheck
        elif state is not None:
            state.block_check = "passed" if verdict.block == "passed" else "pending"
            state.node_id = comfy_adapter.executing_node_id()
    if report.applied:
        if gemm_mode(device) == "nvfp4":
            report.gemm = "cuBLASLt NVFP4"
        elif device.type == "cuda":
            report.gemm = ("none on this GPU (no FP4 tensor cores): ComfyUI keeps NVFP4 layers in bf16 here, so the "
                           "fused path only runs when NVFP4 compute is forced on, with an emulated GEMM "
                           "(dequantize + bf16 matmul)")
        else:
            report.gemm = "emulated (dequantize + bf16 matmul)"
        for key, value in patches.items():
            clone.add_object_patch(f"diffusion_model.{key}", value)
    _set_state(clone, mode="fused" if report.applied else "comfy", scope=scope, summary=report.summary())
    (log.info if report.applied else log.warning)(report.summary())
    return clone, report


def apply_comfy(model_patcher):
    """A clone that runs exactly ComfyUI's stock path (this pack's object patches removed)."""
    clone = model_patcher.clone()
    removed = remove_patches(clone)
    summary = f"H3 fused NVFP4: ComfyUI's own NVFP4 path selected ({removed} patches removed from this clone)"
    _set_state(clone, mode="comfy", scope=patched_scope(model_patcher), summary=summary)
    log.info(summary)
    return clone, summary


def patched_scope(model_patcher, default: str = "block") -> str:
    """The scope the model was patched with (kept by the Toggle unless it is told otherwise)."""
    scope = patch_state(model_patcher).get("scope", default)
    return scope if scope in SCOPES else default


def apply_calibration(model_patcher, allow_reference_backend: bool = False):
    """``(clone, summary)``: a clone of ``model_patcher`` that records every H3 NVFP4 Linear's input amax. A fused
    model stays fused (its patches are rebuilt for the clone, with recording); a stock one stays stock."""
    fused = patch_state(model_patcher).get("mode") == "fused"
    if fused:
        clone, report = apply_fused(model_patcher, patched_scope(model_patcher),
                                    allow_reference_backend=allow_reference_backend)
        fused = report.applied
    else:
        clone = model_patcher.clone()
    layers = nvfp4_layers(clone.get_model_object("diffusion_model"))
    attach_recorder(clone, layers)
    if not layers:
        return clone, "H3 fused NVFP4 calibration: no NVFP4 Linear in MiniMax H3 blocks to record"
    return clone, (f"H3 fused NVFP4 calibration: recording the input amax of {len(layers)} NVFP4 layers on the "
                   f"{'fused' if fused else 'stock'} path; run sampling, then save with 'Save Calibrated H3 NVFP4'")
