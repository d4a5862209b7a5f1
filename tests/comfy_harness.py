"""Headless real ComfyUI for the tests: the ComfyUI that tools/comfy_env.py finds (``COMFYUI_PATH``, the
ComfyUI this pack is installed in, or ``../shared/comfyui``), imported in-process, CPU mode without a GPU.

* :func:`comfy` - import it once and return handles (skips the test if no ComfyUI with MiniMax H3 is found);
* :func:`load_custom_node_pack` - load a custom node folder through ComfyUI's own ``nodes.load_custom_node``;
* :func:`run_prompt` - execute an API-format prompt with ``execution.PromptExecutor``;
* :func:`register_model` / :func:`model_source_node` - feed a ModelPatcher into a graph (test-only node);
* ``H3Harness_Forward`` - a test-only node that loads a MODEL the way sampling does and runs its MiniMax H3
  diffusion model once on fixed inputs, recording the output (whole-model exactness through the graph).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pathlib
import sys
import uuid
from typing import Any, Callable, Iterable

import pytest
import torch
from parity import selfcheck_mode

from h3_fused_nvfp4.tools import comfy_env
from h3_fused_nvfp4.tools import synthetic as syn

HARNESS_MODEL_NODE_ID = "H3Harness_ModelSource"
HARNESS_FORWARD_NODE_ID = "H3Harness_Forward"
_STATE: dict[str, Any] = {}


@dataclasses.dataclass
class ComfyUI:
    root: pathlib.Path
    how: str
    version: str
    nodes: Any
    execution: Any
    model_management: Any
    io: Any
    ui: Any


def comfyui_reason() -> str | None:
    """None if a ComfyUI with MiniMax H3 imports, else why not (the skip reason)."""
    if "reason" not in _STATE:
        try:
            location = comfy_env.find_comfyui()
        except RuntimeError as exc:
            _STATE["reason"] = str(exc)
        else:
            _STATE["reason"] = ("no ComfyUI found (set COMFYUI_PATH, or put ../shared/comfyui beside the repository)"
                                if location is None else comfy_env.h3_importable())
    return _STATE["reason"]


requires_comfyui = pytest.mark.skipif(comfyui_reason() is not None, reason=f"real ComfyUI: {comfyui_reason()}")


def comfy() -> ComfyUI:
    if "comfy" in _STATE:
        return _STATE["comfy"]
    reason = comfyui_reason()
    if reason is not None:
        pytest.skip(f"real ComfyUI: {reason}")
    info = comfy_env.import_comfyui()
    import comfy.model_management
    import execution
    from comfy_api.latest import io, ui

    import nodes

    # comfy-kitchen warns on every emulated FP4 GEMM (CPU, sm_90); both arms emulate the same way.
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)
    handles = ComfyUI(info.location.root, info.location.how, info.version, nodes, execution,
                      comfy.model_management, io, ui)
    _STATE["comfy"] = handles
    _register_harness_nodes(handles)
    return handles


# ---- loading a custom node pack through ComfyUI's loader ---------------------------------------------------

@dataclasses.dataclass
class LoadedPack:
    path: pathlib.Path
    module_name: str
    sys_module_name: str  # ComfyUI's key in sys.modules: the full path with '.' replaced by '_x_'
    module: Any
    node_ids: list[str]
    display_names: dict[str, str]
    log: list[str]

    def submodule(self, dotted: str):
        """The copy of ``h3_fused_nvfp4.<dotted>`` the ComfyUI-loaded nodes use (ComfyUI imports the folder
        under its path, conftest.py under the name ``h3_fused_nvfp4``: two copies of every module)."""
        return sys.modules[f"{self.sys_module_name}.{dotted}"]


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage())


def load_custom_node_pack(path, module_parent: str = "custom_nodes") -> LoadedPack:
    """``await nodes.load_custom_node(path)`` as ComfyUI's startup does; raises with its log if it fails."""
    handles = comfy()
    nodes = handles.nodes
    path = pathlib.Path(path).resolve()
    module_path = str(path)
    module_name = nodes.get_module_name(module_path)
    sys_module_name = os.path.splitext(module_path)[0] if path.is_file() else module_path.replace(".", "_x_")
    capture = _LogCapture()
    logging.getLogger().addHandler(capture)
    try:
        ok = asyncio.run(nodes.load_custom_node(module_path, module_parent=module_parent))
    finally:
        logging.getLogger().removeHandler(capture)
    if not ok:
        raise RuntimeError(f"ComfyUI failed to load {module_path}:\n" + "\n".join(capture.records))
    tag = f"{module_parent}.{module_name}"
    node_ids = [k for k, v in nodes.NODE_CLASS_MAPPINGS.items() if getattr(v, "RELATIVE_PYTHON_MODULE", None) == tag]
    return LoadedPack(path, module_name, sys_module_name, sys.modules[sys_module_name], node_ids,
                      {k: nodes.NODE_DISPLAY_NAME_MAPPINGS[k] for k in node_ids
                       if k in nodes.NODE_DISPLAY_NAME_MAPPINGS},
                      capture.records)


