"""Every input shape and layout ComfyUI's NVFP4 Linear accepts, against ComfyUI's real Linear (on the CPU through
the kernels' Python twin, on a GPU through the kernels): 2-D and N-D inputs (ComfyUI reshapes N-D inputs to 2-D
rows, a view where it can be one, and restores the rank), 1-D inputs (ComfyUI runs them unquantized: the fused
Linear leaves them to it), row-strided views read in place, and layouts the kernels cannot read in place
(transposed, misaligned), packed from a contiguous copy. Equal output bytes, and which calls were fused."""

import pytest
import torch
from conftest import cuda_available
from parity import assert_bit_identical, fresh_seed

from h3_fused_nvfp4.core.linear import FusedNVFP4Linear
from h3_fused_nvfp4.layout import rows_readable_in_place
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")

GPU = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (CPU-only machines skip the GPU tests)")
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
K, N = 256, 96


def layer_and_fused(device, static=None, dtype=torch.bfloat16):
    layer = syn.make_nvfp4_linear(K, N, seed=fresh_seed(), device=device, input_scale=static, bias=True,
                                  compute_dtype=dtype)
    return layer, FusedNVFP4Linear(layer, "layer")


def values(*shape, device, dtype=torch.bfloat16):
    return (torch.randn(*shape, device=device) * 2).to(dtype)


def run_both(layer, fused, x):
    """Stock then fused on the same input (both warmed: the first emulated call of a process differs on the H200)."""
    with torch.inference_mode():
        layer(x.contiguous() if x.dim() > 1 else x)
        fused(x)
        return layer(x), fused(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(37, K), (2, 19, K), (2, 3, 5, K), (1, 1, 1, 1, K)])
@pytest.mark.parametrize("static", [None, 0.02])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_n_d_inputs(device, shape, static, dtype):
    layer, fused = layer_and_fused(device, static, dtype)
    stock, out = run_both(layer, fused, values(*shape, device=device, dtype=dtype))
    assert out.shape == stock.shape == (*shape[:-1], N)
    assert_bit_identical(out, stock, f"{shape}")
    assert fused.calls_stock == 0 and fused.calls_fused == 2


@pytest.mark.parametrize("device", DEVICES)
def test_a_1d_input_is_left_to_comfyui_which_runs_it_unquantized(device):
    layer, fused = layer_and_fused(device)
    x = values(K, device=device)
    stock, out = run_both(layer, fused, x)
    assert out.shape == stock.shape == (N,)
    assert_bit_identical(out, stock, "1-D")
    assert fused.calls_fused == 0 and fused.calls_stock == 2
    # not vacuous: the quantized result of the same row differs from ComfyUI's unquantized one
    with torch.inference_mode():
        assert not torch.equal(fused(x[None])[0].view(torch.int16), stock.view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
def test_row_strided_view_read_in_place(device):
    """A column slice of wider rows: ComfyUI's reshape of [B, S, W][..., :K] is a view with row stride W. The fused
    pack reads it in place (no copy); the bytes equal ComfyUI's quantization of the same values."""
    layer, fused = layer_and_fused(device)
    wide = values(2, 41, K + 64, device=device)
    x = wide[..., :K]
    assert rows_readable_in_place(x.reshape(-1, K)) and not x.is_contiguous()
    with torch.inference_mode():
        layer(x.contiguous())
        stock = layer(x.contiguous())  # ComfyUI's CUDA packer asserts contiguity: compare with the same values
        out = fused(x)
    assert_bit_identical(out, stock, "row-strided view")
    assert fused.calls_stock == 0 and fused.calls_fused == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed", "misaligned", "odd row stride"])
def test_layouts_not_readable_in_place_are_packed_from_a_copy(device, layout):
    layer, fused = layer_and_fused(device)
    if layout == "transposed":
        x = values(K, 53, device=device).t()
    elif layout == "misaligned":
        flat = values(53 * K + 1, device=device)
        x = flat[1:].view(53, K)
    else:
        x = values(53, K + 1, device=device)[:, :K]
    assert not rows_readable_in_place(x)
    with torch.inference_mode():
        layer(x.contiguous())
        stock = layer(x.contiguous())
        out = fused(x)
    assert_bit_identical(out, stock, layout)
    assert fused.calls_stock == 0 and fused.calls_fused == 1


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows(device):
    """An empty batch: the same (empty) output as ComfyUI's, or ComfyUI's own behaviour through a refusal."""
    layer, fused = layer_and_fused(device)
    x = values(0, K, device=device)
    with torch.inference_mode():
        try:
            stock = layer(x)
        except Exception as exc:  # noqa: BLE001 - ComfyUI's own failure must be the fused Linear's too
            with pytest.raises(type(exc)):
                fused(x)
            return
        out = fused(x)
    assert out.shape == stock.shape == (0, N) and out.dtype == stock.dtype
