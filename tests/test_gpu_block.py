"""Full-width H3 block on the GPU: the fused path is bit-identical to ComfyUI's stock block (mirror).

37,810 tokens laid out as 100 text + 414 audio + 37,296 video rows with distinct modulation per segment, NVFP4
compute forced on (below sm_100 both arms emulate the FP4 GEMM the same way).
"""

import logging

import pytest
import torch

from conftest import requires_cuda

pytestmark = requires_cuda

# comfy-kitchen logs a warning per call when the FP4 GEMM is unavailable (sm_90) and it dequantizes instead.
logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)


def _halving_override(func, *args, **kwargs):
    """Another pack's optimized_attention_override: it must run in both arms."""
    return func(*args, **kwargs) * 0.5


@pytest.mark.parametrize(
    "static_layers,per_token_video,override",
    [((), False, False), (("attn.qkv_proj", "mlp.fc2"), False, False), ((), True, False), ((), False, True)],
    ids=["dynamic", "static-mix", "per-token-rows", "attention-override"],
)
def test_full_width_block_bit_identical(static_layers, per_token_video, override):
    import h3_mirror as mirror
    from test_fused_block_cpu import assert_bit_identical, object_patches

    from h3_fused_nvfp4.integration import patch

    seed = torch.seed() % 2**31
    block = mirror.make_block(mirror.H3_HIDDEN, mirror.H3_HEADS, mirror.H3_HEAD_DIM, mirror.H3_FFN, mirror.H3_T_DIM,
                              seed=seed, device="cuda", static_scale_layers=static_layers)
    x, t_emb, segments, rope = mirror.make_inputs(
        100, 414, 37296, seed=seed + 1, device="cuda", hidden=mirror.H3_HIDDEN, head_dim=mirror.H3_HEAD_DIM,
        t_dim=mirror.H3_T_DIM, n_timesteps=2, per_token_video=per_token_video)
    assert x.shape[0] == 37810

    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([block])
    patches, report = patch.build_patches(holder, "block")
    assert report.applied and len(report.layers) == 4
    options = {"optimized_attention_override": _halving_override} if override else {}
    with torch.inference_mode():
        stock = block(x.clone(), t_emb, segments, rope, transformer_options=dict(options))
        with object_patches(holder, patches):
            fused = block(x.clone(), t_emb, segments, rope, transformer_options=dict(options))
    assert_bit_identical(fused, stock, f"full width {static_layers} per-token {per_token_video} seed {seed}")
    linears = [v for v in patches.values() if type(v).__name__ == "FusedNVFP4Linear"]
    assert all(v.calls_fused == 1 and v.calls_stock == 0 for v in linears), [(v.name, v._logged) for v in linears]


def _sageattention_or_skip():
    try:
        import sageattention  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"SageAttention is not installed ({exc}); benchmarks/build_sageattention.sh builds it")


def test_sage_token_major_call_matches_stock_head_major_call():
    """SageAttention gives the same bits from token-major (NHD) views as from stock's head-major (HND) views of
    the qkv buffer at H3's full size, so the fused block may call it copy-free."""
    _sageattention_or_skip()
    import h3_mirror as mirror

    s, heads, dim = 37810, mirror.H3_HEADS, mirror.H3_HEAD_DIM
    qkv = (torch.randn(s, 3 * heads * dim, device="cuda") * 2).to(torch.bfloat16)
    q, k, v = qkv.split(heads * dim, dim=-1)
    head_major = [t.view(s, heads, dim).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    token_major = [t.view(1, s, heads * dim) for t in (q, k, v)]
    stock = mirror.sage_attention(*head_major, heads, skip_reshape=True)
    fused = mirror.sage_attention(*token_major, heads, skip_reshape=False)
    assert fused.shape == stock.shape == (1, s, heads * dim)
    assert fused.is_contiguous()  # the NHD output is out_proj's input as is: no copy in ComfyUI's wrapper
    diff = (fused.view(torch.int16) != stock.view(torch.int16)).sum().item()
    assert diff == 0, f"{diff} elements differ between SageAttention's NHD and HND paths"


def test_full_width_block_bit_identical_with_sage_attention(monkeypatch):
    """``--use-sage-attention``: stock runs SageAttention's HND path, the fused block its NHD path."""
    _sageattention_or_skip()
    import h3_mirror as mirror
    from test_fused_block_cpu import assert_bit_identical, object_patches

    from h3_fused_nvfp4.integration import patch

    monkeypatch.setitem(mirror.GLOBAL_ATTENTION, "function", mirror.sage_attention)
    seed = torch.seed() % 2**31
    block = mirror.make_block(mirror.H3_HIDDEN, mirror.H3_HEADS, mirror.H3_HEAD_DIM, mirror.H3_FFN, mirror.H3_T_DIM,
                              seed=seed, device="cuda")
    x, t_emb, segments, rope = mirror.make_inputs(
        100, 414, 37296, seed=seed + 1, device="cuda", hidden=mirror.H3_HIDDEN, head_dim=mirror.H3_HEAD_DIM,
        t_dim=mirror.H3_T_DIM, n_timesteps=2)
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([block])
    patches, _ = patch.build_patches(holder, "block")
    with torch.inference_mode():
        stock = block(x.clone(), t_emb, segments, rope, transformer_options={})
        with object_patches(holder, patches):
            fused = block(x.clone(), t_emb, segments, rope, transformer_options={})
    assert_bit_identical(fused, stock, f"sage attention, seed {seed}")
