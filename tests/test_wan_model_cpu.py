"""ComfyUI's real Wan models, stock vs the Patch node's fused clone (``models.patch.apply_fused``, scope "block"), on
the CPU at tiny widths: the whole diffusion model's output bit for bit.

Each model is a random-weight NVFP4 checkpoint built from ComfyUI's own model class (tools/families.py; variants
registered for the test the same way) and loaded by ComfyUI's ``load_diffusion_model_state_dict`` in fp16 (ComfyUI's
compute dtype for Wan on NVIDIA GPUs) or bf16, NVFP4 compute forced on. Off the GPU the fused path runs
kernels/twin_ops.py, the Python twin of the kernels: these tests prove the fused block's wiring (the norms folded into
the packs, the residuals with the next norm's statistics, the hand-over between blocks, the shared q / k / v pack,
GELU in ffn.2's pack, every fallback) computes ComfyUI's model bit for bit, and they count every fusion, so a path
that quietly fell back to ComfyUI's ops would fail them. They run with the block check passed (a changed ComfyUI
block makes them fail instead of being routed around), except the tests of the block check itself.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from parity import assert_bit_identical, selfcheck_mode

from h3_fused_nvfp4.core.linear import FusedNVFP4Linear
from h3_fused_nvfp4.kernels import twin_ops
from h3_fused_nvfp4.models import patch
from h3_fused_nvfp4.models.wan.block import FusedWanBlock
from h3_fused_nvfp4.models.wan.structure import find_wan_blocks
from h3_fused_nvfp4.tools import comfy_env
from h3_fused_nvfp4.tools import families as fam

pytestmark = pytest.mark.usefixtures("comfyui")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TINY = dict(fam._WAN_COMMON, dim=128, ffn_dim=256, num_heads=1, in_dim=16, out_dim=16)
# Variants of ComfyUI's Wan models, built like the families of tools/families.py (registered for these tests only).
VARIANTS = {
    "wan21_i2v": fam.Family("wan21_i2v", "Wan 2.1 I2V", "WanModel", "comfy.ldm.wan.model", "WAN21_I2V",
                            r"^blocks\.\d+\.((self_attn|cross_attn)\.([qkvo]|[kv]_img)|ffn\.[02])$", ("num_layers",),
                            True, full={}, tiny=dict(TINY, model_type="i2v", num_layers=3, in_dim=36)),
    "wan21_vace": fam.Family("wan21_vace", "Wan 2.1 VACE", "VaceWanModel", "comfy.ldm.wan.model", "WAN21_Vace",
                             r"^(vace_)?blocks\.\d+\.((self_attn|cross_attn)\.[qkvo]|ffn\.[02])$", ("num_layers",),
                             True, full={}, tiny=dict(TINY, model_type="vace", num_layers=4, vace_layers=2,
                                                      vace_in_dim=96)),
    "wan_no_norm3": fam.Family("wan_no_norm3", "Wan without cross_attn_norm", "WanModel", "comfy.ldm.wan.model",
                               "WAN21_T2V", fam.FAMILIES["wan22_14b"].quantized, ("num_layers",), True, full={},
                               tiny=dict(TINY, model_type="t2v", num_layers=3, cross_attn_norm=False)),
    "wan21_humo": fam.Family("wan21_humo", "Wan 2.1 HuMo", "HumoWanModel", "comfy.ldm.wan.model", "WAN21_HuMo",
                             r"^blocks\.\d+\.((self_attn|cross_attn)\.[qkvo]|ffn\.[02])$", ("num_layers",), True,
                             full={}, tiny=dict(TINY, model_type="humo", num_layers=2)),
}
STATIC_SCALE = 0.004  # amax 10.75: some of the tiny model's activations saturate, as calibrated scales can


@pytest.fixture
def wan_model(comfyui, monkeypatch, clean_models):
    """``load(name, dtype, layers=3, static={layer: scale})``: ComfyUI's ModelPatcher of a tiny Wan checkpoint."""
    import comfy.sd

    for name, family in VARIANTS.items():
        monkeypatch.setitem(fam.FAMILIES, name, family)

    def load(name: str, dtype: str = "fp16", *, layers: int | None = 3, static: dict | None = None, seed: int = 11):
        comfy_env.force_nvfp4_compute(dtype, monkeypatch.setattr)
        sd, metadata = fam.family_state_dict(name, width="tiny", layers=layers, seed=seed)
        for layer, scale in (static or {}).items():
            sd[f"{layer}.input_scale"] = torch.tensor(scale, dtype=torch.float32)
        patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
        assert type(patcher.model.diffusion_model).__name__ == fam.FAMILIES[name].model_class
        assert patcher.model.get_dtype_inference() == DTYPES[dtype]
        return patcher

    with selfcheck_mode("skip"):  # the block check is passed; its own tests set it pending
        yield load


