"""ComfyUI's dynamic VRAM (its default memory mode on CUDA: ``ModelPatcherDynamic`` with comfy-aimdo) and the fused
path, on the CPU.

Dynamic VRAM keeps a layer's weights in system memory and casts them per call (comfy/ops.py
``cast_modules_with_vbar`` stages them, ``resolve_cast_module_with_vbar`` hands them out: LoRA patches applied on
the fly through ``LowVramPatch``, NVFP4 weights requantized, kept in VRAM when there is room); the model's block
loop prefetches each block's weights when that block starts (``transformer_options["prefetch_dynamic_vbars"]``)
and records each block's allocations (comfy/model_prefetch.py, the Comfy compiler). comfy-aimdo needs a GPU, so
the staging is done here on the CPU the way ``cast_modules_with_vbar`` does it, and the weights are resolved by
ComfyUI's own ``resolve_cast_module_with_vbar``; the real thing runs in ComfyUI's server on the GPU
(benchmarks/real_server.py).

* weights patched on the fly (LoRA on NVFP4 Linears, on the next block's adaLN projection and norm) reach both
  arms alike: bit-identical, every NVFP4 call fused, the norm-statistics hand-over between blocks taken;
* the hand-over waits while the next block's adaLN or norm weights are not kept in VRAM (casting them early would
  copy them once more), with the reason in the log;
* what outlives a block (the token index, silu(t_emb), the rows handed to the next block) is allocated outside
  ComfyUI's allocation graph.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch
from parity import assert_bit_identical, differing, fresh_seed

from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")

TOKENS = (19, 46, 245)
PREFETCH = {"prefetch_dynamic_vbars": True}  # what BaseModel._apply_model passes under ModelPatcherDynamic
IN_VRAM = b"resident"  # a cast's VRAM signature (comfy-aimdo's vbar_fault returns one where the weights fit)


class DynamicVram:
    """ComfyUI's dynamic-VRAM cast for chosen layers of ``holder``, on the CPU: each cast stages the layer's
    weights as ``cast_modules_with_vbar`` does (``_prefetch``: a gathered copy, its geometry) and lets ComfyUI's
    ``resolve_cast_module_with_vbar`` hand them out. ``in_vram``: the first cast keeps them (a signature, as when
    they fit in VRAM) and later casts find them resident; otherwise every cast stages them again (a cast buffer,
    no room in VRAM). ``lora``: module name -> LoRA tensors, attached as ComfyUI attaches them under dynamic VRAM
    (``LowVramPatch`` as ``weight_lowvram_function``, ``seed_key`` for the requantization's stochastic rounding).
    Every cast-capable module gets ``comfy_cast_weights`` as ``ModelPatcherDynamic.load`` sets it."""

    def __init__(self, patcher, names, *, in_vram: bool, lora: dict | None = None):
        import comfy.lora
        import comfy.model_patcher
        import comfy.ops

        self.ops = comfy.ops
        self.original = comfy.ops.cast_bias_weight
        self.holder = patcher.model.diffusion_model
        self.in_vram = in_vram
        self.casts = []
        self.layers = {self.holder.get_submodule(name) for name in names}
        keys = {name: f"diffusion_model.{name}.weight" for name in (lora or {})}
        patcher.add_patches(comfy.lora.load_lora({k: v for t in (lora or {}).values() for k, v in t.items()}, {
            name: key for name, key in keys.items()}), 1.0)
        for module in self.holder.modules():
            if hasattr(module, "comfy_cast_weights"):
                module.comfy_cast_weights = True
        for name, key in keys.items():
            if name not in names:  # a layer dynamic VRAM loads to the device gets its patches at load
                patcher.patch_weight_to_device(key)
        for name in names:
            layer = self.holder.get_submodule(name)
            key = f"diffusion_model.{name}.weight"
            layer.weight_lowvram_function = (comfy.model_patcher.LowVramPatch(key, patcher.patches)
                                             if key in patcher.patches else None)
            layer.seed_key = name
            layer._v = ("vbar stand-in", 0, 0)
            layer._v_signature = None  # ModelPatcherDynamic.load: not cast since loading

    def cast(self, s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False, compute_dtype=None,
             want_requant=False):
        if s not in self.layers:
            return self.original(s, input, dtype, device, bias_dtype, offloadable, compute_dtype, want_requant)
        import comfy.memory_management as cmm
        import comfy.model_management as mm
        from comfy.quant_ops import QuantizedTensor

        if input is not None:  # cast_bias_weight's defaults
            dtype = dtype or (input.params.orig_dtype if isinstance(input, QuantizedTensor) else input.dtype)
            bias_dtype = bias_dtype or dtype
            device = device or input.device
        if self.in_vram and s._v_signature is not None:
            s._prefetch = {"signature": IN_VRAM, "resident": True}
        else:
            staged = torch.empty(cmm.vram_aligned_size([s.weight, s.bias]), dtype=torch.uint8)
            mm.cast_to_gathered([s.weight, s.bias], staged)
            s._prefetch = {"signature": IN_VRAM if self.in_vram else None, "resident": False, "xfer_dest": staged,
                           "cast_dest": None, "cast_geometry": cmm.tensors_to_geometries([s.weight, s.bias]),
                           "needs_cast": False}
        try:
            weight, bias = self.ops.resolve_cast_module_with_vbar(s, dtype, device, bias_dtype, compute_dtype,
                                                                  want_requant)
        finally:
            del s._prefetch
        self.casts.append(s.seed_key)
        return (weight, bias, (None, None, None)) if offloadable else (weight, bias)

    @contextlib.contextmanager
    def active(self):
        self.ops.cast_bias_weight = self.cast
        try:
            yield self
        finally:
            self.ops.cast_bias_weight = self.original


def lora_tensors(holder, names, seed: int) -> dict:
    """Module name -> random LoRA tensors (rank 4 ``lora_up`` / ``lora_down``; a ``diff`` for a norm)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        module = holder.get_submodule(name)
        if hasattr(module, "in_features"):
            out[name] = {f"{name}.lora_up.weight": torch.randn(module.out_features, 4, generator=gen) * 0.05,
                         f"{name}.lora_down.weight": torch.randn(4, module.in_features, generator=gen) * 0.05}
        else:
            out[name] = {f"{name}.diff": torch.randn(tuple(module.weight.shape), generator=gen) * 0.05}
    return out


def run_blocks(blocks, inputs, options=PREFETCH):
    x, t_emb, segments, rope = inputs
    h = x.clone()
    with torch.inference_mode():
        for i, block in enumerate(blocks):
            h = block(h, t_emb, segments, rope, transformer_options=dict(options, block_index=i))
    return h


# The layers dynamic VRAM stages at full H3 width (it loads a layer of 16 KB or less to the device instead, LoRA
# applied at load): the NVFP4 projections and the adaLN projection of each block, not the norms.
STAGED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear")
PATCHED = ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2", "blocks.1.adaln_proj.linear", "blocks.2.adaln_proj.linear",
           "blocks.1.norm1")


