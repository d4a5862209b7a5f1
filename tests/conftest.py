"""Test setup: import this repository as the package ``h3_fused_nvfp4``.

ComfyUI imports a custom node folder under whatever name the folder has; the tests pin one name so that the
package's relative imports resolve the same way without a ComfyUI around.
"""

import importlib.util
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_NAME = "h3_fused_nvfp4"


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


requires_cuda = pytest.mark.skipif(
    not cuda_available(), reason="needs a CUDA GPU (CPU-only machines skip the GPU tests)"
)


# Headless CPU ComfyUI fixtures (comfyui, comfy_loader, comfy_runner, tiny_model); importing comfy_harness is cheap,
# ComfyUI itself is imported only when a test asks for one of these fixtures.
from comfy_harness import comfy_loader, comfy_runner, comfyui, tiny_model  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs pip and copies the pack (seconds; may use the network). Runs by default and in CI; deselect with -m 'not slow'")
