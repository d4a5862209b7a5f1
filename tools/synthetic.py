"""Random-weight MiniMax H3 blocks, models and inputs built from ComfyUI's own classes.

Used by the report command, the benchmarks and the tests. Every module is ComfyUI's (``comfy.ldm.minimax.model``
built with ``comfy.ops.mixed_precision_ops``), every NVFP4 weight is made by ComfyUI's own
``QuantizedTensor.from_float(w, "TensorCoreNVFP4Layout")`` and loaded through the layer's own state-dict loader
under the key names and ``comfy_quant`` tags of an NVFP4 checkpoint. Nothing here re-implements ComfyUI: the
inputs follow ``MiniMaxH3Model._forward`` (modulation rows ``t_row * 3 + tag``, the text span split into tag runs,
per-token LongTensor rows for a varying denoise mask, rotation tables from ``rope_rotation_table``).

NVFP4 compute is forced on (``disabled=[]``), so the activations take ComfyUI's quantize path on any device; where
there is no FP4 GEMM (CPU, sm_90) comfy-kitchen dequantizes both operands and runs a bf16 matmul.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import comfy_adapter
from ..core.nvfp4_weights import comfy_quant_tag, make_nvfp4_linear, nvfp4_checkpoint_entries, random_weight
from ..models.h3 import patch as h3_patch
from ..models.h3.structure import LINEAR_PATHS

__all__ = ["comfy_quant_tag", "make_nvfp4_linear", "nvfp4_checkpoint_entries"]  # builders the tests use from here

TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2  # modality tags of MiniMaxH3Model._forward


@dataclasses.dataclass(frozen=True)
class H3Dims:
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    t_dim: int

    @property
    def label(self) -> str:
        return f"hidden {self.hidden}, {self.heads} heads x {self.head_dim}, ffn {self.ffn}, t_dim {self.t_dim}"


H3_FULL = H3Dims(hidden=5376, heads=56, head_dim=128, ffn=14336, t_dim=2688)  # MiniMaxH3Model defaults
H3_SMALL = H3Dims(hidden=256, heads=2, head_dim=128, ffn=512, t_dim=128)  # head_dim kept: the rope kernel needs 128
# 1344x768, 124 frames: 100 text + 2 x 207 audio + 37 x 24 x 42 video rows.
FULL_TOKENS = (100, 414, 37296)


def _model_module():
    return comfy_adapter.h3_model_module()


def h3_ops():
    """ComfyUI's op set for an NVFP4 checkpoint with NVFP4 compute forced on."""
    return comfy_adapter.mixed_precision_ops(torch.bfloat16, disabled=[])


def _random(shape, gen, device, std, dtype, mean=0.0):
    return random_weight(shape, gen, device, std, dtype, mean)


STATIC_INPUT_SCALE = {"attn.qkv_proj": 4.0 / 2688, "attn.out_proj": 2.0 / 2688, "mlp.fc1": 4.0 / 2688,
                      "mlp.fc2": 1.0 / 2688}


def module_state_dict(module: torch.nn.Module, *, seed: int, device, quantized: tuple[str, ...] = LINEAR_PATHS,
                      static_layers: tuple[str, ...] = (), prefix: str = "",
                      input_scales: dict[str, float] = STATIC_INPUT_SCALE) -> dict:
    """Random checkpoint tensors for every Linear / norm / buffer of ``module`` (built with ``h3_ops()``): NVFP4
    for the Linears whose path ends with one of ``quantized``, bf16 otherwise; those in ``static_layers`` with the
    static ``input_scale`` ``input_scales`` gives them."""
    gen = torch.Generator(device=device).manual_seed(int(seed))
    sd = {}
    for name, sub in module.named_modules():
        key = f"{prefix}{name}"
        if hasattr(sub, "in_features") and hasattr(sub, "out_features"):
            std = sub.in_features ** -0.5
            weight = _random((sub.out_features, sub.in_features), gen, device, std, torch.bfloat16)
            kind = next((q for q in quantized if name == q or name.endswith("." + q)), None)
            if kind is not None:
                scale = input_scales[kind] if kind in static_layers else None
                sd.update(nvfp4_checkpoint_entries(key, weight, scale))
            else:
                sd[f"{key}.weight"] = weight
            if getattr(sub, "bias", None) is not None:
                sd[f"{key}.bias"] = _random((sub.out_features,), gen, device, 0.02, torch.bfloat16)
        elif hasattr(sub, "normalized_shape") and getattr(sub, "weight", None) is not None:
            sd[f"{key}.weight"] = _random(tuple(sub.normalized_shape), gen, device, 0.1, torch.bfloat16, mean=1.0)
    for name, buf in module.named_buffers():
        if buf is not None:
            sd[f"{prefix}{name}"] = _random(tuple(buf.shape), gen, device, 1.0,
                                            buf.dtype if buf.is_floating_point() else torch.float32).abs()
    return sd


