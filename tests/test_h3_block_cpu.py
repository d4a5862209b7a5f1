"""ComfyUI's real MiniMax H3 ``DiTBlock`` (comfy/ldm/minimax/model.py with ``comfy.ops.mixed_precision_ops``,
NVFP4 weights from ComfyUI's own ``QuantizedTensor.from_float``) against the fused block, on the CPU.

Off the GPU the fused path runs kernels/twin_ops.py, the Python twin of the kernels: these tests prove that the
fused block's wiring (normalized and modulated sources, the residual's statistics for the next projection, the
hand-over between blocks, the fallbacks) computes ComfyUI's block bit for bit, in every H3 variant. They run
with the block self-check switched off, so a change of ComfyUI's block (say, shift applied before scale) makes
them fail instead of being caught and routed around at run time.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from parity import assert_bit_identical, fresh_seed

from h3_fused_nvfp4.core import calibration as calibrate
from h3_fused_nvfp4.core.patching import SCOPES
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")

# 19 text rows in tag runs + 46 audio + 245 video = 310 rows: not a multiple of 16 or 128.
TOKENS = (19, 46, 245)


@contextlib.contextmanager
def fused(blocks, scope="block", block_check=False):
    """Patch ``blocks`` the way ComfyUI does (a ModelPatcher's object patches, applied and removed)."""
    patcher, patches = syn.fused_patcher(blocks, scope, block_check="pending" if block_check else "passed")
    patcher.patch_model(load_weights=False)
    try:
        yield patches
    finally:
        patcher.unpatch_model()


def run_blocks(blocks, inputs, transformer_options=None):
    x, t_emb, segments, rope = inputs
    h = x.clone()
    with torch.inference_mode():
        for i, block in enumerate(blocks):
            options = dict(transformer_options or {}, block_index=i)
            h = block(h, t_emb, segments, rope, transformer_options=options)
    return h


def linears(patches, prefix="blocks."):
    return [v for v in patches.values() if type(v).__name__ == "FusedNVFP4Linear" and v.name.startswith(prefix)]


def assert_fully_fused(patches, blocks: int, *, calls: int = 1, handoff: bool = True, rope: bool = False):
    """Every fusion of the block path ran in each of ``calls`` model calls: both norms folded, both residual
    kernels, the hand-over between neighbours (``handoff``), every NVFP4 Linear fused (``rope``: the RMSNorm + RoPE
    kernel too; off the GPU comfy-kitchen's op runs)."""
    for i in range(blocks):
        counts = patches[f"blocks.{i}.forward"].counts
        want = {"fused": calls, "norm1": calls, "norm2": calls, "residual": 2 * calls,
                "handoff_in": calls * (handoff and i > 0), "handoff_out": calls * (handoff and i < blocks - 1)}
        assert {k: counts[k] for k in want} == want, (i, dict(counts))
        if rope:
            assert patches[f"blocks.{i}.attn.forward"].counts["rms_rope"] == calls, i
    used = linears(patches)
    assert used and all(v.calls_fused == calls and v.calls_stock == 0 for v in used), [
        (v.name, v.calls_fused, v.calls_stock) for v in used]


VARIANTS = {
    "dynamic": dict(),
    "static-mix": dict(static_layers=("attn.out_proj", "mlp.fc1")),
    "all-static": dict(static_layers=syn.LINEAR_PATHS),
    "curve-form": dict(curve=True),
    "gate-compress": dict(gate_compress=True),
}


@pytest.mark.parametrize("per_token", [False, True], ids=["segment-rows", "per-token-rows"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_blocks_match_comfyui(variant, per_token):
    """Three consecutive real blocks (the hand-over of norm statistics from block to block included)."""
    seed = fresh_seed()
    options = VARIANTS[variant]
    blocks = [syn.make_dit_block(seed=seed + i, **options) for i in range(3)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 9, per_token_video=per_token,
                                   curve=options.get("curve", False))
    stock = run_blocks(blocks, inputs)
    with fused(blocks) as patches:
        result = run_blocks(blocks, inputs)
    assert_bit_identical(result, stock, f"{variant}, per-token rows {per_token}, seed {seed}")
    assert_fully_fused(patches, len(blocks))


def test_silu_of_t_emb_once_per_chain_of_blocks(monkeypatch):
    """ComfyUI's adaln_proj takes silu(t_emb) in every block; the fused chain takes it once (the hand-over carries it),
    still through each block's own AdalnProj.forward. A hook on one block's adaln_proj gets its call, and the rows
    stay ComfyUI's bit for bit."""
    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i) for i in range(3)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 7)
    t_emb = inputs[1]
    silu = torch.nn.functional.silu
    calls = []

    def counting_silu(x, *args, **kwargs):
        if x.shape == t_emb.shape:
            calls.append(x.data_ptr())
        return silu(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "silu", counting_silu)
    stock = run_blocks(blocks, inputs)
    assert len(calls) == 3
    calls.clear()
    with fused(blocks) as patches:
        result = run_blocks(blocks, inputs)
    assert_bit_identical(result, stock, f"silu once, seed {seed}")
    assert len(calls) == 1
    assert_fully_fused(patches, len(blocks))

    hooked = []
    handle = blocks[1].adaln_proj.register_forward_hook(lambda module, args, out: hooked.append(args[0].shape))
    try:
        calls.clear()
        with fused(blocks):
            result = run_blocks(blocks, inputs)
    finally:
        handle.remove()
    assert_bit_identical(result, stock, f"hook on block 1's adaln_proj, seed {seed}")
    assert hooked == [t_emb.shape] and len(calls) == 2  # block 0's silu, and block 1's own in its hooked forward


@pytest.mark.parametrize("scope", SCOPES)
def test_both_scopes_match(scope):
    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i, static_layers=("mlp.fc2",)) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 5)
    stock = run_blocks(blocks, inputs)
    with fused(blocks, scope):
        assert_bit_identical(run_blocks(blocks, inputs), stock, f"scope {scope}, seed {seed}")


