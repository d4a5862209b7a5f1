"""Proves tests/comfy_harness.py: a V3 custom node pack is loaded by the real (vendored) ComfyUI 0.3.75 loader and
executed headless on the CPU with a tiny MODEL."""

import textwrap

import pytest
import torch

import comfy_harness as ch

pytestmark = ch.requires_comfyui

PACK_INIT = textwrap.dedent(
    '''
    from comfy_api.latest import ComfyExtension, io, ui

    PATCH_KEY = "diffusion_model.some_attr"


    class HarnessProbePatch(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id="HarnessProbePatch",
                display_name="Harness Probe Patch",
                category="testing",
                inputs=[io.Model.Input("model"), io.Int.Input("value", default=7, min=0, max=1000)],
                outputs=[io.Model.Output()],
                is_output_node=True,
            )

        @classmethod
        def execute(cls, model, value):
            m = model.clone()
            m.add_object_patch(PATCH_KEY, ("patched", value))
            return io.NodeOutput(m, ui=ui.PreviewText(f"patched {PATCH_KEY}={value}"))


    class HarnessProbeExtension(ComfyExtension):
        async def get_node_list(self):
            return [HarnessProbePatch]


    async def comfy_entrypoint():
        return HarnessProbeExtension()
    '''
)


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.some_attr = "original"


@pytest.fixture(scope="module")
def probe_pack(tmp_path_factory, comfy_loader):
    pack_dir = tmp_path_factory.mktemp("custom_nodes") / "harness_probe_pack"
    pack_dir.mkdir()
    (pack_dir / "__init__.py").write_text(PACK_INIT)
    return comfy_loader(pack_dir)


def test_comfyui_is_cpu_0_3_75(comfyui):
    assert comfyui.version == "0.3.75"
    mm = comfyui.model_management
    assert mm.cpu_state == mm.CPUState.CPU
    assert mm.get_torch_device() == torch.device("cpu")
    assert "KSampler" in comfyui.nodes.NODE_CLASS_MAPPINGS  # core nodes present
    print(f"ComfyUI {comfyui.version} import: {comfyui.import_seconds:.2f}s")


def test_v3_pack_registers_through_loader(probe_pack, comfyui):
    assert probe_pack.api == "v3"
    assert probe_pack.node_ids == ["HarnessProbePatch"]
    assert probe_pack.v1_node_ids == []
    assert not hasattr(probe_pack.module, "NODE_CLASS_MAPPINGS")  # registered via comfy_entrypoint, not V1 mappings
    cls = comfyui.nodes.NODE_CLASS_MAPPINGS["HarnessProbePatch"]
    assert issubclass(cls, comfyui.io.ComfyNode)
    assert cls.RELATIVE_PYTHON_MODULE == "custom_nodes.harness_probe_pack"
    assert probe_pack.display_names == {"HarnessProbePatch": "Harness Probe Patch"}


def test_execute_graph_object_patch_roundtrip(probe_pack, comfy_runner, tiny_model):
    net = TinyNet()
    source = ch.make_model_patcher(net)
    key = tiny_model(source)
    prompt = {
        "1": ch.model_source_node(key),
        "2": {"class_type": "HarnessProbePatch", "inputs": {"model": ["1", 0], "value": 42}},
    }
    run = comfy_runner(prompt)
    run.raise_for_status()
    assert run.status == "success"
    events = [e for e, _ in run.status_messages]
    assert events[0] == "execution_start" and events[-1] == "execution_success"
    assert run.ui["2"] == {"text": ["patched diffusion_model.some_attr=42"]}  # executor merges ui tuples into lists

    patched = run.output("2")
    assert isinstance(patched, type(source)) and patched is not source
    assert patched.model is source.model  # clone shares the module
    assert patched.object_patches == {"diffusion_model.some_attr": ("patched", 42)}
    assert source.object_patches == {}  # the input MODEL is untouched
    assert patched.get_model_object("diffusion_model.some_attr") == ("patched", 42)
    assert net.some_attr == "original"  # nothing applied yet

    # direct ModelPatcher semantics
    patched.patch_model()
    assert net.some_attr == ("patched", 42)
    patched.unpatch_model()
    assert net.some_attr == "original"

    # the path sampling uses: model_management.load_models_gpu -> LoadedModel.model_load -> patch_model
    mm = ch.setup_comfyui().model_management
    mm.load_models_gpu([patched])
    assert net.some_attr == ("patched", 42)
    assert any(lm.model is patched for lm in mm.current_loaded_models)
    mm.unload_all_models()  # -> LoadedModel.model_unload -> ModelPatcher.detach -> unpatch_model
    assert net.some_attr == "original"
    assert not any(lm.model is patched for lm in mm.current_loaded_models)


def test_execution_error_is_reported(probe_pack, comfy_runner):
    prompt = {
        "1": ch.model_source_node("no-such-model"),
        "2": {"class_type": "HarnessProbePatch", "inputs": {"model": ["1", 0], "value": 1}},
    }
    run = comfy_runner(prompt)
    assert not run.success and run.status == "error"
    assert run.error["node_id"] == "1" and "no-such-model" in run.error["exception_message"]
    with pytest.raises(AssertionError, match="no-such-model"):
        run.raise_for_status()


def test_validation_rejects_bad_input(probe_pack, comfy_runner, tiny_model):
    key = tiny_model(TinyNet())
    prompt = {
        "1": ch.model_source_node(key),
        "2": {"class_type": "HarnessProbePatch", "inputs": {"model": ["1", 0], "value": 5000}},
    }
    with pytest.raises(AssertionError, match="failed validation"):
        comfy_runner(prompt)
