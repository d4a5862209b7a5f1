"""Sanity tests for the ComfyUI H3 mirror (tests/h3_mirror.py), on CPU at reduced width."""

import pytest
import torch
import torch.nn.functional as F

import comfy_kitchen as ck
from comfy_kitchen.tensor import QuantizedTensor

import h3_mirror as hm

# Reduced width; S = 37 + 50 + 203 = 290 rows, not a multiple of 16, so quantization pads.
HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM = 256, 4, 64, 512, 256
S_TEXT, S_AUDIO, S_VIDEO = 37, 50, 203
DEV = "cpu"


def _block(seed=1, **kw):
    return hm.make_block(HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM, seed=seed, device=DEV, **kw)


def _inputs(seed=2, **kw):
    return hm.make_inputs(S_TEXT, S_AUDIO, S_VIDEO, seed=seed, device=DEV, hidden=HIDDEN, head_dim=HEAD_DIM,
                          t_dim=T_DIM, **kw)


def _run(block, inputs, **kw):
    x, t_emb, segs, rope = inputs
    x = x.clone()
    with torch.inference_mode():
        return block(x, t_emb, segs, rope, **kw)


def test_structure_matches_comfyui_names():
    b = _block()
    assert isinstance(b.attn.qkv_proj.weight, QuantizedTensor)
    assert b.attn.qkv_proj.weight._layout_cls == "TensorCoreNVFP4Layout"
    assert tuple(b.attn.qkv_proj.weight.shape) == (3 * HEADS * HEAD_DIM, HIDDEN)
    assert b.attn.qkv_proj.quant_format == "nvfp4" and b.attn.qkv_proj.layout_type == "TensorCoreNVFP4Layout"
    assert b.attn.qkv_proj._full_precision_mm is False and b.attn.qkv_proj.input_scale is None
    for lin, shape in ((b.attn.out_proj, (HIDDEN, HEADS * HEAD_DIM)), (b.mlp.fc1, (2 * FFN, HIDDEN)),
                       (b.mlp.fc2, (HIDDEN, FFN))):
        assert isinstance(lin, hm.MirrorNVFP4Linear) and tuple(lin.weight.shape) == shape
    assert b.adaln_proj.linear.weight.dtype == torch.bfloat16
    assert tuple(b.adaln_proj.linear.weight.shape) == (6 * HIDDEN * 3, T_DIM)
    assert (b.adaln_proj.expand, b.adaln_proj.modalities, b.adaln_proj.hidden) == (6, 3, HIDDEN)
    assert b.norm1.normalized_shape == (HIDDEN,) and b.norm1.eps == 1e-5
    assert b.attn.q_norm.normalized_shape == (HEAD_DIM,) and (b.attn.heads, b.attn.head_dim) == (HEADS, HEAD_DIM)
    assert isinstance(b.norm1, torch.nn.RMSNorm)

    m = hm.make_model(HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM, num_layers=2, refiner_layers=2, seed=0, device=DEV)
    assert type(m).__name__ == "MirrorH3Model" and len(m.blocks) == 2 and len(m.token_refiner.blocks) == 2
    assert isinstance(m.token_refiner.blocks[0], hm.MirrorRefinerBlock)


def test_static_scale_layers():
    b = _block(static_scale_layers=("attn.qkv_proj", "mlp.fc2"))
    assert float(b.attn.qkv_proj.input_scale) == pytest.approx(hm.DEFAULT_STATIC_SCALE)
    assert b.attn.qkv_proj.input_scale.dtype == torch.float32
    assert float(b.mlp.fc2.input_scale) == pytest.approx(hm.DEFAULT_STATIC_SCALE)
    assert b.attn.out_proj.input_scale is None and b.mlp.fc1.input_scale is None
    b = _block(static_scale_layers={"mlp.fc1": 0.125})
    assert float(b.mlp.fc1.input_scale) == 0.125


def test_block_runs_in_place_and_is_deterministic():
    block = _block()
    x, t_emb, segs, rope = _inputs()
    x0 = x.clone()
    with torch.inference_mode():
        out = block(x, t_emb, segs, rope)
    assert out is x  # DiTBlock accumulates the gated residuals into its input
    assert out.shape == (S_TEXT + S_AUDIO + S_VIDEO, HIDDEN) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    assert not torch.equal(out, x0)
    # Rebuilding everything from the same seeds gives the same bits.
    again = _run(_block(), _inputs())
    assert torch.equal(again, out)


def test_nvfp4_linear_quantizes_activation():
    lin = hm.make_nvfp4_linear(HIDDEN, 200, seed=3, device=DEV)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(290, HIDDEN, generator=gen) * 2).to(torch.bfloat16)
    y = lin(x)
    w_dq = lin.weight.dequantize()
    # Equals the fake-quant reference: dynamic global scale amax/2688, then dequantize both operands.
    qx = QuantizedTensor.from_float(x, "TensorCoreNVFP4Layout")
    assert float(qx.params.scale) == float((x.abs().amax() / 2688.0).float())
    assert torch.equal(y, F.linear(qx.dequantize(), w_dq))
    # ... and differs from the weight-only-quant matmul, so the activation really was quantized.
    assert not torch.equal(y, F.linear(x, w_dq))
    # 3-D input is flattened for quantization and reshaped back.
    y3 = lin(x.view(2, 145, HIDDEN))
    assert y3.shape == (2, 145, 200) and torch.equal(y3.reshape(290, 200), y)


