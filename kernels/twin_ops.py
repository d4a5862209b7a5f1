"""Python twin of kernels/cuda_ops.py for tensors that are not on a CUDA device (CPU tests, the self-check's logic).

Same functions and arguments as the CUDA kernels, computed with torch's own ops in the order the kernels promise
to reproduce: RMSNorm is ``torch.nn.functional.rms_norm``, the adaLN modulation ``x * (1 + scale[m]) + shift[m]``
(or ``x * (1 + scale[m])`` without a shift) with a bf16 rounding after each op, SwiGLU ``silu(gate) * up``, a
Linear's ``pre_quant_scale`` ``x * prescale`` (one multiply in the activation dtype), the residual ``x + other *
gate[m]`` (torch's addcmul), the post-norm residual ``x + gate[m] * rms_norm(other)`` (a mul, then an add), the
global scale ``dtype(amax|h| / 2688)`` and the pack comfy-kitchen's ``quantize_nvfp4`` (on the CPU its eager
backend, which stock ComfyUI runs there too). It is written from those definitions, not from ComfyUI's code: the
tests compare it with ComfyUI's real blocks. It materializes what the kernels fuse, so it saves nothing.

Like the kernels, the plain and ``pre_quant_scale`` packs take bf16 or fp16 activations (each rounding in the
activation's dtype, as torch rounds it), the block sources bf16 only; the twin refuses what the kernels refuse.
"""

from __future__ import annotations

import torch

from .. import comfy_adapter
from ..layout import GLOBAL_SCALE_DIVISOR, Modulation, PackedActivation, RmsNorm, source_refusal


def _rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[index.to(device=table.device, dtype=torch.long)]


def modulate(x: torch.Tensor, modulation: Modulation) -> torch.Tensor:
    """``bf16(bf16(x * bf16(1 + scale[m])) + shift[m])`` per row, ``bf16(x * bf16(1 + scale[m]))`` without a shift
    (a new tensor)."""
    h = x.mul(1.0 + _rows(modulation.scale, modulation.mod_index))
    return h if modulation.shift is None else h.add_(_rows(modulation.shift, modulation.mod_index))


def swiglu(y: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """fc2's input: ``silu(gate) * up`` of a fused ``[M, 2K]`` row (gate half first), or of two tensors."""
    if up is None:
        return comfy_adapter.eager_swiglu(y)
    return torch.nn.functional.silu(y).mul_(up)


def rms_norm(x: torch.Tensor, norm: RmsNorm) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight.to(x.dtype), norm.eps)


def source_output(x: torch.Tensor, *, swiglu_source: bool = False, modulation: Modulation | None = None,
                  norm: RmsNorm | None = None, prescale: torch.Tensor | None = None,
                  up: torch.Tensor | None = None) -> torch.Tensor:
    """The activation the pack quantizes."""
    if swiglu_source:
        return swiglu(x, up)
    if prescale is not None:
        return x * prescale  # bf16 * bf16 (fp16 * fp16): torch's fp32 product, one rounding to the dtype
    h = rms_norm(x, norm) if norm is not None else x
    return modulate(h, modulation) if modulation is not None else h


def dynamic_global_scale(h: torch.Tensor) -> torch.Tensor:
    return (torch.amax(h.abs()) / GLOBAL_SCALE_DIVISOR).to(torch.float32).reshape(1)


def rms_norm_support(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or weight.dtype != x.dtype:
        return "only 2-D bf16 activations with a bf16 weight"
    return None


def pack_support(x, *, swiglu=False, modulation=None, norm=None, prescale=None, up=None) -> str | None:
    return source_refusal(x, swiglu=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up)


def residual_support(x, other, gate, *, next_norm=None) -> str | None:
    if other.shape != x.shape or gate.shape[-1] != x.shape[-1]:
        return "shape mismatch"
    return None


def pack_nvfp4(x, *, static_scale=None, global_scale=None, weight_scale_2=None, swiglu=False, modulation=None,
               norm=None, prescale=None, up=None, out=None) -> PackedActivation:
    reason = pack_support(x, swiglu=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up)
    if reason is not None:  # what the kernels refuse, the twin refuses
        raise ValueError(reason)
    h = source_output(x, swiglu_source=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up)
    if static_scale is not None:
        g = static_scale.to(torch.float32).reshape(1)
    elif global_scale is not None:
        g = global_scale.to(torch.float32).reshape(1)
    else:
        g = dynamic_global_scale(h)
    rows, cols = h.shape
    qdata, scales = comfy_adapter.quantize_nvfp4(h.contiguous(), g.reshape(()),
                                                 pad_16x=rows % 16 != 0 or cols % 16 != 0)
    alpha = None
    if static_scale is None and weight_scale_2 is not None:
        alpha = (g * weight_scale_2.to(device=g.device, dtype=torch.float32)).reshape(1)
    return PackedActivation(qdata, scales, g, alpha, rows, cols)


def norm_statistics(x, norm: RmsNorm, *, modulation=None, global_scale_out=None) -> None:
    """The twin keeps no rstd (its packs call rms_norm again); it writes the global scale where asked."""
    if global_scale_out is not None:
        h = rms_norm(x, norm)
        global_scale_out.copy_(dynamic_global_scale(modulate(h, modulation) if modulation is not None else h))


def gated_residual_(x, other, gate, mod_index, *, next_norm=None, next_modulation=None, global_scale_out=None):
    x.addcmul_(other, _rows(gate, mod_index).to(x.dtype))
    if next_norm is not None:
        norm_statistics(x, next_norm, modulation=next_modulation, global_scale_out=global_scale_out)
    return x


def post_norm_residual_support(x, other, other_weight, gate=None, *, next_norm=None, next_modulation=None,
                               x_from=None) -> str | None:
    if other.shape != x.shape or (gate is not None and gate.shape[-1] != x.shape[-1]):
        return "shape mismatch"
    if x_from is not None and (x_from.shape != x.shape or x_from.dtype != x.dtype):
        return "x_from must have x's shape and dtype"
    if x.dtype != torch.bfloat16 or other.dtype != x.dtype or other_weight.dtype != x.dtype:
        return "the post-norm residual takes bf16 tensors and a bf16 norm weight"
    return None


def post_norm_residual_(x, other, other_weight, other_eps, gate, mod_index, *, next_norm=None, next_modulation=None,
                        global_scale_out=None, x_from=None):
    """``x += bf16(gate[m] * rms_norm(other))`` (``x += rms_norm(other)`` without a gate): torch's rms_norm, mul and
    add, each rounding to bf16; with ``x_from`` the sum of ``x_from`` and that, written to ``x``."""
    if x_from is not None:
        x.copy_(x_from)
    n = torch.nn.functional.rms_norm(other, (other.shape[-1],), other_weight, other_eps)
    x.add_(n if gate is None else _rows(gate, mod_index).to(x.dtype) * n)
    if next_norm is not None:
        norm_statistics(x, next_norm, modulation=next_modulation, global_scale_out=global_scale_out)
    return x


def rms_rope_support(q, k, freqs, q_weight, k_weight, rot_dim) -> str | None:
    return "the RMSNorm + RoPE kernel has no Python twin; comfy-kitchen's op runs"


def rms_rope_split_half_(*args, **kwargs):
    raise NotImplementedError("rms_rope_split_half_ runs comfy-kitchen's op off the GPU")
