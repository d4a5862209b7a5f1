"""MiniMax H3's block fusion as a model family of the core's patching (core/patching.py).

Patched keys (``diffusion_model.`` prefix), on top of the core's fused Linear for every NVFP4 Linear:

    blocks.{i}.forward                        FusedDiTBlock      (scope "block")
    blocks.{i}.attn.forward                   FusedAttention     (scope "block": RMSNorm+RoPE kernel)
    blocks.{i}.mlp.forward                    FusedSwigluMLP     (scope "block": SwiGLU folded into fc2's pack)
    token_refiner.blocks.{i}.mlp.forward      FusedSwigluMLP     (scope "block")
    ...{attn.qkv_proj,attn.out_proj,mlp.fc1,mlp.fc2}.forward   FusedNVFP4Linear, NVFP4 layers only (both scopes)

Matching is structural (models/h3/structure.py); the self-check runs the Linear's probes and H3's
(models/h3/probes.py), and the first patched block checks the whole block on the first forward.
"""

from __future__ import annotations

from ...blocks.state import block_check_preparer
from ...core.linear import FusedNVFP4Linear, is_nvfp4_linear
from ...core.patching import SCOPES, FamilyPatches
from ...core.probes import LINEAR_PROBES
from .attention import FusedAttention
from .block import FusedDiTBlock, H3State
from .mlp import FusedSwigluMLP
from .probes import H3_PROBES
from .structure import LINEAR_PATHS, find_h3_blocks, submodule

name = "MiniMax H3"
PROBE_SETS = (LINEAR_PROBES, H3_PROBES)  # what the self-check runs before this model's kernels are used
probe_sets = PROBE_SETS


def build(diffusion_model, scope: str = "block") -> FamilyPatches | None:
    """The H3 patches of every matched block (None: no H3 block with an NVFP4 Linear); no side effects."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    blocks = find_h3_blocks(diffusion_model)
    patches: dict[str, object] = {}
    state = H3State()
    dit = refiner = 0
    previous = None  # the fused DiT block just before, for the norm-statistics hand-over
    for blk in blocks:
        fused = {}
        for path in LINEAR_PATHS:
            layer = submodule(blk.module, path)
            if is_nvfp4_linear(layer):
                name = f"{blk.prefix}.{path}"
                fused[path] = FusedNVFP4Linear(layer, name)
                patches[f"{name}.forward"] = fused[path]
        if not fused:
            previous = None
            continue
        dit, refiner = dit + (blk.kind == "dit"), refiner + (blk.kind != "dit")
        if scope != "block":  # "linears": each NVFP4 Linear's pack only (the fused Linears above)
            continue
        mlp = FusedSwigluMLP(blk.module.mlp, f"{blk.prefix}.mlp", fused.get("mlp.fc1"), fused.get("mlp.fc2"))
        patches[f"{blk.prefix}.mlp.forward"] = mlp
        if blk.kind == "dit":
            attention = FusedAttention(blk.module.attn, f"{blk.prefix}.attn", fused.get("attn.qkv_proj"))
            index = int(blk.prefix.rsplit(".", 1)[1])
            block = FusedDiTBlock(blk.module, blk.prefix, index, attention, mlp, state)
            if previous is not None and previous.index == index - 1:
                previous.next = block
            patches[f"{blk.prefix}.forward"] = block
            patches[f"{blk.prefix}.attn.forward"] = attention
            previous = block
    if not patches:
        return None

    prepare = block_check_preparer((state,), scope)

    return FamilyPatches(patches, f"{dit} DiT + {refiner} refiner blocks", prepare)