def test_scope_linears_replaces_only_each_linears_pack(monkeypatch):
    """scope "linears" does what the node says: each NVFP4 Linear's activation pack, nothing else. The MLP runs
    ComfyUI's own SwiGLU and fc2 packs its output (a plain source); the same bytes as stock."""
    from h3_fused_nvfp4.kernels import twin_ops

    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 5)
    stock = run_blocks(blocks, inputs)
    sources, real = [], twin_ops.pack_nvfp4
    monkeypatch.setattr(twin_ops, "pack_nvfp4", lambda x, **kw: (sources.append(
        "swiglu" if kw.get("swiglu") else "norm" if kw.get("norm") else "modulate" if kw.get("modulation") else
        "plain"), real(x, **kw))[1])
    with fused(blocks, "linears") as patches:
        assert {type(p).__name__ for p in patches.values()} == {"FusedNVFP4Linear"}, set(patches)
        assert_bit_identical(run_blocks(blocks, inputs), stock, f"scope linears, seed {seed}")
        assert all(v.calls_fused == 1 for v in linears(patches))
    assert sources == ["plain"] * 8, sources


def _halving_override(func, *args, **kwargs):
    """Another node's optimized_attention_override; the fused block must give it exactly the stock call."""
    return func(*args, **kwargs) * 0.5


def test_attention_override_of_another_node():
    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 3)
    options = {"optimized_attention_override": _halving_override}
    stock = run_blocks(blocks, inputs, options)
    with fused(blocks) as patches:
        assert_bit_identical(run_blocks(blocks, inputs, options), stock, f"override, seed {seed}")
    assert all(v.calls_fused == 1 for v in linears(patches))


