"""NVFP4 layouts and the types shared by the CUDA kernels (kernels/), their Python twin (kernels/twin_ops.py) and the
integration, and the source rules both implementations of the fused pack share (:func:`source_refusal`). A leaf
module: it imports nothing of this package.

Layouts (must match kernels/csrc/nvfp4_common.cuh, comfy-kitchen's quantize_nvfp4 and cuBLASLt's NVFP4 operands):

* qdata ``uint8 [roundup(M, 16), K/2]``, element ``2j`` of a row in the HIGH nibble of byte ``j``;
* block scales ``float8_e4m3fn [roundup(roundup(M, 16), 128), roundup(K/16, 4)]`` in cuBLAS's 128x4 tiled layout
  (:func:`swizzled_scale_offset`), every byte no block writes 0;
* ComfyUI's dynamic activation scale ``g = bf16(amax|x| / 2688)``, 2688 = 6 (E2M1 max) x 448 (E4M3 max).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP4_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SCALE_DIVISOR = FP4_MAX * E4M3_MAX  # 2688
BLOCK = 16  # elements per NVFP4 block (one e4m3 scale each)
NVFP4_LAYOUT = "TensorCoreNVFP4Layout"  # ComfyUI's / comfy-kitchen's name of the NVFP4 QuantizedTensor layout


def tensor_version(t: torch.Tensor):
    """``t._version``, or None for inference tensors (which track no version; ComfyUI samples in inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


def rows_readable_in_place(t: torch.Tensor) -> bool:
    """The kernels read an activation's rows in place: unit column stride, rows starting on 16-byte boundaries."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and (t.dim() < 2 or t.stride(0) * t.element_size() % 16 == 0))


def roundup(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def packed_shapes(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(qdata shape, block-scale shape) of an ``[rows, cols]`` activation, as comfy-kitchen allocates them."""
    rows16 = roundup(rows, BLOCK)
    return (rows16, cols // 2), (roundup(rows16, 128), roundup(cols // BLOCK, 4))


def swizzled_scale_offset(row, col, padded_scale_cols: int):
    """Byte offset of block scale (row, col) in the 128x4 tiled layout (ints or tensors).

    Must match ``swizzled_scale_offset`` in kernels/csrc/nvfp4_common.cuh."""
    return (((row // 128) * (padded_scale_cols // 4) + col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4
            + col % 4)


def packed_buffer_layout(rows: int, k: int) -> tuple[int, int, int, int, int]:
    """(qdata bytes, scale offset, scale bytes, scalars offset, total bytes) of the one uint8 buffer a pack writes:
    qdata | block scales (256-byte aligned) | fp32 global scale, fp32 GEMM alpha (16-byte aligned)."""
    (rows16, half), (srows, scols) = packed_shapes(rows, k)
    q_bytes = rows16 * half
    s_off = roundup(q_bytes, 256)
    s_bytes = srows * scols
    g_off = roundup(s_off + s_bytes, 16)
    return q_bytes, s_off, s_bytes, g_off, g_off + 8


@dataclass(frozen=True)
class Modulation:
    """adaLN modulation applied on the fly: ``h = bf16(bf16(x * bf16(1 + scale[m])) + shift[m])`` (MiniMax H3's
    ``h.mul_(1 + scale).add_(shift)``), or with ``shift=None`` the scale-only form ``h = bf16(x * bf16(1 +
    scale[m]))`` (Z-Image's ``modulate``; the kernels fold it together with its RMSNorm only).

    ``scale``/``shift``: bf16 ``[rows, K]`` tables (free row stride, unit column stride); ``mod_index``: int32
    ``[M]`` on the activation's device, the table row of every token.
    """

    scale: torch.Tensor
    shift: torch.Tensor | None
    mod_index: torch.Tensor


@dataclass(frozen=True)
class RmsNorm:
    """An RMSNorm folded into the kernels: ``n = bf16(weight * (rstd[r] * x))``, torch's CUDA ``rms_norm``
    arithmetic (kernels/csrc/residual_norm.cu). ``weight``: bf16 ``[K]``; ``eps``: the module's eps; ``rstd``: fp32
    ``[M]`` written by a norm-statistics kernel earlier on the stream and read by the pack."""

    weight: torch.Tensor
    eps: float
    rstd: torch.Tensor


@dataclass(frozen=True)
class LayerNorm:
    """torch's ``layer_norm`` folded into the kernels: ``n = dtype(rstd[r] * (x - mean[r]))``, with affine parameters
    ``dtype(fma(weight, rstd[r] * (x - mean[r]), bias))`` (torch's CUDA arithmetic: kernels/csrc/residual_norm.cu).
    ``weight``, ``bias``: both None (no affine parameters) or both ``[K]`` in the activation's dtype; ``eps``: the
    module's eps; ``mean``, ``rstd``: fp32 ``[M]``, written by the LayerNorm statistics earlier on the stream and read
    by the pack."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    mean: torch.Tensor
    rstd: torch.Tensor


@dataclass(frozen=True)
class AddcmulModulation:
    """ComfyUI's modulation ``torch.addcmul(shift, n, 1 + scale)`` of a normalized row (Wan's block), applied on the
    fly: ``h = dtype(shift[m] + n * dtype(1 + scale[m]))``, each op in fp32 opmath with one rounding to the dtype.

    ``scale``/``shift``: ``[rows, K]`` tables in the activation's dtype (one row stride for both, unit column stride);
    ``mod_index``: int32 ``[M]`` on the activation's device, the table row of every token.
    """

    scale: torch.Tensor
    shift: torch.Tensor
    mod_index: torch.Tensor


# Activation dtypes of the packs: the plain and pre_quant_scale sources read either, and so do the sources of a
# LayerNorm block (LayerNorm, addcmul modulation, GELU); the RMSNorm block sources (modulation, RMSNorm, SwiGLU)
# read bf16 only.
PACK_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def source_refusal(x: torch.Tensor, *, swiglu: bool = False, modulation: Modulation | None = None,
                   norm: RmsNorm | None = None, prescale: torch.Tensor | None = None,
                   up: torch.Tensor | None = None, layer_norm: LayerNorm | None = None,
                   addcmul_modulation: AddcmulModulation | None = None, gelu: bool = False) -> str | None:
    """Why no implementation of the fused pack (kernels/cuda_ops.py, kernels/twin_ops.py) takes this source: the
    dtype, shape and combination rules both share (None: these hold; each adds its own, such as alignment).

    ``up``: the SwiGLU source's up values as a second ``[M, K]`` tensor (``h = silu(x) * up``); without it a SwiGLU
    source reads ``[M, 2K]`` rows, gate half first."""
    if x.dtype not in PACK_DTYPE_NAMES:
        return f"the activation is {x.dtype}, the fused pack takes bfloat16 or float16"
    if layer_norm is not None or addcmul_modulation is not None or gelu:
        if swiglu or modulation is not None or norm is not None or prescale is not None or up is not None:
            return ("a LayerNorm / addcmul modulation / GELU source is not combined with the RMSNorm block or "
                    "prescale sources")
        return layer_norm_source_refusal(x, layer_norm, addcmul_modulation, gelu)
    if x.dtype != torch.bfloat16 and (swiglu or modulation is not None or norm is not None):
        return (f"the activation is {x.dtype}: the fused SwiGLU / RMSNorm / modulation sources take bfloat16 (only "
                "plain and pre_quant_scale packs take float16)")
    if x.dim() != 2:
        return f"the activation must be 2-D, got {x.dim()}-D"
    if swiglu and (modulation is not None or norm is not None):
        return "a source is either SwiGLU or normalized / modulated"
    if prescale is not None and (swiglu or modulation is not None or norm is not None):
        return "a pre_quant_scale source reads plain rows (no SwiGLU, RMSNorm or modulation with it)"
    if modulation is not None and modulation.shift is None and norm is None:
        return "a scale-only modulation is folded together with its RMSNorm only"
    if up is not None and not swiglu:
        return "a second input (up) belongs to a SwiGLU source"
    k = x.shape[1] // 2 if swiglu and up is None else x.shape[1]
    if k % 16 or (swiglu and up is None and x.shape[1] % 2):
        return f"the feature width {k} is not a multiple of 16"
    if up is not None and (up.dtype != x.dtype or up.shape != x.shape or up.device != x.device):
        return f"the SwiGLU up tensor must be {PACK_DTYPE_NAMES[x.dtype]} {tuple(x.shape)} on {x.device} like the gates"
    if prescale is not None and (prescale.dtype != x.dtype or prescale.shape != (k,) or prescale.device != x.device):
        return (f"the pre_quant_scale table must be a {PACK_DTYPE_NAMES[x.dtype]} [{k}] tensor on {x.device} (the "
                "activation's dtype)")
    return None


def layer_norm_source_refusal(x: torch.Tensor, layer_norm: LayerNorm | None,
                               modulation: AddcmulModulation | None, gelu: bool) -> str | None:
    """The rules of the LayerNorm block's sources (:func:`source_refusal`): a LayerNorm followed by the addcmul
    modulation, a LayerNorm with its affine parameters, or GELU; every table in the activation's dtype."""
    if x.dim() != 2:
        return f"the activation must be 2-D, got {x.dim()}-D"
    if x.shape[1] % 16:
        return f"the feature width {x.shape[1]} is not a multiple of 16"
    if gelu:
        return None if layer_norm is None and modulation is None else "a GELU source reads plain rows"
    if layer_norm is None:
        return "the addcmul modulation is applied to a folded LayerNorm (a LayerNorm source)"
    k, name = x.shape[1], PACK_DTYPE_NAMES[x.dtype]
    affine = layer_norm.weight is not None or layer_norm.bias is not None
    if affine:
        if modulation is not None:
            return "a LayerNorm source has affine parameters or is modulated, not both"
        for what, t in (("weight", layer_norm.weight), ("bias", layer_norm.bias)):
            if t is None or t.dtype != x.dtype or tuple(t.shape) != (k,) or t.device != x.device:
                return f"the LayerNorm {what} must be a {name} [{k}] tensor on {x.device} (the activation's dtype)"
    elif modulation is None:
        return "a LayerNorm without affine parameters is folded only in front of the addcmul modulation"
    if modulation is not None:
        for what, t in (("scale", modulation.scale), ("shift", modulation.shift)):
            if t.dtype != x.dtype or t.dim() != 2 or t.shape[1] != k or t.device != x.device:
                return f"the modulation {what} table must be {name} [rows, {k}] on {x.device} (the activation's dtype)"
        if modulation.scale.stride() != modulation.shift.stride():
            return "the modulation scale and shift tables must share one row stride"
        idx = modulation.mod_index
        if idx.dtype != torch.int32 or tuple(idx.shape) != (x.shape[0],) or idx.device != x.device:
            return "the modulation index must be int32 [M] on the activation's device"
    for what, t in (("mean", layer_norm.mean), ("rstd", layer_norm.rstd)):
        if t.dtype != torch.float32 or tuple(t.shape) != (x.shape[0],) or t.device != x.device:
            return f"the LayerNorm {what} must be fp32 [M] on the activation's device"
    return None


@dataclass
class PackedActivation:
    qdata: torch.Tensor         # uint8 [rows16, K/2]
    block_scales: torch.Tensor  # float8_e4m3fn [rows128, roundup(K/16, 4)], swizzled
    global_scale: torch.Tensor  # fp32 [1]
    alpha: torch.Tensor | None  # fp32 [1]: global_scale * weight_scale_2, the GEMM's device alpha
    rows: int
    cols: int
