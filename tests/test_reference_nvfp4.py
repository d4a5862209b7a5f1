"""The Python reference packer (tests/nvfp4_oracle.py) on the CPU.

1. Against comfy-kitchen's EAGER backend (``comfy_kitchen.backends.eager.quantization.quantize_nvfp4``, the
   backend ComfyUI uses without CUDA) on fresh random data at the H3 widths: qdata, block scales and the global
   scale (vs ComfyUI's own expression) byte for byte.

   The reference follows comfy-kitchen's CUDA packer, which divides through reciprocals
   (``x * rcp(g * s)``, ``a * rcp(6) * rcp(g)``) where eager divides exactly. The two round differently ONLY
   at an exact rounding tie of the exact quotient whose divisor is not a power of two (e.g. ``g * s = 1.875``
   and ``x = 1.25 * 1.875``): eager rounds the tie to even, the reciprocal lands one ulp off the tie and
   rounds away from it. With ComfyUI's dynamic bf16 scale that can happen on real data (a few elements in
   some tensors; see ``test_dynamic_scale_tie_diverges_from_eager``). The comparison therefore accepts a
   difference only at such an exact tie, and there re-derives both results independently.

2. The documented cases where the reference follows the CUDA packer instead of eager, each against bytes
   derived by hand in the test (not by calling the reference): zeros, -0.0, underflowing block scales, NaN,
   +-Inf, bf16 subnormals, exact ties; the swizzled scale layout and the zero padding.
"""

from __future__ import annotations

import math
import os
import random
import struct

import nvfp4_oracle as ref
import pytest
import torch

WIDTHS = (5376, 7168, 14336)  # H3: hidden size, attention out / fc2 input halves, fc2 input
ROWS = (1, 15, 16, 17, 127, 128, 129, 300)
BIG_ROWS = 3000
CASES = [(rows, cols) for cols in WIDTHS for rows in ROWS] + [(BIG_ROWS, cols) for cols in WIDTHS]

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code 0..7
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)   # midpoints between neighbouring magnitudes


def eager_quantize_nvfp4(x, g):
    eager = pytest.importorskip("comfy_kitchen.backends.eager.quantization", reason="needs comfy-kitchen")
    return eager.quantize_nvfp4(x, g, pad_16x=True)


