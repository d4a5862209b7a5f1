"""Test setup: import this repository as the package ``h3_fused_nvfp4``, find the real ComfyUI the tests run.

ComfyUI imports a custom node folder under whatever name the folder has; the tests pin one name so that the
package's relative imports resolve the same way outside ComfyUI, whatever the clone's folder is called (pytest.ini
beside this file keeps pytest itself from importing the repository root under the folder's name). Which ComfyUI
the tests use (tools/comfy_env.py: ``COMFYUI_PATH``, the ComfyUI this folder is installed in,
``../shared/comfyui``) is printed in pytest's header.
"""

import importlib.util
import logging
import os
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_NAME = "h3_fused_nvfp4"
# Tests share one kernel cache per run, away from the user's (a planted-fault build must never reach it).
os.environ.setdefault("H3_FUSED_NVFP4_CACHE", str(REPO_ROOT / "build" / "kernel-cache"))


def _import_repo_as_package():
    if PACKAGE_NAME in sys.modules:
        return sys.modules[PACKAGE_NAME]
    spec = importlib.util.spec_from_file_location(
        PACKAGE_NAME, REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE_NAME] = module
    spec.loader.exec_module(module)
    return module


_import_repo_as_package()
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tests"))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not cuda_available(),
                                   reason="needs a CUDA GPU (CPU-only machines skip the GPU tests)")

from comfy_harness import clean_models, comfyui, comfyui_reason, force_nvfp4_compute, model_file, pack, selfcheck_forced  # noqa: E402,F401  (fixtures)


def _comfyui_line() -> str:
    from h3_fused_nvfp4.tools import comfy_env

    try:
        location = comfy_env.find_comfyui()
    except RuntimeError as exc:
        return f"real ComfyUI: {exc}"
    reason = comfyui_reason()
    where = f"{location.root} ({location.how})" if location else "none found"
    return f"real ComfyUI: {where}" + (f"; not usable: {reason}" if reason else "")


def pytest_report_header(config):
    return [_comfyui_line()]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_comfyui_line())  # also under -q, where the header is not shown


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: seconds of pip and file copying; runs by default and in CI")
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def fresh_forward_plans():
    """Forward plans cache a device's decisions; a test that swaps a backend or a verdict starts and ends clean."""
    from h3_fused_nvfp4.core import plan

    plan.forget_plans()
    yield
    plan.forget_plans()
