"""GPU parity of the fused kernels against ComfyUI's own ops: ``QuantizedTensor.from_float`` (comfy-kitchen's CUDA
packer), ComfyUI's RMSNorm module, the H3 module's ``_mod_scale_shift`` / ``_mod_gate``, ``comfy.ops``' SwiGLU, and
torch's own ``_fused_rms_norm`` statistics. Equal bytes, on fresh random data (the seed is in the failure message),
into poisoned outputs, plus the hard cases (ties, zeros, -0.0, NaN, +-Inf, subnormals, huge and tiny blocks, odd row
counts, strided views, all 65,536 bf16 bit patterns). fp16 activations of the plain and pre_quant_scale packs against
comfy-kitchen's fp16 quantizer and ComfyUI's fp16 global scale and multiply, with fp16's own hard cases (all 65,536
fp16 bit patterns, its subnormals, global scales that are fp16 subnormals or 0, products that overflow to inf)."""

import pytest
import torch
from conftest import requires_cuda
from parity import (
    assert_bit_identical,
    assert_same_pack,
    comfy_pack,
    fresh_seed,
    fused_pack,
    random_activation,
    segments_and_index,
)

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui")]

H3_ROWS = 37810


def _ops():
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    return ops


def _h3():
    import comfy.ldm.minimax.model as m

    return m


@pytest.mark.parametrize("cols", [5376, 7168, 14336])
def test_h3_widths_dynamic(cols):
    seed = fresh_seed()
    x = random_activation(H3_ROWS, cols)
    assert_same_pack(fused_pack(x), *comfy_pack(x), f"[{H3_ROWS}, {cols}] seed {seed}")


@pytest.mark.parametrize("rows", [1, 17, 129, H3_ROWS])
@pytest.mark.parametrize("cols", [16, 32, 5392])
def test_odd_shapes(rows, cols):
    seed = fresh_seed()
    x = random_activation(rows, cols)
    assert_same_pack(fused_pack(x), *comfy_pack(x), f"[{rows}, {cols}] seed {seed}")


@pytest.mark.parametrize("rows,cols", [(17, 16), (301, 80), (129, 5392), (301, 2048), (301, 10240), (129, 14336),
                                       (H3_ROWS, 7168)])
def test_plain_pack_row_segments(rows, cols):
    """The plain pack's units of work, one step of a row pair (packs.cu PlainSource::kSegmentSteps; rows that do not
    split into whole steps stay whole pairs): 1-14 segments a row, pad rows, partial last steps."""
    seed = fresh_seed()
    x = random_activation(rows, cols)
    assert_same_pack(fused_pack(x), *comfy_pack(x), f"plain [{rows}, {cols}] seed {seed}")


@pytest.mark.parametrize("static", [0.5, 1.0, 3.0e-3, 7.1e-5])
def test_static_scale(static):
    seed = fresh_seed()
    x = random_activation(1000, 5376)
    scale = torch.tensor([static], dtype=torch.float32, device="cuda")
    assert_same_pack(fused_pack(x, static_scale=scale), *comfy_pack(x, scale), f"static {static} seed {seed}")
    # with the weight's scale the pack also writes the GEMM alpha from the static scale (comfy-kitchen: a * b)
    w2 = torch.tensor([3.1e-4], dtype=torch.float32, device="cuda")
    fused = fused_pack(x, static_scale=scale, weight_scale_2=w2)
    assert_same_pack(fused, *comfy_pack(x, scale), f"static {static} with alpha, seed {seed}")
    assert torch.equal(fused.alpha.view(torch.int32), (scale * w2).view(torch.int32))


def test_precomputed_global_scale_and_alpha():
    """A scale computed earlier on the stream (the residual kernels do that) and the alpha the pack writes."""
    ops = _ops()
    x = random_activation(2000, 7168)
    g = ((torch.amax(x.abs()) / 2688.0).to(torch.float32)).reshape(1)  # ComfyUI's own expression, as from_float
    w2 = torch.tensor([3.1e-4], dtype=torch.float32, device="cuda")
    fused = fused_pack(x, global_scale=g, weight_scale_2=w2)
    assert_same_pack(fused, *comfy_pack(x), "precomputed scale")
    assert torch.equal(fused.alpha.view(torch.int32), (g * w2).reshape(1).view(torch.int32))
    dynamic = fused_pack(x, weight_scale_2=w2)
    assert torch.equal(dynamic.alpha.view(torch.int32), (g * w2).reshape(1).view(torch.int32))
    assert ops.pack_support(x) is None


def test_strided_view_is_read_in_place():
    seed = fresh_seed()
    qkv = random_activation(3001, 3 * 7168)
    for view in (qkv[:, :7168], qkv[:, 7168:14336], qkv[:, 14336:]):
        assert_same_pack(fused_pack(view), *comfy_pack(view), f"strided view seed {seed}")


