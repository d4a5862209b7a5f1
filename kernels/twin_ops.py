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

The row ops of a LayerNorm block (Wan; bf16 or fp16) are torch's ``layer_norm`` (with its affine parameters where
given) followed by ComfyUI's modulation ``torch.addcmul(shift, n, 1 + scale)``, GELU ``gelu(approximate="tanh")``,
the residuals ``torch.addcmul(x, other, gate)`` and ``x + other``, and the q / k path ``rms_norm`` over the full width
followed by comfy-kitchen's ``apply_rope1``. The twin keeps no LayerNorm statistics: its packs normalize again.
"""

from __future__ import annotations

import torch

from .. import comfy_adapter
from ..layout import (
    GLOBAL_SCALE_DIVISOR,
    AddcmulModulation,
    LayerNorm,
    Modulation,
    PackedActivation,
    RmsNorm,
    layer_norm_source_refusal,
    source_refusal,
)


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


def layer_norm(x: torch.Tensor, norm: LayerNorm) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, norm.eps)


def addcmul_modulate(n: torch.Tensor, modulation: AddcmulModulation) -> torch.Tensor:
    """``dtype(shift[m] + n * dtype(1 + scale[m]))`` per row (a new tensor)."""
    scale, shift = _rows(modulation.scale, modulation.mod_index), _rows(modulation.shift, modulation.mod_index)
    return torch.addcmul(shift, n, 1 + scale)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def apply_rope1(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen's interleaved RoPE as ComfyUI calls it (x [B, S, H, D], freqs [1, S, 1, D / 2, 2, 2])."""
    return comfy_adapter.apply_rope1(x, freqs)


def source_output(x: torch.Tensor, *, swiglu_source: bool = False, modulation: Modulation | None = None,
                  norm: RmsNorm | None = None, prescale: torch.Tensor | None = None,
                  up: torch.Tensor | None = None, layer_norm_source: LayerNorm | None = None,
                  addcmul_modulation: AddcmulModulation | None = None, gelu_source: bool = False) -> torch.Tensor:
    """The activation the pack quantizes."""
    if gelu_source:
        return gelu(x)
    if layer_norm_source is not None:
        n = layer_norm(x, layer_norm_source)
        return addcmul_modulate(n, addcmul_modulation) if addcmul_modulation is not None else n
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


def pack_support(x, *, swiglu=False, modulation=None, norm=None, prescale=None, up=None, layer_norm=None,
                 addcmul_modulation=None, gelu=False) -> str | None:
    return source_refusal(x, swiglu=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up,
                          layer_norm=layer_norm, addcmul_modulation=addcmul_modulation, gelu=gelu)


def residual_support(x, other, gate, *, next_norm=None) -> str | None:
    if other.shape != x.shape or gate.shape[-1] != x.shape[-1]:
        return "shape mismatch"
    return None


def pack_nvfp4(x, *, static_scale=None, global_scale=None, weight_scale_2=None, swiglu=False, modulation=None,
               norm=None, prescale=None, up=None, out=None, layer_norm=None, addcmul_modulation=None,
               gelu=False) -> PackedActivation:
    reason = pack_support(x, swiglu=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up,
                          layer_norm=layer_norm, addcmul_modulation=addcmul_modulation, gelu=gelu)
    if reason is not None:  # what the kernels refuse, the twin refuses
        raise ValueError(reason)
    h = source_output(x, swiglu_source=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up,
                      layer_norm_source=layer_norm, addcmul_modulation=addcmul_modulation, gelu_source=gelu)
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
    if weight_scale_2 is not None:
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


# ---- the row ops of a LayerNorm block ------------------------------------------------------------------------

def layer_norm_support(x, norm: LayerNorm, *, modulation=None, global_scale_out=None) -> str | None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return "only 2-D bf16 or fp16 activations"
    if (norm.weight is None) != (norm.bias is None):
        return "a LayerNorm with a weight but no bias (or the reverse): torch's kernel takes another branch"
    if global_scale_out is not None:
        return layer_norm_source_refusal(x, norm, modulation, False)
    return None


def layer_norm_statistics(x, norm: LayerNorm, *, modulation=None, global_scale_out=None) -> None:
    """The twin keeps no statistics (its packs normalize again); it writes the global scale where asked."""
    reason = layer_norm_support(x, norm, modulation=modulation, global_scale_out=global_scale_out)
    if reason is not None:
        raise ValueError(reason)
    if global_scale_out is not None:
        n = layer_norm(x, norm)
        h = addcmul_modulate(n, modulation) if modulation is not None else n
        global_scale_out.copy_(dynamic_global_scale(h))


def residual_layer_norm_support(x, other, next_norm: LayerNorm, *, gate=None, mod_index=None, out=None,
                                next_modulation=None, global_scale_out=None) -> str | None:
    if other.shape != x.shape or (out is not None and out.shape != x.shape):
        return "shape mismatch"
    if gate is not None and (gate.shape[-1] != x.shape[-1] or mod_index is None):
        return "a gate table [rows, K] needs its modulation index"
    return layer_norm_support(x, next_norm, modulation=next_modulation, global_scale_out=global_scale_out)


def residual_layer_norm_(x, other, next_norm: LayerNorm, *, gate=None, mod_index=None, out=None,
                         next_modulation=None, global_scale_out=None):
    reason = residual_layer_norm_support(x, other, next_norm, gate=gate, mod_index=mod_index, out=out,
                                         next_modulation=next_modulation, global_scale_out=global_scale_out)
    if reason is not None:
        raise ValueError(reason)
    new = torch.addcmul(x, other, _rows(gate, mod_index)) if gate is not None else x + other
    out = x if out is None else out
    out.copy_(new)
    layer_norm_statistics(out, next_norm, modulation=next_modulation, global_scale_out=global_scale_out)
    return out


def rms_norm_rope_support(q, k, q_weight, k_weight, *, freqs=None, positions=None) -> str | None:
    if q.dim() != 2 or (k is not None and k.shape != q.shape):
        return "q and k must be 2-D rows of one shape"
    if freqs is not None and (positions is None or q.shape[0] % positions or freqs.dim() != 4):
        return "the rope table must be [positions, head_dim / 2, 2, 2] for whole batch items of positions rows"
    return None


def rms_norm_rope_(q, k, q_weight, k_weight, eps: float, *, freqs=None, positions=None):
    reason = rms_norm_rope_support(q, k, q_weight, k_weight, freqs=freqs, positions=positions)
    if reason is not None:
        raise ValueError(reason)
    for x, weight in ((q, q_weight), (k, k_weight)):
        if x is None:
            continue
        n = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        if freqs is not None:
            head_dim = 2 * freqs.shape[1]
            heads = n.view(-1, positions, x.shape[-1] // head_dim, head_dim)
            n = apply_rope1(heads, freqs[:positions].unsqueeze(1).unsqueeze(0)).reshape(x.shape)
        x.copy_(n)
    return q, k
