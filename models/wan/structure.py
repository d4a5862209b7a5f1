"""Where Wan's blocks are in a ComfyUI model, matched by structure, which of them the fused block takes, and between
which of them x may be handed over.

ComfyUI's Wan models (comfy/ldm/wan/: WanModel for Wan 2.1 / 2.2 T2V, I2V, FLF2V and the 5B TI2V, and the variants
built on it) run their transformer blocks in ``diffusion_model.blocks``. A block is fused when it runs ComfyUI's
``WanAttentionBlock.forward`` (its class, or a subclass that keeps that forward) over the layout the fused block reads:
norm1 / norm2 LayerNorms without affine parameters, norm3 a LayerNorm with them or an Identity, the self-attention's
q / k / v / o over the hidden size with full-width q / k RMSNorms, ComfyUI's text or image-and-text cross-attention,
the feed-forward [Linear, GELU (tanh), Linear] and the [1, 6, D] modulation table. Anything else (a block class with a
forward of its own, such as VACE's control blocks or HuMo's audio blocks; a renamed or reshaped layer) runs ComfyUI's
forward, and the family's description on the node says which and why.

The hand-over of norm1's statistics from block i to block i + 1 is computed by block i's last residual from the x it
returns, so it is only correct when nothing changes x between the two calls. Which models guarantee that is read
from the model's own forward (its ``forward_orig``): ComfyUI's WanModel and camera model loops leave x alone
between blocks (another node's ``double_block`` patches are checked per call); VACE adds its control signal after the
blocks its mapping names, S2V's audio injector and Animate's face adapter change x after theirs, so the hand-over
stops there; a forward not listed here (a variant of its own, a custom node's model) gets no hand-over at all.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import torch

from ... import comfy_adapter

# The arguments of WanAttentionBlock.forward the fused block takes and passes on (any other: ComfyUI's forward).
FORWARD_ARGUMENTS = ("self", "x", "e", "freqs", "context", "context_img_len", "transformer_options")
# The NVFP4 Linears the fused block calls itself (the cross-attention's k / v of the context, and I2V's image k / v,
# are ComfyUI's module calls: the core's fused Linear packs them).
LINEAR_PATHS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o", "ffn.0",
                "ffn.2")
QKV_PATHS = LINEAR_PATHS[:3]


@dataclasses.dataclass
class WanBlock:
    prefix: str  # attribute path below the diffusion model, e.g. "blocks.3"
    index: int
    module: torch.nn.Module


@dataclasses.dataclass
class WanBlocks:
    """The blocks of one Wan model the fused block takes, the others with why not, and the hand-over's stops."""

    blocks: list[WanBlock]
    left: dict[str, str]  # block prefix -> why ComfyUI's forward runs
    handoff_stops: dict[int, str]  # block index i -> why block i hands nothing over to block i + 1
    handoff_off: str | None  # why no block hands over in this model (None: the stops above only)

    def handoff_refusal(self, index: int) -> str | None:
        return self.handoff_off or self.handoff_stops.get(index)


