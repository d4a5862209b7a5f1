"""ComfyUI's real Z-Image model (``NextDiT``), stock and through the Patch node's path, for the Z-Image model tests.

A random-weight NVFP4 checkpoint of tools/families.py (ComfyUI's own model class and quantizer, the official key
names) is loaded by ``comfy.sd.load_diffusion_model_state_dict``; the fused arm is the clone that
``models.patch.apply_fused`` returns, as the Patch node makes it; forwards run as ComfyUI's sampling runs them
(``load_models_gpu`` applies the clone's object patches; timesteps from the model's own sampling; batch entries
with their own sigma; reference latents make NextDiT's omni path, whose blocks take ``timestep_zero_index``).
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from h3_fused_nvfp4.core.linear import FusedNVFP4Linear
from h3_fused_nvfp4.models import patch
from h3_fused_nvfp4.tools import families as fam

CHAINS = ("context_refiner", "noise_refiner", "layers")  # NextDiT's block lists, in the order a forward runs them


def build(*, width: str = "tiny", layers: int = 2, seed: int = 0, device: str = "cpu", static: dict | None = None):
    """A Z-Image checkpoint loaded by ComfyUI (call inside ``fam.detection_reads_metadata()`` at tiny width);
    ``static``: layer name -> fp32 ``input_scale`` stored with it."""
    import comfy.sd

    sd, metadata = fam.family_state_dict("z_image", width=width, layers=layers, seed=seed, device=device)
    for layer, scale in (static or {}).items():
        sd[f"{layer}.input_scale"] = torch.tensor(scale, dtype=torch.float32)
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
    assert patcher is not None and type(patcher.model.diffusion_model).__name__ == "NextDiT"
    return patcher


@dataclasses.dataclass
class Call:
    args: tuple
    kwargs: dict


def inputs(patcher, *, sigmas=(0.7,), width: str = "tiny", text_tokens: int = 7, reference: bool = False,
           seed: int = 0, device="cpu") -> Call:
    """The diffusion model's inputs for one batch entry per sigma (each its own latent and caption), as ComfyUI's
    ``_apply_model`` passes them: the timestep from the model's sampling; ``reference``: one reference latent (NextDiT's
    omni path, ``timestep_zero_index`` in its blocks)."""
    base = patcher.model
    dm = base.diffusion_model
    entries = [fam.family_inputs("z_image", dm, width=width, tokens=text_tokens, seed=seed + i)
               for i in range(len(sigmas))]
    x = torch.cat([e.args[0] for e in entries]).to(device)
    context = torch.cat([e.args[2] for e in entries]).to(device)
    timesteps = base.model_sampling.timestep(torch.tensor(sigmas, dtype=torch.float32)).float().to(device)
    kwargs = {}
    if reference:
        gen = torch.Generator().manual_seed(seed + 99)
        kwargs["ref_latents"] = [torch.randn((1, x.shape[1], 4, 4), generator=gen).to(x.dtype).to(device)]
    return Call((x, timesteps, context, text_tokens), kwargs)


def forward(patcher, call: Call, transformer_options: dict | None = None, loaded=None) -> torch.Tensor:
    """One diffusion-model forward with ``patcher`` loaded the way sampling loads it; ``loaded(diffusion_model)``
    runs once it is (what loading resets, a test sets there)."""
    import comfy.model_management as mm

    mm.load_models_gpu([patcher])
    if loaded is not None:
        loaded(patcher.model.diffusion_model)
    options = dict(patcher.model_options.get("transformer_options", {}), **(transformer_options or {}))
    with torch.inference_mode():
        return patcher.model.diffusion_model(*call.args, **call.kwargs, transformer_options=options).clone()


def fused(patcher, scope: str = "block", block_check: str = "passed"):
    """``(clone, report)``: the Patch node's clone; ``block_check``: the first-forward block check's starting state
    of each kind of block ("passed" skips it; "pending" runs it)."""
    clone, report = patch.apply_fused(patcher, scope, allow_reference_backend=True)
    assert report.applied, report.reason
    for state in states(clone):
        state.block_check = block_check
    return clone, report


def blocks(clone) -> dict:
    """Block name ("layers.1") -> its fused block patch."""
    prefix, suffix = "diffusion_model.", ".forward"
    return {k[len(prefix):-len(suffix)]: v for k, v in clone.object_patches.items() if hasattr(v, "w1_w3")}


def linears(clone) -> dict:
    prefix, suffix = "diffusion_model.", ".forward"
    return {k[len(prefix):-len(suffix)]: v for k, v in clone.object_patches.items()
            if isinstance(v, FusedNVFP4Linear)}


def states(clone) -> list:
    return list({id(b.state): b.state for b in blocks(clone).values()}.values())


def chain_lengths(clone) -> dict:
    return collections.Counter(name.split(".")[0] for name in blocks(clone))


def assert_fully_fused(clone, forwards: int, *, handoff: bool = True, shared: bool = True, stock_layers=()):
    """In each of ``forwards`` forwards every fusion ran: every block fused, both its norms folded into the packs,
    both post-norm residual kernels, the hand-over between neighbours of one list (``handoff``), w1 and w3 read one
    pack (``shared``), every NVFP4 Linear call fused (but ``stock_layers``, on ComfyUI's path)."""
    lengths = chain_lengths(clone)
    for name, block in blocks(clone).items():
        chain, index = name.split(".")[0], int(name.split(".")[1])
        want = {"fused": forwards, "attention_norm1": forwards, "ffn_norm1": forwards, "residual": 2 * forwards,
                "handoff_in": forwards * (handoff and index > 0),
                "handoff_out": forwards * (handoff and index < lengths[chain] - 1)}
        assert {k: block.counts[k] for k in want} == want, (name, dict(block.counts))
        assert block.w1_w3.shared_packs == forwards * shared, (name, block.w1_w3.shared_packs)
    for name, linear in linears(clone).items():
        want = (0, forwards) if name in stock_layers else (forwards, 0)
        assert (linear.calls_fused, linear.calls_stock) == want, (name, linear.calls_fused, dict(linear.stock_reasons))
