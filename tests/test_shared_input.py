"""Linears that read one tensor pack it once (core/linear.py ``SharedInput``): every output equals ComfyUI's own
forward of that layer on the same input, the input is packed once where the packs would be identical, and each
layer that cannot take the fused path runs ComfyUI's forward. On the CPU through ComfyUI's real NVFP4 Linear (the
kernels' Python twin); on the GPU through the kernels (skipped without one)."""

import pytest
import torch
from conftest import requires_cuda
from parity import assert_bit_identical, fresh_seed

from h3_fused_nvfp4.core.linear import FusedNVFP4Linear, SharedInput
from h3_fused_nvfp4.kernels import cuda_ops, twin_ops
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")
K, N = 256, 96


def group(scales=(None, None), device="cpu", dtype=torch.bfloat16, bias=True):
    layers = [syn.make_nvfp4_linear(K, N + 32 * i, seed=fresh_seed(), device=device, input_scale=s, bias=bias,
                                    compute_dtype=dtype) for i, s in enumerate(scales)]
    return layers, SharedInput([FusedNVFP4Linear(layer, f"w{i}") for i, layer in enumerate(layers)], "ffn")


def counting_packs(monkeypatch, backend):
    calls = []
    real = backend.pack_nvfp4

    def pack(*args, **kwargs):
        calls.append(kwargs.get("static_scale") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "pack_nvfp4", pack)
    return calls


def check(layers, shared, x, *, packs, fused_calls):
    with torch.inference_mode():
        for layer in layers:  # warm both arms (ComfyUI's first emulated call of a process can differ on the GPU)
            layer(x)
        shared(x)
        stock = [layer(x) for layer in layers]
        del packs[:]
        outs = shared(x)
    for i, (out, ref) in enumerate(zip(outs, stock)):
        assert_bit_identical(out, ref, f"layer {i}")
    assert [f.calls_fused for f in shared.linears] == fused_calls


@pytest.mark.parametrize("scales", [(None, None), (0.5, 0.5), (None, None, None)], ids=["dynamic", "static", "three"])
def test_one_pack_for_every_layer(monkeypatch, scales):
    layers, shared = group(scales)
    packs = counting_packs(monkeypatch, twin_ops)
    assert shared.sharing_refusal is None
    check(layers, shared, (torch.randn(37, K) * 3).to(torch.bfloat16), packs=packs, fused_calls=[2] * len(scales))
    assert len(packs) == 1


@pytest.mark.parametrize("scales", [(None, 0.5), (0.5, 0.25)], ids=["dynamic-and-static", "two-static-values"])
def test_layers_whose_packs_differ_pack_their_own(monkeypatch, scales):
    layers, shared = group(scales)
    packs = counting_packs(monkeypatch, twin_ops)
    assert "scales differ" in shared.sharing_refusal
    check(layers, shared, (torch.randn(37, K) * 3).to(torch.bfloat16), packs=packs, fused_calls=[2, 2])
    assert len(packs) == 2


def test_a_layer_on_comfyuis_path_leaves_the_others_sharing(monkeypatch):
    layers, shared = group((None, None, None))
    layers[1].weight_function = [lambda w: w]  # a LoRA patched on the fly: ComfyUI's path for that layer
    packs = counting_packs(monkeypatch, twin_ops)
    check(layers, shared, (torch.randn(37, K) * 3).to(torch.bfloat16), packs=packs, fused_calls=[2, 0, 2])
    assert len(packs) == 1 and shared.linears[1].calls_stock == 2


def test_a_replaced_static_scale_stops_the_sharing(monkeypatch):
    layers, shared = group((0.5, 0.5))
    layers[1].input_scale = torch.nn.Parameter(torch.tensor(0.25), requires_grad=False)  # not the one compared
    packs = counting_packs(monkeypatch, twin_ops)
    check(layers, shared, (torch.randn(37, K) * 3).to(torch.bfloat16), packs=packs, fused_calls=[2, 2])
    assert len(packs) == 2


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", [(None, None, None), (0.5, 0.5)], ids=["dynamic", "static"])
def test_gpu_one_pack_for_every_layer(monkeypatch, scales, dtype, force_nvfp4_compute):
    layers, shared = group(scales, device="cuda", dtype=dtype)
    packs = counting_packs(monkeypatch, cuda_ops)
    x = (torch.randn(4099, K, device="cuda") * 3).to(dtype)
    x[5] = 0.0
    check(layers, shared, x, packs=packs, fused_calls=[2] * len(scales))
    assert len(packs) == 1
