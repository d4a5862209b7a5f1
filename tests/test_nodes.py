"""The node pack inside the real ComfyUI, headless on the CPU: ComfyUI's own loader imports it, prompts run through
``PromptExecutor``, ``comfy.sd.load_diffusion_model`` loads a tiny MiniMax H3 NVFP4 checkpoint (real key names and
``comfy_quant`` tags, model detection finds ``minimax_h3``), and the whole model runs through the Loader / Patch /
Toggle nodes. Off the GPU the fused path runs the Python twin of the kernels, which the nodes allow only when
``H3_FUSED_NVFP4_REFERENCE_ON_CPU=1`` is set as the pack is imported (the ``pack`` fixture does that).

ComfyUI imports the pack under its folder path while conftest.py imports the same files as ``h3_fused_nvfp4``: two
copies of every module, so tests reach the ones the nodes use through ``pack.submodule`` and compare patch objects
by class name.
"""

from __future__ import annotations

import logging

import comfy_harness as ch
import pytest
import torch
from comfy_harness import NUM_LAYERS, REFINER_LAYERS, UNET_NAME
from parity import assert_bit_identical

from h3_fused_nvfp4.core.linear import FusedNVFP4Linear
from h3_fused_nvfp4.core.patching import STATE_KEY
from h3_fused_nvfp4.models import patch as patch_mod
from h3_fused_nvfp4.models.h3.structure import LINEAR_PATHS
from h3_fused_nvfp4.tools import synthetic as syn

NODE_IDS = ["H3FusedNVFP4Loader", "H3FusedNVFP4Patch", "H3FusedNVFP4Toggle", "H3FusedNVFP4Calibrate",
            "H3FusedNVFP4SaveCalibrated"]
LOGGER = "h3_fused_nvfp4"

pytestmark = pytest.mark.usefixtures("selfcheck_forced")  # the nodes run the self-check as users get it


def load_graph(scope="block", toggles=True, loader="H3FusedNVFP4Loader") -> dict:
    if loader == "H3FusedNVFP4Loader":
        prompt = {"1": {"class_type": loader, "inputs": {"unet_name": UNET_NAME, "weight_dtype": "default",
                                                          "scope": scope}}}
    else:  # ComfyUI's own loader, then the Patch node
        prompt = {"0": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET_NAME, "weight_dtype": "default"}},
                  "1": {"class_type": "H3FusedNVFP4Patch", "inputs": {"model": ["0", 0], "scope": scope}}}
    if toggles:
        prompt["2"] = {"class_type": "H3FusedNVFP4Toggle",
                       "inputs": {"model": ["1", 0], "path": "comfy", "scope": "as patched"}}
        prompt["3"] = {"class_type": "H3FusedNVFP4Toggle",
                       "inputs": {"model": ["1", 0], "path": "fused", "scope": "as patched"}}
    return prompt


def expected_patch_keys(scope: str = "block") -> set[str]:
    keys = set()
    for prefix, n in (("blocks", NUM_LAYERS), ("token_refiner.blocks", REFINER_LAYERS)):
        for i in range(n):
            block = f"diffusion_model.{prefix}.{i}"
            keys.update(f"{block}.{path}.forward" for path in LINEAR_PATHS)
            if scope == "block":  # SwiGLU folded into fc2 (refiner blocks too), the DiT blocks' whole fusion
                keys.add(f"{block}.mlp.forward")
                if prefix == "blocks":
                    keys.update({f"{block}.forward", f"{block}.attn.forward"})
    return keys


def pack_records(caplog, level=logging.DEBUG):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def built_in_graph(build):
    """A model source factory: ``build()`` runs inside the executor (inference mode, as ComfyUI's loader nodes
    run), once; later executions reuse the model."""
    cache = {}

    def factory():
        if "model" not in cache:
            cache["model"] = build()
        return cache["model"]

    return factory


