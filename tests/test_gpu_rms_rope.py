"""The fused per-head RMSNorm + RoPE kernel against comfy-kitchen's rms_rope_split_half_: equal bytes."""

import pytest
import torch
from conftest import requires_cuda
from parity import assert_bit_identical, fresh_seed

pytestmark = requires_cuda


def _views(qkv, heads=56, head_dim=128):
    s = qkv.shape[0]
    inner = heads * head_dim
    q = qkv[:, :inner].view(1, s, heads, head_dim)
    k = qkv[:, inner:2 * inner].view(1, s, heads, head_dim)
    return q, k


def _rope_table(s, rot=96):
    angles = torch.rand(s, rot // 2, device="cuda") * 100
    c, sn = torch.cos(angles), torch.sin(angles)
    return torch.stack([c, -sn, sn, c], dim=-1).reshape(1, s, 1, rot // 2, 2, 2).to(torch.bfloat16)


# H3 has 56 heads; 6 and 1 leave the last 4-head group of each token part empty (the kernel works in head quads),
# and 1 token / 3 tokens give fewer quads than the grid has warps.
@pytest.mark.parametrize("rows,heads,case", [(37810, 56, "random"), (301, 56, "random"), (64, 56, "zeros"),
                                             (64, 56, "specials"), (37, 6, "random"), (3, 1, "random"),
                                             (1, 56, "random")])
def test_matches_comfy_kitchen(rows, heads, case):
    import comfy_kitchen as ck

    from h3_fused_nvfp4.kernels import cuda_ops as ops

    seed = fresh_seed()
    inner = heads * 128
    qkv = (torch.randn(rows, 3 * inner, device="cuda") * torch.rand(rows, 1, device="cuda") * 4).to(torch.bfloat16)
    if case == "zeros":
        qkv[:, :inner] = 0
    elif case == "specials":
        qkv[0, 5] = float("nan")
        qkv[1, 7] = float("inf")
        qkv[2, :128] = 1e-40  # bf16 subnormals
        qkv[3, 300] = -0.0
    freqs = _rope_table(rows)
    qw = (torch.rand(128, device="cuda") + 0.5).to(torch.bfloat16)
    kw = (torch.rand(128, device="cuda") + 0.5).to(torch.bfloat16)
    stock, fused = qkv.clone(), qkv.clone()
    q, k = _views(stock, heads)
    ck.rms_rope_split_half_(q, k, freqs, qw, kw, epsilon=1e-5, rot_dim=96)
    q, k = _views(fused, heads)
    assert ops.rms_rope_support(q, k, freqs, qw, kw, 96) is None
    ops.rms_rope_split_half_(q, k, freqs, qw, kw, 1e-5, 96)
    assert_bit_identical(fused, stock, f"{case}, rows {rows}, heads {heads}, seed {seed}")


def test_unaligned_views_are_refused_with_a_reason():
    """16-byte copies need aligned q/k rows; anything else is left to comfy-kitchen (the block falls back)."""
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    qkv = torch.zeros(8, 3 * 7168 + 2, device="cuda", dtype=torch.bfloat16)
    freqs = _rope_table(8)
    qw = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    q, k = _views(qkv[:, 1:1 + 2 * 7168])  # q starts 2 bytes into the row
    assert "aligned" in ops.rms_rope_support(q, k, freqs, qw, qw, 96)
    with pytest.raises(ValueError, match="aligned"):
        ops.rms_rope_split_half_(q, k, freqs, qw, qw, 1e-5, 96)