def test_every_bf16_value():
    """All 65536 bf16 bit patterns (NaN, +-Inf, -0.0, subnormals, ties) in one tensor, several scales."""
    allbits = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    x = allbits.reshape(-1, 256)
    finite = x[torch.isfinite(x.float()).all(dim=1)]
    shuffled = x.reshape(-1)[torch.randperm(65536, device="cuda")].reshape(-1, 512)
    for case, t in (("all patterns", x), ("finite rows", finite), ("shuffled", shuffled)):
        assert_same_pack(fused_pack(t), *comfy_pack(t), case)
        for static in (1.0, 0.75, 1e-30):
            scale = torch.tensor([static], dtype=torch.float32, device="cuda")
            assert_same_pack(fused_pack(t, static_scale=scale), *comfy_pack(t, scale), f"{case} static {static}")


def _tie_tensor():
    # Exact E2M1 rounding ties: x = boundary * g * s for blocks whose max maps to 6.
    g = 2.0**-4
    rows = []
    for s8 in (1.0, 1.5, 1.25, 0.75, 2.0**-9):
        scale = g * s8
        for boundary in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            row = torch.full((16,), boundary * scale)
            row[0] = 6.0 * scale
            row[1] = -boundary * scale
            rows.append(row)
    return torch.stack(rows).to(torch.bfloat16).cuda(), torch.tensor([g], dtype=torch.float32, device="cuda")


@pytest.mark.parametrize(
    "case",
    ["zeros", "negative_zeros", "one_nan", "inf", "neg_inf", "underflow_blocks", "huge", "tiny", "subnormal", "ties"],
)
def test_hard_cases(case):
    x = random_activation(300, 5376)
    scale = None
    if case == "zeros":
        x = torch.zeros_like(x)
    elif case == "negative_zeros":
        x = torch.full_like(x, -0.0)
    elif case == "one_nan":
        x[7, 33] = float("nan")
    elif case == "inf":
        x[5, 100] = float("inf")
    elif case == "neg_inf":
        x[200, 17] = float("-inf")
    elif case == "underflow_blocks":
        x[:10] *= 1e-9  # block scales round to 0 -> encode = FLT_MAX
    elif case == "huge":
        x = (x.float() * 1e36).to(torch.bfloat16)
    elif case == "tiny":
        x = (x.float() * 1e-36).to(torch.bfloat16)
    elif case == "subnormal":
        x = (torch.randint(-127, 128, x.shape, device="cuda").to(torch.int16)).view(torch.bfloat16)
    elif case == "ties":
        x, scale = _tie_tensor()
    assert_same_pack(fused_pack(x, static_scale=scale), *comfy_pack(x, scale), case)
    if scale is not None:
        assert_same_pack(fused_pack(x), *comfy_pack(x), case + " dynamic")


def test_reference_matches_kernel_on_gpu_data():
    """The CPU reference and the kernel agree on fresh data, except in blocks the reference itself flags as
    sensitive to the GPU's approximate reciprocal (keeps tests/nvfp4_oracle.py and its stated limits honest)."""
    import nvfp4_oracle as ref

    seed = fresh_seed()
    x = random_activation(257, 5376)
    q, s, g = ref.quantize_nvfp4(x.cpu())
    fused = fused_pack(x)
    assert torch.equal(fused.global_scale.cpu().reshape(()), g), f"seed {seed}"
    rows16 = q.shape[0]
    padded = torch.zeros(rows16, x.shape[1], dtype=torch.bfloat16)
    padded[: x.shape[0]] = x.cpu()
    sensitive = ref.rcp_sensitive_blocks(padded, g)
    fused_scales = ref.unswizzle_scales(fused.block_scales.cpu(), rows16, x.shape[1])
    ref_scales = ref.unswizzle_scales(s, rows16, x.shape[1])
    differs = ((fused_scales != ref_scales)
               | (fused.qdata.cpu().reshape(rows16, -1, 8) != q.reshape(rows16, -1, 8)).any(-1))
    unexplained = differs & ~sensitive
    assert unexplained.sum().item() == 0, (f"{unexplained.sum().item()} blocks differ outside the documented cases "
                                           f"(seed {seed})")
    assert sensitive.float().mean().item() < 0.25, f"{sensitive.float().mean().item():.1%} sensitive (seed {seed})"


# ---- fused sources vs ComfyUI's stock elementwise ops -------------------------------------------------------

def _tables(rows, k, n=6):
    ada = (torch.randn(n, 6 * k, device="cuda") * 0.5).to(torch.bfloat16)  # adaln_proj rows, chunked views
    return ada[:, :k], ada[:, k:2 * k], ada[:, 2 * k:3 * k]


