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
