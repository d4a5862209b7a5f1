"""Random-weight NVFP4 checkpoints of ComfyUI's model families, built from ComfyUI's own model classes.

For each family, :func:`family_state_dict` instantiates ComfyUI's real diffusion model class on the meta device
with the configuration ComfyUI's detection (comfy/model_detection.py) derives for the official release, fills
random weights and stores the Linears that the published NVFP4 files quantize (the transformer blocks' attention
and MLP projections; embedders, modulation and final layers stay bf16) as NVFP4 entries made by ComfyUI's own
``QuantizedTensor.from_float`` (``core.nvfp4_weights.nvfp4_checkpoint_entries``), under the real key names. The
result loads through ``comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)``.

``width="full"`` is the official release's widths (hidden size, heads, depth; ``layers`` overrides the depth);
``width="tiny"`` the smallest widths the classes accept with every Linear's in_features a multiple of 16 (head
dimensions stay the official ones where the rotary embedding fixes them).

Metadata: like real LTX-2 files, every checkpoint carries its transformer configuration as safetensors metadata
(``{"config": json({"transformer": {...}})}``). ComfyUI's LTX-2, Wan and H3 detection reads it; LTX-2 needs it,
because detection reads ``cross_attention_dim`` from ``attn2.to_k.weight.shape[1]``, which an NVFP4 file packs to
half the width. Z-Image's and Qwen-Image's detection ignores metadata and pins the official widths (Z-Image is
recognised by ``dim == 3840``; Qwen-Image reads only ``in_channels`` and the depth), so their *tiny* files are
only detected as tiny when the caller makes detection honour the metadata; their *full* files are detected as
they are.

:func:`family_inputs` makes the diffusion model forward's inputs, following each model's ``forward`` signature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re

import torch

from ..core.nvfp4_weights import comfy_quant_tag, nvfp4_checkpoint_entries, random_weight
from . import synthetic as syn

BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    title: str
    model_class: str  # the diffusion model class ComfyUI builds (module-level name)
    model_module: str  # where it lives
    supported_model: str  # comfy.supported_models class ComfyUI picks for the full-width file
    quantized: str  # regex over module names: the Linears an NVFP4 release stores in NVFP4
    depth_keys: tuple[str, ...]  # config keys the ``layers`` override sets
    detection_reads_metadata: bool  # ComfyUI's detection branch merges metadata["config"]["transformer"]
    full: dict
    tiny: dict


_WAN_COMMON = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1),
                   qk_norm=True, cross_attn_norm=True, eps=1e-6, text_dim=4096, text_len=512)
_FLUX2_COMMON = dict(image_model="flux2", axes_dim=[32, 32, 32, 32], mlp_ratio=3.0, theta=2000, out_channels=128,
                     global_modulation=True, mlp_silu_act=True, qkv_bias=False, ops_bias=False,
                     default_ref_method="index", ref_index_scale=10.0, txt_ids_dims=[3], patch_size=1,
                     in_channels=128, vec_in_dim=None, yak_mlp=False, txt_norm=False)
_ZIMAGE_COMMON = dict(image_model="lumina2", patch_size=2, in_channels=16, qk_norm=True, axes_dims=[32, 48, 48],
                      axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0,
                      z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("z_image", "Z-Image Turbo", "NextDiT", "comfy.ldm.lumina.model", "ZImage",
           r"^(layers|noise_refiner|context_refiner)\.\d+\.(attention\.(qkv|out)|feed_forward\.w[123])$",
           ("n_layers",), False,
           full=dict(_ZIMAGE_COMMON, dim=3840, n_heads=30, n_kv_heads=30, n_layers=30, cap_feat_dim=2560),
           tiny=dict(_ZIMAGE_COMMON, dim=256, n_heads=2, n_kv_heads=2, n_layers=1, cap_feat_dim=64)),
    Family("flux2_klein", "FLUX.2 [klein] 4B", "Flux", "comfy.ldm.flux.model", "Flux2",
           r"^(double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear[12])$",
           ("depth", "depth_single_blocks"), False,
           full=dict(_FLUX2_COMMON, hidden_size=3072, num_heads=24, depth=5, depth_single_blocks=20,
                     context_in_dim=7680, guidance_embed=False),
           tiny=dict(_FLUX2_COMMON, hidden_size=128, num_heads=1, depth=1, depth_single_blocks=1,
                     context_in_dim=64, guidance_embed=False)),
    Family("flux2_dev", "FLUX.2 [dev]", "Flux", "comfy.ldm.flux.model", "Flux2",
           r"^(double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear[12])$",
           ("depth", "depth_single_blocks"), False,
           full=dict(_FLUX2_COMMON, hidden_size=6144, num_heads=48, depth=8, depth_single_blocks=48,
                     context_in_dim=15360, guidance_embed=True),
           tiny=dict(_FLUX2_COMMON, hidden_size=128, num_heads=1, depth=1, depth_single_blocks=1,
                     context_in_dim=64, guidance_embed=True)),
    # Wan 2.2 14B (T2V high/low noise) has Wan 2.1 14B's architecture: ComfyUI detects it as WAN21_T2V.
    # ComfyUI's WAN22_T2V class is the 5B TI2V model (out_dim 48): wan22_5b below.
    Family("wan22_14b", "Wan 2.2 14B T2V", "WanModel", "comfy.ldm.wan.model", "WAN21_T2V",
           r"^blocks\.\d+\.((self_attn|cross_attn)\.[qkvo]|ffn\.[02])$", ("num_layers",), True,
           full=dict(_WAN_COMMON, dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_dim=16, out_dim=16),
           tiny=dict(_WAN_COMMON, dim=128, ffn_dim=256, num_heads=1, num_layers=1, in_dim=16, out_dim=16)),
    Family("wan22_5b", "Wan 2.2 5B TI2V", "WanModel", "comfy.ldm.wan.model", "WAN22_T2V",
           r"^blocks\.\d+\.((self_attn|cross_attn)\.[qkvo]|ffn\.[02])$", ("num_layers",), True,
           full=dict(_WAN_COMMON, dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48),
           tiny=dict(_WAN_COMMON, dim=128, ffn_dim=256, num_heads=1, num_layers=1, in_dim=48, out_dim=48)),
    Family("ltx2", "LTX-2 (audio-video)", "LTXAVModel", "comfy.ldm.lightricks.av_model", "LTXAV",
           r"^transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn|"
           r"ff|audio_ff)\.(to_[qkv]|to_out\.0|net\.0\.proj|net\.2)$", ("num_layers",), True,
           full=dict(image_model="ltxav", num_layers=48, attention_head_dim=128, num_attention_heads=32,
                     cross_attention_dim=4096, audio_attention_head_dim=64, audio_num_attention_heads=32,
                     audio_cross_attention_dim=2048, caption_channels=3840, in_channels=128,
                     audio_in_channels=128, use_keyframes_abs_pos_embedding=False),
           tiny=dict(image_model="ltxav", num_layers=1, attention_head_dim=64, num_attention_heads=2,
                     cross_attention_dim=128, audio_attention_head_dim=32, audio_num_attention_heads=2,
                     audio_cross_attention_dim=64, caption_channels=64, in_channels=128,
                     audio_in_channels=128, use_keyframes_abs_pos_embedding=False,
                     # the text connectors (official: 2 layers, 30 heads x 128 = caption_channels)
                     connector_attention_head_dim=32, connector_num_attention_heads=2, connector_num_layers=1)),
    Family("qwen_image", "Qwen-Image", "QwenImageTransformer2DModel", "comfy.ldm.qwen_image.model", "QwenImage",
           r"^transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|"
           r"(img|txt)_mlp\.net\.(0\.proj|2))$", ("num_layers",), False,
           full=dict(image_model="qwen_image", in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=3584),
           tiny=dict(image_model="qwen_image", in_channels=64, out_channels=16, num_layers=1, attention_head_dim=128,
                     num_attention_heads=1, joint_attention_dim=64)),
    Family("minimax_h3", "MiniMax H3", "MiniMaxH3Model", "comfy.ldm.minimax.model", "MiniMaxH3",
           r"^(token_refiner\.)?blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.fc[12])$",
           ("num_layers",), True, full={}, tiny={}),
)}

# H3 through tools/synthetic.py: its dims and the text width of the tiny model.
_H3_DIMS = {"full": syn.H3_FULL, "tiny": syn.H3_SMALL}
_H3_TEXT_DIM = {"full": 4096, "tiny": 64}


def family_config(name: str, *, width: str = "tiny", layers: int | None = None) -> dict:
    """The transformer configuration (ComfyUI's detected ``unet_config``) of ``name`` at ``width``."""
    family = FAMILIES[name]
    if width not in ("tiny", "full"):
        raise ValueError(f"width must be 'tiny' or 'full', not {width!r}")
    config = dict(getattr(family, width))
    if layers is not None:
        for key in family.depth_keys:
            config[key] = int(layers)
    return config


def _model_class(family: Family):
    import importlib

    return getattr(importlib.import_module(family.model_module), family.model_class)


def skeleton(name: str, config: dict) -> torch.nn.Module:
    """ComfyUI's model class built from ``config`` on the meta device (no memory, shapes and names only)."""
    import comfy.ops

    family = FAMILIES[name]
    return _model_class(family)(**config, dtype=BF16, device="meta", operations=comfy.ops.disable_weight_init)


def _std(name: str, shape) -> tuple[float, float]:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf in ("weight", "scale"):
        return 0.1, 1.0
    if len(shape) >= 2:
        return math.prod(shape[1:]) ** -0.5, 0.0
    return 0.02, 0.0


def nvfp4_entry_shapes(prefix: str, out_features: int, in_features: int) -> dict:
    """Shape-only (meta) stand-ins of :func:`nvfp4_checkpoint_entries` (for detection checks at full width)."""
    rows16 = -(-out_features // 16) * 16
    rows, scale_cols = -(-out_features // 128) * 128, -(-(in_features // 16) // 4) * 4
    return {f"{prefix}.weight": torch.empty((rows16, in_features // 2), dtype=torch.uint8, device="meta"),
            f"{prefix}.weight_scale": torch.empty((rows, scale_cols), dtype=torch.float8_e4m3fn, device="meta"),
            f"{prefix}.weight_scale_2": torch.empty((), dtype=torch.float32, device="meta"),
            f"{prefix}.comfy_quant": comfy_quant_tag()}


def quantized_linears(name: str, model: torch.nn.Module) -> list[str]:
    """Module names of the Linears a family's NVFP4 release quantizes (in_features a multiple of 16)."""
    pattern = re.compile(FAMILIES[name].quantized)
    return [n for n, m in model.named_modules()
            if pattern.match(n) and hasattr(m, "in_features") and hasattr(m, "out_features")
            and m.in_features % 16 == 0]


def family_metadata(name: str, config: dict) -> dict:
    """Safetensors metadata of the file: its transformer configuration, as real LTX-2 files carry it."""
    transformer = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items() if k != "image_model"}
    return {"config": json.dumps({"transformer": transformer})}


def family_state_dict(name: str, *, width: str = "tiny", layers: int | None = None, seed: int = 0,
                      device: str = "cpu") -> tuple[dict, dict]:
    """``(state_dict, metadata)`` of a random-weight NVFP4 checkpoint of family ``name``, its tensors on the CPU
    like a loaded file.

    ``device``: where the random weights are drawn and quantized, one tensor at a time, each moved to the CPU right
    away (a full-width file on a GPU: seconds instead of a minute of CPU random numbers and quantization; the
    random streams differ between devices). ``device="meta"``: shapes and dtypes only (quantized entries as
    :func:`nvfp4_entry_shapes`), for checking what ComfyUI's detection makes of a full-width file without building
    one.
    """
    if name == "minimax_h3":
        return _h3_state_dict(width=width, layers=layers, seed=seed, device=device)
    config = family_config(name, width=width, layers=layers)
    model = skeleton(name, config)
    quantized = set(quantized_linears(name, model))
    modules = dict(model.named_modules())
    meta = str(device) == "meta"
    draw = "cpu" if meta else device
    gen = torch.Generator(device=draw).manual_seed(int(seed))
    sd = {}
    for key, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        owner, _, leaf = key.rpartition(".")
        shape = tuple(tensor.shape)
        if owner in quantized and leaf == "weight":
            layer = modules[owner]
            if meta:
                sd.update(nvfp4_entry_shapes(owner, layer.out_features, layer.in_features))
            else:
                weight = random_weight(shape, gen, draw, layer.in_features ** -0.5)
                sd.update({k: v.cpu() for k, v in nvfp4_checkpoint_entries(owner, weight).items()})
                del weight
            continue
        dtype = tensor.dtype
        if meta:
            sd[key] = torch.empty(shape, dtype=dtype, device="meta")
        elif tensor.is_floating_point():
            std, mean = _std(key, shape)
            sd[key] = random_weight(shape, gen, draw, std, dtype=dtype, mean=mean).cpu()
        else:
            sd[key] = torch.zeros(shape, dtype=dtype)
    return sd, family_metadata(name, config)


def block_collection(module_name: str) -> str:
    """The repeated-block list a module belongs to ("double_blocks.3.img_attn.qkv" -> "double_blocks"; a module
    outside any block list: its own name)."""
    match = re.match(r"^(.*?)\.\d+(\.|$)", module_name)
    return match.group(1) if match else module_name


def quantized_linear_counts(name: str, *, width: str = "full", layers: int | None = None) -> dict[str, int]:
    """How many Linears an NVFP4 file of ``name`` quantizes, per block list (:func:`block_collection`), from the
    model class on the meta device: what scales a measurement at ``layers`` blocks to the full depth (lists the
    ``layers`` override leaves alone, like Z-Image's refiners, keep their count)."""
    if name == "minimax_h3":  # tools/synthetic.py's model: four NVFP4 Linears per DiT and token-refiner block
        blocks = layers if layers is not None else (50 if width == "full" else 1)
        return {"blocks": 4 * blocks, "token_refiner.blocks": 4 * min(blocks, 2)}
    counts: dict[str, int] = {}
    for module in quantized_linears(name, skeleton(name, family_config(name, width=width, layers=layers))):
        collection = block_collection(module)
        counts[collection] = counts.get(collection, 0) + 1
    return counts


@contextlib.contextmanager
def detection_reads_metadata():
    """ComfyUI's detection with the file's metadata transformer config merged for every family, as its LTX-2, Wan
    and H3 branches do (tiny Z-Image and Qwen-Image files are otherwise taken for their official widths)."""
    import comfy.model_detection as md

    original = md.detect_unet_config

    def detect(state_dict, key_prefix, metadata=None):
        config = original(state_dict, key_prefix, metadata=metadata)
        if config is not None and metadata is not None and "config" in metadata:
            config.update(json.loads(metadata["config"]).get("transformer", {}))
        return config

    md.detect_unet_config = detect
    try:
        yield
    finally:
        md.detect_unet_config = original


def _h3_state_dict(*, width: str, layers: int | None, seed: int, device: str) -> tuple[dict, dict]:
    if str(device) == "meta":
        raise ValueError("MiniMax H3 is built by tools/synthetic.py with real tensors only")
    dims = _H3_DIMS[width]
    n = layers if layers is not None else (50 if width == "full" else 1)
    sd = syn.model_state_dict(dims, num_layers=n, refiner_layers=min(n, 2), text_dim=_H3_TEXT_DIM[width], seed=seed,
                              device=device)
    config = dict(hidden_size=dims.hidden, num_layers=n, token_refiner_num_layers=min(n, 2),
                  num_attention_heads=dims.heads, attention_head_dim=dims.head_dim, ffn_hidden_size=dims.ffn)
    return sd, family_metadata("minimax_h3", config)


# ---- forward inputs ----------------------------------------------------------------------------------------

# Measurement resolutions of the full-width builds: (width, height, frames); Wan 2.2 5B at its own 720p.
MEASUREMENT = {"z_image": (1024, 1024, 1), "flux2_klein": (1024, 1024, 1), "flux2_dev": (1024, 1024, 1),
               "wan22_14b": (832, 480, 81), "wan22_5b": (1280, 704, 121), "ltx2": (768, 512, 121),
               "qwen_image": (1328, 1328, 1), "minimax_h3": (1344, 768, 124)}
# Tiny sizes (pixels; latents are a few patches wide) and text tokens.
TINY = {"z_image": (64, 48, 1), "flux2_klein": (64, 48, 1), "flux2_dev": (64, 48, 1), "wan22_14b": (64, 48, 5),
        "wan22_5b": (64, 64, 5), "ltx2": (96, 64, 9), "qwen_image": (64, 48, 1), "minimax_h3": (128, 128, 5)}


@dataclasses.dataclass
class ForwardInputs:
    """``diffusion_model(*args, **kwargs)``; ``kwargs`` gets ``transformer_options`` from the caller."""
    args: tuple
    kwargs: dict

    def to(self, device) -> "ForwardInputs":
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device)
            if isinstance(v, (list, tuple)):
                return type(v)(move(t) for t in v)
            return v
        return ForwardInputs(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()})


def family_inputs(name: str, model: torch.nn.Module, *, width: str = "tiny", resolution=None, tokens: int = 7,
                  seed: int = 0) -> ForwardInputs:
    """Inputs of ``model.forward`` (the diffusion model ComfyUI built) at ``resolution`` = (width, height, frames) in
    pixels (default: :data:`TINY` or, for ``width="full"``, :data:`MEASUREMENT`), with ``tokens`` text tokens.
    Latents and text embeddings are bf16 and timesteps float32, as ``BaseModel.apply_model`` passes them."""
    w, h, frames = resolution or (MEASUREMENT if width == "full" else TINY)[name]
    gen = torch.Generator().manual_seed(int(seed))

    def randn(*shape, dtype=BF16):
        return torch.randn(shape, generator=gen).to(dtype)

    if name == "z_image":
        x = randn(1, model.in_channels, h // 8, w // 8)
        cap = randn(1, tokens, model.cap_embedder[-1].in_features, dtype=BF16)
        return ForwardInputs((x, torch.tensor([0.6]), cap, tokens), {})
    if name.startswith("flux2"):
        x = randn(1, model.params.in_channels, h // 16, w // 16)
        ctx = randn(1, tokens, model.params.context_in_dim, dtype=BF16)
        kwargs = {"guidance": torch.tensor([4.0])} if model.params.guidance_embed else {}
        return ForwardInputs((x, torch.tensor([0.6]), ctx), kwargs)
    if name.startswith("wan"):
        stride = 16 if model.out_dim == 48 else 8
        t = 1 + (frames - 1) // 4
        x = randn(1, model.patch_embedding.in_channels, t, h // stride, w // stride)
        ctx = randn(1, tokens, model.text_embedding[0].in_features, dtype=BF16)
        return ForwardInputs((x, torch.tensor([600.0]), ctx), {})
    if name == "ltx2":
        t = 1 + (frames - 1) // 8
        video = randn(1, model.in_channels, t, h // 32, w // 32)
        audio_t = max(1, round(frames / 25 * 25))  # 25 audio latent frames per second; video at 25 fps
        audio = randn(1, 8, audio_t, 16)  # 8 channels x 16 mel bins (LTXAVModel's audio patchifier)
        ctx = randn(1, tokens, 2 * model.caption_channels, dtype=BF16)
        return ForwardInputs(([video, audio], torch.tensor([0.6]), ctx), {"frame_rate": 25, "audio_length": audio_t})
    if name == "qwen_image":
        x = randn(1, 16, 1, h // 8, w // 8)
        ctx = randn(1, tokens, model.txt_in.in_features, dtype=BF16)
        return ForwardInputs((x, torch.tensor([0.6]), ctx), {})
    if name == "minimax_h3":
        t = 1 + (frames - 1) // 4
        video = randn(1, model.latents_dim, t, h // 16, w // 16)
        audio_t = max(1, round(frames * 40 / 24))  # 124 frames -> 207 audio frames (FACTS section 2)
        audio = randn(1, model.audio_latents_dim, 2, audio_t)
        ctx = randn(1, tokens, model.condition_proj.in_features, dtype=BF16)
        tags = torch.tensor(([1, 1, 0, 0] + [1] * tokens)[:tokens])
        payload = {"text_token_tags": tags}
        return ForwardInputs(([video, audio], torch.tensor([700.0]), ctx), {"minimax_payload": payload})
    raise KeyError(name)
