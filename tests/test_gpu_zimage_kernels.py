"""GPU parity of Z-Image's fused kernels against ComfyUI's own ops (comfy/ldm/lumina/model.py: ``modulate``,
``apply_gate``, ``FeedForward._forward_silu_gating``; ComfyUI's RMSNorm module, torch's ``_fused_rms_norm``
statistics, ``QuantizedTensor.from_float``). Equal bytes, on fresh random data (the seed is in the failure message),
into poisoned outputs, at Z-Image's widths (3840, FFN 10240, heads of 128) and odd ones, rows of batch 1 and 2 at
1024x1024 (4352 and 8704) and rows not a multiple of 16 or 128, the hard cases (zeros, -0.0, NaN, +-Inf, outliers,
subnormals, huge and tiny rows, tables with non-finite entries), timestep_zero_index rows; then the fused block of
tests/zimage_block.py at full width against ComfyUI's real JointTransformerBlock, the self-check probes and their
planted faults. Also run with H3_FUSED_NVFP4_EMULATE_BLACKWELL=1 (benchmarks/gpu_run.sh step ``emulated``)."""

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
)

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui")]

DIM, FFN = 3840, 10240
ROWS_1024 = 4352  # one 1024x1024 image: 4096 image tokens + 256 caption tokens
EPS = 1e-5
CUDA = torch.device("cuda", 0)


def _ops():
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    return ops


def _lumina():
    import comfy.ldm.lumina.model as m

    return m


def _norm(k, weight):
    from h3_fused_nvfp4.core.probes import comfy_rms_norm

    return comfy_rms_norm(k, weight, EPS)


def _rows_index(batch, tokens, table_rows, tzi):
    from h3_fused_nvfp4.models.zimage.modulation import adaln_row_index

    return adaln_row_index(batch, tokens, table_rows, tzi).to(CUDA)


