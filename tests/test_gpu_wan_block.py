"""ComfyUI's real Wan model at Wan 2.2 14B's full width (5120, FFN 13824, 40 heads of 128) with 2 blocks on the GPU,
stock vs the Patch node's fused clone (scope "block"), fp16 (ComfyUI's compute dtype for Wan on NVIDIA GPUs): the whole
diffusion model's output bit for bit at 832x480, 81 frames (32,760 tokens, not a multiple of 16 or 128), with the
fused CUDA kernels.

The model is a random-weight NVFP4 checkpoint built from ComfyUI's WanModel (tools/families.py) and loaded by ComfyUI's
loader; NVFP4 compute is forced on (below sm_100 both arms emulate the FP4 GEMM the same way). The stock arm is warmed
before its reference forwards: on the H200 the very first stock call of a process gives other bits inside ComfyUI's
emulated GEMM path. The first fused forward is compared too, the block check on the first block included.
benchmarks/gpu_run.sh runs this file in its ``tests`` step and, with H3_FUSED_NVFP4_EMULATE_BLACKWELL=1 (the
Blackwell code path), in ``emulated``.
"""

import contextlib

import pytest
import torch
from conftest import requires_cuda
from parity import assert_bit_identical, fresh_seed, selfcheck_mode
from test_wan_model_cpu import assert_fully_fused, forward, fused_blocks, fused_clone, inputs

from h3_fused_nvfp4.tools import comfy_env
from h3_fused_nvfp4.tools import families as fam

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui")]
SIZES = {"wan22_14b": (832, 480, 81), "wan22_5b": (1280, 704, 121)}  # 32,760 and 27,280 tokens
TEXT = 256


@contextlib.contextmanager
def loaded(name: str, dtype: str = "fp16", static: dict | None = None, seed: int = 0):
    """ComfyUI's ModelPatcher of a 2-block full-width checkpoint (weights drawn and quantized on the GPU)."""
    import comfy.model_management as mm
    import comfy.sd

    with pytest.MonkeyPatch.context() as mp, selfcheck_mode("skip"):
        comfy_env.force_nvfp4_compute(dtype, mp.setattr)
        sd, metadata = fam.family_state_dict(name, width="full", layers=2, seed=seed, device="cuda")
        for layer, scale in (static or {}).items():
            sd[f"{layer}.input_scale"] = torch.tensor(scale, dtype=torch.float32)
        patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
        del sd
        try:
            yield patcher
        finally:
            mm.unload_all_models()
            mm.soft_empty_cache()


def warm_stock(patcher, calls):
    forward(patcher, next(iter(calls.values())))  # ComfyUI's first emulated GEMM call of a process
    return {key: forward(patcher, call) for key, call in calls.items()}


def full_calls(patcher, name: str, seed: int, **kwargs):
    return {t: inputs(patcher, timesteps=(t,) * kwargs.get("batch", 1), size=SIZES[name], text=TEXT, seed=seed + i,
                      device="cuda", **kwargs) for i, t in enumerate((700.0, 300.0))}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_full_width_model_bit_identical_first_fused_forward_included(dtype):
    """Two sigmas, the first fused forward included (its first block runs the block check and returns ComfyUI's
    block; the second block runs fused); then a clone whose check has passed, every fusion counted."""
    seed = fresh_seed()
    with loaded("wan22_14b", dtype, seed=seed) as patcher:
        calls = full_calls(patcher, "wan22_14b", seed)
        stock = warm_stock(patcher, calls)
        clone, _ = fused_clone(patcher, block_check="pending")
        for t, call in calls.items():
            assert_bit_identical(forward(clone, call), stock[t], f"{dtype} t={t} (first fused forward), seed {seed}")
        state = fused_blocks(clone)[0].state
        assert state.block_check == "passed" and "4096 rows bit-identical" in state.block_check_detail, \
            state.block_check_detail
        clone, _ = fused_clone(patcher)
        for t, call in calls.items():
            assert_bit_identical(forward(clone, call), stock[t], f"{dtype} t={t}, seed {seed}")
        assert_fully_fused(clone, calls=2)