def _run_patched_and_comfy(build, tag, *, seed, what):
    """The model ``build()`` returns, through the Patch node (node "1") and through the Toggle set to ComfyUI's path
    (node "2"), one forward each on the same input: the two outputs must be bit-identical. Returns the run."""
    run = ch.run_prompt({"s": ch.model_source_node(ch.register_model(built_in_graph(build))),
                         "1": {"class_type": "H3FusedNVFP4Patch", "inputs": {"model": ["s", 0], "scope": "block"}},
                         "2": {"class_type": "H3FusedNVFP4Toggle",
                               "inputs": {"model": ["s", 0], "path": "comfy", "scope": "as patched"}},
                         "f1": ch.forward_node(["2", 0], f"{tag} comfy", seed=seed),
                         "f2": ch.forward_node(["1", 0], f"{tag} fused", seed=seed)})
    run.raise_for_status()
    for a, b in ch.forward_pairs(f"{tag} fused", f"{tag} comfy"):
        assert_bit_identical(a, b, what)
    return run


def stock_forwards(diffusion_model):
    return {name: type(m).forward for name, m in diffusion_model.named_modules()}


def assert_unpatched(diffusion_model, forwards):
    for key in expected_patch_keys("block"):
        path = key.removeprefix("diffusion_model.").removesuffix(".forward")
        forward = diffusion_model.get_submodule(path).forward
        assert getattr(forward, "__func__", None) is forwards[path], (key, forward)


# ---- loading the pack --------------------------------------------------------------------------------------

def test_pack_loads_as_v3_through_comfyui_loader(pack, comfyui):
    assert not hasattr(pack.module, "NODE_CLASS_MAPPINGS")
    assert sorted(pack.node_ids) == sorted(NODE_IDS)
    assert not [line for line in pack.log if "Traceback" in line or "Cannot import" in line], pack.log
    for node_id in NODE_IDS:
        cls = comfyui.nodes.NODE_CLASS_MAPPINGS[node_id]
        assert issubclass(cls, comfyui.io.ComfyNode) and cls.CATEGORY == "model/h3 fused nvfp4"
    assert set(pack.display_names) == set(NODE_IDS)
    toggle = comfyui.nodes.NODE_CLASS_MAPPINGS["H3FusedNVFP4Toggle"].INPUT_TYPES()
    assert toggle["required"]["path"][1]["options"] == ["fused", "comfy"]
    scope = (toggle.get("optional") or {}).get("scope") or toggle["required"]["scope"]
    assert scope[1]["options"] == ["as patched", *patch_mod.SCOPES] and scope[1]["default"] == "as patched"


# Loader, Patch and Toggle serve any model (every NVFP4 Linear is fused; H3 also gets its blocks): their names say
# NVFP4, not H3. Calibrate and Save Calibrated inspect H3 checkpoints and keep H3 in their names. Ids never change.
DISPLAY_NAMES = {
    "H3FusedNVFP4Loader": "Load Diffusion Model (Fused NVFP4)",
    "H3FusedNVFP4Patch": "Patch Model (Fused NVFP4)",
    "H3FusedNVFP4Toggle": "Fused NVFP4 Toggle",
    "H3FusedNVFP4Calibrate": "Calibrate H3 NVFP4 Scales",
    "H3FusedNVFP4SaveCalibrated": "Save Calibrated H3 NVFP4",
}


def test_display_names_and_texts_say_which_models(pack, comfyui):
    assert pack.display_names == DISPLAY_NAMES
    readme = (ch.REPO_ROOT / "README.md").read_text(encoding="utf-8")
    for node_id, name in DISPLAY_NAMES.items():
        assert f"**{name}**" in readme and f"`{node_id}`" in readme, name
    for node_id in ("H3FusedNVFP4Loader", "H3FusedNVFP4Patch", "H3FusedNVFP4Toggle"):
        schema = comfyui.nodes.NODE_CLASS_MAPPINGS[node_id].define_schema()
        assert "any" in schema.description, node_id
        texts = [schema.description] + [i.tooltip or "" for i in schema.inputs if i.id != "scope"]
        assert not any("MiniMax H3 model" in t or "H3 checkpoint" in t for t in texts), (node_id, texts)


