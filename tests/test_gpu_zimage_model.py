"""ComfyUI's real Z-Image model at Z-Image Turbo's widths on the GPU (``NextDiT``: 3840 wide, 30 heads x 128, FFN
10240; 2 layers + 2 noise-refiner + 2 context-refiner blocks; 1024x1024, 256 caption tokens: 4352 rows in the
layers), stock vs the Patch node's fused clone, bit for bit.

A random-weight NVFP4 checkpoint (tools/families.py, ComfyUI's own quantizer) loaded by ComfyUI's loader with NVFP4
compute forced on (below sm_100 both arms emulate the FP4 GEMM the same way). The stock arm warms first (on the H200
the very first emulated GEMM call of a process can give other bits); the fused clone's FIRST forward is compared.
``H3_FUSED_NVFP4_EMULATE_BLACKWELL=1`` runs the same on the Blackwell code path (benchmarks/gpu_run.sh, step
``emulated``).
"""

from __future__ import annotations

import logging

import pytest
import torch
import zimage_model as zm
from conftest import requires_cuda
from parity import assert_bit_identical, differing, fresh_seed

from h3_fused_nvfp4.core import verdicts

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui", "clean_models")]

SIGMAS = (0.7, 0.3)
TEXT_TOKENS = 256


@pytest.fixture(autouse=True)
def zimage_env(force_nvfp4_compute, monkeypatch):
    """bf16 NVFP4 compute; the self-check's probes skipped unless a test forces them (they have their own tests in
    tests/test_gpu_zimage_kernels.py), so no block verdict of these tests is stored."""
    monkeypatch.setenv(verdicts.SELFCHECK_ENV, "skip")
    verdicts.forget_verdicts()
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)
    yield
    verdicts.forget_verdicts()


def _model(seed, **kwargs):
    return zm.build(width="full", layers=2, seed=seed, device="cuda", **kwargs)


def _calls(patcher, seed, batch=1, reference=False):
    return [zm.inputs(patcher, sigmas=(SIGMAS[i], SIGMAS[1 - i])[:batch], width="full", text_tokens=TEXT_TOKENS,
                      reference=reference, seed=seed, device="cuda") for i in range(2)]


def _stock(patcher, calls, options=None):
    zm.forward(patcher, calls[0], options)  # warm: the first emulated GEMM of a process
    return [zm.forward(patcher, c, options) for c in calls]


STATIC = {f"{chain}.{i}.{path}": 3.0 / 2688 for chain in zm.CHAINS for i in range(2)
          for path in ("attention.qkv", "feed_forward.w2")}


@pytest.mark.parametrize("batch,reference,static", [(1, False, False), (2, False, False), (1, True, False),
                                                    (1, False, True)],
                         ids=["batch1", "batch2", "reference", "static-mix"])
def test_full_width_model_bit_identical_and_fully_fused(batch, reference, static):
    seed = fresh_seed()
    patcher = _model(seed, static=STATIC if static else None)
    calls = _calls(patcher, seed + 1, batch, reference)
    assert calls[0].args[0].shape[-2:] == (128, 128)
    stock = _stock(patcher, calls)
    clone, _ = zm.fused(patcher)
    got = [zm.forward(clone, c) for c in calls]
    assert [differing(g, s) for g, s in zip(got, stock)] == [0, 0], f"seed {seed}"
    zm.assert_fully_fused(clone, forwards=2)


def _halving_override(func, *args, **kwargs):
    return func(*args, **kwargs) * 0.5


def test_attention_override_full_width():
    seed = fresh_seed()
    patcher = _model(seed)
    calls = _calls(patcher, seed + 1)
    options = {"optimized_attention_override": _halving_override}
    stock = _stock(patcher, calls, options)
    clone, _ = zm.fused(patcher)
    assert [differing(zm.forward(clone, c, options), s) for c, s in zip(calls, stock)] == [0, 0], f"seed {seed}"
    zm.assert_fully_fused(clone, forwards=2)


def test_self_check_and_block_check_as_users_get_them(selfcheck_forced):
    """The Patch node's path with the self-check run (no cached verdict) and the block check at the first forward:
    every probe passes, both kinds of block pass the check, the first forward returns ComfyUI's result and the next
    one is fused, bit-identical."""
    seed = fresh_seed()
    patcher = _model(seed)
    calls = _calls(patcher, seed + 1, reference=True)
    stock = _stock(patcher, calls)
    clone, report = zm.fused(patcher, block_check="pending")
    assert "self-check passed" in report.summary(), report.summary()
    first, second = (zm.forward(clone, c) for c in calls)
    assert [s.block_check for s in zm.states(clone)] == ["passed", "passed"], [
        s.block_check_detail for s in zm.states(clone)]
    assert_bit_identical(first, stock[0], f"the checking forward, seed {seed}")
    assert_bit_identical(second, stock[1], f"after the check, seed {seed}")


def _layers(clone_or_patcher, x, freqs, adaln):
    """NextDiT's layer loop on ``x`` (the model loaded)."""
    h = x
    for i, layer in enumerate(clone_or_patcher.model.diffusion_model.layers):
        h = layer(h, None, freqs, adaln, transformer_options={"block_index": i})
    return h


def _layer_inputs(seed):
    from zimage_block import FULL, make_inputs

    return make_inputs(FULL, 1, 4352, seed=seed, device="cuda")


def test_no_host_sync_in_the_fused_layers():
    """After the first call (buffers made, the row index built), the fused layers never wait for the GPU."""
    import comfy.model_management as mm

    seed = fresh_seed()
    patcher = _model(seed)
    inputs = _layer_inputs(seed + 1)
    clone, _ = zm.fused(patcher)
    mm.load_models_gpu([clone])
    with torch.inference_mode():
        _layers(clone, inputs.x, inputs.freqs_cis, inputs.adaln_input)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _layers(clone, inputs.x, inputs.freqs_cis, inputs.adaln_input)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts = {n: b.counts for n, b in zm.blocks(clone).items() if n.startswith("layers")}
    assert [c["fused"] for c in counts.values()] == [2, 2] and counts["layers.1"]["handoff_in"] == 2


def test_cuda_graph_capture_and_replay_of_the_layers():
    """The fused layers capture in a CUDA graph (no host sync, nothing allocated outside the graph's pool) and a
    replay on new input data gives ComfyUI's bits."""
    import comfy.model_management as mm

    seed = fresh_seed()
    patcher = _model(seed)
    inputs = _layer_inputs(seed + 1)
    freqs, adaln = inputs.freqs_cis, inputs.adaln_input
    new_x = (torch.randn_like(inputs.x.float()) * 1.5).to(torch.bfloat16)
    mm.load_models_gpu([patcher])
    with torch.inference_mode():
        _layers(patcher, new_x, freqs, adaln)
        stock = _layers(patcher, new_x, freqs, adaln).clone()
    clone, _ = zm.fused(patcher)
    mm.load_models_gpu([clone])
    with torch.inference_mode():
        static_x = inputs.x.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _layers(clone, static_x, freqs, adaln)  # a warm-up on the capture stream, as torch recommends
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                out = _layers(clone, static_x, freqs, adaln)
        torch.cuda.current_stream().wait_stream(stream)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
    assert_bit_identical(out, stock, f"CUDA graph replay, seed {seed}")
    counts = zm.blocks(clone)["layers.1"].counts
    assert counts["fused"] == 2 and counts["handoff_in"] == 2  # the warm-up and the capture, handed over