def submodule(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _linear_shape(module) -> tuple[int, int] | None:
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    return None


def _full_width_rms_norm(norm, dim: int) -> bool:
    return (isinstance(norm, torch.nn.RMSNorm) and tuple(norm.normalized_shape) == (dim,)
            and getattr(norm, "weight", None) is not None)


def _plain_layer_norm(norm, dim: int) -> bool:
    return (isinstance(norm, torch.nn.LayerNorm) and tuple(norm.normalized_shape) == (dim,)
            and getattr(norm, "weight", None) is None and getattr(norm, "bias", None) is None)


def _attention_refusal(attn, dim: int, forwards, name: str) -> str | None:
    if attn is None or type(attn).forward not in forwards:
        return f"its {name} is not ComfyUI's ({type(attn).__name__})"
    if attn.num_heads * attn.head_dim != dim:
        return f"its {name} heads do not cover the hidden size"
    for path in ("q", "o") if name == "cross-attention" else ("q", "k", "v", "o"):
        if _linear_shape(getattr(attn, path, None)) != (dim, dim):
            return f"its {name} {path} is not a {dim} x {dim} Linear"
    norms = ("norm_q",) if name == "cross-attention" else ("norm_q", "norm_k")
    if not all(_full_width_rms_norm(getattr(attn, n, None), dim) for n in norms):
        return f"its {name} q / k have no RMSNorm over the hidden size"
    return None


def block_refusal(block, module) -> str | None:
    """None if ``block`` is ComfyUI's WanAttentionBlock in the layout the fused block reads (``module``: ComfyUI's
    comfy/ldm/wan/model.py), else why it runs ComfyUI's forward."""
    if type(block).forward is not getattr(module.WanAttentionBlock, "forward", None):
        return f"{type(block).__name__} has a forward of its own"
    if tuple(inspect.signature(module.WanAttentionBlock.forward).parameters) != FORWARD_ARGUMENTS:
        return "WanAttentionBlock.forward takes other arguments than the fused block passes"
    dim = getattr(block, "dim", None)
    if not isinstance(dim, int):
        return "no hidden size"
    if not (_plain_layer_norm(getattr(block, "norm1", None), dim)
            and _plain_layer_norm(getattr(block, "norm2", None), dim)):
        return "norm1 / norm2 are not LayerNorms without affine parameters over the hidden size"
    norm3 = getattr(block, "norm3", None)
    if not (isinstance(norm3, torch.nn.Identity) or isinstance(norm3, torch.nn.LayerNorm) and tuple(
            norm3.normalized_shape) == (dim,) and norm3.weight is not None and norm3.bias is not None):
        return "norm3 is neither a LayerNorm with weight and bias over the hidden size nor an Identity"
    reason = _attention_refusal(getattr(block, "self_attn", None), dim, (module.WanSelfAttention.forward,),
                                "self-attention")
    if reason is None:
        reason = _attention_refusal(getattr(block, "cross_attn", None), dim, (
            module.WanT2VCrossAttention.forward, module.WanI2VCrossAttention.forward), "cross-attention")
    if reason is not None:
        return reason
    ffn = getattr(block, "ffn", None)
    feed_forward = getattr(module, "WanFeedForward", torch.nn.Sequential)
    if not (isinstance(ffn, torch.nn.Sequential) and len(ffn) == 3
            and type(ffn).forward in (feed_forward.forward, torch.nn.Sequential.forward)
            and isinstance(ffn[1], torch.nn.GELU) and ffn[1].approximate == "tanh"):
        return "its feed-forward is not [Linear, GELU (tanh), Linear]"
    shape0, shape2 = _linear_shape(ffn[0]), _linear_shape(ffn[2])
    if shape0 is None or shape2 is None or shape0[0] != dim or shape2 != (shape0[1], dim):
        return "its feed-forward Linears do not map the hidden size through one width and back"
    modulation = getattr(block, "modulation", None)
    if not isinstance(modulation, torch.Tensor) or tuple(modulation.shape) != (1, 6, dim):
        return "its modulation table is not [1, 6, hidden size]"
    return None


def _every_fifth(model) -> dict[int, str]:
    return {i: "the face adapter adds to x after this block" for i in range(0, len(model.blocks), 5)}


# Model forwards (``forward_orig`` by qualified name, in comfy/ldm/wan/) -> the blocks after which the forward
# changes x in place (block i's hand-over to block i + 1 would describe the x before that change).
HANDOFF_STOPS = {
    "WanModel.forward_orig": lambda model: {},
    "CameraWanModel.forward_orig": lambda model: {},
    "VaceWanModel.forward_orig": lambda model: {
        i: "VACE adds its control blocks' output to x after this block" for i in model.vace_layers_mapping},
    "WanModel_S2V.forward_orig": lambda model: {
        i: "the audio injector changes x after this block" for i in model.audio_injector.injected_block_id},
    "AnimateWanModel.forward_orig": _every_fifth,
}


def handoff_stops(model) -> tuple[dict[int, str], str | None]:
    """``(stops, off)`` of the model's forward (module docstring): the blocks whose hand-over stops, or why there is
    none at all."""
    forward = getattr(type(model), "forward_orig", None)
    qualname, where = getattr(forward, "__qualname__", ""), getattr(forward, "__module__", "") or ""
    stops = HANDOFF_STOPS.get(qualname) if where.startswith("comfy.ldm.wan.") else None
    if stops is None:
        return {}, (f"no hand-over of norm statistics between blocks: the model's own forward "
                    f"({type(model).__name__}) may change x between them")
    try:
        return stops(model), None
    except (AttributeError, TypeError) as exc:  # the forward's attributes are not where this ComfyUI keeps them
        return {}, f"no hand-over of norm statistics between blocks: {type(model).__name__}: {exc}"


def wan_module(model):
    """ComfyUI's comfy/ldm/wan/model.py when ``model`` is one of its Wan models (None otherwise)."""
    if not type(model).__module__.startswith("comfy.ldm.wan."):
        return None
    try:
        return comfy_adapter.wan_model_module()
    except ImportError:
        return None


def find_wan_blocks(model) -> WanBlocks | None:
    """The Wan blocks of ``model`` (None: not one of ComfyUI's Wan models)."""
    module = wan_module(model)
    blocks = getattr(model, "blocks", None)
    if module is None or not isinstance(blocks, torch.nn.ModuleList):
        return None
    found, left = [], {}
    for i, block in enumerate(blocks):
        reason = block_refusal(block, module)
        if reason is None:
            found.append(WanBlock(f"blocks.{i}", i, block))
        else:
            left[f"blocks.{i}"] = reason
    for name, child in model.named_children():  # block lists outside the model's block loop (VACE's)
        if name != "blocks" and isinstance(child, torch.nn.ModuleList):
            for i, block in enumerate(child):
                if isinstance(block, module.WanAttentionBlock):
                    left[f"{name}.{i}"] = (f"{type(block).__name__} in {name}, outside the model's block loop "
                                           "(its own forward around the block)")
    stops, off = handoff_stops(model)
    return WanBlocks(found, left, stops, off)


def block_module(block):
    """The module that defines ``block``'s class: its ``repeat_e``, ``apply_rope1`` and attention function, as the
    block's forward sees them."""
    return sys.modules.get(type(block).__module__)