# ---- the whole model through the nodes ---------------------------------------------------------------------

@pytest.mark.parametrize("scope", patch_mod.SCOPES)
def test_loader_toggle_whole_model_bit_identical(pack, model_file, clean_models, caplog, scope):
    """Loader -> Toggle(comfy) and Toggle(fused) -> the diffusion model's forward, twice: same bytes as ComfyUI."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    prompt = load_graph(scope)
    for tag, model_node in (("comfy", "2"), ("fused1", "3"), ("fused2", "3"), ("comfy2", "2")):
        prompt[f"f_{tag}"] = ch.forward_node([model_node, 0], tag, seed=5)
    run = ch.run_prompt(prompt)
    run.raise_for_status()
    loaded, comfy_clone, fused_clone = run.output("1"), run.output("2"), run.output("3")
    assert type(loaded.model).__name__ == "MiniMaxH3"  # ComfyUI's model detection found minimax_h3
    assert set(loaded.object_patches) == expected_patch_keys(scope)
    assert comfy_clone.object_patches == {} and set(fused_clone.object_patches) == expected_patch_keys(scope)
    for tag in ("fused1", "fused2", "comfy2"):
        for (a, b), stream in zip(ch.forward_pairs(tag, "comfy"), ("video", "audio"), strict=True):
            assert_bit_identical(a, b, f"{tag} {stream} output, scope {scope}")
    used = [v for k, v in fused_clone.object_patches.items()
            if type(v).__name__ == "FusedNVFP4Linear" and k.startswith("diffusion_model.blocks.")]
    assert len(used) == 4 * NUM_LAYERS and all(v.calls_fused > 0 and v.calls_stock == 0 for v in used), [
        (v.name, v.calls_fused, v.calls_stock) for v in used]
    if scope == "block":
        state = fused_clone.object_patches["diffusion_model.blocks.0.forward"].state
        assert state.block_check == "passed", state.block_check_detail
    summary = run.ui_text("1")
    layers, static = 4 * (NUM_LAYERS + REFINER_LAYERS), NUM_LAYERS + REFINER_LAYERS  # out_proj has input_scale
    assert summary.startswith(f"H3 fused NVFP4: patched {NUM_LAYERS} DiT + {REFINER_LAYERS} refiner blocks, "
                              f"{layers} NVFP4 layers ({layers - static} dynamic-scale, {static} static input_scale)")
    assert "self-check passed" in summary and f"scope {scope}" in summary
    assert run.ui_text("3") == summary
    assert run.ui_text("2").startswith("H3 fused NVFP4: ComfyUI's own NVFP4 path selected")
    # Unloaded: ComfyUI restored every forward it had replaced.
    dm = loaded.model.diffusion_model
    clean_models.unload_all_models()
    assert_unpatched(dm, stock_forwards(dm))


def test_a_cached_run_sends_each_pack_nodes_text_again(pack, model_file, clean_models, comfyui):
    """The same graph queued again from another tab is served from ComfyUI's execution cache: no pack node runs, and
    ComfyUI's executor sends each one's cached decision text to that tab (the nodes declare
    ``has_intermediate_output``), in the prompt's history too. Without it the new tab gets no text at all."""
    prompt = load_graph("block")
    prompt["f"] = ch.forward_node(["3", 0], "cached run", seed=5)
    server = ch.FakeServer()
    execution = comfyui.execution
    executor = execution.PromptExecutor(server, cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    texts = {}
    for run, client in enumerate(("first tab", "fresh tab")):
        server.messages.clear()
        executor.execute(prompt, f"prompt {run}", {"client_id": client}, ["f"])
        assert executor.success, executor.status_messages
        sent = {d["node"]: d["output"]["text"] for event, d, sid in server.messages
                if event == "executed" and sid == client and d["output"] and "text" in d["output"]}
        history = {k: v["text"] for k, v in executor.history_result["outputs"].items() if "text" in v}
        if run == 0:
            texts = sent
            assert set(texts) == {"1", "3"} and history == texts, (texts, history)  # 2 feeds no output
            continue
        (cached,) = [d["nodes"] for event, d in executor.status_messages if event == "execution_cached"]
        assert {"1", "3", "f"} <= set(cached), cached
        assert not [d for event, d, sid in server.messages if event == "executing" and d["node"] in texts]
        assert sent == texts and history == texts, (sent, history, texts)


def test_patch_node_after_comfyui_sparse_attention(pack, model_file, clean_models, comfyui):
    """ComfyUI's sparse-attention patch (``apply_block_sparse_attention``, what its BlockSparseAttention node does: a
    block-replace patch per block and an attention override; on the CPU it runs dense), then the Patch node: the
    fused blocks run under those patches, bits unchanged."""
    import comfy.sd
    from comfy_extras.nodes_sparse_attention import apply_block_sparse_attention

    def build():
        loaded = comfy.sd.load_diffusion_model(str(model_file))
        return apply_block_sparse_attention(loaded, tau=1.3, topk_ratio=0.0, vsa=False, start_percent=0.0,
                                            end_percent=1.0, min_tokens=0, dense_blocks="",
                                            sink_conditioning="exact_kv_and_rows", extra_tokens=256, verbose=False)

    run = _run_patched_and_comfy(build, "sparse", seed=6, what="under ComfyUI's sparse-attention patch")
    patched = run.output("1")
    replace = patched.model_options["transformer_options"]["patches_replace"]["dit"]
    assert ("double_block", 0) in replace  # the sparse node's block patch is still installed around ours
    assert patched.model_options["transformer_options"].get("optimized_attention_override") is not None
    used = [v for k, v in patched.object_patches.items() if type(v).__name__ == "FusedNVFP4Linear"
            and k.startswith("diffusion_model.blocks.")]
    assert used and all(v.calls_fused > 0 for v in used)


# ---- models the pack does not touch, devices it cannot use -------------------------------------------------

def _patch_only_graph(key: str) -> dict:
    return {"1": ch.model_source_node(key),
            "2": {"class_type": "H3FusedNVFP4Patch", "inputs": {"model": ["1", 0], "scope": "block"}}}


def test_model_without_nvfp4_layers_passes_through_with_one_warning(pack, caplog):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    source = syn.model_patcher_for(net, "cpu")
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = ch.run_prompt(_patch_only_graph(ch.register_model(source)))
    run.raise_for_status()
    patched = run.output("2")
    assert patched is not source and patched.object_patches == {} and source.object_patches == {}
    records = pack_records(caplog, logging.WARNING)
    assert len(records) == 1 and "Sequential) has no NVFP4-quantized Linear" in records[0].getMessage()
    assert run.ui_text("2") == records[0].getMessage()


def test_h3_blocks_without_nvfp4_layers_pass_through(pack, comfyui):
    import comfy.ldm.minimax.model as m
    import comfy.ops

    block = m.DiTBlock(64, 1, 128, 128, 32, 1e-5, 1e-5, dtype=torch.bfloat16,
                       operations=comfy.ops.disable_weight_init)
    clone, report = patch_mod.apply_fused(syn.model_patcher_for(syn.BlockHolder([block]), "cpu"), "block",
                                          allow_reference_backend=True)
    assert not report.applied and "no NVFP4-quantized Linear" in report.reason and clone.object_patches == {}


def test_cpu_without_reference_backend_is_left_unpatched(comfyui, caplog):
    source = syn.model_patcher_for(syn.BlockHolder([syn.make_dit_block(seed=41)]), "cpu")
    caplog.set_level(logging.INFO, logger=LOGGER)
    clone, report = patch_mod.apply_fused(source, "block")
    assert not report.applied and "no CUDA device" in report.reason and clone.object_patches == {}
    assert [r.levelno for r in pack_records(caplog)] == [logging.WARNING]


def test_kernel_build_failure_leaves_the_model_unpatched(pack, comfyui, monkeypatch, caplog):
    """The kernels fail to build for the (pretended) GPU: Patch returns the model unpatched and says why once."""
    pack_patch = pack.submodule("core.patching")
    source = syn.model_patcher_for(syn.BlockHolder([syn.make_dit_block(seed=51)]), "cpu")
    source.load_device = torch.device("cuda", 0)
    monkeypatch.setattr(pack_patch, "device_description", lambda device: "GPU Fake sm_121")
    monkeypatch.setattr(pack_patch, "kernel_status", lambda device: (False, "build failed: NVRTC (forced by test)"))
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = ch.run_prompt(_patch_only_graph(ch.register_model(source)))
    run.raise_for_status()
    assert run.output("2").object_patches == {}
    message = run.ui_text("2")
    assert message == ("H3 fused NVFP4: model left as ComfyUI runs it (block): kernels unavailable on GPU Fake "
                       "sm_121: build failed: NVRTC (forced by test)")
    assert [r.getMessage() for r in pack_records(caplog, logging.WARNING)] == [message]


def test_linear_build_failure_falls_back_and_logs_once(comfyui, monkeypatch, caplog):
    from h3_fused_nvfp4.core import plan as plan_mod
    from h3_fused_nvfp4.kernels import runtime

    layer = syn.make_nvfp4_linear(256, 768, seed=61)
    fused = FusedNVFP4Linear(layer, "blocks.0.attn.qkv_proj (build failure test)")

    def broken_backend(device):
        raise runtime.KernelBuildError("no kernels for sm_75 (forced)")

    monkeypatch.setattr(plan_mod, "backend_for", broken_backend)

    caplog.set_level(logging.INFO, logger=LOGGER)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(62)).to(torch.bfloat16)
    with torch.inference_mode():
        stock = layer(x)
        first, second = fused(x), fused(x)
    assert_bit_identical(first, stock, "first call")
    assert_bit_identical(second, stock, "second call")
    assert fused.calls_fused == 0 and fused.calls_stock == 2
    lines = [r.getMessage() for r in pack_records(caplog) if "build failure test" in r.getMessage()]
    assert len(lines) == 1 and "kernels unavailable: no kernels for sm_75 (forced)" in lines[0]