def _layout(rows):
    """(batch, tokens, timestep_zero_index) for ``rows`` rows: two batch entries where rows split evenly, slices of
    the second entry's tokens for the timestep_zero_index layout."""
    batch = 2 if rows % 2 == 0 and rows >= 4 else 1
    tokens = rows // batch
    return batch, tokens, [(tokens - tokens // 3, tokens), (1, max(1, tokens // 5))]


def _adaln(rows, k, scale=0.5):
    """[rows, k] views of one adaLN output, as ComfyUI's chunk(4) makes them (row stride 4k)."""
    return ((torch.randn(rows, 4 * k, device="cuda") * scale).to(torch.bfloat16)).chunk(4, dim=1)


def _input(rows, k, case):
    x = random_activation(rows, k)
    if case == "heavy":
        x = (x.float() * torch.exp(2 * torch.randn(rows, k, device="cuda"))).to(torch.bfloat16)
    elif case == "specials":
        x[0] = 0.0
        x[1, 7] = float("nan")
        x[2, 9] = float("inf")
        x[3] = 1e-39  # bf16 subnormals
        x[4, ::5] = 3.0e38
        x[5] = -0.0
    elif case == "outlier":
        x[-1, k - 3] = 3000.0
    elif case == "zeros":
        x.zero_()
    elif case == "subnormal":
        x = (x.float() * 1e-39).to(torch.bfloat16)
    return x


def _poisoned_norm(weight, rows, eps=EPS):
    from h3_fused_nvfp4.layout import RmsNorm

    return RmsNorm(weight, eps, torch.full((rows,), float("nan"), device="cuda"))


def _nan_scalar():
    return torch.full((1,), float("nan"), device="cuda")


def _tables_case(case, weight, scale):
    """Tables where the bounded amax pass must not skip the element that decides the maximum (a large 1 + scale, a
    tiny norm weight next to an outlier) or that hold non-finite entries."""
    if case == "tables":
        scale[:, 40] = 60.0
        weight[500] = 1.0e-30
    elif case == "table_specials":
        scale[1 % scale.shape[0], 33] = float("inf")
        scale[0, 7] = float("nan")


NORM_CASES = [(ROWS_1024, DIM, "random"), (2 * ROWS_1024, DIM, "random"), (301, DIM, "heavy"), (64, DIM, "specials"),
              (4099, DIM, "outlier"), (4099, DIM, "tables"), (301, DIM, "table_specials"), (301, DIM, "subnormal"),
              (129, 1040, "random"), (33, 5632, "random"), (17, 16, "random"), (301, DIM, "zeros")]


@pytest.mark.parametrize("tzi", [False, True], ids=["rows", "timestep_zero_index"])
@pytest.mark.parametrize("rows,k,case", NORM_CASES)
def test_norm_scale_statistics_and_pack_match_comfyui(rows, k, case, tzi):
    """rstd equals torch's own ``_fused_rms_norm`` statistics; the normalized, scale-modulated pack (global scale
    from the same pass, and a static one) equals ComfyUI's RMSNorm module, lumina's ``modulate`` and from_float."""
    ops = _ops()
    seed = fresh_seed()
    x = _input(rows, k, case)
    eps = 1e-38 if case == "subnormal" else EPS
    weight = (1 + torch.randn(k, device="cuda") * 0.1).to(torch.bfloat16)
    batch, tokens, slices = _layout(rows)
    table_rows = batch * (2 if tzi else 1)
    scale = _adaln(table_rows, k)[0].clone() if case in ("tables", "table_specials") else _adaln(table_rows, k)[0]
    _tables_case(case, weight, scale)
    tzi = slices if tzi else None
    index = _rows_index(batch, tokens, table_rows, tzi)
    modulation = ops.Modulation(scale, None, index)
    norm, g = _poisoned_norm(weight, rows, eps), _nan_scalar()
    ops.norm_statistics(x, norm, modulation=modulation, global_scale_out=g)
    _, torch_rstd = torch._fused_rms_norm(x, [k], weight, eps)
    where = f"{case} [{rows}, {k}] tzi {tzi is not None} seed {seed}"
    assert_bit_identical(norm.rstd, torch_rstd.reshape(-1).float(), f"rstd {where}")
    from h3_fused_nvfp4.core.probes import comfy_rms_norm

    h = _lumina().modulate(comfy_rms_norm(k, weight, eps)(x.view(batch, tokens, k)), scale, timestep_zero_index=tzi)
    h = h.reshape(rows, k)
    assert_same_pack(fused_pack(x, global_scale=g, modulation=modulation, norm=norm), *comfy_pack(h), where)
    static = torch.tensor([4.0 / 2688], device="cuda")
    assert_same_pack(fused_pack(x, static_scale=static, modulation=modulation, norm=norm), *comfy_pack(h, static),
                     f"static {where}")


@pytest.mark.parametrize("rows,k,case", NORM_CASES)
def test_unmodulated_norm_statistics_and_pack_match_comfyui(rows, k, case):
    """The refiner blocks' normalized pack without a modulation and its amax, against ComfyUI's RMSNorm module."""
    ops = _ops()
    seed = fresh_seed()
    x = _input(rows, k, case)
    eps = 1e-38 if case == "subnormal" else EPS
    weight = (1 + torch.randn(k, device="cuda") * 0.1).to(torch.bfloat16)
    if case == "tables":
        weight[500] = 1.0e-30
        x[rows // 2, 500] = 1.0e30
    norm, g = _poisoned_norm(weight, rows, eps), _nan_scalar()
    ops.norm_statistics(x, norm, global_scale_out=g)
    from h3_fused_nvfp4.core.probes import comfy_rms_norm

    h = comfy_rms_norm(k, weight, eps)(x)
    where = f"unmodulated {case} [{rows}, {k}] seed {seed}"
    assert_same_pack(fused_pack(x, global_scale=g, norm=norm), *comfy_pack(h), where)
    stats_only = _poisoned_norm(weight, rows, eps)
    ops.norm_statistics(x, stats_only)
    assert_bit_identical(stats_only.rstd, norm.rstd, f"statistics without the amax, {where}")


RESIDUAL_CASES = [(ROWS_1024, DIM, "random"), (2 * ROWS_1024, DIM, "random"), (129, 1040, "random"),
                  (33, 5632, "random"), (4099, DIM, "outlier"), (301, DIM, "specials"), (301, DIM, "zeros"),
                  (4099, DIM, "quiet_rows"), (301, DIM, "other_specials"), (17, 16, "random")]


@pytest.mark.parametrize("place", ["in_place", "from_input"])
@pytest.mark.parametrize("next_stage", ["none", "stats", "amax"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("rows,k,case", RESIDUAL_CASES)
def test_post_norm_residual_matches_comfyui(rows, k, case, gated, next_stage, place):
    """``x + apply_gate(tanh(gate), norm2(out))`` (gated, the modulated blocks; with timestep_zero_index rows) and
    ``x + norm2(out)`` (the refiner blocks), alone or with the next norm's statistics (and the next projection's
    amax: scale-modulated after a gated residual, unmodulated after an ungated one), then the next pack; in place,
    or out of place (``x_from``: a poisoned new stream written from the input, which stays as it is)."""
    ops = _ops()
    seed = fresh_seed()
    m = _lumina()
    x, out = _input(rows, k, case if case != "other_specials" else "random"), random_activation(rows, k)
    if case == "zeros":
        out.zero_()
    elif case == "quiet_rows":  # most half rows skipped whole by the amax bounds; the last is not
        x[torch.arange(rows, device=x.device) % 5 != 0] *= 0.01
        out[torch.arange(rows, device=x.device) % 5 != 0] *= 0.01
        x[-1, k // 2 + 5] = x.abs().max().float() * 1.5
    elif case == "other_specials":
        out[3, 11] = float("nan")
        out[4, 12] = float("inf")
        out[5] = 0.0
        out[6] = 1e-39
    batch, tokens, slices = _layout(rows)
    tzi = slices if gated else None
    table_rows = batch * (2 if gated else 1)
    _, gate, scale, _ = _adaln(table_rows, k)
    index = _rows_index(batch, tokens, table_rows, tzi)
    w2 = (1 + torch.randn(k, device="cuda") * 0.1).to(torch.bfloat16)
    w_next = (1 + torch.randn(k, device="cuda") * 0.1).to(torch.bfloat16)
    x3, out3 = x.view(batch, tokens, k), out.view(batch, tokens, k)
    if gated:
        stock = (x3 + m.apply_gate(gate.unsqueeze(1).tanh(), _norm(k, w2)(out3), timestep_zero_index=tzi))
        next_modulation = ops.Modulation(scale, None, index)
        h = m.modulate(_norm(k, w_next)(stock), scale, timestep_zero_index=tzi)
    else:
        stock = x3 + _norm(k, w2)(out3)
        next_modulation = None
        h = _norm(k, w_next)(stock)
    stock, h = stock.reshape(rows, k), h.reshape(rows, k)
    before = x.clone()
    fused = x.clone() if place == "in_place" else torch.full_like(x, float("nan"))
    norm = _poisoned_norm(w_next, rows) if next_stage != "none" else None
    g = _nan_scalar() if next_stage == "amax" else None
    ops.post_norm_residual_(fused, out, w2, EPS, gate.tanh() if gated else None, index if gated else None,
                            next_norm=norm, next_modulation=next_modulation if next_stage != "none" else None,
                            global_scale_out=g, **({"x_from": x} if place == "from_input" else {}))
    where = f"{'gated' if gated else 'ungated'} {case} [{rows}, {k}] next {next_stage} {place} seed {seed}"
    assert_bit_identical(fused, stock, f"residual {where}")
    assert_bit_identical(x, before, f"the input afterwards {where}")
    if next_stage == "none":
        return
    _, torch_rstd = torch._fused_rms_norm(stock, [k], w_next, EPS)
    assert_bit_identical(norm.rstd, torch_rstd.reshape(-1).float(), f"next rstd {where}")
    kwargs = dict(global_scale=g) if next_stage == "amax" else dict(static_scale=torch.tensor([4.0 / 2688],
                                                                                              device="cuda"))
    packed = fused_pack(fused, modulation=next_modulation, norm=norm, **kwargs)
    assert_same_pack(packed, *comfy_pack(h, kwargs.get("static_scale")), f"next pack {where}")


@pytest.mark.parametrize("silu", ["window", "table"])
@pytest.mark.parametrize("rows,case", [(ROWS_1024, "random"), (2 * ROWS_1024, "random"), (129, "random"),
                                       (4000, "flat"), (300, "inf"), (300, "nan"), (300, "negative"),
                                       (301, "window_edges"), (300, "tiny"), (301, "one_buffer")])
def test_swiglu_pair_pack_matches_comfyui(rows, case, silu, monkeypatch):
    """w2's input from w1's and w3's outputs (``F.silu(x1) * x3``, lumina's ``_forward_silu_gating``), both silu
    sources, dynamic and static scale; ``one_buffer``: x1 and x3 as the two halves of one buffer (strided rows)."""
    ops = _ops()
    monkeypatch.setattr(ops, "SWIGLU_SILU", silu)
    seed = fresh_seed()
    both = (torch.randn(rows, 2 * FFN, device="cuda") * 3).to(torch.bfloat16)
    if case == "flat":  # every |g * u| close to the max: the amax bound prunes almost nothing
        both = (torch.rand(rows, 2 * FFN, device="cuda") * 0.01 + 4).to(torch.bfloat16)
    elif case == "inf":
        both[17, 5] = float("inf")
        both[18, FFN + 9] = float("-inf")
    elif case == "nan":
        both[3, FFN + 100] = float("nan")
    elif case == "tiny":
        both = (torch.randn(rows, 2 * FFN, device="cuda") * 1e-17).to(torch.bfloat16)
    elif case == "negative":  # silu of large negative gates underflows toward -0
        both[:, :FFN] = -both[:, :FFN].abs() * 20
    elif case == "window_edges":
        edges = torch.tensor([2.0 ** -16, 2.0 ** -17, 255.0, 256.0, 300.0, 0.0, -0.0, 1e-30], device="cuda")
        both[::3, 16:24] = edges.to(torch.bfloat16)
        both[1::3, 32:48] = (edges.repeat(2) * -1).to(torch.bfloat16)
    if case == "one_buffer":
        x1, x3 = both[:, :FFN], both[:, FFN:]
    else:
        x1, x3 = both[:, :FFN].contiguous(), both[:, FFN:].contiguous()
    stock = _lumina().FeedForward._forward_silu_gating(None, x1, x3)
    where = f"swiglu pair {case} rows {rows} silu {silu} seed {seed}"
    assert_same_pack(fused_pack(x1, swiglu=True, up=x3), *comfy_pack(stock), where)
    static = torch.tensor([1.0 / 2688], device="cuda")
    assert_same_pack(fused_pack(x1, swiglu=True, up=x3, static_scale=static), *comfy_pack(stock, static),
                     f"static {where}")


def test_unsupported_inputs_are_refused_with_a_reason():
    """What the kernels cannot take is refused by name (the block then runs ComfyUI's op): fp16 (Z-Image in fp16 runs
    ComfyUI's block), an up tensor of another row stride, a scale-only modulation without its norm, a post-norm
    residual handing on to a shifted modulation, gate and next modulation with different row indices, an
    out-of-place residual whose input overlaps its output or has another shape or row stride."""
    ops = _ops()
    x = random_activation(64, 256)
    weight = torch.ones(256, dtype=torch.bfloat16, device="cuda")
    index = torch.zeros(64, dtype=torch.int32, device="cuda")
    scale = torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda")
    norm = _poisoned_norm(weight, 64)
    assert "take bfloat16" in ops.pack_support(x.half(), norm=norm)
    assert "take bfloat16" in ops.pack_support(x.half(), swiglu=True, up=x.half())
    wide = random_activation(64, 512)
    assert "row stride" in ops.pack_support(x, swiglu=True, up=wide[:, :256])
    assert "belongs to a SwiGLU" in ops.pack_support(x, up=x)
    assert "scale-only" in ops.pack_support(x, modulation=ops.Modulation(scale, None, index))
    assert ops.pack_support(x, modulation=ops.Modulation(scale, None, index), norm=norm) is None
    assert ops.pack_support(x, norm=norm) is None
    assert "bf16" in ops.post_norm_residual_support(x.half(), x.half(), weight)
    assert "norm of the residual's input" in ops.post_norm_residual_support(x, x, weight.float())
    shifted = ops.Modulation(scale, scale, index)
    assert "scale-only" in ops.post_norm_residual_support(x, x, weight, scale, next_norm=norm, next_modulation=shifted)
    assert "scale-only" in ops.post_norm_residual_support(x, x, weight, None, next_norm=norm,
                                                          next_modulation=ops.Modulation(scale, None, index))
    with pytest.raises(ValueError, match="one modulation index"):
        ops.post_norm_residual_(x.clone(), x, weight, EPS, scale, index, next_norm=norm, global_scale_out=_nan_scalar(),
                                next_modulation=ops.Modulation(scale, None, index.clone()))
    with pytest.raises(ValueError, match="needs its norm"):
        ops.post_norm_residual_(x.clone(), x, weight, EPS, scale, index, global_scale_out=_nan_scalar())
    target = torch.empty_like(x)
    assert ops.post_norm_residual_support(target, x, weight, scale, x_from=x.clone()) is None
    assert "overlap" in ops.post_norm_residual_support(x, x, weight, scale, x_from=x)
    assert "overlap" in ops.post_norm_residual_support(wide[:, :256], x, weight, scale, x_from=wide[:, 256:])
    assert "row stride" in ops.post_norm_residual_support(target, x, weight, scale, x_from=wide[:, 256:])
    assert "row stride" in ops.post_norm_residual_support(target, x, weight, scale, x_from=x[:, :128])
    with pytest.raises(ValueError, match="row stride"):
        ops.pack_nvfp4(x, swiglu=True, up=wide[:, :256])


# ---- the fused block at full width ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,batch,tzi,static", [
    ("modulated", 1, False, ()), ("modulated", 2, False, ()), ("modulated", 1, True, ()),
    ("modulated", 1, False, ("attention.qkv", "feed_forward.w2")), ("refiner", 1, False, ()),
])
def test_full_width_blocks_match_comfyui(kind, batch, tzi, static):
    """Two of ComfyUI's real JointTransformerBlocks at Z-Image Turbo's widths (3840, 30 heads x 128, FFN 10240),
    4352 tokens a batch entry (1024x1024; refiner: 256 caption tokens), NVFP4 compute forced on: the fused sequence of
    tests/zimage_block.py (the kernels, comfy-kitchen's rms_rope, ComfyUI's attention on k and v without the
    repeat copy) equals the stock blocks bit for bit. Both arms warm first (the first emulated GEMM of a process
    differs on the H200)."""
    from zimage_block import FULL, fused_blocks, make_block, make_inputs, stock_blocks

    from h3_fused_nvfp4.kernels import cuda_ops

    seed = fresh_seed()
    modulated = kind == "modulated"
    tokens = ROWS_1024 if modulated else 256
    blocks = [make_block(FULL, modulated=modulated, seed=seed + i, device="cuda", static_layers=static)
              for i in range(2)]
    slices = [(tokens - 4096, tokens), (10, 200)] if tzi else None  # omni: the image tokens and a caption span
    inputs = make_inputs(FULL, batch, tokens, seed=seed + 7, device="cuda", modulated=modulated,
                         timestep_zero_index=slices)
    stock_blocks(blocks, inputs)
    stock = stock_blocks(blocks, inputs)
    fused_blocks(blocks, inputs, cuda_ops)
    fused = fused_blocks(blocks, inputs, cuda_ops)
    assert_bit_identical(fused, stock, f"{kind} batch {batch} tzi {tzi} static {static} seed {seed}")


# ---- the self-check ---------------------------------------------------------------------------------------------

def test_probes_pass_on_the_gpu():
    from h3_fused_nvfp4.core import verdicts
    from h3_fused_nvfp4.models.zimage.probes import ZIMAGE_PROBES

    ops = _ops()
    verdicts.run_probes(ops, CUDA, (ZIMAGE_PROBES,))  # kernels built and loaded
    results = verdicts.run_probes(ops, CUDA, (ZIMAGE_PROBES,))
    assert all(r.ok is True for r in results.values()), {n: r.detail for n, r in results.items()}


@pytest.mark.parametrize("faulted,failing", [
    (("packs.cu", "residual_norm.cu"), {"pack_norm_scale", "pack_norm_unmodulated", "post_norm_residual_gated",
                                        "post_norm_residual", "pack_swiglu_pair"}),
    (("residual_norm.cu",), {"pack_norm_scale", "pack_norm_unmodulated", "post_norm_residual_gated",
                             "post_norm_residual"}),
    (("packs.cu",), {"pack_norm_scale", "pack_norm_unmodulated", "post_norm_residual_gated", "post_norm_residual",
                     "pack_swiglu_pair"}),
])
def test_planted_wrong_kernels_fail_their_probes(faulted, failing, monkeypatch, tmp_path):
    """Kernels built with NVFP4_PLANT_FAULT (every bf16 rounding and bf16x2 product toward zero) in one source or
    both: each Z-Image probe whose kernels are wrong fails with the first differing index. The residual kernels
    (residual_norm.cu) are also what produce the normalized packs' statistics and amax; the packs (packs.cu) hand
    the residual probes' next pack and the SwiGLU of two tensors; a probe whose kernels are right passes."""
    from h3_fused_nvfp4.core import verdicts
    from h3_fused_nvfp4.models.zimage.probes import ZIMAGE_PROBES

    ops = _ops()
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", str(tmp_path / "cache"))
    defines = ops.kernel_defines
    monkeypatch.setattr(ops, "kernel_defines", lambda source=ops.PACKS: defines(source) + (
        (("NVFP4_PLANT_FAULT", 1),) if source in faulted else ()))
    results = verdicts.run_probes(ops, CUDA, (ZIMAGE_PROBES,))
    failed = {n for n, r in results.items() if r.ok is False}
    assert failed == failing, {n: r.detail for n, r in results.items()}
    assert all("differs at index" in results[n].detail for n in failing)