# ---- executing a prompt headless ---------------------------------------------------------------------------

class FakeServer:
    """What ``execution`` and ``comfy_execution.progress`` touch of ``server.PromptServer``."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.sockets_metadata: dict = {}
        self.messages: list = []

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data, sid))

    def queue_updated(self):
        pass


@dataclasses.dataclass
class PromptRun:
    success: bool
    status: str
    ui: dict
    outputs: dict
    error: dict | None

    def output(self, node_id: str, slot: int = 0, index: int = 0):
        return self.outputs[str(node_id)][slot][index]

    def ui_text(self, node_id: str) -> str:
        text = self.ui[str(node_id)]["text"]
        assert len(text) == 1, text
        return text[0]

    def raise_for_status(self):
        if not self.success:
            err = self.error or {}
            raise AssertionError(f"prompt {self.status}: node {err.get('node_id')} ({err.get('node_type')}): "
                                 f"{err.get('exception_type')}: {err.get('exception_message')}\n"
                                 f"{''.join(err.get('traceback') or [])}")
        return self


def _leaf_nodes(prompt: dict) -> list[str]:
    referenced = {str(v[0]) for node in prompt.values() for v in node.get("inputs", {}).values()
                  if isinstance(v, list) and len(v) == 2 and isinstance(v[1], int)}
    return [nid for nid in prompt if nid not in referenced]


def validate_prompt(prompt: dict, targets: Iterable[str]) -> None:
    """ComfyUI's per-node validation (``execution.validate_inputs``) of ``targets`` and what they depend on."""
    handles = comfy()
    validated: dict = {}
    for nid in targets:
        ok, reasons, _ = asyncio.run(handles.execution.validate_inputs("validate", prompt, str(nid), validated))
        if ok is not True:
            bad = {k: v[1] for k, v in validated.items() if v[0] is not True and v[1]}
            raise AssertionError(f"prompt failed validation for {nid}: {reasons or bad}")


