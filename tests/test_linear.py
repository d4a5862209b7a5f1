"""The fused NVFP4 Linear against ComfyUI's real NVFP4 Linear (mixed-precision ops, weights from ComfyUI's own
quantizer) through the same GEMM: equal bits. Dynamic and static activation scale, with and without bias (H3's
projections have none), 2-D and 3-D input, row counts that are not a multiple of 16. On the GPU at H3's widths and
37,810 rows (below sm_100 both arms emulate the FP4 GEMM the same way); on the CPU at small widths through the
kernels' Python twin."""

import pytest
import torch
from conftest import cuda_available
from parity import assert_bit_identical, assert_fused_linear_matches_stock, fresh_seed

from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")

GPU = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (CPU-only machines skip the GPU tests)")
SHAPES = [pytest.param("cuda", 5376, 21504, marks=GPU), pytest.param("cuda", 7168, 5376, marks=GPU),
          pytest.param("cuda", 5376, 28672, marks=GPU), pytest.param("cuda", 14336, 5376, marks=GPU),
          ("cpu", 256, 768), ("cpu", 512, 256)]
ROWS = {"cuda": (37810, 1001), "cpu": (310, 47)}


@pytest.mark.parametrize("device,in_f,out_f", SHAPES)
@pytest.mark.parametrize("static,bias,many_rows", [(None, False, True), (0.02, True, True), (None, True, False)])
def test_fused_linear_bit_identical(device, in_f, out_f, static, bias, many_rows):
    from h3_fused_nvfp4.core.linear import FusedNVFP4Linear

    seed = fresh_seed()
    rows = ROWS[device][0 if many_rows else 1]
    layer = syn.make_nvfp4_linear(in_f, out_f, seed=seed, device=device, input_scale=static, bias=bias)
    x = (torch.randn(rows, in_f, device=device) * 2).to(torch.bfloat16)
    assert_fused_linear_matches_stock(layer, FusedNVFP4Linear(layer, "layer"), x, f"seed {seed}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_static_alpha_follows_in_place_changes(device, monkeypatch):
    """With a static ``input_scale`` ComfyUI's GEMM computes alpha = input_scale x weight_scale_2 per call. After
    either changes in place (inference tensors keep no version; a LoRA re-quantization can land a new
    weight_scale_2 at the same address), the alpha the fused Linear hands its GEMM is the product of the values
    now, bit for bit (the emulated GEMM of the CPU and the H200 does not read it; the FP4 GEMM does)."""
    from h3_fused_nvfp4.core import linear
    from h3_fused_nvfp4.core.linear import FusedNVFP4Linear

    alphas = []
    real = linear.nvfp4_gemm

    def gemm(packed, *args, **kwargs):
        alphas.append(packed.alpha.clone())
        return real(packed, *args, **kwargs)

    monkeypatch.setattr(linear, "nvfp4_gemm", gemm)
    seed = fresh_seed()
    with torch.inference_mode():
        layer = syn.make_nvfp4_linear(256, 128, seed=seed, device=device, input_scale=0.02)
        assert layer.input_scale.is_inference()
        fused = FusedNVFP4Linear(layer, "layer")
        x = (torch.randn(40, 256, device=device) * 2).to(torch.bfloat16)
        layer(x)
        fused(x)  # both arms warm (the first emulated call of a process differs on the H200)
        for step, change in enumerate((lambda: None, lambda: layer.input_scale.mul_(3),
                                       lambda: layer.weight._params.scale.mul_(0.5),
                                       lambda: layer.input_scale.copy_(torch.tensor(7e-3)))):
            change()
            out = fused(x)
            # ComfyUI's alpha: the quantized input's scale (the input_scale) times the weight's (comfy-kitchen)
            comfy_alpha = (layer.input_scale.to(device=device, dtype=torch.float32).reshape(1)
                           * layer.weight._params.scale.reshape(1))
            assert torch.equal(alphas[-1].view(torch.int32), comfy_alpha.view(torch.int32)), (step, seed)
            assert_bit_identical(out, layer(x), f"after change {step}, seed {seed}")
    assert fused.calls_fused == 5
