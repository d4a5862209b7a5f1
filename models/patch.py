"""The pack's patch of any ComfyUI model: every NVFP4 Linear takes the fused pack (core/patching.py); a model of a
family with block fusions (one folder each under models/) gets them on top. What the nodes call."""

from __future__ import annotations

from .. import comfy_adapter
from ..core import patching
from ..core.calibration import attach_recorder
from ..core.patching import SCOPES, PatchReport, apply_comfy, patch_state, patched_scope
from .h3 import patch as h3
from .wan import patch as wan
from .zimage import patch as zimage

FAMILIES = (h3, zimage, wan)  # model families with block fusions, tried in this order

__all__ = ["SCOPES", "PatchReport", "apply_calibration", "apply_comfy", "apply_fused", "patch_state",
           "patched_scope"]


def apply_fused(model_patcher, scope: str = "block", *, allow_reference_backend: bool = False):
    """``(clone, report)``: a clone of ``model_patcher`` with the fused path patched in (core/patching.py)."""
    return patching.apply_fused(model_patcher, scope, FAMILIES, allow_reference_backend=allow_reference_backend)


def apply_calibration(model_patcher, allow_reference_backend: bool = False):
    """``(clone, summary)``: a clone of ``model_patcher`` that records every NVFP4 Linear's input amax. A fused
    model stays fused (its patches are rebuilt for the clone, with recording); a stock one stays stock."""
    fused = patch_state(model_patcher).get("mode") == "fused"
    if fused:
        clone, report = apply_fused(model_patcher, patched_scope(model_patcher),
                                    allow_reference_backend=allow_reference_backend)
        fused = report.applied
    else:
        clone = model_patcher.clone()
    layers = patching.nvfp4_linears(clone.get_model_object("diffusion_model"))
    attach_recorder(clone, layers, source=comfy_adapter.diffusion_model_source(model_patcher))
    if not layers:
        return clone, "H3 fused NVFP4 calibration: no NVFP4 Linear to record"
    return clone, (f"H3 fused NVFP4 calibration: recording the input amax of {len(layers)} NVFP4 layers on the "
                   f"{'fused' if fused else 'stock'} path; run sampling, then save with 'Save Calibrated H3 NVFP4'")