def inputs(patcher, *, batch: int = 1, timesteps=(600.0,), frames_t: bool = False, seed: int = 5, size=(64, 48, 5),
           text: int = 7, device="cpu", **extra):
    """``(args, kwargs)`` of the diffusion model's forward as ComfyUI's apply_model passes them (latents and text in
    the compute dtype, float timesteps) at ``size`` (width, height, frames in pixels): ``batch`` items, one timestep
    each, or with ``frames_t`` one per latent frame (Wan 2.2 5B with a denoise mask)."""
    dm, dtype = patcher.model.diffusion_model, patcher.model.get_dtype_inference()
    gen = torch.Generator().manual_seed(seed)
    stride = 16 if dm.out_dim == 48 else 8
    w, h, frames = size
    latent_frames = 1 + (frames - 1) // 4
    x = torch.randn((batch, dm.patch_embedding.in_channels, latent_frames, h // stride, w // stride), generator=gen)
    context = torch.randn((batch, text, dm.text_embedding[0].in_features), generator=gen)
    t = torch.tensor(timesteps, dtype=torch.float32)
    if frames_t:
        t = t.view(batch, 1) * (1 - torch.arange(latent_frames, dtype=torch.float32) / (2 * latent_frames))
    kwargs = {k: v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in extra.items()}
    return (x.to(device, dtype), t.to(device), context.to(device, dtype)), kwargs


def forward(patcher, call, options=None, loaded=None) -> torch.Tensor:
    """One forward of the diffusion model, loaded as sampling loads it (``loaded(diffusion_model)`` runs then)."""
    import comfy.model_management as mm

    mm.load_models_gpu([patcher])  # applies the clone's object patches, as sampling does
    if loaded is not None:
        loaded(patcher.model.diffusion_model)
    args, kwargs = call
    transformer_options = dict(patcher.model_options.get("transformer_options", {}), **(options or {}))
    with torch.inference_mode():
        return patcher.model.diffusion_model(*[a.clone() for a in args], **kwargs,
                                             transformer_options=transformer_options)


def fused_clone(patcher, scope: str = "block", block_check: str = "passed"):
    clone, report = patch.apply_fused(patcher, scope, allow_reference_backend=True)
    assert report.applied, report.reason
    for state in {p.state for p in clone.object_patches.values() if isinstance(p, FusedWanBlock)}:
        state.block_check = block_check
    return clone, report


def fused_blocks(clone) -> dict[int, FusedWanBlock]:
    return {p.index: p for p in clone.object_patches.values() if isinstance(p, FusedWanBlock)}


def fused_linears(clone) -> dict[str, FusedNVFP4Linear]:
    return {p.name: p for p in clone.object_patches.values() if isinstance(p, FusedNVFP4Linear)}


def assert_fully_fused(clone, *, calls: int = 1, handoff_after=None, skip=()):
    """Every fusion of the block ran in each of ``calls`` forwards: norm1, norm3 and norm2 folded into the packs,
    three residual kernels, q / k RMSNorm + RoPE and the cross-attention q RMSNorm in place, one pack shared by q, k
    and v, the hand-over into every block after one in ``handoff_after`` (default: all but the last), and every NVFP4
    Linear call fused (the Linears named in ``skip`` excepted)."""
    blocks = fused_blocks(clone)
    last = max(blocks)
    handoff_after = set(range(last)) if handoff_after is None else set(handoff_after)
    for i, block in blocks.items():
        want = {"fused": calls, "norm1": calls, "norm3": calls, "norm2": calls, "residual": 3 * calls,
                "rms_norm_rope": calls, "rms_norm": calls, "handoff_out": calls * (i in handoff_after),
                "handoff_in": calls * (i - 1 in handoff_after)}
        assert {k: block.counts[k] for k in want} == want, (i, dict(block.counts))
        assert block.qkv.shared_packs == calls, (i, block.qkv.shared_packs)
    linears = {n: v for n, v in fused_linears(clone).items() if n not in skip}
    off = [(n, v.calls_fused, dict(v.stock_reasons)) for n, v in linears.items()
           if v.calls_stock or v.calls_fused != calls]
    assert linears and not off, off


@contextlib.contextmanager
def pack_sources():
    """The source of every pack the twin makes (what each NVFP4 Linear's pack read)."""
    seen, real = [], twin_ops.pack_nvfp4

    def recording(x, **kwargs):
        seen.append("gelu" if kwargs.get("gelu") else "layer_norm_modulate" if kwargs.get("addcmul_modulation") else
                    "layer_norm_affine" if kwargs.get("layer_norm") is not None else "plain")
        return real(x, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(twin_ops, "pack_nvfp4", recording)
        yield seen


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", ["14b batch 1", "14b batch 2", "5b frame timesteps, batch 2"])
def test_whole_model_matches_comfyui_at_two_sigmas(wan_model, dtype, case):
    """Three consecutive blocks (two hand-overs), two timesteps (sigmas), the first fused forward included."""
    name = "wan22_5b" if case.startswith("5b") else "wan22_14b"
    batch = 2 if "batch 2" in case else 1
    patcher = wan_model(name, dtype)
    calls = {t: inputs(patcher, batch=batch, timesteps=(t, t - 150.0)[:batch], frames_t="frame" in case,
                       size=(64, 64, 5) if name == "wan22_5b" else (64, 48, 5)) for t in (600.0, 300.0)}
    stock = {t: forward(patcher, call) for t, call in calls.items()}
    clone, report = fused_clone(patcher)
    assert "patched 3 Wan blocks, 30 NVFP4 layers" in report.summary(), report.summary()
    with pack_sources() as sources:
        for t, call in calls.items():
            assert_bit_identical(forward(clone, call), stock[t], f"{case} {dtype} t={t}")
    assert_fully_fused(clone, calls=2)
    # per block: ONE pack for q, k, v (modulated norm1), o, the cross q (norm3 with its affine parameters), the
    # context's k and v, the cross o, ffn.0 (modulated norm2), ffn.2 (GELU of ffn.0's output)
    block = ["layer_norm_modulate", "plain", "layer_norm_affine", "plain", "plain", "plain", "layer_norm_modulate",
             "gelu"]
    assert sources == block * 3 * 2, sources


@pytest.mark.parametrize("static", ["all", "q only", "ffn.2 and cross q"])
def test_static_input_scales(wan_model, static):
    """Static ``input_scale``s: one value for q, k and v shares their pack; a static q with dynamic k and v packs each
    (their scales differ); a static cross-attention q or ffn.2 reads no reduced scale."""
    paths = {"all": ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                     "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2"),
             "q only": ("self_attn.q",), "ffn.2 and cross q": ("ffn.2", "cross_attn.q")}[static]
    patcher = wan_model("wan22_14b", "fp16",
                        static={f"blocks.{i}.{p}": STATIC_SCALE for i in range(3) for p in paths})
    call = inputs(patcher, batch=2, timesteps=(700.0, 700.0))
    stock = forward(patcher, call)
    clone, report = fused_clone(patcher)
    assert f"{30 - 3 * len(paths)} dynamic-scale, {3 * len(paths)} static input_scale" in report.summary()
    assert_bit_identical(forward(clone, call), stock, f"static {static}")
    if static == "q only":
        for block in fused_blocks(clone).values():
            assert block.qkv.sharing_refusal is not None and block.qkv.shared_packs == 0
            block.qkv.shared_packs = 1  # the rest of the fusion as counted below
    assert_fully_fused(clone)


def test_lora_patched_layer_runs_comfyuis_path(wan_model):
    """A layer whose weight ComfyUI patches per call (a LoRA on a partly offloaded model: ``weight_function``) runs
    ComfyUI's forward on ComfyUI's input; q and v still share their pack, the rest of the block stays fused."""
    patcher = wan_model("wan22_14b", "fp16")
    call = inputs(patcher, batch=2, timesteps=(500.0, 500.0))

    def lora(dm):  # what ComfyUI's load sets on a layer whose LoRA it applies per call
        dm.blocks[1].self_attn.k.weight_function = [lambda w: w * 1.0625]

    try:
        stock = forward(patcher, call, loaded=lora)
        clone, _ = fused_clone(patcher)
        assert_bit_identical(forward(clone, call, loaded=lora), stock, "LoRA on blocks.1.self_attn.k")
    finally:
        patcher.model.diffusion_model.blocks[1].self_attn.k.weight_function = []
    assert not torch.equal(stock, forward(patcher, call)), "the planted LoRA changes nothing"
    k = fused_linears(clone)["blocks.1.self_attn.k"]
    assert k.calls_fused == 0 and list(k.stock_reasons.values()) == [1], dict(k.stock_reasons)
    assert "weight patches (LoRA)" in next(iter(k.stock_reasons))
    assert_fully_fused(clone, skip={"blocks.1.self_attn.k"})


def test_scope_linears_packs_each_linear_only(wan_model):
    patcher = wan_model("wan22_14b", "bf16")
    call = inputs(patcher)
    stock = forward(patcher, call)
    clone, _ = fused_clone(patcher, "linears")
    assert {type(p).__name__ for p in clone.object_patches.values()} == {"FusedNVFP4Linear"}
    with pack_sources() as sources:
        assert_bit_identical(forward(clone, call), stock, "scope linears")
    assert sources == ["plain"] * 30


def test_block_check_passes_on_the_first_call(wan_model):
    """The first fused forward's first block runs ComfyUI's block and the fused one on its real input, records a
    passing verdict and returns ComfyUI's result; the rest of that forward and the next run fused."""
    patcher = wan_model("wan22_14b", "fp16")
    call = inputs(patcher, batch=2, timesteps=(600.0, 600.0))
    stock = forward(patcher, call)
    clone, _ = fused_clone(patcher, block_check="pending")
    assert_bit_identical(forward(clone, call), stock, "the checking forward")
    state = fused_blocks(clone)[0].state
    assert state.block_check == "passed", state.block_check_detail
    assert "blocks.0: 48 rows bit-identical" in state.block_check_detail
    assert_bit_identical(forward(clone, call), stock, "after the check")
    blocks = fused_blocks(clone)
    assert [blocks[i].counts["fused"] for i in range(3)] == [1 + 1, 2, 2]  # block 0: the check's fused arm, then one


def test_block_check_catches_a_changed_comfyui_block(wan_model, monkeypatch):
    """A planted change of ComfyUI's block (its repeat_e rounds every modulation row up by one fp16 step) makes the
    first call's comparison differ: the verdict fails, the node is told, the model runs ComfyUI's (changed) blocks."""
    import comfy.ldm.wan.model as m

    patcher = wan_model("wan22_14b", "fp16")
    call = inputs(patcher)
    original = m.repeat_e

    def changed_repeat_e(e, x):
        out = original(e, x)
        return torch.nextafter(out, torch.full_like(out, 1e4)) if e.shape[-1] > 1 else out

    monkeypatch.setattr(m, "repeat_e", changed_repeat_e)
    stock = forward(patcher, call)
    clone, _ = fused_clone(patcher, block_check="pending")
    sent = []
    monkeypatch.setattr(patch.comfy_adapter, "send_progress_text", lambda node, text: sent.append(text))
    assert_bit_identical(forward(clone, call), stock, "the checking forward")
    state = fused_blocks(clone)[0].state
    assert state.block_check == "failed" and "differ" in state.block_check_detail, state.block_check_detail
    assert sent and sent[0].startswith("H3 fused NVFP4: block self-check FAILED"), sent
    assert_bit_identical(forward(clone, call), stock, "after the failed check")
    # the check's fused arm, twice (a first difference is compared again), and never after
    assert {i: b.counts["fused"] for i, b in fused_blocks(clone).items()} == {0: 2, 1: 0, 2: 0}


def _halving_override(func, *args, **kwargs):
    return func(*args, **kwargs) * 0.5


def _attn1_patch(args):
    return args["x"] + args["q"].flatten(2) * 0.25 - args["k"].flatten(2) * 0.125


def _attn2_patch(args):
    return args["x"] * 0.75


def _double_block_patch(args):
    return {"img": args["img"] * 0.5}


def _block_replace(args, extra):
    out = extra["original_block"](args)
    return {"img": out["img"] * 0.5}


PATCHES = {
    "attention override": (dict(optimized_attention_override=_halving_override), None),
    "attn1_patch": (dict(patches={"attn1_patch": [_attn1_patch]}), None),
    "attn2_patch": (dict(patches={"attn2_patch": [_attn2_patch]}), None),
    "double_block patch": (dict(patches={"double_block": [_double_block_patch]}), set()),
    "block replace on block 1": (dict(patches_replace={"dit": {("double_block", 1): _block_replace}}), set()),
}


@pytest.mark.parametrize("case", list(PATCHES))
def test_other_nodes_patches_keep_working(wan_model, case):
    """Patches ComfyUI lets other nodes install run where ComfyUI runs them, on the same tensors; a patch that can
    change x between blocks stops the hand-over (the statistics are made in the next block)."""
    options, handoff_after = PATCHES[case]
    patcher = wan_model("wan22_14b", "fp16")
    call = inputs(patcher, batch=2, timesteps=(650.0, 650.0))
    stock = forward(patcher, call, options)
    clone, _ = fused_clone(patcher)
    assert_bit_identical(forward(clone, call, options), stock, case)
    assert_fully_fused(clone, handoff_after=handoff_after)


def test_i2v_image_cross_attention(wan_model):
    """Wan 2.1 I2V: CLIP image tokens first in the context, a second attention over them (ComfyUI's modules), q packed
    from norm3 once for both."""
    patcher = wan_model("wan21_i2v", "fp16")
    clip = torch.randn((2, 257, 1280), generator=torch.Generator().manual_seed(3))
    call = inputs(patcher, batch=2, timesteps=(550.0, 550.0), clip_fea=clip)
    stock = forward(patcher, call)
    clone, _ = fused_clone(patcher)
    assert_bit_identical(forward(clone, call), stock, "I2V")
    assert_fully_fused(clone)
    assert all(fused_linears(clone)[f"blocks.{i}.cross_attn.{p}_img"].calls_fused == 1 for i in range(3)
               for p in "kv")


def test_without_cross_attention_norm(wan_model):
    """cross_attn_norm off (norm3 an Identity): the cross-attention q packs the residual's output itself, a plain
    pack with its own scale; the residual's statistics go to scratch."""
    patcher = wan_model("wan_no_norm3", "fp16")
    assert isinstance(patcher.model.diffusion_model.blocks[0].norm3, torch.nn.Identity)
    call = inputs(patcher, batch=2, timesteps=(600.0, 600.0))
    stock = forward(patcher, call)
    clone, _ = fused_clone(patcher)
    with pack_sources() as sources:
        assert_bit_identical(forward(clone, call), stock, "no norm3")
    block = ["layer_norm_modulate", "plain", "plain", "plain", "plain", "plain", "layer_norm_modulate", "gelu"]
    assert sources == block * 3, sources
    counts = [dict(b.counts) for b in fused_blocks(clone).values()]
    assert all(c["residual"] == 3 and c.get("norm3", 0) == 0 and c["norm2"] == 1 for c in counts), counts
    assert all(v.calls_fused == 1 and v.calls_stock == 0 for v in fused_linears(clone).values())


def test_vace_control_blocks_on_comfyuis_path_and_no_handover_where_vace_adds(wan_model):
    """VACE: the main blocks are fused; the control blocks (their own forward around the block, in vace_blocks) run
    ComfyUI's, their Linears packed; VACE adds to x in place after the blocks of its mapping, so no hand-over there.
    The fused block never writes its input: VACE's first control block reads the x that went into block 0."""
    patcher = wan_model("wan21_vace", "fp16", layers=None)
    dm = patcher.model.diffusion_model
    assert dm.vace_layers_mapping == {0: 0, 2: 1}
    gen = torch.Generator().manual_seed(9)
    vace = torch.randn((2, 1, 96, 2, 6, 8), generator=gen)
    call = inputs(patcher, batch=2, timesteps=(600.0, 600.0), vace_context=vace)
    call[1]["vace_strength"] = [0.8]
    stock = forward(patcher, call)
    clone, report = fused_clone(patcher)
    text = report.summary()
    assert "patched 4 Wan blocks (2 on ComfyUI's block (vace_blocks.0, vace_blocks.1: VaceWanAttentionBlock in " \
           "vace_blocks, outside the model's block loop" in text, text
    assert "no hand-over of norm statistics after 2 blocks: VACE adds its control blocks' output to x" in text, text
    assert_bit_identical(forward(clone, call), stock, "VACE")
    assert_fully_fused(clone, handoff_after={1})


def test_audio_blocks_stay_on_comfyuis_path(wan_model):
    """HuMo's audio blocks (an audio cross-attention between the cross-attention and norm2) run ComfyUI's forward,
    with the reason on the node; their NVFP4 Linears take the fused pack."""
    patcher = wan_model("wan21_humo", "bf16", layers=None)
    call = inputs(patcher)
    stock = forward(patcher, call)
    clone, report = fused_clone(patcher)
    assert "patched 0 Wan blocks (2 on ComfyUI's block (blocks.0, blocks.1: WanAttentionBlockAudio has a forward of " \
           "its own)" in report.summary(), report.summary()
    assert not fused_blocks(clone)
    assert_bit_identical(forward(clone, call), stock, "HuMo")
    assert all(v.calls_fused == 1 for v in fused_linears(clone).values())


@pytest.mark.parametrize("model_class, stops", [
    ("WanModel_S2V", {0: "the audio injector changes x after this block"}),
    ("AnimateWanModel", {0: "the face adapter adds to x after this block", 5: "the face adapter adds to x after "
                                                                              "this block"}),
    ("CameraWanModel", {}),
])
def test_handover_stops_of_the_variants(comfyui, model_class, stops):
    """Where the variants' own forwards change x between blocks (ComfyUI's classes, built on the meta device): S2V's
    audio injector after its injection layers, Animate's face adapter after every fifth block; the camera model's
    loop leaves x alone. Their blocks are WanAttentionBlocks: fused."""
    import importlib

    import comfy.ops

    module = importlib.import_module("comfy.ldm.wan.model_animate" if model_class == "AnimateWanModel"
                                     else "comfy.ldm.wan.model")
    config = {k: v for k, v in TINY.items() if k not in ("image_model", "model_type")}
    extra = {"WanModel_S2V": dict(audio_inject_layers=[0]), "AnimateWanModel": {}, "CameraWanModel": {}}[model_class]
    model = getattr(module, model_class)(**config, num_layers=7, **extra, dtype=torch.bfloat16, device="meta",
                                         operations=comfy.ops.disable_weight_init)
    found = find_wan_blocks(model)
    assert [b.index for b in found.blocks] == list(range(7)) and not found.left
    assert found.handoff_off is None and found.handoff_stops == {i: r for i, r in stops.items() if i < 7}


def test_a_model_of_its_own_gets_no_handover(comfyui):
    """A Wan model whose forward this pack has not read (a subclass with its own loop) keeps its blocks fused but
    hands nothing over between them: its loop may change x."""
    import comfy.ldm.wan.model as m
    import comfy.ops

    class OwnLoop(m.WanModel):
        def forward_orig(self, *args, **kwargs):
            return super().forward_orig(*args, **kwargs)

    OwnLoop.__module__ = "comfy.ldm.wan.model"
    config = {k: v for k, v in TINY.items() if k not in ("image_model",)}
    found = find_wan_blocks(OwnLoop(**config, num_layers=2, dtype=torch.bfloat16, device="meta",
                                    operations=comfy.ops.disable_weight_init))
    assert len(found.blocks) == 2 and "own forward (OwnLoop)" in found.handoff_off
    assert found.handoff_refusal(0) == found.handoff_off


def test_a_reshaped_block_is_left_alone(comfyui):
    """A block whose layers are not where or what the fused block reads (here: norm1 with affine parameters) runs
    ComfyUI's forward, with the reason."""
    import comfy.ldm.wan.model as m
    import comfy.ops

    config = {k: v for k, v in TINY.items() if k not in ("image_model",)}
    model = m.WanModel(**config, num_layers=2, dtype=torch.bfloat16, device="meta",
                       operations=comfy.ops.disable_weight_init)
    model.blocks[1].norm1 = comfy.ops.disable_weight_init.LayerNorm(128, elementwise_affine=True, device="meta")
    found = find_wan_blocks(model)
    assert [b.index for b in found.blocks] == [0]
    assert found.left == {"blocks.1": "norm1 / norm2 are not LayerNorms without affine parameters over the hidden "
                                      "size"}


# An op the self-check turned off, and what then stays fused (the count that must drop to 0 is the op's own).
FALLBACKS = {
    "layer_norm_f16": ("norm1", "norm3", "norm2", "handoff_out"),  # torch's LayerNorm; the residuals still fused
    "residual_layer_norm_f16": ("residual",),  # torch's addcmul / add, then the next norm's statistics in a pass
    "rms_norm_rope_f16": ("rms_norm_rope", "rms_norm"),  # ComfyUI's RMSNorm modules and apply_rope1
    "pack_layer_norm_modulate_f16": (),  # q / k / v and ffn.0 on ComfyUI's path: their Linears count it
    "pack_gelu_f16": (),
}


@pytest.mark.parametrize("op", list(FALLBACKS))
def test_an_op_turned_off_runs_comfyuis_op(wan_model, monkeypatch, op):
    """Every fused step has ComfyUI's op as its fallback: with one op refused (as a failed self-check refuses it) the
    model stays bit-identical, that step runs ComfyUI's op (its count stays 0) and the rest stays fused."""
    from h3_fused_nvfp4.core.plan import ForwardPlan

    patcher = wan_model("wan22_14b", "fp16")
    call = inputs(patcher, batch=2, timesteps=(450.0, 450.0))
    stock = forward(patcher, call)
    real = ForwardPlan.refusal
    monkeypatch.setattr(ForwardPlan, "refusal", lambda plan, *ops: (
        "planted: the self-check turned it off" if op in ops else real(plan, *ops)))
    clone, _ = fused_clone(patcher)
    assert_bit_identical(forward(clone, call), stock, f"{op} turned off")
    blocks = fused_blocks(clone)
    assert all(b.counts["fused"] == 1 for b in blocks.values())
    for name in FALLBACKS[op]:
        assert all(b.counts[name] == 0 for b in blocks.values()), (name, [dict(b.counts) for b in blocks.values()])
    linears = fused_linears(clone)
    refused = {n for n, v in linears.items() if v.calls_stock}
    want = {"pack_layer_norm_modulate_f16": {f"blocks.{i}.{p}" for i in range(3) for p in (
                "self_attn.q", "self_attn.k", "self_attn.v", "ffn.0")},
            "pack_gelu_f16": {f"blocks.{i}.ffn.2" for i in range(3)}}.get(op, set())
    assert refused == want, sorted(refused ^ want)


@contextlib.contextmanager
def answered_as_on_a_gpu():
    """Tensors say they are CUDA tensors (only while a CUDA wrapper's support check runs)."""
    real = torch.Tensor.is_cuda
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        torch.Tensor.is_cuda = real


@pytest.mark.parametrize("name, dtype, batch", [("wan22_14b", "fp16", 2), ("wan22_5b", "bf16", 1)])
def test_the_cuda_kernels_take_every_call_of_the_fused_block(wan_model, monkeypatch, name, dtype, batch):
    """Every call the fused block makes into the fused ops (packs, LayerNorm statistics, residuals, RMSNorm + RoPE)
    is one the CUDA wrappers take: their support checks (dtypes, shapes, strides, 16-byte alignment of the rows and
    of the strided modulation tables, one modulation index) answer None for it, the device check answered as on a
    GPU. A layout the kernels refuse would otherwise only show on the GPU, as a fallback."""
    from h3_fused_nvfp4.kernels import cuda_ops

    checks = {"pack_nvfp4": ("pack_support", lambda x, **kw: ((x,), {k: v for k, v in kw.items() if k in (
                  "swiglu", "modulation", "norm", "prescale", "up", "layer_norm", "addcmul_modulation", "gelu")})),
              "layer_norm_statistics": ("layer_norm_support", lambda x, norm, **kw: ((x, norm), kw)),
              "residual_layer_norm_": ("residual_layer_norm_support", lambda x, o, n, **kw: ((x, o, n), kw)),
              "rms_norm_rope_": ("rms_norm_rope_support", lambda q, k, qw, kw_, eps, **kw: ((q, k, qw, kw_), kw))}
    refused, asked = [], {op: 0 for op in checks}

    def checked(op, real):
        support, arguments = checks[op]

        def call(*args, **kwargs):
            a, kw = arguments(*args, **kwargs)
            with answered_as_on_a_gpu():
                reason = getattr(cuda_ops, support)(*a, **kw)
            asked[op] += 1
            if reason is not None:
                refused.append((op, reason))
            return real(*args, **kwargs)
        return call

    for op in checks:
        monkeypatch.setattr(twin_ops, op, checked(op, getattr(twin_ops, op)))
    patcher = wan_model(name, dtype)
    call = inputs(patcher, batch=batch, timesteps=(600.0, 520.0)[:batch], frames_t=True, size=(64, 64, 5))
    stock = forward(patcher, call)
    clone, _ = fused_clone(patcher)
    assert_bit_identical(forward(clone, call), stock, f"{name} {dtype}")
    assert not refused, refused
    assert asked == {"pack_nvfp4": 24, "layer_norm_statistics": 1 + 9, "residual_layer_norm_": 9,
                     "rms_norm_rope_": 6}, asked  # the twin's residuals make their statistics through its own op


def test_a_block_forward_with_other_arguments_is_left_alone(comfyui, monkeypatch):
    """A ComfyUI whose WanAttentionBlock.forward takes other arguments than the fused block passes on keeps its
    blocks on ComfyUI's forward (the fused block would call it wrongly), with the reason."""
    import comfy.ldm.wan.model as m
    import comfy.ops

    original = m.WanAttentionBlock.forward

    def forward_with_audio(self, x, e, freqs, context, context_img_len=257, audio=None, transformer_options={}):
        return original(self, x, e, freqs, context, context_img_len, transformer_options)

    monkeypatch.setattr(m.WanAttentionBlock, "forward", forward_with_audio)
    config = {k: v for k, v in TINY.items() if k not in ("image_model",)}
    found = find_wan_blocks(m.WanModel(**config, num_layers=1, dtype=torch.bfloat16, device="meta",
                                       operations=comfy.ops.disable_weight_init))
    assert not found.blocks
    assert found.left == {"blocks.0": "WanAttentionBlock.forward takes other arguments than the fused block passes"}
