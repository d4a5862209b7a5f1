"""The fused NVFP4 Linear against ComfyUI's real NVFP4 Linear (mixed-precision ops, weights from ComfyUI's own
quantizer) through the same GEMM: equal bits. H3 widths at 37,810 rows, dynamic and static activation scale, with
and without bias, 2-D and 3-D input, and a row count that is not a multiple of 16. Below sm_100 both arms emulate
the FP4 GEMM the same way."""

import pytest
import torch

from conftest import requires_cuda
from h3_fused_nvfp4.integration import synthetic as syn
from parity import assert_bit_identical, fresh_seed

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui")]


@pytest.mark.parametrize("in_f,out_f", [(5376, 21504), (7168, 5376), (5376, 28672), (14336, 5376)])
@pytest.mark.parametrize("static,bias,rows", [(None, False, 37810), (0.02, True, 37810), (None, True, 1001)])
def test_fused_linear_bit_identical(in_f, out_f, static, bias, rows):
    from h3_fused_nvfp4.integration.linear import FusedNVFP4Linear

    seed = fresh_seed()
    layer = syn.make_nvfp4_linear(in_f, out_f, seed=seed, device="cuda", input_scale=static, bias=bias)
    x = (torch.randn(rows, in_f, device="cuda") * 2).to(torch.bfloat16)
    fused = FusedNVFP4Linear(layer, "layer")
    with torch.inference_mode():
        layer(x)  # warm both arms (the first emulated call of a process differs)
        fused(x)
        stock, out = layer(x), fused(x)
        stock3, out3 = layer(x[None]), fused(x[None])
    assert fused.calls_fused == 3 and fused.calls_stock == 0
    assert out.shape == stock.shape == (rows, out_f) and out3.shape == stock3.shape == (1, rows, out_f)
    assert_bit_identical(out, stock, f"2-D seed {seed}")
    assert_bit_identical(out3, stock3, f"3-D seed {seed}")
