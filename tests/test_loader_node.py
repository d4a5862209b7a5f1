"""H3FusedNVFP4Loader end to end in the headless ComfyUI 0.3.75, and the fused path under ``torch.compile``.

ComfyUI 0.3.75 cannot load a MiniMax H3 / NVFP4 checkpoint, so ``comfy.sd.load_diffusion_model`` (the attribute
the pack's nodes module calls) is replaced by a fake that records ``(path, model_options)`` and returns a
ModelPatcher around the reduced-width H3 mirror of tests/test_comfyui_nodes.py (or around a plain module). The
file the loader resolves is real: a small safetensors file in a temporary folder registered for
``diffusion_models`` for the duration of a test.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import comfy_harness as ch
import h3_mirror as mirror
from h3_fused_nvfp4.integration import patch as patch_mod
from test_comfyui_nodes import (  # noqa: F401  (pack is a fixture: the pack loaded with the CPU reference allowed)
    HEAD_DIM,
    HIDDEN,
    NUM_LAYERS,
    REFINER_LAYERS,
    T_DIM,
    assert_bit_identical,
    expected_patch_keys,
    make_h3,
    make_patcher,
    pack,
    pack_module,
    pack_records,
    type_names,
    ui_text,
)
from test_fused_block_cpu import object_patches

LOGGER = "h3_fused_nvfp4"
UNET_NAME = "tiny_h3_nvfp4.safetensors"
MISSING_NAME = "no_such_h3_model.safetensors"

# weight_dtype -> model_options, as ComfyUI's UNETLoader.load_unet builds them.
EXPECTED_OPTIONS = {
    "default": {},
    "fp8_e4m3fn": {"dtype": torch.float8_e4m3fn},
    "fp8_e4m3fn_fast": {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True},
    "fp8_e5m2": {"dtype": torch.float8_e5m2},
}


# ---- helpers -----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def diffusion_models_folder(folder):
    """Register ``folder`` for "diffusion_models"; restore ComfyUI's path list and file-list cache on exit."""
    import folder_paths

    key = "diffusion_models"
    entry = folder_paths.folder_names_and_paths[key]
    saved_paths = list(entry[0])
    saved_cache = folder_paths.filename_list_cache.pop(key, None)
    folder_paths.add_model_folder_path(key, str(folder))
    try:
        yield folder
    finally:
        entry[0][:] = saved_paths
        folder_paths.folder_names_and_paths[key] = entry
        folder_paths.filename_list_cache.pop(key, None)  # it would still list our file (its folder still exists)
        if saved_cache is not None:
            folder_paths.filename_list_cache[key] = saved_cache


