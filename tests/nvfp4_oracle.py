"""Exact Python reference of comfy-kitchen's CUDA NVFP4 activation packer.

This is the oracle the CUDA kernels in ``kernels/`` are tested against. It reproduces, step by step,
the instruction sequence that comfy-kitchen's ``quantize_nvfp4`` kernel (built with ``--use_fast_math``)
executes for every 16-element block of a row, with ``x`` bf16 or fp16 (the kernel is templated on the input type:
the same instructions on fp16, ``max.f16`` / ``abs.f16``) and ``g`` the fp32 global (decode) scale:

    a  = max_i |x_i|                       bf16 ``max`` that skips NaN (all-NaN block -> NaN), widened to fp32
    d  = div.approx.ftz(div.approx.ftz(a, 6), g)                      = (a * fl(1/6)) * rcp(g), flushed
    d  = min.ftz(d, 448)                   ``min`` returns the non-NaN operand, so NaN -> 448
    s8 = cvt.rn.satfinite.e4m3(d)          the block-scale byte
    e  = min.ftz(rcp.approx.ftz(g * float(s8)), FLT_MAX)             rcp(0) = inf -> FLT_MAX
    q_i = cvt.rn.satfinite.e2m1(x_i * e)   mul.ftz; round-to-nearest-even; |v| > 5 -> 6; NaN -> +6;
                                            the sign of a zero result is kept (-0.0 -> code 0x8)

Every fp32 multiply is ``.ftz``: subnormal operands and results become zeros of the same sign, so bf16
subnormal inputs quantize to (signed) zero codes. fp16 subnormals (down to 2^-24) widen to NORMAL fp32 values and
are not flushed.

Layout (layout.py; must match ``kernels/csrc/nvfp4_common.cuh``):
  * qdata ``uint8 [roundup(M, 16), K/2]``, element ``2j`` of a row in the HIGH nibble of byte ``j``;
    rows ``M .. roundup(M,16)`` are packed from zeros with the real ``g``.
  * block scales ``float8_e4m3fn [roundup(roundup(M,16), 128), roundup(K/16, 4)]`` in cuBLAS's 128x4
    tiled ("swizzled") layout, see :func:`swizzled_scale_offset`; every byte that no block writes is 0.

What this reference cannot reproduce: the GPU's ``rcp.approx`` (MUFU.RCP, <= 1 ulp) is modelled by the
correctly rounded reciprocal. The two agree whenever ``g * s8`` is a power of two (then both are exact),
and a code can only differ when ``x_i * e`` lands within one ulp of an E2M1 rounding boundary
(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) -- in practice an exact tie ``x_i == boundary * g * s8`` with
``g * s8`` not a power of two -- or when ``d`` lands within one ulp of an E4M3 rounding boundary.
Those cases are checked on the GPU against comfy-kitchen itself (tests/test_gpu_pack_parity.py).
"""

from __future__ import annotations

import torch

from h3_fused_nvfp4.layout import (
    BLOCK,
    E4M3_MAX,
    FP4_MAX,
    GLOBAL_SCALE_DIVISOR,
    packed_shapes,
    roundup,
    swizzled_scale_offset,
)

__all__ = ["GLOBAL_SCALE_DIVISOR", "dynamic_global_scale", "e2m1_codes", "pack_nibbles", "packed_shapes",
           "quantize_blocks", "quantize_nvfp4", "rcp_sensitive_blocks", "roundup", "swizzled_scale_offset",
           "unswizzle_scales"]

FLT_MAX = 3.4028234663852886e38
_FLT_MIN_NORMAL = 2.0**-126


# --- fp32 building blocks with the GPU's flush-to-zero semantics ------------------------------------

def _ftz(t: torch.Tensor) -> torch.Tensor:
    """Flush fp32 subnormals to a zero of the same sign (what every ``.ftz`` instruction does)."""
    return torch.where(t.abs() < _FLT_MIN_NORMAL, t * 0.0, t)


