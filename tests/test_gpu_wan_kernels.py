"""GPU parity of the fused ops of Wan's block (kernels/csrc/residual_norm.cu ``*layer_norm_*`` and ``rms_norm_*``,
packs.cu's LayerNorm and GELU sources) against ComfyUI's real ops: its LayerNorm and RMSNorm modules (torch's CUDA
layer_norm and rms_norm), the block's modulation and residuals (torch's addcmul and add, with ComfyUI's repeat_e),
ComfyUI's apply_rope1 (comfy-kitchen's CUDA rope), its eager GELU and its NVFP4 quantizer (comfy-kitchen's CUDA
packer). Equal bytes on fresh random data (the seed is in the failure message) with the hard cases (zeros, constant
rows, heavy tails, fp16 subnormals and values near its largest, -0.0, NaN and inf rows, modulation that overflows to
inf, 1 + scale on rounding ties, rope tables with fp32 subnormals, every 16-bit pattern through GELU), into poisoned
outputs, at Wan 2.2 14B's widths (5120, FFN 13824, 40 heads of 128) and 32,760 rows (832x480, 81 frames), the 5B's
(3072, FFN 14336, 24 heads) and odd shapes (rows not a multiple of 16 or 128, widths that end inside a 512-column
step); fp16 (ComfyUI's compute dtype for Wan) and bf16. Also: the statistics themselves against torch's
native_layer_norm, the Wan probes on the GPU, planted wrong kernels caught (each new kernel), and the block
specification (tests/wan_block_spec.py) at full width against ComfyUI's real blocks. benchmarks/gpu_run.sh runs this
file in its ``tests`` step and, with H3_FUSED_NVFP4_EMULATE_BLACKWELL=1 (the Blackwell code path), in ``emulated``."""

import pytest
import torch
from conftest import requires_cuda
from parity import POISON, assert_bit_identical, assert_same_pack, comfy_pack, fresh_seed, fused_pack

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui")]

F16, BF16 = torch.float16, torch.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
WAN14_ROWS = 21 * 30 * 52  # 832x480, 81 frames: 32,760 tokens
EPS = 1e-6


def _ops():
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    return ops


def _probes():
    from h3_fused_nvfp4.models.wan import probes

    return probes


def wan_rows(rows: int, cols: int, dtype, seed: int, *, finite: bool = True, big: float | None = None):
    """Random rows (per-row offsets and magnitudes over several binades) whose first rows are the probes' hard cases."""
    gen = torch.Generator(device="cuda").manual_seed(seed)  # drawn on the GPU: 32,760 x 13,824 values
    mag = torch.exp2(torch.randint(-6, 6, (rows, 1), generator=gen, device="cuda").float())
    x = torch.randn((rows, cols), generator=gen, device="cuda") * mag
    x = (x + torch.randn((rows, 1), generator=gen, device="cuda") * 4).to(dtype)
    hard = _probes().probe_rows("cuda", cols, dtype, seed, finite=finite, big=big)[:rows]
    x[:hard.shape[0]] = hard
    return x


def modulation_tables(rows: int, cols: int, dtype, seed: int, *, frames: int = 3, batch: int = 1):
    """The modulation of a Wan block as ComfyUI builds it: e0 [B, F, 6, D], the six chunks as strided [B F, D] tables
    (tests/wan_block_spec.py block_tables) and the row of each token through ComfyUI's repeat_e."""
    from wan_block_spec import block_tables, modulation_index

    gen = torch.Generator(device="cpu").manual_seed(seed)
    e = (torch.randn((batch, frames, 6, cols), generator=gen) * 0.3).to(dtype).cuda()

    class Block:  # the block's own modulation parameter
        modulation = (torch.randn((1, 6, cols), generator=gen) * cols ** -0.5).to(dtype).cuda()

    x = torch.empty((batch, rows // batch, cols), dtype=dtype, device="cuda")
    tables = block_tables(Block, e, x, modulation_index(e, x))
    tie = 2.0 ** -11 if dtype == F16 else 2.0 ** -8
    for chunk in (1, 4):  # the two scales: 1 + scale on rounding ties (down, then up)
        tables.e[chunk][0, :16], tables.e[chunk][0, 16:32] = tie, 3 * tie
    return tables


def comfy_layer_norm(cols, dtype, weight=None, bias=None):
    return _probes().comfy_layer_norm(cols, dtype, "cuda", weight, bias)


def poisoned_stats(rows: int):
    from h3_fused_nvfp4.layout import LayerNorm

    poison = torch.full((rows,), -7, dtype=torch.int32, device="cuda").view(torch.float32)  # a NaN pattern
    return LayerNorm(None, None, EPS, poison.clone(), poison.clone())


def torch_stats(x: torch.Tensor):
    """torch's own CUDA layer_norm statistics (mean, rstd) of every row."""
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[1]], None, None, EPS)
    return mean.reshape(-1), rstd.reshape(-1)