@pytest.mark.parametrize("rows", [H3_ROWS, 301])
def test_modulated_pack_matches_comfyui(rows):
    ops = _ops()
    seed = fresh_seed()
    k = 5376
    h = random_activation(rows, k)
    shift, scale, _ = _tables(rows, k)
    segments, index = segments_and_index(rows, 6)
    stock = _h3()._mod_scale_shift(h.clone(), shift, scale, segments)
    fused = fused_pack(h, modulation=ops.Modulation(scale, shift, index))
    assert_same_pack(fused, *comfy_pack(stock), f"modulate rows {rows} seed {seed}")


@pytest.mark.parametrize("silu", ["window", "table"])
@pytest.mark.parametrize("rows,case", [(H3_ROWS, "random"), (129, "random"), (4000, "flat"), (300, "inf"),
                                       (300, "nan"), (300, "negative"), (301, "window_edges"), (300, "tiny")])
def test_swiglu_pack_matches_comfyui(rows, case, silu, monkeypatch):
    """Both silu sources: the 12 KB window of torch's silu table (sm_120 / sm_121 and the emulated Blackwell build)
    and the whole 128 KB table (where it fits: sm_90 to sm_110); the table falls back to the window where it does
    not fit."""
    import comfy.ops

    ops = _ops()
    monkeypatch.setattr(ops, "SWIGLU_SILU", silu)
    seed = fresh_seed()
    y = (torch.randn(rows, 2 * 14336, device="cuda") * 3).to(torch.bfloat16)
    if case == "flat":  # every |g * u| close to the max: the amax bound prunes almost nothing
        y = (torch.rand(rows, 2 * 14336, device="cuda") * 0.01 + 4).to(torch.bfloat16)
    elif case == "inf":
        y[17, 5] = float("inf")
        y[18, 14336 + 9] = float("-inf")
    elif case == "nan":
        y[3, 14336 + 100] = float("nan")
    elif case == "tiny":  # products |g u| down to bf16 subnormals: the amax bound's bf16 product rounds there too
        y = (torch.randn(rows, 2 * 14336, device="cuda") * 1e-17).to(torch.bfloat16)
    elif case == "negative":  # silu of large negative gates underflows toward -0
        y[:, :14336] = -y[:, :14336].abs() * 20
    elif case == "window_edges":  # gates at and beyond both ends of the silu window, alone in their block or not
        edges = torch.tensor([2.0 ** -16, 2.0 ** -17, 255.0, 256.0, 300.0, 0.0, -0.0, 1e-30], device="cuda")
        y[::3, 16:24] = edges.to(torch.bfloat16)
        y[1::3, 32:48] = (edges.repeat(2) * -1).to(torch.bfloat16)
    stock = comfy.ops._eager_input_act(y, "swiglu")
    assert_same_pack(fused_pack(y, swiglu=True), *comfy_pack(stock), f"swiglu {case} rows {rows} seed {seed}")


def test_gated_residual_matches_comfyui():
    ops = _ops()
    seed = fresh_seed()
    rows, k = 5003, 5376
    x, other = random_activation(rows, k), random_activation(rows, k)
    _, _, gates = _tables(rows, k)
    segments, index = segments_and_index(rows, 6)
    stock = _h3()._mod_gate(x.clone(), gates, other, segments)
    fused = x.clone()
    ops.gated_residual_(fused, other, gates, index)
    assert_bit_identical(fused, stock, f"gated residual seed {seed}")


# ---- RMSNorm folded into the kernels -------------------------------------------------------------------------

def _norm_input(rows, k, case):
    x = (torch.randn(rows, k, device="cuda") * torch.exp2(torch.randint(-6, 6, (rows, 1), device="cuda").float()))
    if case == "heavy":
        x = x * torch.exp(2 * torch.randn(rows, k, device="cuda"))
    elif case == "specials":
        x[0] = 0.0
        x[1, 7] = float("nan")
        x[2, 9] = float("inf")
        x[3] = 1e-39  # bf16 subnormals
        x[4, ::5] = 3.0e38
        x[5] = -0.0
    return x.to(torch.bfloat16)


def _comfy_norm(k, weight):
    from h3_fused_nvfp4.models.h3.probes import _comfy_rms_norm

    return _comfy_rms_norm(k, weight, 1e-5)


@pytest.mark.parametrize("rows,k,case", [(H3_ROWS, 5376, "random"), (301, 5376, "heavy"), (64, 5376, "specials"),
                                         (129, 1040, "random"), (33, 5632, "random"), (17, 16, "random"),
                                         (4099, 5376, "outlier"), (4099, 5376, "tables"), (301, 5376, "table_specials"),
                                         (301, 5376, "subnormal")])