def comfy_global_scale(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's dynamic scale, with ComfyUI's own expression."""
    return (torch.amax(x.abs()) / 2688.0).to(torch.float32)


def f32_bits(value) -> int:
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def f32(value) -> float:
    """Round a Python float to fp32 (and back)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def e2m1_by_hand(v: float) -> int:
    """cvt.rn.satfinite.e2m1 on one value: nearest magnitude, ties to the even code, |v| > 6 saturates."""
    if math.isnan(v):
        return 0x7
    m = abs(v)
    if m >= 6.0:
        index = 7
    else:
        dist = [abs(m - level) for level in E2M1_GRID]
        best = min(dist)
        candidates = [i for i, d in enumerate(dist) if d == best]
        index = candidates[0] if len(candidates) == 1 else next(i for i in candidates if i % 2 == 0)
    return index | (8 if math.copysign(1.0, v) < 0 else 0)


def unpack_codes(qdata: torch.Tensor) -> torch.Tensor:
    """[R, K/2] bytes -> [R, K] codes (element 2j is the HIGH nibble of byte j)."""
    return torch.stack([qdata >> 4, qdata & 0xF], dim=-1).reshape(qdata.shape[0], -1)


def scale_byte(block_scales: torch.Tensor, row: int, col: int) -> int:
    """Block scale (row, col) of a swizzled scale tensor, addressed with the reference's offset function."""
    flat = block_scales.reshape(-1).view(torch.uint8)
    return int(flat[ref.swizzled_scale_offset(row, col, block_scales.shape[1])])


# ---- 1. reference vs comfy-kitchen's eager backend -----------------------------------------------------------

E4M3_GRID = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448


def _check_scale_tie(block: torch.Tensor, g: float, ref_byte: int, ck_byte: int, where: str) -> None:
    """A block-scale byte may differ only where a / (6 g) is exactly halfway between two e4m3 values."""
    a = block.abs().max().item()
    exact = a / (6.0 * g)  # 6 g is exact in fp64, so an exact midpoint comes out exactly
    lo_byte = int((E4M3_GRID <= exact).nonzero().max())
    hi_byte = int((E4M3_GRID >= exact).nonzero().min())
    lo, hi = E4M3_GRID[lo_byte].item(), E4M3_GRID[hi_byte].item()
    assert lo < exact < hi and exact == (lo + hi) / 2, (
        f"{where}: block scale {ref_byte:#04x} (reference) vs {ck_byte:#04x} (eager), a={a!r} g={g!r}: "
        f"a/(6g)={exact!r} is not an e4m3 rounding tie"
    )
    assert ck_byte == (lo_byte if lo_byte % 2 == 0 else hi_byte), f"{where}: eager does not round the tie to even"
    # CUDA: d = (fp32(a) * fl(1/6)) * fl(1/g), each product rounded to fp32, lands off the tie.
    d = f32(f32(f32(a) * f32(1.0 / 6.0)) * f32(1.0 / f32(g)))
    assert d != exact, where
    assert ref_byte == (hi_byte if d > exact else lo_byte), (f"{where}: reference byte is not the rcp rounding "
                                                             f"of d={d!r}")


def _check_code_tie(x: float, g: float, s: float, ref_code: int, ck_code: int, where: str) -> None:
    """A code may differ only where x / (g s) is exactly an E2M1 rounding tie."""
    t = f32(f32(g) * s)  # mul.ftz(g, s8): what both backends divide by
    exact = x / t
    assert abs(exact) in E2M1_TIES, (
        f"{where}: code {ref_code:#x} (reference) vs {ck_code:#x} (eager) for x={x!r}, g*s={t!r}: "
        f"x/(g*s)={exact!r} is not an E2M1 rounding tie"
    )
    assert ck_code == e2m1_by_hand(exact), f"{where}: eager does not round the tie {exact} to even"
    v = f32(f32(x) * f32(1.0 / t))  # CUDA: x * fl(1/(g*s))
    assert ref_code == e2m1_by_hand(v), f"{where}: reference code {ref_code:#x}, x*fl(1/(g*s))={v!r}"


def assert_reference_matches_eager(x: torch.Tensor, label: str, global_scale: torch.Tensor | None = None):
    """Compare the reference with eager; return (block scales, codes) that differ at exact ties."""
    rows, cols = x.shape
    q_ref, s_ref, g_ref = ref.quantize_nvfp4(x, global_scale)
    g = comfy_global_scale(x) if global_scale is None else global_scale.float().reshape(())
    assert f32_bits(g_ref) == f32_bits(g), f"{label}: global scale {g_ref.item()!r} vs ComfyUI's {g.item()!r}"
    q_ck, s_ck = eager_quantize_nvfp4(x, g)
    assert q_ref.dtype == q_ck.dtype == torch.uint8 and q_ref.shape == q_ck.shape, label
    assert s_ref.dtype == s_ck.dtype == torch.float8_e4m3fn and s_ref.shape == s_ck.shape, label
    rows16 = q_ref.shape[0]

    plain_ref = ref.unswizzle_scales(s_ref, rows16, cols)
    plain_ck = ref.unswizzle_scales(s_ck, rows16, cols)
    scale_diff = plain_ref != plain_ck
    swizzled_diff = int((s_ref.view(torch.uint8) != s_ck.view(torch.uint8)).sum())
    assert swizzled_diff == int(scale_diff.sum()), f"{label}: block-scale padding bytes differ"

    codes_ref, codes_ck = unpack_codes(q_ref), unpack_codes(q_ck)
    code_diff = (codes_ref != codes_ck) & ~scale_diff.repeat_interleave(16, dim=1)
    n_scale, n_code = int(scale_diff.sum()), int(code_diff.sum())
    if n_scale or n_code:
        # Every difference is re-derived below; ties are rare (about 1e-4 of the elements at worst, for a g
        # like 1.90625 * 2^k), so a broken reference fails at its first non-tie difference.
        padded = torch.zeros(rows16, cols, dtype=torch.bfloat16)
        padded[:rows] = x
        values = padded.double()
        g_value = g.item()
        for r, j in scale_diff.nonzero().tolist():
            _check_scale_tie(values[r, 16 * j:16 * j + 16], g_value, int(plain_ref[r, j]), int(plain_ck[r, j]),
                             f"{label} block ({r}, {j})")
        where = code_diff.nonzero()
        r, c = where[:, 0], where[:, 1]
        xs = values[r, c].tolist()
        ss = plain_ref[r, c // 16].view(torch.float8_e4m3fn).float().tolist()
        refs, cks = codes_ref[r, c].tolist(), codes_ck[r, c].tolist()
        for i, (row, col) in enumerate(where.tolist()):
            _check_code_tie(xs[i], g_value, ss[i], refs[i], cks[i], f"{label} element ({row}, {col})")
    return n_scale, n_code


def fresh_seed() -> int:
    env = os.environ.get("H3_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def random_activation(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    # Row magnitudes over 14 binades (2^-6 .. 2^7): block scales from e4m3 subnormals up to 448. Wider spreads
    # make block scales underflow to 0, where CUDA and eager differ by design (test_scale_underflow_block).
    mag = torch.exp2(torch.randint(-6, 8, (rows, 1), generator=gen).float())
    return (torch.randn(rows, cols, generator=gen) * mag).to(torch.bfloat16)


@pytest.mark.parametrize("rows,cols", CASES, ids=[f"{r}x{c}" for r, c in CASES])
def test_reference_matches_eager_backend(rows, cols):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = random_activation(rows, cols, gen)
    assert_reference_matches_eager(x, f"{rows}x{cols} seed={seed} (rerun: H3_TEST_SEED={seed})")


def test_dynamic_scale_tie_diverges_from_eager():
    """The one class of random-data differences, pinned: dynamic g = 1.25, a block with s = 1.5, g*s = 1.875.

    amax = 3360 -> g = bf16(3360 / 2688) = 1.25 exactly. Block 1: a = 11.25 -> d = 11.25 / 6 / 1.25 = 1.5,
    s = 1.5 (0x3C), g*s = 1.875 (not a power of two), e = fl(1/1.875) = 0.53333336...
    x = 2.34375 = 1.25 * 1.875: eager x/1.875 = 1.25 exactly, a tie -> even 1.0 (code 2);
    CUDA x*e = 2.34375 * 0.53333336 = 1.2500001 -> 1.5 (code 3).
    """
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 3360.0
    x[0, 16], x[0, 17], x[0, 18] = 11.25, 2.34375, -2.34375
    q, s, g = ref.quantize_nvfp4(x)
    assert g.item() == 1.25
    assert scale_byte(s, 0, 1) == 0x3C  # 1.5 = 2^0 * 1.100b -> 0 0111 100
    assert f32(2.34375 * f32(1.0 / 1.875)) > 1.25
    # block 1 codes: 11.25 * e = 6.0000005 -> 7; 2.34375 * e -> 1.5 (3); -2.34375 -> 0xB
    assert q[0, 8].item() == 0x73 and q[0, 9].item() == 0xB0
    q_ck, _ = eager_quantize_nvfp4(x, comfy_global_scale(x))
    assert q_ck[0, 8].item() == 0x72 and q_ck[0, 9].item() == 0xA0  # eager: the tie to even, 1.0
    assert assert_reference_matches_eager(x, "pinned dynamic tie") == (0, 2)


def test_scale_tie_diverges_from_eager():
    """The same class for a block scale: static g = 1.875 (a bf16 value), a = 0.054931640625 = 11.25 * 2.5 * 2^-9.
    a / (6 g) = 2.5 * 2^-9 exactly, halfway between the e4m3 subnormals 2 * 2^-9 (0x02) and 3 * 2^-9 (0x03):
    eager rounds the tie to even (0x02); CUDA's a * fl(1/6) * fl(1/g) = 0.0048828130 lands above it (0x03)."""
    g = torch.tensor(1.875)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 0.054931640625
    assert x[0, 0].item() == 0.054931640625
    d = f32(f32(f32(0.054931640625) * f32(1.0 / 6.0)) * f32(1.0 / 1.875))
    assert d > 2.5 * 2.0**-9
    _, s, _ = ref.quantize_nvfp4(x, g)
    _, s_ck = eager_quantize_nvfp4(x, g)
    assert scale_byte(s, 0, 0) == 0x03 and scale_byte(s_ck, 0, 0) == 0x02
    assert assert_reference_matches_eager(x, "pinned scale tie", global_scale=g) == (1, 0)


def test_static_scale_divergence_from_eager():
    """An arbitrary (not bf16-rounded) static scale: eager's true division and CUDA's reciprocal multiply
    round differently without any exact tie in the data.

    g = 0x3F4FFFFF = 0.8125 - 2^-24 (one ulp below 13/16). Block absmax 4.875 = 6 * 0.8125: d = 1.0000001 ->
    s = 1.0 (0x38) in both, so g*s = g. x = 1.015625 = 1.25 * 0.8125:
      exact  x / g = 1.25 * 0.8125 / (0.8125 - 2^-24) = 1.25000009... -> eager fl32 = 1.2500001 -> 1.5 (code 3)
      CUDA   e = fl(1/g) = 1.2307693, x * e = 1.25 exactly (fp32) -> tie, to even -> 1.0 (code 2)
    and likewise 2.03125 (2.5 * 0.8125): eager 3.0 (5), CUDA 2.0 (4); 4.0625 (5 * 0.8125): eager 6.0 (7),
    CUDA 4.0 (6).
    """
    g_bits = 0x3F4FFFFF
    g = torch.tensor([g_bits], dtype=torch.int32).view(torch.float32).reshape(())
    gf = f32_from_bits(g_bits)
    assert f32_bits(0.8125) == g_bits + 1
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    values = [4.875, 1.015625, -1.015625, 2.03125, 4.0625]
    x[0, : len(values)] = torch.tensor(values)
    q, s, _ = ref.quantize_nvfp4(x, g)
    q_ck, s_ck = eager_quantize_nvfp4(x, g)
    assert scale_byte(s, 0, 0) == scale_byte(s_ck, 0, 0) == 0x38

    e = f32(1.0 / gf)
    assert e == 1.2307692766189575  # fl(1/g)
    hand_ref, hand_ck = [], []
    for v in values:
        prod = f32(f32(v) * e)      # reference / CUDA: x * fl(1/(g*s))
        quot = f32(v / gf)          # eager: fl(x / (g*s))
        hand_ref.append(e2m1_by_hand(prod))
        hand_ck.append(e2m1_by_hand(min(max(quot, -6.0), 6.0)))
    assert [f32(f32(v) * e) for v in values[1:]] == [1.25, -1.25, 2.5, 5.0]  # exact ties after the multiply
    assert hand_ref == [0x7, 0x2, 0xA, 0x4, 0x6]
    assert hand_ck == [0x7, 0x3, 0xB, 0x5, 0x7]
    # Reference bytes: (4.875, 1.015625) -> 0x72, (-1.015625, 2.03125) -> 0xA4, (4.0625, 0) -> 0x60.
    assert q[0, :4].tolist() == [0x72, 0xA4, 0x60, 0x00]
    assert q_ck[0, :4].tolist() == [0x73, 0xB5, 0x70, 0x00]


# ---- 2. documented CUDA behaviour, hand-derived ---------------------------------------------------------------
# Notation: g global scale, a block absmax, d = a*fl(1/6)*fl(1/g) -> min(., 448) -> s = e4m3(d),
# e = min(rcp(g*s), FLT_MAX), code = e2m1(x*e). e4m3 bytes: 448 = 0x7E, 1.0 = 0x38, 0.5 = 0x30, 0 = 0x00.
# Helpful exact facts: fl(6 * fl(1/6)) = 1.0 and fl(3 * fl(1/6)) = 0.5 in fp32 (the error of fl(1/6) is below
# half an ulp of the product), so a block with absmax 6 and g = 1 gets s = 1.0 and e = 1 exactly.

G1 = torch.tensor(1.0)


def test_all_zero_tensor():
    """g = bf16(0 / 2688) = 0. a = 0 -> d = 0 * rcp(0) = 0 * inf = NaN -> min(NaN, 448) = 448 -> 0x7E for EVERY
    block of rows [0, roundup(M, 16)), the zero pad rows included. e = rcp(0 * 448) = inf -> FLT_MAX;
    codes 0 * FLT_MAX = 0. (Eager: 0/0 -> NaN scale 0x7F instead.) Bytes of the padded layout outside the
    real blocks stay 0."""
    rows, cols = 5, 32  # 2 blocks per row; scale columns padded to 4; qdata rows padded to 16, scale rows to 128
    q, s, g = ref.quantize_nvfp4(torch.zeros(rows, cols, dtype=torch.bfloat16))
    assert f32_bits(g) == 0
    assert q.shape == (16, 16) and not q.any()
    assert s.shape == (128, 4)
    flat = s.reshape(-1).view(torch.uint8)
    expected = torch.zeros(128 * 4, dtype=torch.uint8)
    for r in range(16):
        for j in range(2):
            expected[ref.swizzled_scale_offset(r, j, 4)] = 0x7E
    assert torch.equal(flat, expected)
    assert int((flat == 0x7E).sum()) == 32


def test_negative_zero_keeps_its_sign():
    """Static g = 1. Row 0: a = 6 -> s = 1.0 (0x38), e = 1: 6 -> 0x7, -0.0 * 1 = -0.0 -> 0x8, +0.0 -> 0x0.
    Row 1 (all -0.0): a = 0 -> d = 0 -> s = 0 -> e = rcp(0) = inf -> FLT_MAX; -0.0 * FLT_MAX = -0.0 -> 0x8."""
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 3] = 6.0, -0.0, -0.0
    x[1] = -0.0
    assert torch.signbit(x[1]).all()
    q, s, _ = ref.quantize_nvfp4(x, G1)
    assert q[0].tolist() == [0x78, 0x08] + [0x00] * 6
    assert q[1].tolist() == [0x88] * 8
    assert scale_byte(s, 0, 0) == 0x38 and scale_byte(s, 1, 0) == 0x00


def test_scale_underflow_block():
    """Static g = 1, a = 2^-12: d = 2^-12 / 6 = 4.07e-5 < 2^-10 (half the smallest e4m3 subnormal 2^-9) -> s = 0
    (0x00) although the block holds nonzero values. e = rcp(g * 0) = inf -> FLT_MAX, so every nonzero x
    saturates: 2^-12 * FLT_MAX = 8.3e34 -> 0x7, -2^-13 -> 0xF, 2^-20 -> 0x7; zeros stay 0x0 / 0x8.
    (Eager zeroes such a block.)"""
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, :6] = torch.tensor([2.0**-12, -(2.0**-13), 0.0, -0.0, 2.0**-20, 0.0])
    q, s, _ = ref.quantize_nvfp4(x, G1)
    assert scale_byte(s, 0, 0) == 0x00
    assert q[0].tolist() == [0x7F, 0x08, 0x70] + [0x00] * 5


def test_nan_with_dynamic_scale():
    """torch.amax propagates NaN: g = NaN. Every block: d = a * rcp(NaN) = NaN -> 448 (0x7E), pad rows too;
    e = rcp(NaN * 448) = NaN -> min(NaN, FLT_MAX) = FLT_MAX. Codes: NaN -> 0x7, 1.0 * FLT_MAX -> 0x7,
    -2.0 -> 0xF, 3.0 -> 0x7, 0 -> 0x0."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), 1.0, -2.0
    x[0, 16] = 3.0
    q, s, g = ref.quantize_nvfp4(x)
    assert math.isnan(g.item()) and math.isnan(comfy_global_scale(x).item())
    assert q[0].tolist() == [0x77, 0xF0] + [0x00] * 6 + [0x70] + [0x00] * 7
    assert not q[1:].any()  # pad rows: zeros * FLT_MAX = 0
    for r in range(16):
        assert scale_byte(s, r, 0) == scale_byte(s, r, 1) == 0x7E
    assert int((s.view(torch.uint8) == 0x7E).sum()) == 32 and int((s.view(torch.uint8) != 0).sum()) == 32


def test_nan_with_static_scale():
    """Static g = 1. Block 0 [NaN, 3, -1.5, 0.75, -NaN, 0...]: max.bf16 skips NaN, a = 3 -> d = 0.5 -> 0x30,
    e = 2: NaN -> 0x7 (either sign), 3*2 = 6 -> 0x7, -3 -> 0xD, 1.5 -> 0x3.
    Block 1 all NaN: a = NaN -> 448 (0x7E), e = fl(1/448), every code 0x7."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([float("nan"), 3.0, -1.5, 0.75])
    x[0, 4:5] = bf16_from_bits([0xFFC0])  # a NaN with the sign bit set
    x[0, 16:] = float("nan")
    q, s, _ = ref.quantize_nvfp4(x, G1)
    assert scale_byte(s, 0, 0) == 0x30 and scale_byte(s, 0, 1) == 0x7E
    assert q[0, :8].tolist() == [0x77, 0xD3, 0x70, 0x00, 0x00, 0x00, 0x00, 0x00]
    assert q[0, 8:].tolist() == [0x77] * 8


def test_infinities_with_static_scale():
    """Static g = 1. Block [inf, -inf, 448, 1344, -896, 0...]: a = inf -> d = inf -> 448 (0x7E),
    e = fl(1/448): inf -> 0x7, -inf -> 0xF, 448 e ~ 1 -> 0x2, 1344 e ~ 3 -> 0x5, -896 e ~ -2 -> 0xC."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, :5] = torch.tensor([float("inf"), float("-inf"), 448.0, 1344.0, -896.0])
    q, s, _ = ref.quantize_nvfp4(x, G1)
    assert scale_byte(s, 0, 0) == 0x7E
    assert q[0].tolist() == [0x7F, 0x25, 0xC0] + [0x00] * 5


def test_infinity_with_dynamic_scale():
    """g = bf16(inf / 2688) = inf, rcp(inf) = 0.
    Block 0 [inf, 1, -1]: d = inf * 0 = NaN -> 448 (0x7E); e = rcp(inf * 448) = 0: inf * 0 = NaN -> 0x7,
    1 * 0 = 0 -> 0x0, -1 * 0 = -0.0 -> 0x8.
    Block 1 [2, -3]: d = 2/6 * 0 = 0 -> s = 0; e = rcp(inf * 0 = NaN) = NaN -> FLT_MAX: 2 -> 0x7, -3 -> 0xF."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :3] = torch.tensor([float("inf"), 1.0, -1.0])
    x[0, 16:18] = torch.tensor([2.0, -3.0])
    q, s, g = ref.quantize_nvfp4(x)
    assert g.item() == float("inf") and comfy_global_scale(x).item() == float("inf")
    assert scale_byte(s, 0, 0) == 0x7E and scale_byte(s, 0, 1) == 0x00
    assert q[0].tolist() == [0x70, 0x80] + [0x00] * 6 + [0x7F] + [0x00] * 7


def test_bf16_subnormals_flush_to_signed_zero():
    """Static g = 1. Every fp32 multiply is .ftz, so subnormal x (bf16 subnormals are fp32 subnormals) become
    zeros of the same sign. Block 0 [6, +sub, -sub, +sub]: s = 1.0, e = 1: 0x7, 0x0, 0x8, 0x0.
    Block 1 (subnormals only): a is subnormal -> d = 0 -> s = 0 -> e = FLT_MAX, and FLT_MAX * sub flushes
    the subnormal first: +sub -> 0x0, -sub -> 0x8 (no saturation)."""
    sub = [0x0040, 0x8040, 0x007F, 0x0001, 0x8001, 0x807F]  # +2^-127, -2^-127, largest, smallest, ...
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 6.0
    x[0, 1:4] = bf16_from_bits(sub[:3])
    x[0, 16:22] = bf16_from_bits(sub)
    values = x.float()[0]
    assert all(0 < abs(v) < 2.0**-126 for v in values[[1, 2, 3, 16, 17, 18, 19, 20, 21]].tolist())
    q, s, _ = ref.quantize_nvfp4(x, G1)
    assert scale_byte(s, 0, 0) == 0x38 and scale_byte(s, 0, 1) == 0x00
    assert q[0, :8].tolist() == [0x70, 0x80] + [0x00] * 6
    # (+2^-127, -2^-127) (largest, smallest) (-smallest, -largest)
    assert q[0, 8:].tolist() == [0x08, 0x00, 0x88] + [0x00] * 5


def test_exact_ties_round_to_even():
    """g * s a power of two, so x * e is exact and lands on the ties. Row 0: a = 6 -> s = 1.0, e = 1.
    2.5 (2|3) -> 2.0, code 4; 3.5 (3|4) -> 4.0, code 6; 0.25 (0|0.5) -> 0, code 0; 0.75 (0.5|1) -> 1.0, code 2;
    5 (4|6) -> 4.0, code 6; 1.25 (1|1.5) -> 1.0, code 2; 1.75 (1.5|2) -> 2.0, code 4; negatives add 0x8
    (-0.25 rounds to -0.0, code 0x8). Row 1 = row 0 / 2: a = 3 -> s = 0.5 (0x30), e = 2, the same codes."""
    row = [6.0, 2.5, 3.5, 0.25, 0.75, 5.0, 1.25, 1.75, -2.5, -0.25, -5.0, -0.75, 0.0, 0.0, 0.0, 0.0]
    x = torch.tensor([row, [v / 2 for v in row]], dtype=torch.bfloat16)
    q, s, _ = ref.quantize_nvfp4(x, G1)
    expected = [0x74, 0x60, 0x26, 0x24, 0xC8, 0xEA, 0x00, 0x00]
    assert q[0].tolist() == expected and q[1].tolist() == expected
    assert scale_byte(s, 0, 0) == 0x38 and scale_byte(s, 1, 0) == 0x30
    # and the same by the hand rounding rule
    assert [e2m1_by_hand(v) for v in row[:12]] == [7, 4, 6, 0, 2, 6, 2, 4, 0xC, 0x8, 0xE, 0xA]


# ---- layout ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "row,col,expected",
    [
        # padded_scale_cols = 8: tiles of 128 rows x 4 columns = 512 bytes, 2 tiles per tile row;
        # offset = tile * 512 + (row % 32) * 16 + (row % 128) // 32 * 4 + col % 4
        (0, 0, 0),
        (1, 0, 16),
        (31, 0, 496),
        (32, 0, 4),
        (127, 3, 31 * 16 + 3 * 4 + 3),  # 511, the last byte of tile 0
        (0, 4, 512),
        (0, 5, 513),
        (128, 0, 2 * 512),
        (130, 6, 3 * 512 + 2 * 16 + 0 + 2),  # 1570
        (200, 7, 3 * 512 + 8 * 16 + 2 * 4 + 3),  # 1675
    ],
)
def test_swizzled_scale_offset_by_hand(row, col, expected):
    assert ref.swizzled_scale_offset(row, col, 8) == expected