def assert_stats(norm, x, label):
    mean, rstd = torch_stats(x)
    assert_bit_identical(norm.mean, mean, f"{label}: mean")
    assert_bit_identical(norm.rstd, rstd, f"{label}: rstd")


def _affine(cols, dtype, seed):
    return _probes()._affine("cuda", cols, dtype, seed)


def _scale_out():
    return torch.full((1,), float("nan"), dtype=torch.float32, device="cuda")


# ---- LayerNorm statistics and the packs that read them ---------------------------------------------------------

@DTYPES
@pytest.mark.parametrize("rows,cols", [(WAN14_ROWS, 5120), (27280, 3072), (4099, 5632), (37, 1040), (1, 16),
                                       (129, 528)])
def test_layer_norm_statistics_match_torch(dtype, rows, cols):
    seed = fresh_seed()
    x = wan_rows(rows, cols, dtype, seed, finite=False)
    norm = poisoned_stats(rows)
    _ops().layer_norm_statistics(x, norm)
    assert_stats(norm, x, f"{dtype} [{rows}, {cols}] seed {seed}")


@DTYPES
@pytest.mark.parametrize("rows,cols,scale", [(WAN14_ROWS, 5120, "statistics"), (WAN14_ROWS, 5120, "pack"),
                                             (27280, 3072, "statistics"), (4099, 1040, "static"),
                                             (37, 5120, "statistics"), (129, 528, "pack")])
def test_layer_norm_modulate_pack(dtype, rows, cols, scale):
    """norm1 / norm2 -> q, k, v / ffn.0: torch.addcmul(shift, LayerNorm(x), 1 + scale) packed; the scale from the
    statistics kernel's amax, from the pack's own reduction, or static."""
    seed = fresh_seed()
    ops = _ops()
    x = wan_rows(rows, cols, dtype, seed)
    tables = modulation_tables(rows, cols, dtype, seed)
    modulation = tables.modulation(0, 1)
    index = modulation.mod_index.long()
    h = torch.addcmul(tables.e[0][index], comfy_layer_norm(cols, dtype)(x), 1 + tables.e[1][index])
    norm, g = poisoned_stats(rows), _scale_out()
    static = torch.tensor([2.0 / 2688 * 1.5], device="cuda") if scale == "static" else None
    ops.layer_norm_statistics(x, norm, modulation=modulation if scale == "statistics" else None,
                              global_scale_out=g if scale == "statistics" else None)
    assert_stats(norm, x, f"seed {seed}")
    fused = fused_pack(x, layer_norm=norm, addcmul_modulation=modulation, static_scale=static,
                       global_scale=g if scale == "statistics" else None)
    assert_same_pack(fused, *comfy_pack(h, static), f"{dtype} modulated [{rows}, {cols}] {scale} seed {seed}")


