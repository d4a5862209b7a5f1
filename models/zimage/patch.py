"""Z-Image Turbo's block fusion as a model family of the core's patching (core/patching.py).

Patched keys (``diffusion_model.`` prefix), on top of the core's fused Linear for every NVFP4 Linear:

    {layers,noise_refiner,context_refiner,siglip_refiner}.{i}.forward     FusedJointBlock (scope "block")
    ...{attention.qkv,attention.out,feed_forward.w1,w2,w3}.forward      FusedNVFP4Linear, NVFP4 layers only

Scope "linears" patches only the Linears (each packs its own input, as for any model). Matching is structural
(structure.py); the self-check runs the Linear's probes and Z-Image's (probes.py), and the first patched block of
each kind (modulated, refiner) compares the whole block with ComfyUI's at the first forward. The block fusion takes
bf16 compute; a model computing in fp16 keeps only the fused Linears, and the node says so.
"""

from __future__ import annotations

import collections

import torch

from ...blocks.state import ModelState, block_check_preparer
from ...core.linear import FusedNVFP4Linear
from ...core.patching import SCOPES, FamilyPatches
from ...core.probes import LINEAR_PROBES
from .block import ChainIndex, FusedJointBlock
from .probes import ZIMAGE_PROBES
from .structure import BLOCK_LISTS, find_joint_blocks, nvfp4_layers

name = "Z-Image"
PROBE_SETS = (LINEAR_PROBES, ZIMAGE_PROBES)  # what the self-check runs before this model's kernels are used
probe_sets = PROBE_SETS
BLOCK_DTYPES = (torch.bfloat16,)
FUSED = ("RMSNorm and modulation folded into the packs, post-norm residuals with the next norm's statistics, one "
         "pack for w1 and w3, SwiGLU in w2's pack")


def _describe(counts: collections.Counter, scope: str) -> str:
    lists = ", ".join(f"{counts[chain]} {chain.replace('_', '-')}" for chain, _, _ in BLOCK_LISTS if counts[chain])
    what = FUSED if scope == "block" else "the NVFP4 Linears' packs only (scope linears)"
    return f"Z-Image's blocks ({lists}): {what}"


def build(diffusion_model, scope: str = "block") -> FamilyPatches | None:
    """The Z-Image patches of every matched block (None: no Z-Image block with an NVFP4 Linear); no side effects."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    patches: dict[str, object] = {}
    # one block check per kind: the first modulated and the first refiner block each compare with ComfyUI's
    states = {True: ModelState(), False: ModelState()}
    indexes = collections.defaultdict(ChainIndex)
    counts: collections.Counter = collections.Counter()
    previous = None  # the fused block just before in the same list, for the norm-statistics hand-over
    for blk in find_joint_blocks(diffusion_model):
        linears = {}
        for path, layer in nvfp4_layers(blk).items():
            linears[path] = FusedNVFP4Linear(layer, f"{blk.prefix}.{path}")
            patches[f"{blk.prefix}.{path}.forward"] = linears[path]
        if not linears:
            previous = None
            continue
        counts[blk.chain] += 1
        if scope != "block":
            continue
        fused = FusedJointBlock(blk.module, blk.prefix, blk.index, states[blk.modulated], linears=linears,
                                modulated=blk.modulated, chain_index=indexes[blk.chain], patch_key=blk.patch_key)
        if previous is not None and previous.name == f"{blk.chain}.{blk.index - 1}":
            previous.next = fused
        patches[f"{blk.prefix}.forward"] = fused
        previous = fused
    if not patches:
        return None

    prepare = block_check_preparer(states.values(), scope)

    return FamilyPatches(patches, _describe(counts, scope), prepare, block_dtypes=BLOCK_DTYPES)