def test_nvfp4_linear_static_scale_and_bias():
    lin = hm.make_nvfp4_linear(HIDDEN, 96, bias=True, static_input_scale=0.01, seed=5, device=DEV)
    assert lin.bias.dtype == torch.bfloat16
    x = torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    qx = QuantizedTensor.from_float(x, "TensorCoreNVFP4Layout", scale=torch.tensor(0.01))
    assert float(qx.params.scale) == pytest.approx(0.01)
    assert torch.equal(lin(x), F.linear(qx.dequantize(), lin.weight.dequantize(), lin.bias))
    # full_precision_mm mirrors ComfyUI below SM 10: bf16 activation, dequantized weight.
    lin._full_precision_mm = True
    assert torch.equal(lin(x), F.linear(x, lin.weight.dequantize(), lin.bias))


def test_rope_path_matches_ck_reference():
    # The attention module's rope branch is ck.rms_rope_split_half_ on the q/k views of the qkv buffer.
    block = _block()
    attn = block.attn
    x, _, _, rope = _inputs()
    h = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    captured = {}

    def capture(q, k, v, heads, mask=None, skip_reshape=False, **kw):
        assert skip_reshape and mask is None and q.shape == (1, HEADS, x.shape[0], HEAD_DIM)
        captured["q"], captured["k"], captured["v"] = q.clone(), k.clone(), v.clone()
        return hm.sdpa_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape, **kw)

    attn.comfy_attention.function = capture
    with torch.inference_mode():
        attn(h, rope_freqs=rope)
        qkv = attn.qkv_proj(h)
    q, k, v = qkv.split(HEADS * HEAD_DIM, dim=-1)
    s = h.shape[0]
    qr, kr = ck.rms_rope_split_half(q.reshape(1, s, HEADS, HEAD_DIM), k.reshape(1, s, HEADS, HEAD_DIM), rope,
                                    attn.q_norm.weight, attn.k_norm.weight, epsilon=1e-5, rot_dim=rope.shape[-3] * 2)
    assert rope.shape == (1, s, 1, hm.rot_dim_for(HEAD_DIM) // 2, 2, 2)
    assert torch.equal(captured["q"], qr[0].transpose(0, 1).unsqueeze(0))
    assert torch.equal(captured["k"], kr[0].transpose(0, 1).unsqueeze(0))
    assert torch.equal(captured["v"], v.reshape(s, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0))


def test_attention_override_and_block_attention_argument():
    block = _block()
    inputs = _inputs()
    ref = _run(block, inputs)
    calls = []

    def override(func, *args, **kwargs):
        calls.append(kwargs["skip_reshape"])
        return func(*args, **kwargs)

    assert torch.equal(_run(block, inputs, transformer_options={"optimized_attention_override": override}), ref)
    assert calls == [True]
    # ComfyUI's `attention=` replaces block.attn (used by sparse-attention block patches).
    assert torch.equal(_run(block, inputs, attention=block.attn), ref)


def test_per_token_rows_equal_int_rows():
    block = _block()
    x, t_emb, segs, rope = _inputs(n_timesteps=2)
    a, b, row = segs[2]
    per_token = segs[:2] + [(a, b, torch.full((b - a,), row, dtype=torch.long))]
    out_int = _run(block, (x, t_emb, segs, rope))
    out_tok = _run(block, (x, t_emb, per_token, rope))
    assert torch.equal(out_int, out_tok)


def test_per_token_video_inputs():
    x, t_emb, segs, rope = _inputs(n_timesteps=3, per_token_video=True)
    assert [s[:2] for s in segs] == [(0, S_TEXT), (S_TEXT, S_TEXT + S_AUDIO),
                                     (S_TEXT + S_AUDIO, S_TEXT + S_AUDIO + S_VIDEO)]
    assert segs[0][2] == 1 and segs[1][2] == 1 * 3 + 2
    rows = segs[2][2]
    assert rows.dtype == torch.long and rows.shape == (S_VIDEO,)
    assert set(rows.unique().tolist()) <= {0, 3, 6} and rows.unique().numel() > 1
    out = _run(_block(), (x, t_emb, segs, rope))
    assert torch.isfinite(out.float()).all()


def test_segments_get_distinct_modulation():
    # Same rows in every segment must give a different result than distinct rows: the mod rows matter.
    block = _block()
    x, t_emb, segs, rope = _inputs()
    uniform = [(a, b, 0) for a, b, _ in segs]
    assert not torch.equal(_run(block, (x, t_emb, segs, rope)), _run(block, (x, t_emb, uniform, rope)))


def test_refiner_and_model_block_loop():
    m = hm.make_model(HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM, num_layers=2, refiner_layers=1, seed=11, device=DEV)
    x, t_emb, segs, rope = _inputs()
    with torch.inference_mode():
        text = m.token_refiner(x[:S_TEXT].clone())
        assert text.shape == (S_TEXT, HIDDEN) and torch.isfinite(text.float()).all()
        ref = m.blocks[1](m.blocks[0](x.clone(), t_emb, segs, rope), t_emb, segs, rope)
        seen = []

        def patch(args, extra):
            seen.append(args["transformer_options"]["block_index"])
            return extra["original_block"](args)

        opts = {"patches_replace": {"dit": {("double_block", 1): patch}}}
        out = m.run_blocks(x.clone(), t_emb, segs, rope, transformer_options=opts)
    assert torch.equal(out, ref) and seen == [1]

