"""NVFP4 text encoders as ComfyUI runs them: on ComfyUI's real MiniMax H3 text encoder (H3's official encoder is an
NVFP4 AWQ file), loaded by ComfyUI's own ``comfy.sd.load_text_encoder_state_dicts`` from a random-weight checkpoint
whose language-model projections are NVFP4 entries made by ComfyUI's quantizer (some with a ``pre_quant_scale``),
at tiny widths (ComfyUI's ``<encoder>_model_config`` option and a smaller vision-tower table).

ComfyUI builds every text encoder's quantized Linears to run in full precision (``comfy/sd1_clip.py``:
``mixed_precision_ops(..., full_precision_mm=True)``: the weight is dequantized, the input never quantized) and
encodes prompts with fp32 activations. There is no activation pack to fuse, so the pack does not patch text
encoders. This test keeps that fact checked: if ComfyUI starts quantizing text-encoder activations, it fails, and
the pack should then patch them (its fused Linear already folds AWQ's ``pre_quant_scale``).
"""

from __future__ import annotations

import re

import pytest
import torch

from h3_fused_nvfp4.core.nvfp4_weights import nvfp4_checkpoint_entries, random_weight

ENCODER_KEY = "qwen3vl_32b"  # ComfyUI's name of the H3 encoder inside its CLIP model (SD1ClipModel attribute)
TRANSFORMER_PREFIX = f"{ENCODER_KEY}.transformer."  # what ComfyUI's load_sd strips from the file's keys
# The language model at a tiny width; its depth stays 50 (ComfyUI's detection of the H3 encoder reads layer 49).
TINY_LANGUAGE_MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, depth=1, deepstack_visual_indexes=[0])
LAYERS = 50
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
# AWQ files smooth the projections' inputs: a pre_quant_scale on the layers' input projections of every third layer
AWQ = re.compile(r"^model\.layers\.\d*[036]\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)$")


@pytest.fixture
def tiny_vision_tower(comfyui, monkeypatch):
    import comfy.text_encoders.qwen3vl as qwen3vl

    monkeypatch.setitem(qwen3vl.QWEN3VL_VISION, ENCODER_KEY, TINY_VISION)


def model_options() -> dict:
    return {f"{ENCODER_KEY}_model_config": dict(TINY_LANGUAGE_MODEL)}


def h3_text_encoder_state_dict(dtype: torch.dtype, seed: int = 0) -> dict:
    """A random-weight H3 text-encoder checkpoint (file key names); ``dtype``: the unquantized tensors' dtype, which
    ComfyUI's loader takes as the encoder's compute dtype (``llama_detect``: the norm weights' dtype)."""
    from comfy.text_encoders.minimax import te

    skeleton = te(dtype_llama=dtype)(device="meta", dtype=dtype, model_options=model_options())
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, tensor in skeleton.state_dict().items():
        if not key.startswith(TRANSFORMER_PREFIX):
            continue
        key = key.removeprefix(TRANSFORMER_PREFIX)
        owner, _, leaf = key.rpartition(".")
        shape = tuple(tensor.shape)
        if leaf == "weight" and QUANTIZED.match(owner):
            sd.update(nvfp4_checkpoint_entries(owner, random_weight(shape, gen, "cpu", shape[1] ** -0.5)))
            if AWQ.match(owner):
                sd[f"{owner}.pre_quant_scale"] = (torch.rand(shape[1], generator=gen) * 1.5 + 0.25).to(dtype)
        elif "norm" in owner and leaf == "weight":
            sd[key] = random_weight(shape, gen, "cpu", 0.1, dtype, mean=1.0)
        else:
            sd[key] = random_weight(shape, gen, "cpu", 0.02 if len(shape) < 2 else shape[-1] ** -0.5, dtype)
    return sd


def load_h3_text_encoder(dtype=torch.bfloat16):
    """The CLIP ComfyUI's loader makes of the checkpoint (``CLIPLoader`` calls the same function)."""
    import comfy.sd

    clip = comfy.sd.load_text_encoder_state_dicts([h3_text_encoder_state_dict(dtype)],
                                                  model_options=model_options())
    assert type(clip.cond_stage_model).__name__ == "MiniMaxH3TEModel_"  # ComfyUI detected H3's encoder
    return clip


def test_comfyui_runs_nvfp4_text_encoder_linears_in_full_precision(pack, comfyui, force_nvfp4_compute,
                                                                   tiny_vision_tower, clean_models):
    from h3_fused_nvfp4.core.linear import FusedNVFP4Linear, is_nvfp4_linear

    clip = load_h3_text_encoder()
    layers = {n: m for n, m in clip.cond_stage_model.named_modules() if is_nvfp4_linear(m)}
    assert len(layers) == 7 * LAYERS
    assert any(getattr(m, "pre_quant_scale", None) is not None for m in layers.values())
    assert all(m._full_precision_mm is True for m in layers.values())
    reasons = {FusedNVFP4Linear(m, n).static_refusal() for n, m in layers.items()}
    assert reasons == {"ComfyUI keeps this layer in full precision (the model's ops run quantized Linears in full "
                       "precision, as ComfyUI builds text encoders: weights dequantized, inputs never quantized)"}