def test_attention_argument_of_a_block_patch():
    """A block-replace patch passing its own ``attention`` (ComfyUI's sparse-attention node does): the block
    materializes the modulated input for it, the rest stays fused."""
    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 4)
    x, t_emb, segments, rope = inputs
    calls = []

    def attention_of(block):
        def attention(h, rope_freqs=None, transformer_options={}):
            calls.append(h.shape)
            return type(block.attn).forward(block.attn, h, rope_freqs=rope_freqs,
                                            transformer_options=transformer_options)
        return attention

    def run():
        h = x.clone()
        with torch.inference_mode():
            for i, block in enumerate(blocks):
                h = block(h, t_emb, segments, rope, transformer_options={"block_index": i},
                          attention=attention_of(block))
        return h

    stock = run()
    with fused(blocks) as patches:
        result = run()
    assert_bit_identical(result, stock, f"attention argument, seed {seed}")
    assert len(calls) == 4
    assert all(v.calls_fused == 1 for v in linears(patches) if "qkv_proj" not in v.name)


def test_weight_function_on_one_layer_falls_back_exactly():
    """A LoRA-style weight function makes that layer take ComfyUI's path; the block stays bit-identical."""
    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 1)
    blocks[0].attn.qkv_proj.weight_function = [lambda w: w]
    stock = run_blocks(blocks, inputs)
    with fused(blocks) as patches:
        result = run_blocks(blocks, inputs)
    assert_bit_identical(result, stock, f"weight function, seed {seed}")
    qkv = patches["blocks.0.attn.qkv_proj.forward"]
    assert qkv.calls_fused == 0 and qkv.calls_stock == 1
    assert all(v.calls_fused == 1 for v in linears(patches) if v is not qkv)


def assert_block_check_passes(blocks, inputs, stock):
    """The first patched call runs both arms on its input, records a passing verdict and returns the stock result;
    the next call (fused) gives the same bits."""
    with fused(blocks, block_check=True) as patches:
        first = run_blocks(blocks, inputs)
        state = patches["blocks.0.forward"].state
        assert state.block_check == "passed", state.block_check_detail
        second = run_blocks(blocks, inputs)
    assert_bit_identical(first, stock, "the checking call")
    assert_bit_identical(second, stock, "after the check")


def test_block_check_passes_and_returns_the_stock_result():
    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 2)
    assert_block_check_passes(blocks, inputs, run_blocks(blocks, inputs))


def recorded_both_ways(blocks, inputs, block_check=False):
    """Calibration statistics of ``blocks`` on ``inputs``: recorded on ComfyUI's path, then on the fused path
    (``block_check``: the fused call is the one that runs the block self-check)."""
    stock_rec, fused_rec = calibrate.CalibrationRecorder(), calibrate.CalibrationRecorder()
    layers = [(f"blocks.{i}.{path}", b.get_submodule(path)) for i, b in enumerate(blocks) for path in syn.LINEAR_PATHS]
    for name, layer in layers:
        layer.forward = calibrate.RecordingForward(layer, name, stock_rec)
    try:
        run_blocks(blocks, inputs)
    finally:
        for _, layer in layers:
            del layer.__dict__["forward"]
    with fused(blocks, block_check=block_check) as patches:
        for v in linears(patches):
            v.recorder = fused_rec
        run_blocks(blocks, inputs)
        assert patches["blocks.0.forward"].state.block_check == "passed"
    a, b = stock_rec.statistics(), fused_rec.statistics()
    assert set(a) == set(b) == {name for name, _ in layers}
    return a, b


@pytest.mark.parametrize("block_check", [False, True], ids=["after-the-check", "on-the-checking-call"])
def test_calibration_records_the_stock_inputs(block_check):
    """A fused layer records the amax of the input ComfyUI builds for it, once per call, also on the call that
    runs the block self-check (the check's extra forwards do not count)."""
    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i) for i in range(2)]
    a, b = recorded_both_ways(blocks, syn.make_block_inputs(tokens=TOKENS, seed=seed + 5), block_check)
    assert all(a[n]["amax"] == b[n]["amax"] > 0 and a[n]["calls"] == b[n]["calls"] == 1 for n in a), (a, b)