def test_lora_weight_wrapper_takes_comfyui_path_for_that_layer(pack, model_file, clean_models, comfyui):
    """A weight wrapper on one layer (what a LoRA loader installs), added before the Patch node: that layer takes
    ComfyUI's path, the rest stays fused, the model output is unchanged."""
    import comfy.sd

    lora_layer = "blocks.0.attn.qkv_proj"

    def build():
        source = comfy.sd.load_diffusion_model(str(model_file))
        source.add_weight_wrapper(f"diffusion_model.{lora_layer}.weight", lambda weight: weight)
        return source

    run = _run_patched_and_comfy(build, "lora", seed=7, what="LoRA-like wrapper")
    linears = {v.name: v for v in run.output("1").object_patches.values() if type(v).__name__ == "FusedNVFP4Linear"}
    assert linears[lora_layer].calls_fused == 0 and linears[lora_layer].calls_stock > 0
    assert all(v.calls_fused > 0 for k, v in linears.items() if k.startswith("blocks.") and k != lora_layer)


def test_missing_file_is_a_clear_validation_error(pack, model_file):
    with pytest.raises(AssertionError, match="unet_name: 'no_such_model.safetensors' not in"):
        ch.run_prompt({"1": {"class_type": "H3FusedNVFP4Loader",
                             "inputs": {"unet_name": "no_such_model.safetensors", "weight_dtype": "default",
                                        "scope": "block"}}})