def test_norm_statistics_and_pack_match_torch_and_comfyui(rows, k, case):
    """rstd equals torch's own ``_fused_rms_norm`` statistics; the normalized, modulated pack (global scale from the
    same pass) equals ComfyUI's RMSNorm module, ``_mod_scale_shift`` and ``from_float``."""
    from h3_fused_nvfp4.layout import RmsNorm

    ops = _ops()
    seed = fresh_seed()
    x = _norm_input(rows, k, case)
    # bf16 subnormal rows with a tiny eps: rstd near 1e19 and subnormal x |w| |1 + scale| products, where the amax
    # bounds rely on their absolute margin
    eps = 1e-38 if case == "subnormal" else 1e-5
    if case == "subnormal":
        x = (x.float() * 1e-39).to(torch.bfloat16)
    weight = (1 + torch.randn(k, device="cuda") * 0.1).to(torch.bfloat16)
    shift, scale, _ = _tables(rows, k)
    _amax_hard_case(case, x, weight, shift, scale)
    if case == "subnormal":
        shift.mul_(1e-25)  # the maximum made by the normalized values, not the shift
    segments, index = segments_and_index(rows, 6)
    norm = RmsNorm(weight, eps, torch.full((rows,), float("nan"), device="cuda"))
    g = torch.full((1,), float("nan"), device="cuda")
    ops.norm_statistics(x, norm, modulation=ops.Modulation(scale, shift, index), global_scale_out=g)
    _, torch_rstd = torch._fused_rms_norm(x, [k], weight, eps)
    assert_bit_identical(norm.rstd, torch_rstd.reshape(-1).float(), f"rstd {case} [{rows}, {k}] seed {seed}")
    from h3_fused_nvfp4.models.h3.probes import _comfy_rms_norm

    h = _h3()._mod_scale_shift(_comfy_rms_norm(k, weight, eps)(x), shift, scale, segments)
    fused = fused_pack(x, global_scale=g, modulation=ops.Modulation(scale, shift, index), norm=norm)
    assert_same_pack(fused, *comfy_pack(h), f"normalized pack {case} [{rows}, {k}] seed {seed}")
    stats_only = RmsNorm(weight, eps, torch.full((rows,), float("nan"), device="cuda"))  # poisoned
    ops.norm_statistics(x, stats_only)
    assert_bit_identical(stats_only.rstd, norm.rstd, "statistics without the amax")


