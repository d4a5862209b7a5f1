"""Wan's block fusion as a model family of the core's patching (core/patching.py).

Patched keys (``diffusion_model.`` prefix), on top of the core's fused Linear for every NVFP4 Linear:

    blocks.{i}.forward                              FusedWanBlock      (scope "block")
    blocks.{i}.{self_attn.[qkvo],cross_attn.[qo],ffn.[02]}.forward   FusedNVFP4Linear, NVFP4 layers only (both scopes)

Matching is structural (models/wan/structure.py): the blocks that run ComfyUI's WanAttentionBlock forward are fused,
the others keep ComfyUI's forward (their NVFP4 Linears the fused pack) and the summary on the node says which and
why, and so does it for the blocks after which the model's own forward changes x (no hand-over there). The
self-check runs the Linear's probes and Wan's (models/wan/probes.py), and the first patched block checks the whole
block on the first forward.
"""

from __future__ import annotations

import collections

from ...blocks.state import block_check_preparer
from ...core.linear import FusedNVFP4Linear, is_nvfp4_linear
from ...core.patching import SCOPES, FamilyPatches
from ...core.probes import LINEAR_PROBES
from .block import FusedWanBlock, WanState
from .probes import WAN_PROBES
from .structure import LINEAR_PATHS, find_wan_blocks, submodule

name = "Wan"
PROBE_SETS = (LINEAR_PROBES, WAN_PROBES)  # what the self-check runs before this model's kernels are used
probe_sets = PROBE_SETS


def _notes(found, fused: int) -> str:
    """What the node says of the blocks left on ComfyUI's forward and of the hand-over's stops."""
    notes = []
    for reason, names in _grouped(found.left).items():
        notes.append(f"{len(names)} on ComfyUI's block ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}: "
                     f"{reason})")
    if fused > 1 and found.handoff_off:
        notes.append(found.handoff_off)
    elif fused > 1 and found.handoff_stops:
        stops = _grouped({f"blocks.{i}": r for i, r in sorted(found.handoff_stops.items())})
        notes += [f"no hand-over of norm statistics after {len(names)} blocks: {reason}"
                  for reason, names in stops.items()]
    return f" ({'; '.join(notes)})" if notes else ""


def _grouped(reasons: dict[str, str]) -> dict[str, list[str]]:
    grouped = collections.defaultdict(list)
    for key, reason in reasons.items():
        grouped[reason].append(key)
    return grouped


def build(diffusion_model, scope: str = "block") -> FamilyPatches | None:
    """The Wan patches of every matched block (None: not a Wan model, or one without a block the fused block takes
    or leaves on ComfyUI's forward for a reason the node shows); no side effects."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    found = find_wan_blocks(diffusion_model)
    if found is None:
        return None
    patches: dict[str, object] = {}
    state = WanState()
    blocks, previous = 0, None  # the fused block just before, for the norm-statistics hand-over
    for blk in found.blocks:
        linears = {}
        for path in LINEAR_PATHS:
            layer = submodule(blk.module, path)
            if is_nvfp4_linear(layer):
                linears[path] = FusedNVFP4Linear(layer, f"{blk.prefix}.{path}")
                patches[f"{blk.prefix}.{path}.forward"] = linears[path]
        if not linears:
            previous = None
            continue
        blocks += 1
        if scope != "block":  # "linears": each NVFP4 Linear's pack only (the fused Linears above)
            continue
        block = FusedWanBlock(blk.module, blk.prefix, blk.index, linears, state, found.handoff_refusal(blk.index))
        if previous is not None and previous.index == blk.index - 1:
            previous.next = block
        patches[f"{blk.prefix}.forward"] = block
        previous = block
    if not patches and not found.left:
        return None
    description = f"{blocks} Wan blocks" + (_notes(found, blocks) if scope == "block" else "")

    prepare = block_check_preparer((state,), scope)

    return FamilyPatches(patches, description, prepare)
