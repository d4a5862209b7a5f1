"""ComfyUI's real Z-Image model (``NextDiT`` of comfy/ldm/lumina/model.py, loaded by ComfyUI's loader from a
random-weight NVFP4 checkpoint at tiny width, 2 layers + 2 noise-refiner + 2 context-refiner blocks) against the
Patch node's fused clone, on the CPU.

Off the GPU the fused path runs kernels/twin_ops.py, the Python twin of the kernels: these tests show that the
family's fused block (models/zimage/block.py) computes ComfyUI's model bit for bit through the path users get
(``models.patch.apply_fused`` on a model patcher, the patches applied by ComfyUI's loading): two sigmas, batch 1 and
2, reference latents (``timestep_zero_index``), static input scales, a LoRA, another node's attention override and
post-block patches, with every fusion counted; the block check at the first forward, and a planted change of
ComfyUI's block caught by it; fp16 compute left to ComfyUI's blocks with the reason in the node text. The block
check is off unless a test turns it on, so a change of ComfyUI's block makes these tests fail instead of being
caught and routed around at run time. The self-check's probes have their own tests (tests/test_zimage_cpu.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
import zimage_model as zm
from parity import assert_bit_identical, differing, fresh_seed

from h3_fused_nvfp4.core import verdicts
from h3_fused_nvfp4.models.zimage.patch import FUSED
from h3_fused_nvfp4.tools import comfy_env
from h3_fused_nvfp4.tools import families as fam

pytestmark = pytest.mark.usefixtures("comfyui", "clean_models")


@pytest.fixture(autouse=True)
def zimage_env(force_nvfp4_compute, monkeypatch):
    """bf16 NVFP4 compute, tiny files detected at their width, the self-check's probes skipped (a block verdict of
    these tests is never stored: no cached verdict of a planted fault can reach another run)."""
    monkeypatch.setenv(verdicts.SELFCHECK_ENV, "skip")
    verdicts.forget_verdicts()
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)
    with fam.detection_reads_metadata():
        yield
    verdicts.forget_verdicts()


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def pack_log():
    capture = LogCapture()
    logger = logging.getLogger("h3_fused_nvfp4")
    logger.addHandler(capture)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield capture.messages
    logger.removeHandler(capture)
    logger.setLevel(level)


SIGMAS = (0.7, 0.3)


@pytest.mark.parametrize("batch,reference", [(1, False), (2, False), (1, True), (2, True)],
                         ids=["batch1", "batch2", "batch1-reference", "batch2-reference"])
def test_whole_model_bit_identical_and_fully_fused(batch, reference):
    """Two sigmas (batch 2: each entry its own sigma, then swapped); with a reference latent NextDiT runs its omni
    path (2B adaLN rows, timestep_zero_index slices in the noise refiner and the layers)."""
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    calls = [zm.inputs(patcher, sigmas=(SIGMAS[i], SIGMAS[1 - i])[:batch], reference=reference, seed=seed + 1)
             for i in range(2)]
    stock = [zm.forward(patcher, c) for c in calls]
    clone, report = zm.fused(patcher)
    assert [differing(zm.forward(clone, c), s) for c, s in zip(calls, stock)] == [0, 0], f"seed {seed}"
    assert zm.chain_lengths(clone) == {"layers": 2, "noise_refiner": 2, "context_refiner": 2}
    zm.assert_fully_fused(clone, forwards=2)
    assert f"patched Z-Image's blocks (2 layers, 2 noise-refiner, 2 context-refiner): {FUSED}" in report.summary()
    assert len(report.layers) == 30 and not report.left and not report.block_note


@pytest.mark.parametrize("static", ["mixed", "w1-w3-differ", "all"])
def test_static_input_scales(static):
    """Layers with a static input_scale: their packs read it (no reduction); w1 and w3 share one pack only where
    their scales agree."""
    seed = fresh_seed()
    layers = [f"{chain}.{i}.{path}" for chain in zm.CHAINS for i in range(2)
              for path in ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    pick = {"mixed": ("attention.qkv", "feed_forward.w2", "feed_forward.w1", "feed_forward.w3"),
            "w1-w3-differ": ("feed_forward.w1",), "all": ("attention", "feed_forward")}[static]
    scales = {name: 3.0 / 2688 for name in layers if any(p in name for p in pick)}
    patcher = zm.build(seed=seed, static=scales)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1)
    stock = zm.forward(patcher, call)
    clone, report = zm.fused(patcher)
    assert_bit_identical(zm.forward(clone, call), stock, f"static {static}, seed {seed}")
    assert report.static_layers == len(scales) > 0
    zm.assert_fully_fused(clone, forwards=1, shared=static != "w1-w3-differ")


def _lora(patcher, names, seed: int) -> None:
    """Rank-4 LoRA tensors on ``names``, attached by ComfyUI's own loader functions (ComfyUI bakes them into the
    NVFP4 weights when it loads the model)."""
    import comfy.lora

    gen = torch.Generator().manual_seed(seed)
    dm = patcher.model.diffusion_model
    tensors, keys = {}, {}
    for name in names:
        module = dm.get_submodule(name)
        tensors[f"{name}.lora_up.weight"] = torch.randn(module.out_features, 4, generator=gen) * 0.05
        tensors[f"{name}.lora_down.weight"] = torch.randn(4, module.in_features, generator=gen) * 0.05
        keys[name] = f"diffusion_model.{name}.weight"
    patcher.add_patches(comfy.lora.load_lora(tensors, keys), 1.0)


def test_lora_baked_in_by_comfyui():
    """A LoRA on NVFP4 Linears and on an adaLN projection: ComfyUI patches the weights when it loads the model, and
    the fused clone reads the same patched weights (the LoRA changes the output in both arms alike)."""
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1)
    plain = zm.forward(patcher, call)
    lora = patcher.clone()
    _lora(lora, ["layers.0.attention.qkv", "layers.1.feed_forward.w2", "noise_refiner.1.adaLN_modulation.0",
                 "context_refiner.0.feed_forward.w3"], seed + 2)
    stock = zm.forward(lora, call)
    assert differing(stock, plain) > 0
    clone, _ = zm.fused(lora)
    assert_bit_identical(zm.forward(clone, call), stock, f"LoRA, seed {seed}")
    zm.assert_fully_fused(clone, forwards=1)


def test_weight_patched_on_the_fly_takes_comfyuis_path():
    """A Linear whose weight ComfyUI patches per call (a LoRA on a partly offloaded model: ``weight_function``) runs
    ComfyUI's forward for that layer, and a norm patched so runs torch's norm; the model stays bit-identical."""
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1)

    def patched_on_the_fly(dm):  # loading resets the weight functions: set after it
        dm.layers[1].attention.qkv.weight_function = [lambda w: w]
        dm.layers[0].ffn_norm1.weight_function = [lambda w: w]

    stock = zm.forward(patcher, call, loaded=patched_on_the_fly)
    clone, _ = zm.fused(patcher)
    assert_bit_identical(zm.forward(clone, call, loaded=patched_on_the_fly), stock, f"weight functions, seed {seed}")
    layer = zm.linears(clone)["layers.1.attention.qkv"]
    assert (layer.calls_fused, layer.calls_stock) == (0, 1)
    assert zm.blocks(clone)["layers.0"].counts["ffn_norm1"] == 0
    assert sum(v.calls_fused for v in zm.linears(clone).values()) == 29


def _halving_override(func, *args, **kwargs):
    """Another node's optimized_attention_override; the fused block must give it exactly ComfyUI's call."""
    return func(*args, **kwargs) * 0.5


def test_attention_override_of_another_node():
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1, reference=True)
    options = {"optimized_attention_override": _halving_override}
    stock = zm.forward(patcher, call, options)
    assert differing(stock, zm.forward(patcher, call)) > 0  # the override took effect
    clone, _ = zm.fused(patcher)
    assert_bit_identical(zm.forward(clone, call, options), stock, f"override, seed {seed}")
    zm.assert_fully_fused(clone, forwards=1)


def _post_block_patch(kind: str):
    """A post-block patch of NextDiT's loops that writes x between the blocks (halves the image tokens)."""
    def patch(args):
        return {"img": args["img"] * 0.5}
    return {"patches": {kind: [patch]}}


