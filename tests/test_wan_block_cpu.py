"""The executable specification of the fused Wan block (tests/wan_block_spec.py) against ComfyUI's real blocks, on
the CPU with the Python twin of the kernels.

ComfyUI's ``WanAttentionBlock``s (built with ComfyUI's ops for a quantized checkpoint, NVFP4 compute forced on, every
Linear NVFP4 from ComfyUI's own quantizer) run one after another as its WanModel runs them; the specification runs the
same blocks on the same inputs with the fused ops (one pack for q, k and v, the norms' statistics handed from each
residual to the next projection, GELU folded into ffn.2's pack); every block's output must be bit-identical. fp16
(ComfyUI's compute dtype for Wan on NVIDIA GPUs) and bf16; T2V (Wan 2.2 14B's block), a timestep per frame (Wan 2.2
5B with a denoise mask, also with tokens that do not split evenly over the frames), I2V's cross-attention, a batch of
two (cond / uncond), token counts that are not a multiple of 16. The GPU tests run the same at Wan 2.2 14B's widths
with the kernels (tests/test_gpu_wan_kernels.py).
"""

import pytest
import torch
from parity import assert_bit_identical
from wan_block_spec import block_inputs, make_blocks, spec_outputs, stock_outputs

from h3_fused_nvfp4.kernels import twin_ops

pytestmark = pytest.mark.usefixtures("comfyui")
DIM, FFN, HEADS = 256, 512, 2  # two heads of Wan's 128 dimensions
CASES = {
    "t2v": dict(),
    "frame timesteps": dict(frames_e=3),
    "frame timesteps, uneven": dict(frames_e=4),  # 105 tokens over 4 frames: ComfyUI's repeat_e pads and trims
    "i2v": dict(cross="i2v_cross_attn", image=16),
    "single item": dict(batch=1, grid=(2, 4, 4)),
}


@pytest.fixture
def nvfp4_compute(comfyui, monkeypatch):
    """ComfyUI runs NVFP4 activations (as on a Blackwell GPU; its GEMM then dequantizes on the CPU, in both arms)."""
    monkeypatch.setattr(comfyui.model_management, "supports_nvfp4_compute", lambda *a, **k: True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_spec_matches_comfyui_blocks(dtype, case, nvfp4_compute):
    options = dict(CASES[case])
    cross = options.pop("cross", "t2v_cross_attn")
    image = options.pop("image", None)
    blocks = make_blocks(dtype, dim=DIM, ffn=FFN, heads=HEADS, count=2, cross=cross, seed=3)
    inputs = block_inputs(dtype, dim=DIM, heads=HEADS, image=image, seed=4, **options)
    with torch.inference_mode():
        stock = stock_outputs(blocks, inputs)
        fused = spec_outputs(blocks, inputs, twin_ops)
    for i, (a, b) in enumerate(zip(fused, stock)):
        assert torch.isfinite(b.float()).all(), f"block {i}: ComfyUI's output is not finite (inputs too large)"
        assert_bit_identical(a, b, f"{case} {dtype} block {i}")


def test_spec_without_cross_attention_norm(nvfp4_compute):
    """cross_attn_norm off (norm3 an Identity): the cross-attention q packs x itself."""
    blocks = make_blocks(torch.float16, dim=DIM, ffn=FFN, heads=HEADS, count=2, cross_attn_norm=False, seed=5)
    inputs = block_inputs(torch.float16, dim=DIM, heads=HEADS, seed=6)
    with torch.inference_mode():
        stock = stock_outputs(blocks, inputs)
        fused = spec_outputs(blocks, inputs, twin_ops)
    for i, (a, b) in enumerate(zip(fused, stock)):
        assert_bit_identical(a, b, f"no norm3, block {i}")


def test_spec_sees_a_changed_block(nvfp4_compute, monkeypatch):
    """A comparison that could not fail would prove nothing: ComfyUI's block with the rows of its first gate swapped
    between the two batch items (through its ``repeat_e``) differs from the specification."""
    import comfy.ldm.wan.model as m

    original = m.repeat_e
    calls = []

    def shifted_repeat_e(e, x):  # the block's third call: e[2], the gate of the self-attention residual
        calls.append(e.shape)
        out = original(e, x)
        return out.flip(0) if len(calls) % 6 == 3 else out

    blocks = make_blocks(torch.float16, dim=DIM, ffn=FFN, heads=HEADS, count=1, seed=7)
    inputs = block_inputs(torch.float16, dim=DIM, heads=HEADS, seed=8)
    with torch.inference_mode():
        fused = spec_outputs(blocks, inputs, twin_ops)
        monkeypatch.setattr(m, "repeat_e", shifted_repeat_e)
        stock = stock_outputs(blocks, inputs)
    assert calls, "ComfyUI's block no longer calls repeat_e"
    assert not torch.equal(fused[0].view(torch.int16), stock[0].view(torch.int16))