def chain(seed, *, in_vram: bool, with_lora: bool, staged_norms: bool = False, static_layers=()):
    blocks = [syn.make_dit_block(seed=seed + i, static_layers=static_layers) for i in range(3)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 9)
    patcher, patches = syn.fused_patcher(blocks, "block")
    staged = [f"blocks.{i}.{path}" for i in range(3) for path in STAGED]
    staged += [f"blocks.{i}.norm1" for i in range(3)] if staged_norms else []
    lora = lora_tensors(patcher.model.diffusion_model, PATCHED, seed + 3) if with_lora else None
    return blocks, inputs, patcher, patches, DynamicVram(patcher, staged, in_vram=in_vram, lora=lora)


def fused_linears(patches):
    return [v for v in patches.values() if type(v).__name__ == "FusedNVFP4Linear"]


def handoffs(patches) -> list[int]:
    return [patches[f"blocks.{i}.forward"].counts["handoff_out"] for i in range(3)]


@pytest.mark.parametrize("with_lora,static", [(True, False), (True, True), (False, False)],
                         ids=["lora-on-the-fly", "lora-on-the-fly-static-out-proj-fc2", "no-lora"])
def test_weights_cast_by_dynamic_vram_match_comfyui(with_lora, static):
    """Two forwards (sampling steps) of three real blocks under dynamic VRAM's cast and prefetch: the LoRA on two
    NVFP4 Linears (fc2 with a static input_scale in the static variant: its weight requantized with a new scale),
    on block 1's norm1 and on blocks 1 and 2's adaLN projections (which the previous block's last residual reads for
    the hand-over) reaches both arms alike; every NVFP4 call fused, both norms folded; the hand-over is taken from
    the second forward on (the first cast of a layer after loading places it in VRAM)."""
    seed = fresh_seed()
    blocks, inputs, patcher, patches, dynamic = chain(seed, in_vram=True, with_lora=with_lora,
                                                      static_layers=("attn.out_proj", "mlp.fc2") if static else ())
    plain = run_blocks(blocks, inputs)
    with dynamic.active():
        stock = [run_blocks(blocks, inputs) for _ in range(2)]
        dynamic.casts.clear()
        for layer in dynamic.layers:  # a fresh load: nothing in VRAM yet
            layer._v_signature = None
        patcher.patch_model(load_weights=False)
        try:
            first = run_blocks(blocks, inputs)
            assert handoffs(patches) == [0, 0, 0]  # the next block's adaLN was not in VRAM yet
            second = run_blocks(blocks, inputs)
        finally:
            patcher.unpatch_model()
    assert_bit_identical(first, stock[0], f"first forward, LoRA {with_lora}, seed {seed}")
    assert_bit_identical(second, stock[1], f"second forward, LoRA {with_lora}, seed {seed}")
    assert (differing(stock[1], plain) > 0) == with_lora  # the LoRA took effect (in both arms)
    assert handoffs(patches) == [1, 1, 0]
    assert sorted(set(dynamic.casts)) == sorted(layer.seed_key for layer in dynamic.layers)
    assert all(v.calls_fused == 2 and v.calls_stock == 0 for v in fused_linears(patches)), [
        (v.name, v.calls_fused, dict(v.stock_reasons)) for v in fused_linears(patches)]
    for i in range(3):
        counts = patches[f"blocks.{i}.forward"].counts
        assert (counts["fused"], counts["norm1"], counts["norm2"]) == (2, 2, 2), (i, dict(counts))