def make_dit_block(dims: H3Dims = H3_SMALL, *, seed: int = 0, device="cpu", static_layers: tuple[str, ...] = (),
                   curve: bool = False, gate_compress: bool = False):
    """One ComfyUI ``DiTBlock`` with random NVFP4 projections, loaded the way ComfyUI loads a checkpoint.

    ``curve``: the curve-form (``adaln_curve_grid``) configuration: ``apply_silu=False``, fp32 adaLN.
    ``static_layers``: projections that get a static ``input_scale``.
    """
    m = _model_module()
    block = m.DiTBlock(dims.hidden, dims.heads, dims.head_dim, dims.ffn, dims.t_dim, 1e-5, 1e-5,
                       apply_silu=not curve, adaln_dtype=torch.float32 if curve else None,
                       gate_compress=gate_compress, dtype=torch.bfloat16, device=device, operations=h3_ops())
    sd = module_state_dict(block, seed=seed, device=device, static_layers=static_layers)
    missing, unexpected = block.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"DiTBlock state dict mismatch: missing {missing}, unexpected {unexpected}")
    return block.requires_grad_(False)  # as ComfyUI loads models (comfy-kitchen's in-place rope needs it)


def model_state_dict(dims: H3Dims = H3_SMALL, *, num_layers: int = 2, refiner_layers: int = 2, text_dim: int = 64,
                     seed: int = 0, static_layers: tuple[str, ...] = (), curve: bool = False, device="cpu") -> dict:
    """A complete ``MiniMaxH3Model`` checkpoint (CPU tensors, real key names) with NVFP4 block projections.

    ``device``: where the random weights are drawn and quantized, one tensor at a time, each moved to the CPU right
    away (a full-size model on a GPU: seconds instead of many minutes of CPU random numbers and quantization)."""
    import comfy.ops

    m = _model_module()
    kwargs = dict(hidden_size=dims.hidden, num_layers=num_layers, token_refiner_num_layers=refiner_layers,
                  num_attention_heads=dims.heads, attention_head_dim=dims.head_dim, ffn_hidden_size=dims.ffn,
                  text_dim=text_dim, time_embed_hidden_size=dims.hidden, time_embed_dim=dims.t_dim,
                  adaln_curve_grid=33 if curve else None)
    skeleton = m.MiniMaxH3Model(**kwargs, dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    quantized = {f"{prefix}.{i}.{path}.weight": (f"{prefix}.{i}.{path}", path)
                 for prefix, n in (("blocks", num_layers), ("token_refiner.blocks", refiner_layers))
                 for i in range(n) for path in LINEAR_PATHS}
    sd = {}
    for name, param in skeleton.named_parameters():
        std = (0.1 if name.endswith("norm.weight") or ".norm" in name
               else (param.shape[-1] ** -0.5 if param.dim() == 2 else 0.02))
        mean = 1.0 if "norm" in name and name.endswith("weight") else 0.0
        value = _random(tuple(param.shape), gen, device, std, param.dtype, mean=mean)
        if name in quantized:
            key, path = quantized.pop(name)
            scale = STATIC_INPUT_SCALE[path] if path in static_layers else None
            sd.update({k: v.cpu() for k, v in nvfp4_checkpoint_entries(key, value, scale).items()})
        else:
            sd[name] = value.cpu()
        del value
    if quantized:
        raise RuntimeError(f"MiniMaxH3Model has no parameters {sorted(quantized)[:4]}...")
    for name, buf in skeleton.named_buffers():
        sd[name] = _random(tuple(buf.shape), gen, device, 1.0, buf.dtype).abs().cpu()
    return {k: v.contiguous() for k, v in sd.items()}


def text_tag_runs(text_rows: int) -> list[int]:
    """Presentation tags of a text span with vision pads (tag 0) inside it, as ``text_token_tags`` carries them."""
    tags = [TAG_TEXT] * text_rows
    for i in range(text_rows // 3, min(text_rows, text_rows // 3 + max(1, text_rows // 5))):
        tags[i] = TAG_VIDEO
    return tags


def mod_segments_for(text: int, audio: int, video: int, *, n_timesteps: int = 2, per_token_video: bool = False,
                     device="cpu", seed: int = 0) -> list:
    """``mod_segments`` as ``MiniMaxH3Model._forward`` builds them for ``[text | audio | video]``: text tag runs at
    timestep row 0, audio at the last timestep row, video at row 0 or (``per_token_video``) a LongTensor of rows."""
    t_video, t_audio = 0, n_timesteps - 1
    segments = []
    tags = text_tag_runs(text)
    start = 0
    for i in range(1, text + 1):
        if i == text or tags[i] != tags[start]:
            segments.append((start, i, t_video * 3 + tags[start]))
            start = i
    segments.append((text, text + audio, t_audio * 3 + TAG_AUDIO))
    a = text + audio
    if per_token_video:
        gen = torch.Generator().manual_seed(int(seed))
        rows = torch.randint(0, n_timesteps, (video,), generator=gen) * 3 + TAG_VIDEO
        segments.append((a, a + video, rows.to(device)))
    else:
        segments.append((a, a + video, t_video * 3 + TAG_VIDEO))
    return segments


def make_block_inputs(dims: H3Dims = H3_SMALL, tokens: tuple[int, int, int] = (19, 46, 245), *, seed: int = 0,
                      device="cpu", n_timesteps: int = 2, per_token_video: bool = False, curve: bool = False,
                      x_std: float = 1.0):
    """``(x, t_emb, mod_segments, rope_freqs)`` for ``DiTBlock.forward``; the default 310 rows are not a multiple
    of 16 or 128. ``curve``: t_emb in fp32, as the curve-form model interpolates it."""
    m = _model_module()
    text, audio, video = tokens
    s = text + audio + video
    gen = torch.Generator(device=device).manual_seed(int(seed))
    x = _random((s, dims.hidden), gen, device, x_std, torch.bfloat16)
    t_emb = _random((n_timesteps, dims.t_dim), gen, device, 1.0, torch.float32 if curve else torch.bfloat16)
    # H3's rope: 3 position axes x 16 frequencies = 48 rotation pairs over the first 96 of 128 head dims
    positions = torch.rand((s, 3), generator=gen, device=device, dtype=torch.float32) * 64
    inv = torch.rand((16,), generator=gen, device=device, dtype=torch.float32)
    half = (positions.unsqueeze(-1) * inv.view(1, 1, -1)).reshape(s, 48)
    rope = m.rope_rotation_table(torch.cat((half, half), dim=-1), torch.bfloat16)
    segments = mod_segments_for(text, audio, video, n_timesteps=n_timesteps, per_token_video=per_token_video,
                                device=device, seed=seed + 7)
    return x, t_emb, segments, rope


class BlockHolder(torch.nn.Module):
    """Stands in for a diffusion model around single blocks, so patch keys (``blocks.0...``) resolve."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)


def model_patcher_for(diffusion_model: torch.nn.Module, device=None):
    """A ComfyUI ``ModelPatcher`` whose ``diffusion_model`` is ``diffusion_model`` (object patches resolve on it)."""
    import comfy.model_management as mm
    import comfy.model_patcher

    class Base(torch.nn.Module):
        def __init__(self, dm):
            super().__init__()
            self.diffusion_model = dm

        def memory_required(self, input_shape=None):
            return 0

    device = torch.device(device) if device is not None else next(diffusion_model.parameters()).device
    # size given: ComfyUI would compute it from state_dict(), which refuses inference-mode QuantizedTensors
    return comfy.model_patcher.ModelPatcher(Base(diffusion_model), load_device=device,
                                            offload_device=mm.unet_offload_device(), size=1)


def fused_patcher(blocks, scope: str = "block", *, block_check: str = "passed", device=None):
    """``(patcher, patches)``: a ModelPatcher over ``blocks`` (in a :class:`BlockHolder`) carrying the H3 fusion's
    object patches, the way ComfyUI applies them (``patcher.patch_model()`` / ``unpatch_model()``).
    ``block_check``: the first-forward block check's starting state ("passed" skips it)."""
    holder = BlockHolder(blocks)
    found = h3_patch.build(holder, scope)
    if found is None:
        raise ValueError("no H3 block with an NVFP4 Linear among the blocks")
    for state in {p.state for p in found.patches.values() if hasattr(p, "state")}:
        state.block_check = block_check
    patcher = model_patcher_for(holder, device)
    for key, value in found.patches.items():
        patcher.add_object_patch(f"diffusion_model.{key}", value)
    return patcher, found.patches