@pytest.mark.parametrize("kind", ["double_block", "noise_refiner"])
def test_post_block_patches_refuse_the_handoff(kind, pack_log):
    """ComfyUI's post-block patches change x between the blocks of their list (NextDiT writes the layers' patch
    output into the block's output in place): the hand-over in that list is refused with the reason, each block
    takes its own input, and the model stays bit-identical."""
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1)
    options = _post_block_patch(kind)
    stock = zm.forward(patcher, call, options)
    assert differing(stock, zm.forward(patcher, call)) > 0
    clone, _ = zm.fused(patcher)
    assert_bit_identical(zm.forward(clone, call, options), stock, f"{kind} patch, seed {seed}")
    chain = "layers" if kind == "double_block" else "noise_refiner"
    counts = {name: b.counts for name, b in zm.blocks(clone).items()}
    assert counts[f"{chain}.0"]["handoff_out"] == counts[f"{chain}.1"]["handoff_in"] == 0
    other = "noise_refiner" if chain == "layers" else "layers"
    assert counts[f"{other}.0"]["handoff_out"] == counts["context_refiner.0"]["handoff_out"] == 1
    assert any(f"post-block patches ({kind})" in m for m in pack_log), pack_log
    assert all(v.calls_fused == 1 for v in zm.linears(clone).values())