def test_full_width_static_scales():
    """A static ``input_scale`` on every NVFP4 Linear, one value for q / k / v (shared pack)."""
    seed = fresh_seed()
    paths = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
             "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")
    static = {f"blocks.{i}.{p}": 0.004 for i in range(2) for p in paths}
    with loaded("wan22_14b", static=static, seed=seed) as patcher:
        calls = full_calls(patcher, "wan22_14b", seed)
        stock = warm_stock(patcher, calls)
        clone, report = fused_clone(patcher)
        assert "0 dynamic-scale, 20 static input_scale" in report.summary(), report.summary()
        for t, call in calls.items():
            assert_bit_identical(forward(clone, call), stock[t], f"static t={t}, seed {seed}")
        assert_fully_fused(clone, calls=2)


def test_5b_frame_timesteps_batch_2():
    """Wan 2.2 5B at 1280x704, 121 frames (27,280 tokens): a timestep per latent frame (31 modulation rows per batch
    item, ComfyUI's repeat_e over uneven frames), cond and uncond in one batch."""
    seed = fresh_seed()
    with loaded("wan22_5b", seed=seed) as patcher:
        calls = full_calls(patcher, "wan22_5b", seed, batch=2, frames_t=True)
        stock = warm_stock(patcher, calls)
        clone, _ = fused_clone(patcher)
        for t, call in calls.items():
            assert_bit_identical(forward(clone, call), stock[t], f"5B frame timesteps t={t}, seed {seed}")
        assert_fully_fused(clone, calls=2)


def block_arguments(patcher, call) -> list[tuple]:
    """The (args, kwargs) each block of the model is called with in ``call``'s forward (recorded by a pre-hook)."""
    seen = []
    handles = [b.register_forward_pre_hook(lambda m, a, k: seen.append((a, dict(k))), with_kwargs=True)
               for b in patcher.model.diffusion_model.blocks]
    try:
        forward(patcher, call)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_cuda_graph_capture_and_replay_and_no_host_sync():
    """After a warm forward, the fused blocks never wait for the GPU, capture in a CUDA graph (no stray allocation
    outside its pool; the hand-over between the two blocks inside it), and a replay on new input data gives the
    stock bits."""
    import comfy.model_management as mm

    seed = fresh_seed()
    with loaded("wan22_14b", seed=seed) as patcher:
        call = full_calls(patcher, "wan22_14b", seed)[700.0]
        clone, _ = fused_clone(patcher)
        forward(clone, call)  # warm: kernels built, buffers allocated
        arguments = block_arguments(clone, call)
        x0 = arguments[0][0][0]
        kwargs = [dict(k, transformer_options={"block_index": i}) for i, (_, k) in enumerate(arguments)]
        blocks = clone.model.diffusion_model.blocks

        def run(x):
            with torch.inference_mode():
                for block, k in zip(blocks, kwargs):
                    x = block(x, **k)
            return x

        run(x0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(x0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        static_x = x0.clone()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(static_x)  # a warm-up on the capture stream, as torch recommends
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                captured = run(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        new_x = (torch.randn_like(x0.float()) * 1.5).to(x0.dtype)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        # the forward, the recorded one, two runs, the capture-stream warm-up, the capture: all fused, handed over
        counts = [b.counts for b in fused_blocks(clone).values()]
        assert [c["fused"] for c in counts] == [6, 6] and counts[0]["handoff_out"] == counts[1]["handoff_in"] == 6
        mm.load_models_gpu([patcher])  # ComfyUI's own blocks (the clone's patches come off)
        run(new_x)  # ComfyUI's first emulated GEMM call of a process can differ from its later ones
        assert_bit_identical(replayed, run(new_x), f"CUDA graph replay, seed {seed}")
