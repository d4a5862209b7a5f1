"""Find and import a real ComfyUI outside ComfyUI's own process (the report command and the tests).

Inside a running ComfyUI nothing here is needed: ``comfy`` is already imported. Standalone, the first match wins:

1. ``$COMFYUI_PATH``;
2. the ComfyUI this pack is installed in (``<ComfyUI>/custom_nodes/<pack>``, recognised by ``comfy/`` and
   ``main.py``);
3. ``../shared/comfyui`` beside this repository (the source tree the test suite runs against).

:func:`import_comfyui` makes ``comfy``, ``nodes``, ``execution`` ... importable without letting ComfyUI parse
``sys.argv``, in CPU mode when no CUDA device is present (``comfy.model_management`` reads ``args.cpu`` at import).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import sys

PACK_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class ComfyLocation:
    root: pathlib.Path
    how: str  # "COMFYUI_PATH", "installed", "shared tree", or "already imported"


def _is_comfyui(path: pathlib.Path) -> bool:
    return (path / "comfy").is_dir() and (path / "main.py").is_file()


def find_comfyui() -> ComfyLocation | None:
    """Where the ComfyUI to use lives (see the module docstring), or None."""
    if _imported is not None:
        return _imported.location
    comfy = sys.modules.get("comfy")  # imported by ComfyUI itself (inside its process)
    if comfy is not None and getattr(comfy, "__path__", None):  # a namespace package: no __file__
        return ComfyLocation(pathlib.Path(next(iter(comfy.__path__))).resolve().parent, "already imported")
    env = os.environ.get("COMFYUI_PATH")
    if env:
        path = pathlib.Path(env).expanduser().resolve()
        if not _is_comfyui(path):
            raise RuntimeError(f"COMFYUI_PATH={env} is not a ComfyUI folder (no comfy/ and main.py)")
        return ComfyLocation(path, "COMFYUI_PATH")
    if PACK_ROOT.parent.name == "custom_nodes" and _is_comfyui(PACK_ROOT.parent.parent):
        return ComfyLocation(PACK_ROOT.parent.parent, "installed")
    shared = PACK_ROOT.parent / "shared" / "comfyui"
    if _is_comfyui(shared):
        return ComfyLocation(shared.resolve(), "shared tree")
    return None


@dataclasses.dataclass
class ComfyUI:
    location: ComfyLocation
    version: str
    cpu: bool


_imported: ComfyUI | None = None


def import_comfyui() -> ComfyUI:
    """Import ComfyUI once per process, in CPU mode exactly when CUDA is unavailable."""
    global _imported
    if _imported is not None:
        return _imported
    location = find_comfyui()
    if location is None:
        raise RuntimeError("no ComfyUI found: set COMFYUI_PATH to a ComfyUI folder")
    if str(location.root) not in sys.path:
        sys.path.insert(0, str(location.root))
    import torch

    cpu = not torch.cuda.is_available()
    if "comfy.model_management" not in sys.modules:
        import comfy.options  # noqa: F401  (args parsing stays off: the caller's argv is never parsed)
        from comfy.cli_args import args

        args.cpu = cpu
    import comfy.model_management  # noqa: F401

    version = comfyui_version()
    try:  # main.py registers the public node APIs (comfy_api.latest ...) before loading custom nodes
        import nodes

        asyncio.run(nodes.init_public_apis())
    except (ImportError, AttributeError):
        pass
    _imported = ComfyUI(location, version, cpu)
    return _imported


def comfyui_version() -> str:
    """The importable ComfyUI's ``comfyui_version.__version__``, or "unknown"."""
    try:
        import comfyui_version as v

        return v.__version__
    except ImportError:
        return "unknown"


def h3_importable() -> str | None:
    """None if ComfyUI's MiniMax H3 model imports, else why not."""
    try:
        import_comfyui()
        import comfy.ldm.minimax.model  # noqa: F401
    except Exception as exc:  # a broken or old ComfyUI: the caller reports why
        return f"{type(exc).__name__}: {exc}"
    return None


COMPUTE_DTYPES = ("auto", "bf16", "fp16")


def force_nvfp4_compute(dtype: str = "bf16", set_attribute=setattr) -> None:
    """Load diffusion models as ComfyUI does on a Blackwell GPU: NVFP4 activations on (ComfyUI allows them only
    with an FP4 GEMM, compute capability >= 10; below it both arms emulate the GEMM the same way), and the compute
    dtype of the quantized model:

    * ``"auto"``: ComfyUI's own choice from the model's ``supported_inference_dtypes`` (Wan lists fp16 first); on a
      machine without CUDA, ComfyUI's bf16 / fp16 questions are answered as an sm_80+ NVIDIA GPU answers them
      (on the CPU it would pick fp32, which no NVFP4 model runs in);
    * ``"bf16"`` / ``"fp16"``: forced, as ``--bf16-unet`` / ``--fp16-unet`` force the model's dtype, and for the
      compute dtype of a quantized model, which ComfyUI's loader picks on its own (``unet_manual_cast``).

    Call after :func:`import_comfyui`; it changes this process's ComfyUI for good (a benchmark's), unless
    ``set_attribute`` is one that undoes its changes later (a test's ``monkeypatch.setattr``)."""
    import comfy.model_management as mm
    import torch
    from comfy.cli_args import args

    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, not {dtype!r}")
    set_attribute(mm, "supports_nvfp4_compute", lambda *a, **k: True)
    if dtype == "auto":
        if not torch.cuda.is_available():
            set_attribute(mm, "should_use_fp16", lambda *a, **k: True)
            set_attribute(mm, "should_use_bf16", lambda *a, **k: True)
        return
    forced = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    set_attribute(args, "bf16_unet", dtype == "bf16")
    set_attribute(args, "fp16_unet", dtype == "fp16")
    set_attribute(mm, "should_use_bf16", lambda *a, **k: dtype == "bf16")
    set_attribute(mm, "should_use_fp16", lambda *a, **k: dtype == "fp16")
    set_attribute(mm, "unet_manual_cast", lambda *a, **k: forced)
