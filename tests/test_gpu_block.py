"""ComfyUI's real MiniMax H3 DiTBlock at full width on the GPU (37,810 tokens of the 1344x768, 124-frame layout:
100 text rows in tag runs + 414 audio + 37,296 video), stock vs fused: equal bytes in every variant.

Three consecutive blocks, so the hand-over of norm statistics from block to block is exercised. NVFP4 compute is
forced on (below sm_100 both arms emulate the FP4 GEMM the same way). Both arms are warmed before comparing: on the
H200 the very first stock call of a process gives other bits inside ComfyUI's emulated GEMM path.
"""

import pytest
import torch
from conftest import requires_cuda
from parity import assert_bit_identical, fresh_seed
from test_h3_block_cpu import (
    assert_block_check_passes,
    assert_fully_fused,
    fused,
    linears,
    recorded_both_ways,
    run_blocks,
)

from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui")]

VARIANTS = {
    "dynamic": dict(),
    "static-mix": dict(static_layers=("attn.qkv_proj", "mlp.fc2")),
    "all-static": dict(static_layers=syn.LINEAR_PATHS),
    "curve-form": dict(curve=True),
    "gate-compress": dict(gate_compress=True),
}


def _blocks(seed, n=3, **options):
    return [syn.make_dit_block(syn.H3_FULL, seed=seed + i, device="cuda", **options) for i in range(n)]


def _inputs(seed, **kwargs):
    return syn.make_block_inputs(syn.H3_FULL, syn.FULL_TOKENS, seed=seed, device="cuda", **kwargs)


def _warm_stock(blocks, inputs, options=None):
    run_blocks(blocks, inputs, options)
    return run_blocks(blocks, inputs, options)


@pytest.mark.parametrize("per_token", [False, True], ids=["segment-rows", "per-token-rows"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_width_blocks_bit_identical(variant, per_token):
    seed = fresh_seed()
    options = VARIANTS[variant]
    blocks = _blocks(seed, **options)
    inputs = _inputs(seed + 9, per_token_video=per_token, curve=options.get("curve", False))
    assert inputs[0].shape[0] == 37810
    stock = _warm_stock(blocks, inputs)
    with fused(blocks) as patches:
        run_blocks(blocks, inputs)
        result = run_blocks(blocks, inputs)
    assert_bit_identical(result, stock, f"{variant}, per-token rows {per_token}, seed {seed}")
    assert_fully_fused(patches, len(blocks), calls=2, rope=True)


def _halving_override(func, *args, **kwargs):
    return func(*args, **kwargs) * 0.5


def test_attention_override_full_width():
    seed = fresh_seed()
    blocks = _blocks(seed, n=2)
    inputs = _inputs(seed + 1)
    options = {"optimized_attention_override": _halving_override}
    stock = _warm_stock(blocks, inputs, options)
    with fused(blocks) as patches:
        run_blocks(blocks, inputs, options)
        assert_bit_identical(run_blocks(blocks, inputs, options), stock, f"override seed {seed}")
    assert_fully_fused(patches, len(blocks), calls=2, handoff=False)  # the override gets the stock attention call


def test_block_check_on_the_gpu():
    seed = fresh_seed()
    blocks = _blocks(seed, n=2)
    inputs = _inputs(seed + 2)
    assert_block_check_passes(blocks, inputs, _warm_stock(blocks, inputs))


def test_cuda_graph_capture_and_replay():
    """ComfyUI can capture blocks in CUDA graphs: the fused blocks capture (no host sync, no stray allocation
    outside the graph's pool) and a replay on new input data gives the stock bits."""
    seed = fresh_seed()
    blocks = _blocks(seed, n=2)
    inputs = _inputs(seed + 3)
    x, t_emb, segments, rope = inputs
    with fused(blocks) as patches:
        run_blocks(blocks, inputs)  # warm: kernels built, buffers allocated
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for i, b in enumerate(blocks):  # a warm-up on the capture stream, as torch recommends
                b(static_x.clone(), t_emb, segments, rope, transformer_options={"block_index": i})
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                h = static_x
                for i, b in enumerate(blocks):
                    h = b(h, t_emb, segments, rope, transformer_options={"block_index": i})
        torch.cuda.current_stream().wait_stream(stream)
        # the warm-up, the capture-stream warm-up (one block at a time: no hand-over) and the capture ran fused
        assert [patches[f"blocks.{i}.forward"].counts["residual"] for i in range(2)] == [6, 6]
        assert all(v.calls_fused == 3 and v.calls_stock == 0 for v in linears(patches))
        new_x = (torch.randn_like(x.float()) * 1.5).to(torch.bfloat16)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        replayed = h.clone()
    stock = _warm_stock(blocks, (new_x, t_emb, segments, rope))
    assert_bit_identical(replayed, stock, f"CUDA graph replay, seed {seed}")


def test_no_host_sync_in_the_fused_blocks():
    """After the first call (kernels built, buffers made), a fused forward never waits for the GPU."""
    seed = fresh_seed()
    blocks = _blocks(seed, n=2)
    inputs = _inputs(seed + 4)
    with fused(blocks) as patches:
        run_blocks(blocks, inputs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_blocks(blocks, inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert_fully_fused(patches, len(blocks), calls=2, rope=True)


def test_calibration_records_the_same_amax_on_both_paths():
    """The recorder of a fused layer (the amax of the input ComfyUI would build) equals the one of the stock layer."""
    seed = fresh_seed()
    a, b = recorded_both_ways(_blocks(seed, n=2), _inputs(seed + 5))
    assert all(a[n]["amax"] == b[n]["amax"] > 0 and a[n]["calls"] == b[n]["calls"] == 1 for n in a), (a, b)