def write_tiny_checkpoint(path):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    save_file({
        "blocks.0.attn.qkv_proj.weight": torch.randint(0, 255, (3 * HIDDEN, HIDDEN // 2), dtype=torch.uint8,
                                                       generator=gen),
        "blocks.0.attn.qkv_proj.weight_scale_2": torch.tensor([0.01], dtype=torch.float32),
        "blocks.0.norm1.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }, str(path), metadata={"note": "test file for tests/test_loader_node.py"})


@pytest.fixture
def model_file(comfyui, tmp_path):
    """Full path of ``UNET_NAME`` in a temporary folder registered for "diffusion_models"."""
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    path = folder / UNET_NAME
    write_tiny_checkpoint(path)
    with diffusion_models_folder(folder):
        yield str(path)


class FakeLoadDiffusionModel:
    """Stands in for ``comfy.sd.load_diffusion_model``: records each call and returns a prebuilt patcher.

    The patcher is built by the test, outside the executor's ``torch.inference_mode()`` (see make_patcher)."""

    def __init__(self, patcher):
        self.patcher = patcher
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, unet_path, model_options={}):
        from safetensors import safe_open

        with safe_open(unet_path, framework="pt") as f:  # the path is the file the test wrote
            assert "blocks.0.attn.qkv_proj.weight" in f.keys()
        self.calls.append((unet_path, dict(model_options)))
        return self.patcher


@pytest.fixture
def fake_loader(comfyui, monkeypatch):
    """Install a FakeLoadDiffusionModel for a given patcher: ``install(patcher) -> fake``."""
    import comfy.sd

    def install(patcher):
        fake = FakeLoadDiffusionModel(patcher)
        monkeypatch.setattr(comfy.sd, "load_diffusion_model", fake)
        return fake

    return install


def loader_graph(unet_name: str, weight_dtype: str, path: str = "fused", with_unet_loader: bool = False) -> dict:
    prompt = {
        "1": {"class_type": "H3FusedNVFP4Loader",
              "inputs": {"unet_name": unet_name, "weight_dtype": weight_dtype, "scope": "block"}},
        "2": {"class_type": "H3FusedNVFP4Toggle", "inputs": {"model": ["1", 0], "path": path, "scope": "block"}},
    }
    if with_unet_loader:  # ComfyUI's own loader, same fake behind it: the reference for path and model_options
        prompt["3"] = {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": weight_dtype}}
    return prompt


def unet_name_options(comfyui):
    cls = comfyui.nodes.NODE_CLASS_MAPPINGS["H3FusedNVFP4Loader"]
    v1 = cls.INPUT_TYPES()["required"]["unet_name"]
    (combo,) = [i for i in cls.define_schema().inputs if i.id == "unet_name"]
    assert list(v1[1]["options"]) == list(combo.options)
    return list(combo.options)


# ---- 1. the loader node end to end -------------------------------------------------------------------------

def test_schema_lists_registered_file(pack, comfyui, tmp_path):
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    assert UNET_NAME not in unet_name_options(comfyui)
    with diffusion_models_folder(folder):
        assert UNET_NAME not in unet_name_options(comfyui)  # the folder is empty
        write_tiny_checkpoint(folder / UNET_NAME)
        assert UNET_NAME in unet_name_options(comfyui)  # rescanned: the folder changed
        core = comfyui.nodes.NODE_CLASS_MAPPINGS["UNETLoader"].INPUT_TYPES()["required"]["unet_name"][0]
        assert UNET_NAME in core
    assert UNET_NAME not in unet_name_options(comfyui)  # the registration is undone
    inputs = comfyui.nodes.NODE_CLASS_MAPPINGS["H3FusedNVFP4Loader"].INPUT_TYPES()
    weight_dtype = inputs.get("required", {}).get("weight_dtype") or inputs["optional"]["weight_dtype"]
    assert list(weight_dtype[1]["options"]) == list(EXPECTED_OPTIONS) == pack_module(pack, "nodes").WEIGHT_DTYPES


@pytest.mark.parametrize("weight_dtype, path", [
    ("default", "fused"), ("fp8_e4m3fn", "comfy"), ("fp8_e4m3fn_fast", "fused"), ("fp8_e5m2", "comfy")])
def test_loader_node_end_to_end(pack, comfy_runner, model_file, fake_loader, caplog, weight_dtype, path):
    source = make_patcher(make_h3(seed=81))
    fake = fake_loader(source)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = comfy_runner(loader_graph(UNET_NAME, weight_dtype, path, with_unet_loader=True))
    run.raise_for_status()

    # Both loaders resolved the same file and passed the same model_options (ComfyUI's UNETLoader is node 3).
    assert len(fake.calls) == 2, fake.calls
    for call_path, options in fake.calls:
        assert call_path == model_file
        assert options == EXPECTED_OPTIONS[weight_dtype]
        assert {k: type(v) for k, v in options.items()} == {k: type(v) for k, v in EXPECTED_OPTIONS[weight_dtype].items()}
    assert run.output("3") is source

    loaded, toggled = run.output("1"), run.output("2")
    assert loaded is not source and loaded.model is source.model
    assert source.object_patches == {}
    expected = expected_patch_keys("block")
    assert set(loaded.object_patches) == expected
    names = type_names(loaded)
    assert {names[f"diffusion_model.blocks.{i}.forward"] for i in range(NUM_LAYERS)} == {"FusedDiTBlock"}
    assert {names[f"diffusion_model.blocks.{i}.attn.forward"] for i in range(NUM_LAYERS)} == {"FusedAttention"}
    assert names["diffusion_model.token_refiner.blocks.0.mlp.fc1.forward"] == "FusedNVFP4Linear"
    assert names["diffusion_model.token_refiner.blocks.1.mlp.forward"] == "FusedSwigluMLP"
    state = loaded.model_options["transformer_options"][patch_mod.STATE_KEY]
    assert state["mode"] == "fused" and state["scope"] == "block"

    summary = ui_text(run, "1")
    assert "\n" not in summary and summary == state["summary"]
    assert summary.startswith(f"H3 fused NVFP4: patched {NUM_LAYERS} DiT + {REFINER_LAYERS} refiner blocks, "
                              f"{4 * (NUM_LAYERS + REFINER_LAYERS)} NVFP4 layers")
    assert "scope block" in summary and "Python reference backend" in summary
    loader_lines = [r for r in pack_records(caplog) if r.getMessage() == summary]
    assert loader_lines and all(r.levelno == logging.INFO for r in loader_lines)

    # The Toggle downstream works on its own clone of the loader's output.
    assert toggled is not loaded and toggled.model is source.model
    assert set(loaded.object_patches) == expected  # untouched by the Toggle
    if path == "fused":
        assert set(toggled.object_patches) == expected
        assert ui_text(run, "2") == summary
    else:
        assert toggled.object_patches == {}
        assert ui_text(run, "2") == (f"H3 fused NVFP4: ComfyUI's own NVFP4 path selected "
                                     f"({len(expected)} patches removed from this clone)")
    assert not [r for r in pack_records(caplog) if r.levelno >= logging.WARNING]


def test_loader_output_runs_fused_and_exact(pack, comfy_runner, model_file, fake_loader, comfyui):
    """The loader's MODEL, loaded by ComfyUI, runs the fused path with the stock bits."""
    mm = comfyui.model_management
    model = make_h3(seed=82)
    inputs = mirror.make_inputs(7, 9, 60, seed=83, device="cpu", hidden=HIDDEN, head_dim=HEAD_DIM, t_dim=T_DIM,
                                n_timesteps=2)
    x, t_emb, segments, rope = inputs
    stock = model.run_blocks(x.clone(), t_emb, segments, rope, transformer_options={})
    fake_loader(make_patcher(model))
    run = comfy_runner(loader_graph(UNET_NAME, "default"))
    run.raise_for_status()
    loaded = run.output("1")
    try:
        mm.load_models_gpu([loaded])
        fused = model.run_blocks(x.clone(), t_emb, segments, rope, transformer_options={})
    finally:
        mm.unload_all_models()
    assert_bit_identical(fused, stock, "loader output")
    linears = [v for k, v in loaded.object_patches.items()
               if type(v).__name__ == "FusedNVFP4Linear" and k.startswith("diffusion_model.blocks.")]
    assert len(linears) == 4 * NUM_LAYERS and all(v.calls_fused > 0 and v.calls_stock == 0 for v in linears)
    # Unpatched again after the unload (ComfyUI restores the bound method it saved).
    assert getattr(model.blocks[0].forward, "__func__", None) is type(model.blocks[0]).forward


def test_missing_file_is_a_clear_node_error(pack, comfy_runner, model_file, fake_loader, comfyui):
    fake = fake_loader(make_patcher(make_h3(seed=84)))
    assert MISSING_NAME not in unet_name_options(comfyui)
    prompt = loader_graph(MISSING_NAME, "default")

    # ComfyUI's own UNETLoader (a V1 combo) is rejected by validation, naming the value.
    core = {"9": {"class_type": "UNETLoader", "inputs": {"unet_name": MISSING_NAME, "weight_dtype": "default"}}}
    with pytest.raises(AssertionError, match=f"value_not_in_list|{MISSING_NAME}"):
        ch.validate_prompt(core, ["9"])
    # 0.3.75 does not check V3 combo values at validation (see test_workflow.py), so our node fails when it runs:
    # an execution error of node 1 that names the folder and the file, the graph's other node not run.
    try:
        ch.validate_prompt(prompt, ["2"])
    except AssertionError as exc:  # a ComfyUI that does check V3 combos: fine too, if it names the file
        assert MISSING_NAME in str(exc)
    run = comfy_runner(prompt, validate=False)
    assert not run.success and run.status == "error"
    assert run.error["node_id"] == "1" and run.error["node_type"] == "H3FusedNVFP4Loader"
    assert run.error["exception_type"] == "FileNotFoundError"
    assert run.error["exception_message"].strip() == (
        f"Model in folder 'diffusion_models' with filename '{MISSING_NAME}' not found.")
    assert "1" not in run.outputs and "2" not in run.outputs
    assert fake.calls == []
    with pytest.raises(AssertionError, match="FileNotFoundError"):
        run.raise_for_status()

    # The harness (and ComfyUI's executor) are fine afterwards: the existing file loads.
    ok = comfy_runner(loader_graph(UNET_NAME, "default"))
    ok.raise_for_status()
    assert fake.calls == [(model_file, {})]


# ---- 2. a model that is not H3 -----------------------------------------------------------------------------

def test_non_h3_model_loads_as_stock_with_warning(pack, comfy_runner, model_file, fake_loader, caplog):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    source = make_patcher(net)
    fake = fake_loader(source)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = comfy_runner(loader_graph(UNET_NAME, "fp8_e4m3fn", path="comfy"))
    run.raise_for_status()  # never an error

    assert fake.calls == [(model_file, {"dtype": torch.float8_e4m3fn})]
    loaded = run.output("1")
    assert loaded.model is source.model and loaded.object_patches == {} and source.object_patches == {}
    assert loaded.model_options["transformer_options"][patch_mod.STATE_KEY]["mode"] == "comfy"
    expected = ("H3 fused NVFP4: model left as ComfyUI runs it (block): "
                "Sequential has no MiniMax H3 transformer blocks")
    assert ui_text(run, "1") == expected
    warnings = [r for r in pack_records(caplog) if r.levelno >= logging.WARNING]
    assert [(r.levelno, r.getMessage()) for r in warnings] == [(logging.WARNING, expected)]
    assert run.output("2").object_patches == {}
    assert ui_text(run, "2") == "H3 fused NVFP4: ComfyUI's own NVFP4 path selected (0 patches removed from this clone)"


# ---- 3. torch.compile ----------------------------------------------------------------------------------------

COMPILE_HIDDEN, COMPILE_HEADS, COMPILE_HEAD_DIM, COMPILE_FFN, COMPILE_T_DIM = 128, 2, 64, 256, 128


@pytest.mark.parametrize("scope", patch_mod.SCOPES)
def test_torch_compile_traces_the_stock_path(scope):
    """Under dynamo the patched forwards take ComfyUI's path (so the traced graph is the stock one) and the compiled
    result has the stock bits; the same patches called eagerly do run fused (the control)."""
    torch._dynamo.reset()
    model = mirror.make_model(COMPILE_HIDDEN, COMPILE_HEADS, COMPILE_HEAD_DIM, COMPILE_FFN, COMPILE_T_DIM,
                              num_layers=1, refiner_layers=0, seed=91, device="cpu",
                              static_scale_layers=("attn.out_proj",))
    x, t_emb, segments, rope = mirror.make_inputs(7, 9, 60, seed=92, device="cpu", hidden=COMPILE_HIDDEN,
                                                  head_dim=COMPILE_HEAD_DIM, t_dim=COMPILE_T_DIM, n_timesteps=2)
    block = model.blocks[0]

    def fn(h):
        return block(h, t_emb, segments, rope, transformer_options={})

    with torch.inference_mode():
        stock = fn(x.clone())
    patches, report = patch_mod.build_patches(model, scope)
    assert report.applied
    linears = [v for v in patches.values() if type(v).__name__ == "FusedNVFP4Linear"]
    assert len(linears) == 4
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        with object_patches(model, patches):
            compiled = torch.compile(fn, backend="eager")
            first = compiled(x.clone())
            assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])  # dynamo did trace
            assert [(v.name, v.calls_fused) for v in linears] == [(v.name, 0) for v in linears]
            assert all(v.calls_stock > 0 for v in linears), [(v.name, v.calls_stock) for v in linears]
            assert all("inside torch.compile (stock path is traced instead)" in v._logged for v in linears)
            second = compiled(x.clone())  # the cached compiled code
            assert all(v.calls_fused == 0 for v in linears)

            with torch.inference_mode():  # control: the same patches outside dynamo run fused
                eager = fn(x.clone())
            assert all(v.calls_fused == 1 for v in linears), [(v.name, v.calls_fused) for v in linears]
    finally:
        torch._dynamo.reset()
    assert_bit_identical(first, stock, f"compiled, scope {scope}")
    assert_bit_identical(second, stock, f"compiled again, scope {scope}")
    assert_bit_identical(eager, stock, f"eager fused, scope {scope}")