def run_prompt(prompt: dict, outputs: Iterable[str] | None = None) -> PromptRun:
    """Validate (ComfyUI's per-node validator) and execute ``prompt`` with a fresh ``PromptExecutor``."""
    handles = comfy()
    prompt = {str(k): v for k, v in prompt.items()}
    targets = [str(o) for o in outputs] if outputs is not None else _leaf_nodes(prompt)
    validate_prompt(prompt, targets)
    executor = handles.execution.PromptExecutor(FakeServer(), cache_type=handles.execution.CacheType.CLASSIC,
                                                cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    executor.execute(prompt, str(uuid.uuid4()), {}, targets)
    status, error = "success", None
    for event, data in executor.status_messages:
        if event in ("execution_error", "execution_interrupted"):
            status, error = event.split("_")[1], data
    cache = executor.caches.outputs
    entries = {nid: cache.get_local(nid) if hasattr(cache, "get_local") else cache.get(nid) for nid in prompt}
    outputs_by_node = {nid: e.outputs for nid, e in entries.items() if e is not None}
    return PromptRun(bool(executor.success) and status == "success", status,
                     dict(executor.history_result.get("outputs", {})), outputs_by_node, error)


# ---- test-only nodes ---------------------------------------------------------------------------------------

_MODELS: dict[str, Callable[[], Any]] = {}
_COUNTER = itertools.count()
FORWARD_RESULTS: dict[str, list[torch.Tensor]] = {}


def register_model(patcher_or_factory) -> str:
    key = f"model{next(_COUNTER)}"
    _MODELS[key] = patcher_or_factory if callable(patcher_or_factory) and not hasattr(patcher_or_factory, "clone") \
        else (lambda v=patcher_or_factory: v)
    return key


def model_source_node(key: str) -> dict:
    return {"class_type": HARNESS_MODEL_NODE_ID, "inputs": {"key": key}}


def forward_node(model_ref, tag: str, seed: int = 0) -> dict:
    """A Forward node recording its model output under ``tag`` (an earlier result of that tag is dropped)."""
    FORWARD_RESULTS.pop(tag, None)
    return {"class_type": HARNESS_FORWARD_NODE_ID, "inputs": {"model": model_ref, "tag": tag, "seed": seed}}


def forward_pairs(tag: str, reference: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output of ``tag``, output of ``reference``) per model output stream (video, audio); both must have run."""
    a, b = FORWARD_RESULTS.get(tag), FORWARD_RESULTS.get(reference)
    assert a and b and len(a) == len(b), f"forward results {tag!r} / {reference!r} missing or of other lengths"
    return list(zip(a, b))


def h3_forward_inputs(diffusion_model, seed: int):
    """Fixed inputs for ``MiniMaxH3Model.forward``: a 2 x 8 x 8 video latent (32 video rows), 5 stereo audio frames
    (10 rows), 7 text tokens with a vision-pad tag run, sigma 0.7."""
    gen = torch.Generator().manual_seed(seed)
    text_dim = diffusion_model.condition_proj.in_features
    video = torch.randn((1, diffusion_model.latents_dim, 2, 8, 8), generator=gen)
    audio = torch.randn((1, diffusion_model.audio_latents_dim, 2, 5), generator=gen)
    context = torch.randn((1, 7, text_dim), generator=gen).to(torch.bfloat16)
    payload = {"text_token_tags": torch.tensor([1, 1, 0, 0, 1, 1, 1])}
    return [video, audio], torch.tensor([700.0]), context, payload


def _register_harness_nodes(handles: ComfyUI) -> None:
    io = handles.io

    class ModelSource(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id=HARNESS_MODEL_NODE_ID, display_name="Harness Model Source (tests)",
                             category="testing", inputs=[io.String.Input("key")], outputs=[io.Model.Output()])

        @classmethod
        def fingerprint_inputs(cls, key):
            return float("nan")  # never cached

        @classmethod
        def execute(cls, key):
            return io.NodeOutput(_MODELS[key]())

    class Forward(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id=HARNESS_FORWARD_NODE_ID, display_name="Harness H3 Forward (tests)",
                             category="testing", is_output_node=True,
                             inputs=[io.Model.Input("model"), io.String.Input("tag"), io.Int.Input("seed", default=0)],
                             outputs=[io.Latent.Output()])

        @classmethod
        def fingerprint_inputs(cls, **kwargs):
            return float("nan")

        @classmethod
        def execute(cls, model, tag, seed):
            import comfy.model_management as mm

            mm.load_models_gpu([model])  # applies the clone's object patches, as sampling does
            dm = model.model.diffusion_model
            x, timestep, context, payload = h3_forward_inputs(dm, seed)
            device = model.load_device
            options = dict(model.model_options.get("transformer_options", {}))
            with torch.inference_mode():
                out = dm([t.to(device) for t in x], timestep.to(device), context.to(device),
                         transformer_options=options, minimax_payload=payload)
            FORWARD_RESULTS[tag] = [o.cpu() for o in out]
            return io.NodeOutput({"samples": FORWARD_RESULTS[tag][0]})

    for node in (ModelSource, Forward):
        handles.nodes.NODE_CLASS_MAPPINGS[node.GET_SCHEMA().node_id if hasattr(node, "GET_SCHEMA") else
                                         node.define_schema().node_id] = node
        node.RELATIVE_PYTHON_MODULE = "custom_nodes.h3_harness"


# ---- fixtures ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def comfyui() -> ComfyUI:
    return comfy()


@pytest.fixture
def clean_models(comfyui):
    """ComfyUI's loaded-model list is empty after the test, whatever happened."""
    yield comfyui.model_management
    comfyui.model_management.unload_all_models()


@pytest.fixture
def force_nvfp4_compute(comfyui, monkeypatch):
    """Load models as ComfyUI does on a Blackwell GPU: NVFP4 activations on (ComfyUI allows them only with an FP4
    GEMM, compute capability >= 10; without one its GEMM dequantizes, in both arms) and a bf16 diffusion model
    (``--bf16-unet``; on a CPU ComfyUI would pick fp32)."""
    from comfy.cli_args import args

    monkeypatch.setattr(comfyui.model_management, "supports_nvfp4_compute", lambda *a, **k: True)
    monkeypatch.setattr(args, "bf16_unet", True)
    monkeypatch.setattr(comfyui.model_management, "should_use_bf16", lambda *a, **k: True)  # bf16 compute


# ---- the pack inside ComfyUI, a tiny H3 checkpoint ------------------------------------------------------------

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE_ON_CPU_ENV = "H3_FUSED_NVFP4_REFERENCE_ON_CPU"
NUM_LAYERS, REFINER_LAYERS = 2, 2
UNET_NAME = "tiny_h3_nvfp4.safetensors"


@pytest.fixture(scope="module")
def pack(comfyui):
    """This repository loaded through ComfyUI's ``nodes.load_custom_node``, the CPU twin allowed."""
    nodes_module_name = str(REPO_ROOT).replace(".", "_x_") + ".nodes"
    first_import = nodes_module_name not in sys.modules
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(REFERENCE_ON_CPU_ENV, "1")
        loaded = load_custom_node_pack(REPO_ROOT)
    nodes_module = loaded.submodule("nodes")
    if first_import:
        assert nodes_module.REFERENCE_ON_CPU is True
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nodes_module, "REFERENCE_ON_CPU", True)
        yield loaded


