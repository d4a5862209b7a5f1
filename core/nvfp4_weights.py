"""NVFP4 Linear weights the way ComfyUI stores and loads them: the checkpoint tensors of one layer (quantized by
ComfyUI's own ``QuantizedTensor.from_float``) and a ComfyUI NVFP4 Linear built from them.

The converter writes these entries; the self-check's Linear probe builds its layer from them; tools/synthetic.py
builds whole random-weight models with them.
"""

from __future__ import annotations

import json

import torch

from .. import comfy_adapter


def comfy_quant_tag(fmt: str = "nvfp4") -> torch.Tensor:
    """A layer's ``comfy_quant`` tensor: its format as JSON bytes."""
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


def nvfp4_checkpoint_entries(prefix: str, weight: torch.Tensor, input_scale: float | None = None) -> dict:
    """The checkpoint tensors of one NVFP4 Linear, quantized by ComfyUI's own ``QuantizedTensor.from_float``."""
    qt = comfy_adapter.quantize_like_comfy(weight.to(torch.bfloat16))
    p = f"{prefix}." if prefix else ""
    entries = {
        f"{p}weight": qt._qdata,
        f"{p}weight_scale": qt._params.block_scale,
        f"{p}weight_scale_2": qt._params.scale.reshape(()).to(torch.float32),
        f"{p}comfy_quant": comfy_quant_tag(),
    }
    if input_scale is not None:
        entries[f"{p}input_scale"] = torch.tensor(input_scale, dtype=torch.float32, device=weight.device)
    return entries


def random_weight(shape, gen: torch.Generator, device, std: float, dtype=torch.bfloat16, mean: float = 0.0):
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std + mean).to(dtype)


def make_nvfp4_linear(in_features: int, out_features: int, *, seed: int = 0, device="cpu",
                      input_scale: float | None = None, bias: bool = False, compute_dtype=torch.bfloat16,
                      pre_quant_scale: torch.Tensor | None = None):
    """One ComfyUI NVFP4 Linear (mixed-precision ops, NVFP4 compute forced on) with a random weight, loaded through
    the layer's own state-dict loader (``pre_quant_scale``: an AWQ smoothing table [in_features], stored in the
    checkpoint entry of that name and loaded by ComfyUI as it is, in its own dtype)."""
    layer = comfy_adapter.mixed_precision_ops(compute_dtype, disabled=[]).Linear(in_features, out_features, bias=bias,
                                                                                 device=device)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    sd = nvfp4_checkpoint_entries("", random_weight((out_features, in_features), gen, device, in_features ** -0.5),
                                  input_scale)
    if bias:
        sd["bias"] = random_weight((out_features,), gen, device, 0.02)
    if pre_quant_scale is not None:
        sd["pre_quant_scale"] = pre_quant_scale.to(device)
    layer.load_state_dict(sd, strict=False)
    return layer.requires_grad_(False)