def test_handoff_waits_for_weights_dynamic_vram_streams(caplog):
    """No room in VRAM: every cast stages the layer again. The next block's adaLN projection and (large) norm1
    would be copied once more if block i's residual cast them, so each block computes its own statistics; the
    result stays ComfyUI's, every NVFP4 call fused, and the log says why."""
    seed = fresh_seed()
    blocks, inputs, patcher, patches, dynamic = chain(seed, in_vram=False, with_lora=True, staged_norms=True)
    with dynamic.active():
        stock = run_blocks(blocks, inputs)
        patcher.patch_model(load_weights=False)
        try:
            with caplog.at_level(logging.INFO, logger="h3_fused_nvfp4"):
                result = run_blocks(blocks, inputs)
        finally:
            patcher.unpatch_model()
    assert_bit_identical(result, stock, f"streamed weights, seed {seed}")
    assert handoffs(patches) == [0, 0, 0]
    assert all(v.calls_fused == 1 and v.calls_stock == 0 for v in fused_linears(patches))
    assert "dynamic VRAM has not kept the next block's adaln_proj and norm1 weights in VRAM" in caplog.text


class RecordingMallocGraph:
    """Stands in for ComfyUI's active allocation graph (comfy/model_prefetch.py ``MALLOC_GRAPHS``): records whether
    allocations are paused, as ``pause_malloc_graph`` asks."""

    _comfy_active = True

    def __init__(self):
        self.paused = 0

    def pause(self, sync=False):
        self.paused += 1

    def resume(self, sync=False):
        self.paused -= 1