def test_toggle_keeps_the_patched_scope(pack, model_file, clean_models):
    prompt = load_graph("linears")
    run = ch.run_prompt(prompt)
    run.raise_for_status()
    assert set(run.output("3").object_patches) == expected_patch_keys("linears")
    state = run.output("3").model_options["transformer_options"][STATE_KEY]
    assert state["scope"] == "linears"


@pytest.mark.parametrize("weight_dtype", ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"])
def test_loader_passes_the_same_model_options_as_unet_loader(pack, model_file, monkeypatch, weight_dtype):
    """Loader and ComfyUI's UNETLoader resolve the same file and pass the same model_options (recorded)."""
    import comfy.sd

    calls = []
    source = syn.model_patcher_for(torch.nn.Linear(4, 4), "cpu")
    monkeypatch.setattr(comfy.sd, "load_diffusion_model", lambda path, model_options={}: (
        calls.append((path, dict(model_options))), source)[1])
    run = ch.run_prompt({
        "1": {"class_type": "H3FusedNVFP4Loader", "inputs": {"unet_name": UNET_NAME, "weight_dtype": weight_dtype,
                                                           "scope": "block"}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET_NAME, "weight_dtype": weight_dtype}}})
    run.raise_for_status()
    assert len(calls) == 2 and calls[0] == calls[1] and calls[0][0] == str(model_file), calls
    assert "has no NVFP4-quantized Linear" in run.ui_text("1")  # no NVFP4 layer: passed through


