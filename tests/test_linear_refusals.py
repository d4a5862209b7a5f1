"""Every call the fused Linear leaves to ComfyUI: the reason it gives, and that ComfyUI's own forward then runs on
the same input (equal output bytes to the layer's own forward, or the same exception). On the CPU through ComfyUI's
real NVFP4 Linear. (1-D and empty inputs: tests/test_linear_shapes.py; torch.compile: tests/test_nodes.py; a
malformed pre_quant_scale: tests/test_linear_prescale.py; a self-check verdict: tests/test_selfcheck.py.)"""

import pytest
import torch
from parity import assert_bit_identical, fresh_seed

from h3_fused_nvfp4.core.linear import FusedNVFP4Linear
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")
K, N = 256, 64


def make(compute_dtype=torch.bfloat16):
    layer = syn.make_nvfp4_linear(K, N, seed=fresh_seed(), bias=True, compute_dtype=compute_dtype)
    return layer, FusedNVFP4Linear(layer, "layer")


def x_of(dtype=torch.bfloat16, rows=37, k=K):
    return (torch.randn(rows, k) * 2).to(dtype)


def left_to_comfyui(layer, fused, x, reason_part: str):
    reason = fused.refusal(x, x.shape[-1])
    assert reason is not None and reason_part in reason, reason
    with torch.no_grad():
        out, stock = fused(x), layer(x)
    assert fused.calls_fused == 0 and fused.stock_reasons == {reason: 1}
    assert_bit_identical(out, stock, reason)


def test_weight_patches_lora():
    layer, fused = make()
    layer.weight_function = [lambda w: w]  # per layer, as ComfyUI installs them (the class default is shared)
    left_to_comfyui(layer, fused, x_of(), "weight patches (LoRA)")


def test_forced_weight_cast():
    layer, fused = make()
    layer.comfy_force_cast_weights = True
    left_to_comfyui(layer, fused, x_of(), "forces weight casting")


def test_full_precision_layer():
    layer, fused = make()
    layer._full_precision_mm = True
    left_to_comfyui(layer, fused, x_of(), "keeps this layer in full precision")


def test_fp32_activations():
    layer, fused = make(torch.float32)
    left_to_comfyui(layer, fused, x_of(torch.float32), "torch.float32, not bfloat16 or float16")


def test_autograd_recording_takes_comfyuis_training_path():
    layer, fused = make()
    x = x_of().requires_grad_()
    assert "autograd is recording" in fused.refusal(x, K)
    out, stock = fused(x), layer(x)
    assert out.requires_grad and fused.calls_stock == 1 and fused.calls_fused == 0
    assert_bit_identical(out.detach(), stock.detach(), "training path")
    out.sum().backward()  # ComfyUI's QuantLinearFunc backward runs
    assert x.grad is not None and x.grad.shape == x.shape


def test_wrong_input_width_fails_as_comfyui_fails():
    layer, fused = make()
    x = x_of(k=K + 16)
    assert "!= in_features" in fused.refusal(x, K + 16)
    with pytest.raises(Exception) as stock_error:
        layer(x)
    with pytest.raises(type(stock_error.value)):
        fused(x)
    assert fused.calls_stock == 1 and fused.calls_fused == 0
