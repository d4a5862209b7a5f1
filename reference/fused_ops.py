"""Python twin of kernels/ops.py for tensors that are not on a CUDA device (CPU tests, debugging).

Same functions and arguments as the CUDA kernels, computed the stock way: the source op (adaLN modulation or
SwiGLU) with ComfyUI's own torch op sequence (reference/h3_ops.py), the global scale with ComfyUI's expression,
and the pack with comfy-kitchen's ``quantize_nvfp4`` -- on the CPU that is comfy-kitchen's eager backend, which
is what stock ComfyUI runs there (it divides exactly where the CUDA packer multiplies by an approximate
reciprocal, so the two differ on some static-scale ties; reference/nvfp4.py models the CUDA one). It
materializes what the kernels fuse, so it saves nothing: it runs and tests the fused wiring without a GPU.
"""

from __future__ import annotations

import torch

from ..kernels.ops import Modulation, PackedActivation
from . import h3_ops, nvfp4


def source_output(x: torch.Tensor, *, swiglu: bool = False, modulation: Modulation | None = None) -> torch.Tensor:
    """The activation the pack quantizes: ``x``, ``swiglu(x)`` or the adaLN-modulated ``x`` (bf16 roundings
    as ComfyUI's ``mul_``/``add_``)."""
    if swiglu:
        return h3_ops.swiglu(x)
    if modulation is not None:
        index = modulation.mod_index.to(device=x.device, dtype=torch.long)
        one_plus_scale = (1.0 + modulation.scale)[index]
        return x.mul(one_plus_scale).add_(modulation.shift[index])
    return x


def pack_support(x: torch.Tensor, *, swiglu: bool = False, modulation: Modulation | None = None) -> str | None:
    if x.dtype != torch.bfloat16:
        return f"the activation is {x.dtype}, the fused pack takes bfloat16"
    if x.dim() != 2:
        return f"the activation must be 2-D, got {x.dim()}-D"
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    if k % 16:
        return f"the feature width {k} is not a multiple of 16"
    return None


def pack_nvfp4(x, *, static_scale=None, weight_scale_2=None, swiglu=False, modulation=None, out=None):
    import comfy_kitchen as ck

    h = source_output(x, swiglu=swiglu, modulation=modulation)
    if static_scale is None:
        g = (torch.amax(h.abs()) / nvfp4.GLOBAL_SCALE_DIVISOR).to(torch.float32)  # ComfyUI's expression
    else:
        g = static_scale.to(torch.float32).reshape(())
    rows, cols = h.shape
    qdata, scales = ck.quantize_nvfp4(h.contiguous(), g, pad_16x=rows % 16 != 0 or cols % 16 != 0)
    g = g.reshape(1)
    alpha = None
    if static_scale is None and weight_scale_2 is not None:
        alpha = nvfp4.gemm_alpha(g, weight_scale_2.to(g.device)).reshape(1)
    return PackedActivation(qdata, scales, g, alpha, rows, cols)


def gated_residual_(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor, mod_index: torch.Tensor) -> torch.Tensor:
    """``x[r] += other[r] * gate[mod_index[r]]`` with torch's addcmul_ (elementwise identical to per segment)."""
    return x.addcmul_(other, gate[mod_index.to(device=x.device, dtype=torch.long)].to(x.dtype))