@DTYPES
@pytest.mark.parametrize("rows,cols", [(WAN14_ROWS, 5120), (301, 3072), (37, 1040)])
def test_layer_norm_affine_pack(dtype, rows, cols):
    """norm3 (weight and bias) -> the cross-attention q, scale from the statistics kernel and from the pack."""
    seed = fresh_seed()
    ops = _ops()
    from h3_fused_nvfp4.layout import LayerNorm

    x = wan_rows(rows, cols, dtype, seed)
    weight, bias = _affine(cols, dtype, seed)
    poison = poisoned_stats(rows)
    norm, g = LayerNorm(weight, bias, EPS, poison.mean, poison.rstd), _scale_out()
    h = comfy_layer_norm(cols, dtype, weight, bias)(x)
    ops.layer_norm_statistics(x, norm, global_scale_out=g)
    assert_same_pack(fused_pack(x, layer_norm=norm, global_scale=g), *comfy_pack(h), f"affine, statistics {seed}")
    assert_same_pack(fused_pack(x, layer_norm=norm), *comfy_pack(h), f"affine, pack's own scale {seed}")


@DTYPES
def test_layer_norm_pack_with_nan_inf_and_overflow(dtype):
    """NaN and inf rows (their statistics NaN, as torch's) and a modulation whose products overflow to inf: static
    scale (ComfyUI's dynamic scale would be NaN for every row)."""
    seed = fresh_seed()
    probes = _probes()
    x = wan_rows(301, 5120, dtype, seed, finite=False)
    modulation, scale_rows, shift_rows = probes.probe_modulation("cuda", 5120, dtype, seed, extreme=True)
    modulation = type(modulation)(modulation.scale, modulation.shift,
                                  modulation.mod_index.repeat(9)[:301].contiguous())
    index = modulation.mod_index.long()
    h = torch.addcmul(modulation.shift[index], comfy_layer_norm(5120, dtype)(x), 1 + modulation.scale[index])
    assert not torch.isfinite(h.float()).all()
    norm = poisoned_stats(301)
    _ops().layer_norm_statistics(x, norm)
    scale = torch.tensor([probes.STATIC], device="cuda")
    assert_same_pack(fused_pack(x, layer_norm=norm, addcmul_modulation=modulation, static_scale=scale),
                     *comfy_pack(h, scale), f"{dtype} NaN / inf / overflow seed {seed}")


# ---- residuals with the next norm's statistics ------------------------------------------------------------------

@DTYPES
@pytest.mark.parametrize("residual", ["gated", "add"])
@pytest.mark.parametrize("amax", ["none", "modulated", "affine"])
@pytest.mark.parametrize("rows,cols,in_place", [(WAN14_ROWS, 5120, True), (4099, 3072, False), (37, 1040, True)])
def test_residual_layer_norm(dtype, residual, amax, rows, cols, in_place):
    """x = addcmul(x, y, gate[m]) (after attention and ffn) or x + y (after the cross-attention), with the next norm's
    statistics and the next projection's amax, in place or into a poisoned buffer; then the pack."""
    seed = fresh_seed()
    ops = _ops()
    from h3_fused_nvfp4.layout import LayerNorm

    x = wan_rows(rows, cols, dtype, seed, big=1.5e4 if dtype == F16 else None)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    y = (torch.randn((rows, cols), generator=gen, device="cuda") * 2).to(dtype)
    tables = modulation_tables(rows, cols, dtype, seed)
    gate, index = tables.e[2], tables.mod_index
    expected = torch.addcmul(x, y, gate[index.long()]) if residual == "gated" else x + y
    weight, bias = _affine(cols, dtype, seed) if amax == "affine" else (None, None)
    poison = poisoned_stats(rows)
    norm = LayerNorm(weight, bias, EPS, poison.mean, poison.rstd)
    modulation = tables.modulation(3, 4) if amax == "modulated" else None
    g = _scale_out() if amax != "none" else None
    out = None if in_place else torch.full_like(x, float("nan")).view(torch.int16).fill_(POISON).view(dtype)
    source = x.clone()
    result = ops.residual_layer_norm_(source, y, norm, gate=gate if residual == "gated" else None,
                                      mod_index=index if residual == "gated" else None, out=out,
                                      next_modulation=modulation, global_scale_out=g)
    label = f"{dtype} {residual} residual, {amax} amax, [{rows}, {cols}] seed {seed}"
    assert result is (source if in_place else out)
    assert_bit_identical(result, expected, label)
    if not in_place:
        assert_bit_identical(source, x, f"{label}: x left as it was")
    assert_stats(norm, expected, label)
    if amax == "modulated":
        h = torch.addcmul(tables.e[3][index.long()], comfy_layer_norm(cols, dtype)(expected),
                          1 + tables.e[4][index.long()])
        assert_same_pack(fused_pack(result, layer_norm=norm, addcmul_modulation=modulation, global_scale=g),
                         *comfy_pack(h), label)
    elif amax == "affine":
        h = comfy_layer_norm(cols, dtype, weight, bias)(expected)
        assert_same_pack(fused_pack(result, layer_norm=norm, global_scale=g), *comfy_pack(h), label)