def _mul_ftz(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _ftz(_ftz(a) * _ftz(b))


def _rcp_ftz(a: torch.Tensor) -> torch.Tensor:
    # rcp.approx.ftz modelled by the correctly rounded reciprocal (see the module docstring).
    return _ftz(1.0 / _ftz(a))


def _min_ftz(a: torch.Tensor, bound: float) -> torch.Tensor:
    # PTX min returns the non-NaN operand.
    a = _ftz(a)
    return torch.where(torch.isnan(a) | (a > bound), torch.full_like(a, bound), a)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """cvt.rn.satfinite.e2m1: fp32 -> 4-bit code (sign << 3 | magnitude index), as uint8.

    Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; round to nearest, ties to the even code; anything above 5
    (including inf) saturates to 6; NaN -> +6 (code 0x7); the sign of a zero result is kept.
    """
    mag = v.abs()
    # Interval upper edges with their tie direction: a tie goes to the even code.
    idx = torch.zeros(v.shape, dtype=torch.uint8)
    idx = torch.where(mag > 0.25, 1, idx)   # 0.25 -> 0 (even)
    idx = torch.where(mag >= 0.75, 2, idx)  # 0.75 -> 1.0 (even)
    idx = torch.where(mag > 1.25, 3, idx)   # 1.25 -> 1.0
    idx = torch.where(mag >= 1.75, 4, idx)  # 1.75 -> 2.0
    idx = torch.where(mag > 2.5, 5, idx)    # 2.5 -> 2.0
    idx = torch.where(mag >= 3.5, 6, idx)   # 3.5 -> 4.0
    idx = torch.where(mag > 5.0, 7, idx)    # 5.0 -> 4.0
    idx = idx.to(torch.uint8)
    nan = torch.isnan(v)
    idx = torch.where(nan, torch.full_like(idx, 7), idx)
    negative = torch.signbit(v) & ~nan
    return idx | (negative.to(torch.uint8) << 3)


def _bf16_absmax_skip_nan(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim the way ``max.bf16`` (``max.f16``) does: NaN operands are skipped; all-NaN -> NaN."""
    mag = blocks.abs().float()
    is_nan = torch.isnan(mag)
    best = torch.where(is_nan, torch.full_like(mag, -1.0), mag).amax(dim=-1)
    return torch.where(is_nan.all(dim=-1), torch.full_like(best, float("nan")), best)


# --- global scale --------------------------------------------------------------------------------

def dynamic_global_scale(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's dynamic per-tensor scale: ``torch.amax(x.abs()) / 2688`` evaluated in x's dtype, as fp32.

    The division by a Python scalar runs as ``fp32(amax) * fp32(1/2688)`` rounded once to x's dtype (torch's
    GPU kernel multiplies by the reciprocal of a scalar divisor). ``amax`` propagates NaN, so a tensor
    with any NaN gets a NaN scale; an all-zero tensor gets 0. In fp16 the scale of a small amax lands in the
    fp16 subnormals (amax < ~0.16) or on 0 (amax < ~8e-5); an infinite amax gives an infinite scale.
    """
    amax = x.abs().amax().float()
    inv = torch.tensor(1.0 / GLOBAL_SCALE_DIVISOR, dtype=torch.float32)
    return (amax * inv).to(x.dtype).to(torch.float32).reshape(())


# --- the packer ----------------------------------------------------------------------------------

def quantize_blocks(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpadded core: [M, K] bf16 or fp16 + fp32 scalar g -> (codes uint8 [M, K] one nibble per byte,
    block-scale bytes uint8 [M, K/16])."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    g = g.to(torch.float32).reshape(())
    a = _bf16_absmax_skip_nan(blocks)
    sixth = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
    d = _mul_ftz(_mul_ftz(a, sixth), _rcp_ftz(g))
    d = _min_ftz(d, E4M3_MAX)
    s8 = d.to(torch.float8_e4m3fn)
    e = _min_ftz(_rcp_ftz(_mul_ftz(g, s8.float())), FLT_MAX)
    v = _mul_ftz(blocks.float(), e.unsqueeze(-1))
    return e2m1_codes(v).reshape(rows, cols), s8.view(torch.uint8)


def rcp_sensitive_blocks(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """bool [M, K/16]: blocks whose bytes could change if the GPU's ``rcp.approx`` were one ulp off the
    correctly rounded reciprocal this reference uses -- the only inputs where the two may disagree.

    Each of the two reciprocals (of g, and of g * s8) is nudged by one ulp either way; a block is sensitive when
    its block scale or any of its codes moves.
    """
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    g = g.to(torch.float32).reshape(())
    a = _bf16_absmax_skip_nan(blocks)
    sixth = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
    x32 = blocks.float()
    results = []
    for nudge in (1.0 - 2.0**-23, 1.0, 1.0 + 2.0**-23):
        d = _min_ftz(_mul_ftz(_mul_ftz(a, sixth), _ftz(_rcp_ftz(g) * nudge)), E4M3_MAX)
        s8 = d.to(torch.float8_e4m3fn)
        for nudge_e in (1.0 - 2.0**-23, 1.0, 1.0 + 2.0**-23):
            e = _min_ftz(_ftz(_rcp_ftz(_mul_ftz(g, s8.float())) * nudge_e), FLT_MAX)
            codes = e2m1_codes(_mul_ftz(x32, e.unsqueeze(-1)))
            results.append((s8.view(torch.uint8), codes))
    s0, c0 = results[4]
    sensitive = torch.zeros(rows, cols // BLOCK, dtype=torch.bool)
    for s8, codes in results:
        sensitive |= (s8 != s0) | (codes != c0).any(dim=-1)
    return sensitive


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[M, K] codes -> [M, K/2] bytes, element 2j in the high nibble (comfy-kitchen's hi_first=True)."""
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """Reference of the whole activation pack for a 2-D bf16 or fp16 tensor.

    ``global_scale``: a static fp32 ``input_scale``; ``None`` computes ComfyUI's dynamic scale.
    Returns ``(qdata uint8, block_scales float8_e4m3fn, global_scale fp32 0-d)`` in comfy-kitchen's
    padded layouts.
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"expected a 2-D bf16 or fp16 tensor, got {tuple(x.shape)} {x.dtype}")
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"the feature width must be a multiple of 16, got {cols}")
    x = x.cpu()
    g = dynamic_global_scale(x) if global_scale is None else global_scale.detach().cpu().float().reshape(())
    (rows16, _), (scale_rows, scale_cols) = packed_shapes(rows, cols)
    padded = torch.zeros(rows16, cols, dtype=x.dtype)
    padded[:rows] = x
    codes, s8 = quantize_blocks(padded, g)
    qdata = pack_nibbles(codes)

    scales = torch.zeros(scale_rows * scale_cols, dtype=torch.uint8)
    r = torch.arange(rows16).unsqueeze(1).expand(rows16, cols // BLOCK)
    c = torch.arange(cols // BLOCK).unsqueeze(0).expand(rows16, cols // BLOCK)
    scales[swizzled_scale_offset(r, c, scale_cols).reshape(-1)] = s8.reshape(-1)
    return qdata, scales.view(torch.float8_e4m3fn).reshape(scale_rows, scale_cols), g


def unswizzle_scales(block_scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled [R128, C] scale bytes -> plain [rows, cols // 16] bytes (for readable test failures)."""
    scale_cols = block_scales.shape[1]
    flat = block_scales.reshape(-1).view(torch.uint8)
    r = torch.arange(rows).unsqueeze(1).expand(rows, cols // BLOCK)
    c = torch.arange(cols // BLOCK).unsqueeze(0).expand(rows, cols // BLOCK)
    return flat[swizzled_scale_offset(r, c, scale_cols)]