def test_block_check_passes_at_the_first_forward():
    """The first fused forward compares ComfyUI's and the fused block on its real input, once per kind of block
    (the first context-refiner block, the first noise-refiner block), and returns ComfyUI's result; the next forward
    runs fused, bit-identical."""
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1, reference=True)
    stock = zm.forward(patcher, call)
    clone, _ = zm.fused(patcher, block_check="pending")
    first = zm.forward(clone, call)
    checks = [(s.block_check, s.block_check_detail.split(":")[0]) for s in zm.states(clone)]
    assert checks == [("passed", "noise_refiner.0"), ("passed", "context_refiner.0")], zm.states(clone)
    second = zm.forward(clone, call)
    assert_bit_identical(first, stock, f"the checking forward, seed {seed}")
    assert_bit_identical(second, stock, f"after the check, seed {seed}")


def test_block_check_catches_a_planted_change_of_comfyuis_block(monkeypatch):
    """ComfyUI's modulation changed (one rounding where it rounds twice: ``1 + scale``, then the product): the block
    check of the modulated blocks finds the difference, those blocks run ComfyUI's (changed) code from then on, the
    refiner blocks stay fused."""
    from h3_fused_nvfp4 import comfy_adapter

    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1)
    lumina = comfy_adapter.lumina_model_module()

    def modulate_rounding_once(x, scale, timestep_zero_index=None):
        assert timestep_zero_index is None
        return (x.float() * (1 + scale.float().unsqueeze(1))).to(x.dtype)

    monkeypatch.setattr(lumina, "modulate", modulate_rounding_once)
    stock = zm.forward(patcher, call)
    clone, _ = zm.fused(patcher, block_check="pending")
    first, second = zm.forward(clone, call), zm.forward(clone, call)
    modulated, refiner = zm.states(clone)
    assert modulated.block_check == "failed" and "noise_refiner.0 output" in modulated.block_check_detail
    assert refiner.block_check == "passed", refiner.block_check_detail
    assert_bit_identical(first, stock, "the checking forward")
    assert_bit_identical(second, stock, "after the failed check")
    counts = {name: b.counts["fused"] for name, b in zm.blocks(clone).items()}
    # the checking block ran its fused route twice (a differing first comparison is repeated once), the refiner
    # blocks every forward but the check's
    assert counts == {"context_refiner.0": 2, "context_refiner.1": 2, "noise_refiner.0": 2, "noise_refiner.1": 0,
                      "layers.0": 0, "layers.1": 0}, counts


def test_fp16_compute_keeps_comfyuis_blocks_and_says_why(monkeypatch):
    """ComfyUI allows fp16 compute for Z-Image; the block fusion takes bf16: the node text says so, only the fused
    Linears (their fp16 packs) are patched, and the model stays bit-identical."""
    comfy_env.force_nvfp4_compute("fp16", monkeypatch.setattr)
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    assert patcher.model.get_dtype_inference() == torch.float16
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1)
    call.args = tuple(a.half() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a
                      for a in call.args)
    stock = zm.forward(patcher, call)
    clone, report = zm.fused(patcher)
    assert ("block fusion off: its kernels take bf16 and this model computes in fp16, so ComfyUI's blocks run"
            in report.summary()), report.summary()
    assert not zm.blocks(clone) and len(zm.linears(clone)) == 30
    assert_bit_identical(zm.forward(clone, call), stock, f"fp16, seed {seed}")
    assert all(v.calls_fused == 1 for v in zm.linears(clone).values())
    _, linears_only = zm.fused(patcher, scope="linears")  # no block fusion asked for: nothing to say about it
    assert "block fusion off" not in linears_only.summary(), linears_only.summary()