# ---- q / k: RMSNorm over the full width + interleaved RoPE -----------------------------------------------------

def wan_rope(positions_grid, head_dim: int, dtype):
    """ComfyUI's rope table of a latent grid, as WanModel.rope_encode makes it (EmbedND with Wan's axes): fp32
    [1, S, 1, head_dim / 2, 2, 2]."""
    import comfy.ldm.flux.layers

    t, h, w = positions_grid
    d = head_dim
    embed = comfy.ldm.flux.layers.EmbedND(dim=d, theta=10000.0, axes_dim=[d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
    ids = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    return embed(ids.reshape(1, -1, 3).to(dtype).cuda()).movedim(1, 2)


@DTYPES
@pytest.mark.parametrize("heads,grid,batch,rope", [(40, (21, 30, 52), 1, "wan"), (24, (3, 44, 80), 1, "wan"),
                                                    (40, (2, 5, 7), 2, "wan"), (8, (1, 3, 13), 2, "hard"),
                                                    (1, (1, 1, 37), 1, "hard")])
def test_rms_norm_rope_matches_comfyui(dtype, heads, grid, batch, rope):
    """q and k of Wan's self-attention: ComfyUI's RMSNorm over the full width, then its apply_rope1; and the
    RMSNorm alone (the cross-attention q)."""
    import comfy.ldm.flux.math

    seed = fresh_seed()
    ops, probes = _ops(), _probes()
    positions = grid[0] * grid[1] * grid[2]
    cols, rows = 128 * heads, batch * positions
    q, k = wan_rows(rows, cols, dtype, seed), wan_rows(rows, cols, dtype, seed + 1)
    qw, _ = _affine(cols, dtype, seed + 2)
    kw, _ = _affine(cols, dtype, seed + 3)
    freqs = wan_rope(grid, 128, dtype) if rope == "wan" else \
        probes.rope_table(positions, 128, seed, "cuda").unsqueeze(1).unsqueeze(0)
    expected = []
    for x, w in ((q, qw), (k, kw)):
        n = probes.comfy_rms_norm(cols, dtype, w)(x)
        rotated = comfy.ldm.flux.math.apply_rope1(n.view(batch, positions, heads, 128), freqs)
        expected.append(rotated.reshape(rows, cols))
    fq, fk = q.clone(), k.clone()
    table = freqs[0, :, 0].contiguous()
    assert ops.rms_norm_rope_support(fq, fk, qw, kw, freqs=table, positions=positions) is None
    ops.rms_norm_rope_(fq, fk, qw, kw, EPS, freqs=table, positions=positions)
    label = f"{dtype} {heads} heads, {rows} rows, {rope} rope, seed {seed}"
    assert_bit_identical(fq, expected[0], f"q {label}")
    assert_bit_identical(fk, expected[1], f"k {label}")
    fq = q.clone()
    ops.rms_norm_rope_(fq, None, qw, None, EPS)
    assert_bit_identical(fq, probes.comfy_rms_norm(cols, dtype, qw)(q), f"q, RMSNorm only, {label}")


def test_rms_norm_rope_refuses_what_it_cannot_read():
    ops = _ops()
    q = torch.zeros((64, 1024 + 8), dtype=F16, device="cuda")
    w = torch.ones(1024, dtype=F16, device="cuda")
    table = torch.zeros((64, 64, 2, 2), device="cuda")
    assert "aligned" in ops.rms_norm_rope_support(q[:, 4:1028], None, w, None)
    assert "whole batch items" in ops.rms_norm_rope_support(q[:, :1024], q[:, :1024], w, w, freqs=table, positions=7)
    assert "fp32" in ops.rms_norm_rope_support(q[:, :1024], None, w, None, freqs=table.half(), positions=64)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.rms_norm_rope_(torch.zeros((4, 1000), dtype=F16, device="cuda"), None, w[:1000], None, EPS)


# ---- GELU in ffn.2's pack ---------------------------------------------------------------------------------------

@DTYPES
@pytest.mark.parametrize("lookup", ["table", "global"])
def test_gelu_pack_every_bit_pattern(dtype, lookup, monkeypatch):
    from h3_fused_nvfp4 import comfy_adapter

    ops = _ops()
    monkeypatch.setattr(ops, "GELU_LOOKUP", lookup)
    bits = torch.arange(65536, dtype=torch.int32, device="cuda")
    every = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(dtype).reshape(-1, 256)
    h = comfy_adapter.eager_gelu_tanh(every)
    for static in (1.0, 0.5, 1e-3):
        scale = torch.tensor([static], device="cuda")
        assert_same_pack(fused_pack(every, gelu=True, static_scale=scale), *comfy_pack(h, scale),
                         f"{dtype} every pattern, {lookup}, static {static}")
    finite = every[torch.isfinite(h.float()).all(dim=1)]
    assert_same_pack(fused_pack(finite, gelu=True), *comfy_pack(comfy_adapter.eager_gelu_tanh(finite)),
                     f"{dtype} finite rows, {lookup}, dynamic")


@DTYPES
@pytest.mark.parametrize("lookup", ["table", "global"])
@pytest.mark.parametrize("rows,cols", [(WAN14_ROWS, 13824), (4099, 14336), (37, 1040)])
def test_gelu_pack_ffn(dtype, lookup, rows, cols, monkeypatch):
    """ffn.0's output -> ffn.2 at Wan 2.2 14B's and 5B's FFN widths: the scale from the pack's reduction."""
    from h3_fused_nvfp4 import comfy_adapter

    seed = fresh_seed()
    ops = _ops()
    monkeypatch.setattr(ops, "GELU_LOOKUP", lookup)
    f = wan_rows(rows, cols, dtype, seed)
    h = comfy_adapter.eager_gelu_tanh(f)
    assert_same_pack(fused_pack(f, gelu=True), *comfy_pack(h), f"{dtype} GELU [{rows}, {cols}] {lookup} seed {seed}")


# ---- the probes, planted faults -------------------------------------------------------------------------------

def test_wan_probes_pass_on_the_gpu():
    from h3_fused_nvfp4.core import verdicts

    probes = _probes()
    device = torch.device("cuda", 0)
    results = verdicts.run_probes(_ops(), device, (probes.WAN_PROBES,))
    failed = {n: r.detail for n, r in results.items() if r.ok is not True}
    assert not failed, failed


def test_planted_wrong_kernels_fail(monkeypatch, tmp_path):
    """NVFP4_PLANT_FAULT builds a wrong version of every new kernel: 16-bit results rounded toward zero (residuals,
    RMSNorm + RoPE, the LayerNorm packs), torch's warps combined in another order (the statistics), the neighbouring
    GELU entry (the GELU packs). Each Wan probe fails, and each kernel's own output differs from ComfyUI's."""
    from h3_fused_nvfp4 import comfy_adapter
    from h3_fused_nvfp4.core import verdicts
    from h3_fused_nvfp4.layout import LayerNorm

    ops, probes = _ops(), _probes()
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ops, "EXTRA_DEFINES", (("NVFP4_PLANT_FAULT", 1),))
    results = verdicts.run_probes(ops, torch.device("cuda", 0), (probes.WAN_PROBES,))
    for name in probes.WAN_PROBES.probes:
        assert results[name].ok is False and "differs at index" in results[name].detail, (name, results[name])
    x = wan_rows(4099, 5120, F16, 1)
    y = wan_rows(4099, 5120, F16, 2)
    tables = modulation_tables(4099, 5120, F16, 3)
    weight, bias = _affine(5120, F16, 4)
    for residual in ("none", "gated", "add"):
        for amax in ("none", "modulated", "affine"):
            poison = poisoned_stats(4099)
            norm = LayerNorm(weight, bias, EPS, poison.mean, poison.rstd) if amax == "affine" else poison
            modulation = tables.modulation(0, 1) if amax == "modulated" else None
            g = _scale_out() if amax != "none" else None
            source = x.clone()
            if residual == "none":
                ops.layer_norm_statistics(source, norm, modulation=modulation, global_scale_out=g)
            else:
                gated = residual == "gated"
                ops.residual_layer_norm_(source, y, norm, gate=tables.e[2] if gated else None,
                                         mod_index=tables.mod_index if gated else None, next_modulation=modulation,
                                         global_scale_out=g)
            mean, rstd = torch_stats(source)
            assert not torch.equal(norm.rstd.view(torch.int32), rstd.view(torch.int32)) or \
                not torch.equal(norm.mean.view(torch.int32), mean.view(torch.int32)), (residual, amax)
    f = wan_rows(301, 13824, F16, 5)
    h = comfy_adapter.eager_gelu_tanh(f)
    for lookup in ("table", "global"):
        monkeypatch.setattr(ops, "GELU_LOOKUP", lookup)
        q, s, _ = comfy_pack(h, torch.tensor([1.0], device="cuda"))
        packed = fused_pack(f, gelu=True, static_scale=torch.tensor([1.0], device="cuda"))
        assert not torch.equal(packed.qdata, q), lookup
    q = x[:64].clone()
    ops.rms_norm_rope_(q, None, weight, None, EPS)
    assert not torch.equal(q.view(torch.int16), probes.comfy_rms_norm(5120, F16, weight)(x[:64]).view(torch.int16))


# ---- the block specification at full width ----------------------------------------------------------------------

@pytest.mark.parametrize("model", ["wan22_14b_fp16", "wan22_5b_fp16", "wan22_14b_bf16"])
def test_block_specification_at_full_width(model):
    """Two of ComfyUI's real WanAttentionBlocks at the official widths (NVFP4 weights from ComfyUI's quantizer, its
    GEMM emulated on GPUs without FP4 tensor cores, in both arms) against the specification run with the kernels:
    every block output bit-identical. Wan 2.2 14B at 832x480, 81 frames (32,760 tokens; bf16 at a smaller grid), the
    5B at 1280x704, 121 frames (27,280 tokens) with a timestep per latent frame."""
    from wan_block_spec import block_inputs, make_blocks, spec_outputs, stock_outputs

    dim, ffn, heads, grid, frames_e, dtype = {
        "wan22_14b_fp16": (5120, 13824, 40, (21, 30, 52), 1, F16),
        "wan22_5b_fp16": (3072, 14336, 24, (31, 22, 40), 31, F16),
        "wan22_14b_bf16": (5120, 13824, 40, (5, 30, 52), 1, BF16),
    }[model]
    seed = fresh_seed()
    blocks = make_blocks(dtype, dim=dim, ffn=ffn, heads=heads, count=2, seed=seed, device="cuda")
    inputs = block_inputs(dtype, dim=dim, heads=heads, grid=grid, batch=1, frames_e=frames_e, text=512, seed=seed,
                          device="cuda")
    with torch.inference_mode():
        stock_outputs(blocks, inputs)  # the first emulated GEMM of a process can differ: both arms warm first
        spec_outputs(blocks, inputs, _ops())
        stock = stock_outputs(blocks, inputs)
        fused = spec_outputs(blocks, inputs, _ops())
    for i, (a, b) in enumerate(zip(fused, stock)):
        assert torch.isfinite(b.float()).all(), f"{model} block {i}: ComfyUI's output is not finite"
        assert_bit_identical(a, b, f"{model} block {i}, seed {seed}")