def _amax_hard_case(case, x, weight, shift, scale):
    """Inputs where the bounded amax pass (residual_norm.cu, bounded_amax) must not skip the element that decides the
    maximum: a lone outlier in the last row's last chunk; the maximum made by a shift, a large 1 + scale, or next to
    a tiny norm weight; non-finite table entries."""
    rows, k = x.shape
    if case == "outlier":
        x[-1, k - 3] = 3000.0
    elif case == "tables":
        shift[:, 17] = 1.0e4        # the maximum comes from the shift term
        scale[:, 40] = 60.0         # ... or from a large 1 + scale
        weight[500] = 1.0e-30       # |w| |1 + scale| underflows next to ordinary columns
        x[rows // 2, 500] = 1.0e30
    elif case == "table_specials":
        scale[1, 33] = float("inf")
        shift[2, k - 1] = float("nan")
    elif case == "zeros":
        x.zero_()
    elif case == "quiet_rows":  # most half rows skipped whole by the residual kernels' row bound; the last is not
        x[torch.arange(rows, device=x.device) % 5 != 0] *= 0.01
        x[-1, k // 2 + 5] = x.abs().max().float() * 1.5


@pytest.mark.parametrize("with_amax", [True, False])
@pytest.mark.parametrize("rows,k,case", [(H3_ROWS, 5376, "random"), (129, 1040, "random"), (33, 5632, "random"),
                                         (4099, 5376, "outlier"), (4099, 5376, "tables"),
                                         (301, 5376, "table_specials"), (301, 5376, "zeros"),
                                         (4099, 5376, "quiet_rows")])
def test_residual_with_next_norm_statistics_matches_comfyui(with_amax, rows, k, case):
    """The gated residual that also produces the next norm's statistics (and the next projection's scale) against
    ``_mod_gate`` + ComfyUI's RMSNorm + ``_mod_scale_shift`` + ``from_float``."""
    from h3_fused_nvfp4.layout import RmsNorm

    ops = _ops()
    seed = fresh_seed()
    x, other = random_activation(rows, k), random_activation(rows, k)
    shift, scale, gates = _tables(rows, k)
    segments, index = segments_and_index(rows, 6)
    weight = (1 + torch.randn(k, device="cuda") * 0.1).to(torch.bfloat16)
    _amax_hard_case(case, x, weight, shift, scale)
    if case == "zeros":
        other.zero_()
    if case == "quiet_rows":
        other[torch.arange(rows, device=other.device) % 5 != 0] *= 0.01
    norm = RmsNorm(weight, 1e-5, torch.full((rows,), float("nan"), device="cuda"))
    g = torch.full((1,), float("nan"), device="cuda")
    static = torch.tensor([4.0 / 2688], device="cuda")
    fused = x.clone()
    modulation = ops.Modulation(scale, shift, index)
    ops.gated_residual_(fused, other, gates, index, next_norm=norm, next_modulation=modulation,
                        global_scale_out=g if with_amax else None)
    stock = _h3()._mod_gate(x.clone(), gates, other, segments)
    assert_bit_identical(fused, stock, f"residual [{rows}, {k}] seed {seed}")
    h = _h3()._mod_scale_shift(_comfy_norm(k, weight)(stock), shift, scale, segments)
    kwargs = dict(global_scale=g) if with_amax else dict(static_scale=static)
    packed = fused_pack(fused, modulation=modulation, norm=norm, **kwargs)
    assert_same_pack(packed, *comfy_pack(h, None if with_amax else static),
                     f"pack after the residual {case} [{rows}, {k}] seed {seed}")


def test_unsupported_norm_inputs_are_refused_with_a_reason():
    ops = _ops()
    x = random_activation(8, 5376)
    assert "float32" in ops.rms_norm_support(x, torch.ones(5376, device="cuda"))
    assert "multiple of 16" in ops.rms_norm_support(random_activation(8, 5640), torch.ones(5640, device="cuda",
                                                                                               dtype=torch.bfloat16))
    wide = random_activation(8, 5376 + 16)
    assert "aligned" in ops.rms_norm_support(wide[:, 4:4 + 5376], torch.ones(5376, device="cuda",
                                                                              dtype=torch.bfloat16))


# ---- a Linear's pre_quant_scale (AWQ smoothing) folded into the pack -----------------------------------------

def _comfy_prescaled(x, table):
    """ComfyUI's NVFP4 Linear's first step (comfy/ops.py): the input times the table cast to the input dtype."""
    import comfy.model_management

    return x * comfy.model_management.cast_to_device(table, x.device, x.dtype)


def _prescale(table, dtype=torch.bfloat16):
    """The table as the fused Linear hands it to the pack: ComfyUI's cast to the activation dtype."""
    import comfy.model_management

    return comfy.model_management.cast_to_device(table, torch.device("cuda"), dtype).contiguous()


def _assert_prescale_packs(x, table, scales, label):
    """The fused prescale pack of ``x`` against ComfyUI's multiply and quantizer, per static scale (None: dynamic,
    with the GEMM alpha checked too)."""
    h = _comfy_prescaled(x, table)
    prescale = _prescale(table, x.dtype)
    for scale in scales:
        where = f"{label} static {None if scale is None else float(scale)}"
        if scale is None:
            w2 = torch.tensor([3.1e-4], dtype=torch.float32, device="cuda")
            fused = fused_pack(x, prescale=prescale, weight_scale_2=w2)
            g = comfy_pack(h)[2].reshape(1).to(torch.float32)
            assert torch.equal(fused.alpha.view(torch.int32), (g * w2).reshape(1).view(torch.int32)), where
        else:
            fused = fused_pack(x, prescale=prescale, static_scale=scale)
        assert_same_pack(fused, *comfy_pack(h, scale), where)


@pytest.mark.parametrize("rows,cols,static", [(H3_ROWS, 5376, None), (1001, 4096, None), (1001, 4096, 0.02),
                                              (129, 5392, None), (17, 16, None), (301, 14336, 3.0e-3)])
def test_prescale_pack_matches_comfyui(rows, cols, static):
    seed = fresh_seed()
    x = random_activation(rows, cols)
    table = torch.exp(torch.randn(cols, device="cuda") * 0.8)  # fp32, as ModelOpt stores it
    scale = None if static is None else torch.tensor([static], dtype=torch.float32, device="cuda")
    fused = fused_pack(x, prescale=_prescale(table), static_scale=scale)
    assert_same_pack(fused, *comfy_pack(_comfy_prescaled(x, table), scale), f"prescale [{rows}, {cols}] seed {seed}")


@pytest.mark.parametrize("case", ["probe_table", "probe_inputs", "every_bf16_table", "subnormal_products",
                                  "strided", "bf16_table", "with_alpha"])
def test_prescale_pack_hard_cases(case):
    """The self-check's hard table (zeros, -0.0, negatives, overflow to inf and underflow in the bf16 cast), its hard
    inputs (NaN, +-Inf, ties, subnormals), every bf16 bit pattern as a table entry, products that land in the bf16
    subnormals, a strided view, a table stored in bf16, and the GEMM alpha the pack writes."""
    from h3_fused_nvfp4.core import probes

    seed = fresh_seed()
    scales = [None]
    if case == "probe_table":
        x = random_activation(300, 1056)
        table = probes.prescale_table(1056).cuda()
        scales.append(torch.tensor([1.0], device="cuda"))
    elif case == "probe_inputs":
        x, _ = probes.probe_activations("cuda")["hard cases with NaN/inf, dynamic scale"]
        table = probes.prescale_table(x.shape[1]).cuda()
        scales.append(torch.tensor([1.0], device="cuda"))
    elif case == "every_bf16_table":
        table = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
        x = random_activation(64, 65536)
        scales.append(torch.tensor([0.75], device="cuda"))
    elif case == "subnormal_products":  # |x| ~ 2^-66 times 2^-55..-75: products across 2^-126 down past 2^-133,
        x = (torch.randn(257, 2048, device="cuda") * 1e-20).to(torch.bfloat16)  # rounded in the bf16 subnormals
        exponents = torch.randint(55, 76, (2048,), device="cuda").float()
        table = torch.exp2(-exponents) * (1 + torch.rand(2048, device="cuda"))
        scales.append(torch.tensor([1e-38], device="cuda"))
    elif case == "strided":
        wide = random_activation(3001, 3 * 2048)
        x = wide[:, 2048:4096]
        table = torch.exp(torch.randn(2048, device="cuda"))
    elif case == "bf16_table":
        x = random_activation(999, 2048)
        table = torch.exp(torch.randn(2048, device="cuda")).to(torch.bfloat16)
    else:  # with_alpha
        x = random_activation(999, 2048)
        table = torch.exp(torch.randn(2048, device="cuda"))
    _assert_prescale_packs(x, table, scales, f"prescale {case} seed {seed}")


def test_prescale_inputs_are_checked():
    ops = _ops()
    x = random_activation(8, 256)
    good = torch.ones(256, dtype=torch.bfloat16, device="cuda")
    assert ops.pack_support(x, prescale=good) is None
    assert "bf16 [256]" in ops.pack_support(x, prescale=good.float())
    assert "bf16 [256]" in ops.pack_support(x, prescale=good[:128])
    misaligned = torch.ones(264, dtype=torch.bfloat16, device="cuda")[4:260]
    assert "16-byte aligned" in ops.pack_support(x, prescale=misaligned)
    assert "bf16 [256]" in ops.pack_support(x, prescale=good.cpu())
    assert "pre_quant_scale" in ops.pack_support(random_activation(8, 512), swiglu=True, prescale=good)
    with pytest.raises(ValueError):
        ops.pack_nvfp4(x, prescale=good[:128])


# ---- fp16 activations (plain and pre_quant_scale sources) ---------------------------------------------------------
# ComfyUI's global scale torch.amax(x.abs()) / 2688 in fp16 (fp32(amax) * fp32(1/2688) rounded to fp16: subnormal
# for amax < ~0.16, 0 below ~8e-5), comfy-kitchen's CUDA quantize_nvfp4<__half>, and the fp16 pre_quant_scale
# multiply, against the _f16 kernels.

F16 = torch.float16


def _f16(rows, cols):
    return random_activation(rows, cols, dtype=F16)


@pytest.mark.parametrize("rows,cols", [(H3_ROWS, 5120), (1, 16), (17, 32), (129, 5392), (301, 7168), (301, 10240),
                                       (1001, 13824)])
def test_fp16_plain_pack_matches_comfyui(rows, cols):
    seed = fresh_seed()
    x = _f16(rows, cols)
    assert_same_pack(fused_pack(x), *comfy_pack(x), f"fp16 [{rows}, {cols}] seed {seed}")


@pytest.mark.parametrize("static", [0.5, 1.0, 3.0e-3, 7.1e-5, 2.0 ** -20])
def test_fp16_static_scale(static):
    seed = fresh_seed()
    x = _f16(1000, 5120)
    scale = torch.tensor([static], dtype=torch.float32, device="cuda")
    assert_same_pack(fused_pack(x, static_scale=scale), *comfy_pack(x, scale), f"fp16 static {static} seed {seed}")


def test_fp16_every_value():
    """All 65536 fp16 bit patterns (NaN, +-Inf, -0.0, subnormals, ties) in one tensor, several scales."""
    allbits = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(F16)
    x = allbits.reshape(-1, 256)
    finite = x[torch.isfinite(x.float()).all(dim=1)]
    shuffled = x.reshape(-1)[torch.randperm(65536, device="cuda")].reshape(-1, 512)
    subnormal_rows = x[: 4]  # +0 and the positive subnormals 0x0001-0x03FF only: a dynamic scale of 0
    for case, t in (("all patterns", x), ("finite rows", finite), ("shuffled", shuffled),
                    ("subnormal rows", subnormal_rows)):
        assert_same_pack(fused_pack(t), *comfy_pack(t), f"fp16 {case}")
        for static in (1.0, 0.75, 2.0 ** -24, 1e-30):
            scale = torch.tensor([static], dtype=torch.float32, device="cuda")
            assert_same_pack(fused_pack(t, static_scale=scale), *comfy_pack(t, scale), f"fp16 {case} static {static}")


def _f16_tie_tensor():
    g = 2.0 ** -4
    rows = []
    for s8 in (1.0, 1.5, 1.25, 0.75, 2.0 ** -6):
        scale = g * s8
        for boundary in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            row = torch.full((16,), boundary * scale)
            row[0] = 6.0 * scale
            row[1] = -boundary * scale
            rows.append(row)
    return torch.stack(rows).to(F16).cuda(), torch.tensor([g], dtype=torch.float32, device="cuda")


@pytest.mark.parametrize(
    "case",
    ["zeros", "negative_zeros", "one_nan", "all_nan_block", "inf", "neg_inf", "underflow_blocks", "huge", "subnormal",
     "subnormal_scale", "zero_scale", "ties"],
)
def test_fp16_hard_cases(case):
    """fp16's hard cases: its subnormals as inputs, global scales that are fp16 subnormals (amax ~0.05) or 0 (amax
    < ~8e-5: then rcp(0) = inf, every block scale 448 and every nonzero code saturated, as comfy-kitchen's), its
    largest values, NaN and +-Inf, rounding ties."""
    x = _f16(300, 5120)
    scale = None
    if case == "zeros":
        x = torch.zeros_like(x)
    elif case == "negative_zeros":
        x = torch.full_like(x, -0.0)
    elif case == "one_nan":
        x[7, 33] = float("nan")
    elif case == "all_nan_block":
        x[9, 32:48] = float("nan")
    elif case == "inf":
        x[5, 100] = float("inf")
    elif case == "neg_inf":
        x[200, 17] = float("-inf")
    elif case == "underflow_blocks":
        x[:10] *= 1e-4  # block scales round to 0 -> encode = FLT_MAX
    elif case == "huge":
        x = (torch.randn(300, 5120, device="cuda") * 2e4).clamp(-65504, 65504).to(F16)
    elif case == "subnormal":
        x = torch.randint(-1023, 1024, x.shape, device="cuda").to(torch.int16)
        x = torch.where(x < 0, (-x) | -32768, x).view(F16)  # sign-magnitude: every fp16 subnormal, both signs
    elif case == "subnormal_scale":
        x = (torch.randn(300, 5120, device="cuda") * 0.01).to(F16)
    elif case == "zero_scale":
        x = (torch.randn(300, 5120, device="cuda") * 1e-5).to(F16)
    elif case == "ties":
        x, scale = _f16_tie_tensor()
    if case in ("subnormal_scale", "zero_scale", "subnormal"):  # fp16 subnormal inputs: amax < 2^-14, g = 0
        g = float(comfy_pack(x)[2])
        assert (0 < g < 2.0 ** -14) if case == "subnormal_scale" else g == 0, (case, g)
    assert_same_pack(fused_pack(x, static_scale=scale), *comfy_pack(x, scale), f"fp16 {case}")
    if scale is not None:
        assert_same_pack(fused_pack(x), *comfy_pack(x), f"fp16 {case} dynamic")


def test_fp16_reference_matches_kernel_on_gpu_data():
    """The CPU oracle's fp16 model (tests/nvfp4_oracle.py) against the fp16 kernel on fresh data, except in blocks it
    flags as sensitive to the GPU's approximate reciprocal."""
    import nvfp4_oracle as ref

    seed = fresh_seed()
    x = _f16(257, 5120)
    q, s, g = ref.quantize_nvfp4(x.cpu())
    fused = fused_pack(x)
    assert torch.equal(fused.global_scale.cpu().reshape(()), g), f"seed {seed}"
    rows16 = q.shape[0]
    padded = torch.zeros(rows16, x.shape[1], dtype=F16)
    padded[: x.shape[0]] = x.cpu()
    sensitive = ref.rcp_sensitive_blocks(padded, g)
    fused_scales = ref.unswizzle_scales(fused.block_scales.cpu(), rows16, x.shape[1])
    differs = ((fused_scales != ref.unswizzle_scales(s, rows16, x.shape[1]))
               | (fused.qdata.cpu().reshape(rows16, -1, 8) != q.reshape(rows16, -1, 8)).any(-1))
    assert (differs & ~sensitive).sum().item() == 0, f"seed {seed}"


@pytest.mark.parametrize("rows,cols,static", [(H3_ROWS, 5120, None), (1001, 4096, None), (1001, 4096, 0.02),
                                              (129, 5392, None), (17, 16, None), (301, 13824, 3.0e-3)])
def test_fp16_prescale_pack_matches_comfyui(rows, cols, static):
    seed = fresh_seed()
    x = _f16(rows, cols)
    table = torch.exp(torch.randn(cols, device="cuda") * 0.8)
    scale = None if static is None else torch.tensor([static], dtype=torch.float32, device="cuda")
    fused = fused_pack(x, prescale=_prescale(table, F16), static_scale=scale)
    assert_same_pack(fused, *comfy_pack(_comfy_prescaled(x, table), scale),
                     f"fp16 prescale [{rows}, {cols}] seed {seed}")


@pytest.mark.parametrize("case", ["probe_table", "probe_inputs", "every_fp16_table", "overflow_products",
                                  "subnormal_products", "strided", "fp16_table", "with_alpha"])
def test_fp16_prescale_pack_hard_cases(case):
    """The fp16 probe table (overflow and underflow in the fp16 cast), the fp16 hard inputs, every fp16 bit pattern
    as a table entry, products that overflow to +-inf in fp16 and that land in its subnormals, a strided view, a
    table stored in fp16, and the GEMM alpha the pack writes."""
    from h3_fused_nvfp4.core import probes

    seed = fresh_seed()
    scales = [None]
    if case == "probe_table":
        x = _f16(300, 1056)
        table = probes.prescale_table_f16(1056).cuda()
        scales.append(torch.tensor([1.0], device="cuda"))
    elif case == "probe_inputs":
        x, _ = probes.probe_activations_f16("cuda")["fp16 hard cases with NaN/inf, dynamic scale"]
        table = probes.prescale_table_f16(x.shape[1]).cuda()
        scales.append(torch.tensor([1.0], device="cuda"))
    elif case == "every_fp16_table":
        table = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(F16)
        x = _f16(64, 65536)
        scales.append(torch.tensor([0.75], device="cuda"))
    elif case == "overflow_products":  # |x p| above 65504 for a part of the products: +-inf in fp16
        x = (torch.randn(257, 2048, device="cuda") * 4).to(F16)
        table = torch.exp(torch.randn(2048, device="cuda") * 0.5) * 2e4
        scales.append(torch.tensor([1.0], device="cuda"))
    elif case == "subnormal_products":  # |x| ~ 2^-7 times 2^-8..-20: products across 2^-14 down past 2^-24
        x = (torch.randn(257, 2048, device="cuda") * 2.0 ** -7).to(F16)
        exponents = torch.randint(8, 21, (2048,), device="cuda").float()
        table = torch.exp2(-exponents) * (1 + torch.rand(2048, device="cuda"))
        scales.append(torch.tensor([2.0 ** -20], device="cuda"))
    elif case == "strided":
        wide = _f16(3001, 3 * 2048)
        x = wide[:, 2048:4096]
        table = torch.exp(torch.randn(2048, device="cuda"))
    elif case == "fp16_table":
        x = _f16(999, 2048)
        table = torch.exp(torch.randn(2048, device="cuda")).to(F16)
    else:  # with_alpha
        x = _f16(999, 2048)
        table = torch.exp(torch.randn(2048, device="cuda"))
    h = _comfy_prescaled(x, table)
    if case == "overflow_products":
        assert torch.isinf(h).any() and torch.isfinite(x).all(), "the case must overflow in the product"
    if case == "subnormal_products":
        assert ((h != 0) & (h.abs() < 2.0 ** -14)).float().mean() > 0.2, "the case must land in the subnormals"
    _assert_prescale_packs(x, table, scales, f"fp16 prescale {case} seed {seed}")


def test_fp16_inputs_are_checked():
    """fp16 goes to the plain and prescale kernels only, with an fp16 table; the H3 sources refuse it by name."""
    ops = _ops()
    x = _f16(8, 256)
    good = torch.ones(256, dtype=F16, device="cuda")
    assert ops.pack_support(x) is None and ops.pack_support(x, prescale=good) is None
    assert "fp16 [256]" in ops.pack_support(x, prescale=good.to(torch.bfloat16))
    assert "bf16 [256]" in ops.pack_support(random_activation(8, 256), prescale=good)
    assert "take bfloat16" in ops.pack_support(_f16(8, 512), swiglu=True)
    shift, scale, _ = _tables(8, 256)
    index = torch.zeros(8, dtype=torch.int32, device="cuda")
    assert "take bfloat16" in ops.pack_support(x, modulation=ops.Modulation(scale, shift, index))
    assert "float32" in ops.pack_support(x.float())
    with pytest.raises(ValueError, match="take bfloat16"):
        ops.pack_nvfp4(_f16(8, 512), swiglu=True)