def test_torch_compile_traces_the_stock_path(comfyui):
    """Under dynamo the patched forwards take ComfyUI's path (the traced graph is the stock one) with the stock bits;
    the same patches called eagerly run fused (the control)."""
    from test_h3_block_cpu import TOKENS, fused, linears, run_blocks

    torch._dynamo.reset()
    blocks = [syn.make_dit_block(seed=91, static_layers=("attn.out_proj",))]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=92)
    x, t_emb, segments, rope = inputs
    stock = run_blocks(blocks, inputs)

    def fn(h):
        return blocks[0](h, t_emb, segments, rope, transformer_options={"block_index": 0})

    try:
        with fused(blocks) as patches:
            compiled = torch.compile(fn, backend="eager")
            first = compiled(x.clone())
            used = linears(patches)
            assert all(v.calls_fused == 0 and v.calls_stock > 0 for v in used), [(v.name, v.calls_fused) for v in used]
            eager = run_blocks(blocks, inputs)
            assert all(v.calls_fused == 1 for v in used)
    finally:
        torch._dynamo.reset()
    assert_bit_identical(first, stock, "compiled")
    assert_bit_identical(eager, stock, "eager fused")


# What scope=block fuses (models/h3/block.py: FusedBlock, FusedAttention, FusedSwigluMLP; models/wan/block.py:
# FusedWanBlock): the tooltip and the README say the same.
SCOPE_BLOCK_FUSES = ("RMSNorm (norm1 / norm2) folded into the activation packs", "adaLN modulation", "SwiGLU",
                     "gated residuals", "per-head RMSNorm + RoPE", "hand-over of norm statistics between consecutive "
                     "blocks", "LayerNorm (norm1 / norm2 / norm3) folded into the activation packs",
                     "addcmul modulation (one pack for q, k and v)", "GELU folded into ffn.2's pack",
                     "full-width RMSNorm + RoPE")


def test_scope_tooltip_and_readme_name_everything_block_fuses(comfyui):
    from h3_fused_nvfp4 import nodes

    readme = " ".join((ch.REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    scope_text = readme[readme.index("`block` (default)"):]
    scope_text = scope_text[:scope_text.index("bit-identical")]
    for phrase in SCOPE_BLOCK_FUSES:
        assert phrase in nodes.SCOPE_TOOLTIP, phrase
        assert phrase in scope_text, phrase