def test_what_outlives_a_block_is_allocated_outside_comfyuis_allocation_graph(monkeypatch):
    """Under the Comfy compiler each block's allocations are recorded and replayed per block: the token index,
    silu(t_emb) and the adaLN rows (every block's own and the next block's, handed over) outlive the call that
    makes them, so the fused block makes them with the graph paused; the result stays ComfyUI's."""
    import comfy.model_prefetch

    from h3_fused_nvfp4.models.h3 import modulation

    seed = fresh_seed()
    blocks = [syn.make_dit_block(seed=seed + i) for i in range(3)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=seed + 9)
    t_emb = inputs[1]
    stock = run_blocks(blocks, inputs)
    graph = RecordingMallocGraph()
    made = []
    silu, get = torch.nn.functional.silu, modulation.ModulationIndexCache.get

    def recording_silu(x, *args, **kwargs):
        if x.shape == t_emb.shape:
            made.append(("silu(t_emb)", graph.paused))
        return silu(x, *args, **kwargs)

    def recording_get(self, *args, **kwargs):
        made.append(("token index", graph.paused))
        return get(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "silu", recording_silu)
    monkeypatch.setattr(modulation.ModulationIndexCache, "get", recording_get)
    hooks = [b.adaln_proj.linear.register_forward_hook(lambda *_: made.append(("adaLN rows", graph.paused)))
             for b in blocks]
    patcher, patches = syn.fused_patcher(blocks, "block")
    monkeypatch.setitem(comfy.model_prefetch.MALLOC_GRAPHS, threading.get_ident(), graph)
    patcher.patch_model(load_weights=False)
    try:
        result = run_blocks(blocks, inputs)
    finally:
        patcher.unpatch_model()
        for hook in hooks:
            hook.remove()
    assert_bit_identical(result, stock, f"allocation graph, seed {seed}")
    assert handoffs(patches) == [1, 1, 0] and graph.paused == 0
    assert sorted({what for what, _ in made}) == ["adaLN rows", "silu(t_emb)", "token index"], made
    assert all(paused for _, paused in made), made


@pytest.mark.parametrize("in_vram", [True, False], ids=["kept-in-vram", "streamed"])
def test_static_scale_gemm_alpha_from_the_weight_comfyuis_cast_hands_out(monkeypatch, in_vram):
    """A Linear with a static input_scale gives its FP4 GEMM (Blackwell) the output scale input_scale x the weight's
    scale_2, which ComfyUI's GEMM computes from the weight its cast hands out. Under dynamic VRAM a LoRA is applied
    by that cast and the NVFP4 weight requantized with a scale_2 of its own: the alpha must be that weight's, on
    every call, not the stored weight's."""
    import comfy.ops

    from h3_fused_nvfp4 import comfy_adapter
    from h3_fused_nvfp4.core import linear as core_linear

    layer = syn.make_nvfp4_linear(256, 128, seed=11, input_scale=3.0 / 2688)  # a LoRA that moves scale_2
    holder = torch.nn.Module()
    holder.proj = layer
    patcher = syn.model_patcher_for(holder, "cpu")
    dynamic = DynamicVram(patcher, ["proj"], in_vram=in_vram, lora=lora_tensors(holder, ["proj"], 5))
    fused = core_linear.FusedNVFP4Linear(layer, "proj")
    alphas, cast_scales = [], []
    monkeypatch.setattr(core_linear, "gemm_mode", lambda device: "nvfp4")  # the FP4 GEMM's call, as on Blackwell

    def fp4_gemm(a, b, *, tensor_scale_a, tensor_scale_b, block_scale_a, block_scale_b, bias, out_dtype, alpha):
        alphas.append(alpha.clone())
        cast_scales.append(tensor_scale_b.clone())
        return torch.zeros((a.shape[0], b.shape[0]), dtype=out_dtype)

    monkeypatch.setattr(comfy_adapter, "scaled_mm_nvfp4", fp4_gemm)
    x = torch.randn((40, 256), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with dynamic.active(), torch.inference_mode():
        for _ in range(3):
            fused(x)
    stored = layer.weight._params.scale.float().reshape(1)
    assert fused.calls_fused == 3 and len(alphas) == 3
    assert all(torch.equal(s, cast_scales[0]) for s in cast_scales)
    assert not torch.equal(cast_scales[0].float().reshape(1), stored)  # the LoRA's requantization changed it
    want = (torch.tensor([3.0 / 2688], dtype=torch.float32) * cast_scales[0].float()).reshape(1)
    for alpha in alphas:
        assert torch.equal(alpha.view(torch.int32), want.view(torch.int32)), (alpha, want)
    assert comfy.ops.cast_bias_weight is dynamic.original