def test_fp16_call_of_a_fused_block_is_refused_by_name():
    """A fused block called with fp16 activations (a model whose compute dtype the patch could not tell) refuses the
    call with the reason, so ComfyUI's block runs it."""
    from h3_fused_nvfp4.models.zimage.block import JointCall

    patcher = zm.build(seed=fresh_seed())
    clone, _ = zm.fused(patcher)
    block = zm.blocks(clone)["context_refiner.0"]
    call = JointCall(torch.zeros(1, 32, 256, dtype=torch.float16), None, None, None, None, {})
    assert block.input_refusal(call) == ("the block computes in torch.float16: its fused kernels take bfloat16 "
                                         "(ComfyUI's block runs; its NVFP4 Linears keep the fused pack)")
    assert block.input_refusal(JointCall(call.x.bfloat16(), None, None, None, None, {})) is None


def test_scope_linears_patches_the_packs_only():
    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    call = zm.inputs(patcher, sigmas=SIGMAS, seed=seed + 1)
    stock = zm.forward(patcher, call)
    clone, report = zm.fused(patcher, scope="linears")
    assert not zm.blocks(clone) and "the NVFP4 Linears' packs only (scope linears)" in report.summary()
    assert_bit_identical(zm.forward(clone, call), stock, f"scope linears, seed {seed}")
    assert all(v.calls_fused == 1 for v in zm.linears(clone).values())


def test_blocks_at_token_counts_off_16_and_128_leave_what_the_caller_holds():
    """The patched blocks called the way NextDiT calls them, on 37 tokens a batch entry (Z-Image pads its sequences
    to 32 tokens; other callers need not), batch 2 with timestep_zero_index: ComfyUI's blocks bit for bit. The
    caller keeps the input and every block's output (a cache of the first block's output does): ComfyUI's blocks
    return new tensors, and so do the fused ones (the hand-over between them taken)."""
    from zimage_block import TINY, make_inputs

    seed = fresh_seed()
    patcher = zm.build(seed=seed)
    inputs = make_inputs(TINY, 2, 37, seed=seed + 1, timestep_zero_index=[(30, 37), (3, 9)])
    dm = patcher.model.diffusion_model
    adaln = dm.t_embedder(torch.tensor([0.2, 0.9, 0.4, 0.6]), dtype=torch.bfloat16)

    def run(model_patcher):
        import comfy.model_management as mm

        mm.load_models_gpu([model_patcher])
        held = [inputs.x.clone()]
        with torch.inference_mode():
            for i, layer in enumerate(model_patcher.model.diffusion_model.layers):
                held.append(layer(held[-1], None, inputs.freqs_cis, adaln,
                                  timestep_zero_index=inputs.timestep_zero_index,
                                  transformer_options={"block_index": i}))
        return held

    stock = [t.clone() for t in run(patcher)]
    clone, _ = zm.fused(patcher)
    fused = run(clone)
    for i, (a, b) in enumerate(zip(fused, stock)):
        assert_bit_identical(a, b, f"37 tokens, {'the input' if i == 0 else f'layer {i - 1} output'}, seed {seed}")
    layers = {n: b.counts for n, b in zm.blocks(clone).items() if n.startswith("layers")}
    assert layers["layers.0"]["handoff_out"] == layers["layers.1"]["handoff_in"] == 1
    assert all(c["residual"] == 2 for c in layers.values())


def test_handoff_waits_for_the_next_blocks_weights_under_dynamic_vram(monkeypatch):
    """Under dynamic VRAM the hand-over reads the next block's adaLN projection and attention_norm1 (a refiner: the
    norm) through ComfyUI's cast only once dynamic VRAM keeps them in VRAM (the toolkit asks the block which)."""
    from h3_fused_nvfp4 import comfy_adapter
    from h3_fused_nvfp4.models.zimage.block import JointCall

    clone, _ = zm.fused(zm.build(seed=fresh_seed()))
    blocks = zm.blocks(clone)
    streamed = {blocks["layers.1"].block.adaLN_modulation, blocks["context_refiner.1"].block.attention_norm1}
    monkeypatch.setattr(comfy_adapter, "weights_in_vram", lambda module: module not in streamed)
    x = torch.zeros(1, 32, 256, dtype=torch.bfloat16)
    options = {"prefetch_dynamic_vbars": True}
    layer = JointCall(x, None, None, torch.zeros(1, 256, dtype=torch.bfloat16), None, dict(options, block_index=0))
    assert "not kept the next block's adaLN_modulation weights in VRAM" in blocks["layers.0"].handoff_refusal(layer)
    refiner = JointCall(x, None, None, None, None, options)
    assert "next block's attention_norm1 weights" in blocks["context_refiner.0"].handoff_refusal(refiner)
    assert blocks["noise_refiner.0"].handoff_refusal(JointCall(x, None, None, layer.adaln_input, None, options)) is None
    streamed.clear()
    assert blocks["layers.0"].handoff_refusal(layer) is None