def test_swizzled_scale_offset_matches_comfy_kitchen_to_blocked():
    float_utils = pytest.importorskip("comfy_kitchen.float_utils")
    rows, cols = 256, 12
    plain = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    blocked = float_utils.to_blocked(plain, flatten=True)
    r = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    assert torch.equal(blocked[ref.swizzled_scale_offset(r, c, cols)], plain)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_padding_is_zero(static):
    """M = 17, K = 80: 5 blocks per row, scale columns padded to 8, qdata rows to 32, scale rows to 128.
    With a finite g the pad rows (zeros) get s = 0 and codes 0; no byte outside the real blocks is written."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, cols = 17, 80
    x = (torch.randn(rows, cols, generator=gen) + 4.0).to(torch.bfloat16)  # no zero block scales
    q, s, g = ref.quantize_nvfp4(x, torch.tensor(0.01) if static else None)
    assert math.isfinite(g.item()) and g.item() > 0
    assert q.shape == (32, 40) and s.shape == (128, 8)
    assert q[:rows].any(dim=1).all() and not q[rows:].any(), f"seed={seed}"
    flat = s.reshape(-1).view(torch.uint8)
    real = torch.zeros_like(flat, dtype=torch.bool)
    for r in range(rows):
        for j in range(cols // 16):
            real[ref.swizzled_scale_offset(r, j, 8)] = True
    assert int(real.sum()) == rows * (cols // 16)
    assert (flat[real] != 0).all() and not flat[~real].any(), f"seed={seed}"


# ---- fp16 inputs (comfy-kitchen's quantize_nvfp4<__half>: the same instructions on fp16) --------------------------

def test_fp16_subnormals_are_widened_not_flushed():
    """fp16 subnormals widen to normal fp32 values: unlike bf16 subnormals they keep their codes. A block of
    multiples of 2^-20 (all below fp16's smallest normal 2^-14) with g = 2^-20: s8 = 1, e = 2^20, x * e exact."""
    unit = 2.0 ** -20
    values = [6.0, 3.0, 1.0, 0.5, -6.0, -2.0, -1.5, 0.0, 4.0, -4.0, 1.5, -0.5, 2.0, -3.0, 0.0, -0.0]
    x = torch.tensor([[v * unit for v in values]], dtype=torch.float16)
    assert (x.float().abs() < 2.0 ** -14).all() and (x.float() != 0).sum() == 13
    q, s, g = ref.quantize_nvfp4(x, torch.tensor(unit))
    magnitude = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}
    codes = [magnitude[abs(v)] | (8 if math.copysign(1.0, v) < 0 else 0) for v in values]
    expected = [(codes[2 * j] << 4) | codes[2 * j + 1] for j in range(8)]
    assert q[0].tolist() == expected
    assert s.view(torch.uint8).reshape(-1)[0].item() == 0x38  # e4m3 1.0


@pytest.mark.parametrize("amax,expected", [
    (1.0, 0.0003719329833984375),           # fp16 0x0E18 (a normal)
    (0.05, 1.8596649169921875e-05),         # an fp16 subnormal: 312 * 2^-24
    (5e-5, 0.0),                            # below half the smallest subnormal: 0
    (float("inf"), float("inf")),
])
def test_fp16_dynamic_scale_rounds_to_fp16(amax, expected):
    """ComfyUI's dynamic scale of an fp16 tensor is rounded to fp16 (subnormals and 0 included), from the CUDA
    sequence fp32(amax) * fp32(1/2688)."""
    x = torch.tensor([[amax] + [0.0] * 15], dtype=torch.float16)
    a = float(x.abs().max())
    product = f32(f32(a) * f32(1.0 / 2688.0))
    by_hand = float(torch.tensor(product, dtype=torch.float32).to(torch.float16))
    assert by_hand == expected or (math.isinf(expected) and math.isinf(by_hand))
    g = float(ref.dynamic_global_scale(x))
    assert g == by_hand
