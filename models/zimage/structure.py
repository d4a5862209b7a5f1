"""Where Z-Image's blocks and NVFP4 Linears are in a ComfyUI model, matched by structure.

ComfyUI builds Z-Image Turbo as a ``NextDiT`` (comfy/ldm/lumina/model.py) whose block lists are made of
``JointTransformerBlock``s: ``layers`` and ``noise_refiner`` modulated by the timestep (adaLN), ``context_refiner``
(and ``siglip_refiner`` where the model has one) without modulation. Matching is structural - attribute names,
Linear shapes, the modulation flag each list must have, and the module helpers the fused block falls back to - so a
renamed or reshaped model is left alone (its NVFP4 Linears still take the fused pack).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ...core.linear import is_nvfp4_linear

# The block lists of a NextDiT, whether their blocks are modulated, and the key of ComfyUI's post-block patches
# (transformer_options["patches"]) that NextDiT applies to x after each block of that list (None: none).
BLOCK_LISTS = (("layers", True, "double_block"), ("noise_refiner", True, "noise_refiner"),
               ("context_refiner", False, None), ("siglip_refiner", False, None))
LINEAR_PATHS = ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")
# What the fused block calls of the blocks' module: ComfyUI's modulation / gate helpers and its attention.
MODULE_HELPERS = ("modulate", "apply_gate", "clamp_fp16", "optimized_attention_masked")


@dataclass
class JointBlock:
    prefix: str       # attribute path below the diffusion model, e.g. "layers.3"
    chain: str        # the block list ("layers", "noise_refiner", ...)
    index: int        # its index in that list
    module: torch.nn.Module
    modulated: bool
    patch_key: str | None  # ComfyUI's post-block patches of this list (BLOCK_LISTS)


def _linear_shape(module) -> tuple[int, int] | None:
    if module is None or not (hasattr(module, "in_features") and hasattr(module, "out_features")):
        return None
    return int(module.in_features), int(module.out_features)


def _norm_over(module, width: int) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and tuple(getattr(module, "normalized_shape", ())) == (width,)


def _attention_matches(attn, dim: int) -> bool:
    heads, kv_heads, head_dim = (getattr(attn, a, None) for a in ("n_local_heads", "n_local_kv_heads", "head_dim"))
    if not all(isinstance(v, int) for v in (heads, kv_heads, head_dim)) or kv_heads != heads:
        return False  # grouped k / v heads take ComfyUI's other RoPE path; the fused block does not
    inner = heads * head_dim
    return (getattr(attn, "qk_norm", False) is True
            and _linear_shape(getattr(attn, "qkv", None)) == (dim, 3 * inner)
            and _linear_shape(getattr(attn, "out", None)) == (inner, dim)
            and _norm_over(getattr(attn, "q_norm", None), head_dim)
            and _norm_over(getattr(attn, "k_norm", None), head_dim))


def _feed_forward_matches(ffn, dim: int) -> bool:
    w1, w2, w3 = (_linear_shape(getattr(ffn, name, None)) for name in ("w1", "w2", "w3"))
    return (w1 is not None and w1[0] == dim and w3 == w1 and w2 == (w1[1], dim)
            and callable(getattr(ffn, "_forward_silu_gating", None)))


def _adaln_matches(block, dim: int) -> bool:
    """A modulated block's adaLN projection gives the four [rows, dim] tables ComfyUI chunks it into."""
    adaln = getattr(block, "adaLN_modulation", None)
    last = list(adaln)[-1] if isinstance(adaln, torch.nn.Sequential) and len(adaln) else None
    shape = _linear_shape(last)
    return shape is not None and shape[1] == 4 * dim


def block_matches(block, modulated: bool) -> bool:
    """Whether ``block`` is a ComfyUI ``JointTransformerBlock`` the fused block reproduces, ``modulated`` or not."""
    module = sys.modules.get(type(block).__module__)
    if not all(hasattr(module, helper) for helper in MODULE_HELPERS):
        return False
    attn, ffn = getattr(block, "attention", None), getattr(block, "feed_forward", None)
    dim = (_linear_shape(getattr(attn, "qkv", None)) or (None,))[0]
    if dim is None or getattr(block, "modulation", None) is not modulated:
        return False
    if not all(_norm_over(getattr(block, name, None), dim) for name in NORMS):
        return False
    if not (_attention_matches(attn, dim) and _feed_forward_matches(ffn, dim)):
        return False
    return _adaln_matches(block, dim) if modulated else True


def find_joint_blocks(diffusion_model) -> list[JointBlock]:
    """The matching blocks of every block list of ``diffusion_model``, in list order."""
    found = []
    for chain, modulated, patch_key in BLOCK_LISTS:
        container = getattr(diffusion_model, chain, None)
        if not isinstance(container, torch.nn.ModuleList):
            continue
        for i, block in enumerate(container):
            if block_matches(block, modulated):
                found.append(JointBlock(f"{chain}.{i}", chain, i, block, modulated, patch_key))
    return found


def submodule(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def nvfp4_layers(block: JointBlock) -> dict[str, torch.nn.Module]:
    """Path in the block -> module of each of its NVFP4 Linears."""
    return {path: layer for path in LINEAR_PATHS if is_nvfp4_linear(layer := submodule(block.module, path))}
