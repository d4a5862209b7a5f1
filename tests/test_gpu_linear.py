"""The fused NVFP4 Linear path against ComfyUI's stock NVFP4 Linear (mirror) through the same GEMM: equal bits.

H3 widths at 37,810 rows, dynamic and static activation scale, with and without bias, 2-D and 3-D input, and a
row count that is not a multiple of 16. Below sm_100 both arms emulate the FP4 GEMM the same way.
"""

import logging

import pytest
import torch

from conftest import requires_cuda

pytestmark = requires_cuda
logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)


@pytest.mark.parametrize("in_f,out_f", [(5376, 21504), (7168, 5376), (5376, 28672), (14336, 5376)])
@pytest.mark.parametrize("static,bias,rows", [(None, False, 37810), (0.02, True, 37810), (None, True, 1001)])
def test_fused_linear_bit_identical(in_f, out_f, static, bias, rows):
    import h3_mirror as mirror

    from h3_fused_nvfp4.integration.linear import FusedNVFP4Linear

    seed = torch.seed() % 2**31
    layer = mirror.make_nvfp4_linear(in_f, out_f, bias=bias, static_input_scale=static, seed=seed, device="cuda")
    x = (torch.randn(rows, in_f, device="cuda") * 2).to(torch.bfloat16)
    fused_forward = FusedNVFP4Linear(layer, "layer")
    with torch.inference_mode():
        stock = layer(x)
        fused = fused_forward(x)
        stock3 = layer(x[None])
        fused3 = fused_forward(x[None])
    assert fused_forward.calls_fused == 2 and fused_forward.calls_stock == 0, fused_forward._logged
    assert fused.shape == stock.shape == (rows, out_f) and fused3.shape == stock3.shape == (1, rows, out_f)
    for a, b in ((fused, stock), (fused3, stock3)):
        max_diff = (a.float() - b.float()).abs().max().item()
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"max |diff| {max_diff} (seed {seed})"
