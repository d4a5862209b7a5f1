"""Where MiniMax H3's blocks and NVFP4 Linears are in a ComfyUI model, matched by structure.

Matching is structural (attribute names and Linear shapes of ComfyUI's comfy/ldm/minimax/model.py, and the module
helpers the fused block calls for its fallbacks), so a renamed or reshaped ComfyUI H3 is left alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ...core.linear import is_nvfp4_linear

LINEAR_PATHS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")  # the NVFP4 Linears of an H3 block


@dataclass
class H3Block:
    prefix: str       # attribute path below the diffusion model, e.g. "blocks.3"
    module: torch.nn.Module
    kind: str         # "dit" or "refiner"


def _linear_shape(module) -> tuple[int, int] | None:
    if module is None:
        return None
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    return None


def _attention_matches(attn, hidden: int) -> bool:
    heads, head_dim = getattr(attn, "heads", None), getattr(attn, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return False
    inner = heads * head_dim
    return (
        _linear_shape(getattr(attn, "qkv_proj", None)) == (hidden, 3 * inner)
        and _linear_shape(getattr(attn, "out_proj", None)) == (inner, hidden)
        and hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    )


def _mlp_matches(mlp, hidden: int) -> bool:
    fc1, fc2 = _linear_shape(getattr(mlp, "fc1", None)), _linear_shape(getattr(mlp, "fc2", None))
    return fc1 is not None and fc2 is not None and fc1[0] == hidden and fc1[1] == 2 * fc2[0] and fc2[1] == hidden


def _hidden_of(block) -> int | None:
    qkv = _linear_shape(getattr(getattr(block, "attn", None), "qkv_proj", None))
    return qkv[0] if qkv else None


def block_kind(block) -> str | None:
    """"dit" for an H3 DiTBlock, "refiner" for a token-refiner block, None otherwise."""
    module = sys.modules.get(type(block).__module__)
    if not all(hasattr(module, helper) for helper in ("_mod_scale_shift", "_mod_gate")):
        return None  # not ComfyUI's H3 module (the fused block falls back to its helpers)
    hidden = _hidden_of(block)
    if hidden is None or not (hasattr(block, "norm1") and hasattr(block, "norm2")):
        return None
    if not (_attention_matches(block.attn, hidden) and _mlp_matches(getattr(block, "mlp", None), hidden)):
        return None
    adaln = getattr(block, "adaln_proj", None)
    if adaln is None:
        return "refiner"
    shape = _linear_shape(getattr(adaln, "linear", None))
    expand, modalities = getattr(adaln, "expand", None), getattr(adaln, "modalities", None)
    if shape and expand == 6 and modalities == 3 and shape[1] == 6 * hidden * 3:
        return "dit"
    return None


def find_h3_blocks(diffusion_model) -> list[H3Block]:
    found = []
    for prefix, container in (("blocks", getattr(diffusion_model, "blocks", None)),
                              ("token_refiner.blocks",
                               getattr(getattr(diffusion_model, "token_refiner", None), "blocks", None))):
        if container is None:
            continue
        for i, block in enumerate(container):
            kind = block_kind(block)
            if kind == "dit" and prefix == "blocks" or kind == "refiner" and prefix != "blocks":
                found.append(H3Block(f"{prefix}.{i}", block, kind))
    return found



def submodule(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def nvfp4_layers(diffusion_model) -> dict[str, torch.nn.Module]:
    """Name (below ``diffusion_model.``) -> module of every NVFP4 Linear of the matched H3 blocks."""
    return {f"{blk.prefix}.{path}": layer for blk in find_h3_blocks(diffusion_model) for path in LINEAR_PATHS
            if is_nvfp4_linear(layer := submodule(blk.module, path))}