@pytest.fixture
def selfcheck_forced():
    """The self-check runs as users get it (no cached verdict), in every copy of the pack's modules."""
    with selfcheck_mode("force"):
        yield


@contextlib.contextmanager
def diffusion_models_folder(folder):
    """Register ``folder`` for "diffusion_models"; restore ComfyUI's path list and file-list cache on exit."""
    import folder_paths

    key = "diffusion_models"
    entry = folder_paths.folder_names_and_paths[key]
    saved = list(entry[0])
    folder_paths.filename_list_cache.pop(key, None)
    folder_paths.add_model_folder_path(key, str(folder))
    try:
        yield folder
    finally:
        entry[0][:] = saved
        folder_paths.filename_list_cache.pop(key, None)


@pytest.fixture
def model_file(comfyui, tmp_path, force_nvfp4_compute):
    """A tiny H3 NVFP4 checkpoint (out_proj with a static input_scale) registered for "diffusion_models"."""
    from safetensors.torch import save_file

    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    sd = syn.model_state_dict(num_layers=NUM_LAYERS, refiner_layers=REFINER_LAYERS, seed=3,
                              static_layers=("attn.out_proj",))
    save_file(sd, str(folder / UNET_NAME))
    with diffusion_models_folder(folder):
        yield folder / UNET_NAME
