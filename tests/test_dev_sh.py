"""dev.sh in a plain clone: ``./dev.sh report`` finds out whether a ComfyUI is there (tools/comfy_env.py's search:
``$COMFYUI_PATH``, the ComfyUI the pack is installed in, ``../shared/comfyui``) before it creates an environment or
installs anything, and says so in one line. The interpreter dev.sh is given here logs its calls and refuses to
create an environment or to install, so nothing is ever downloaded."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CLONE_FILES = ("dev.sh", "tools/comfy_env.py", "requirements.txt", "tests/requirements-test.txt")
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="dev.sh is a bash script")

FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "{log}"
case "$1 $2" in
  "-m venv"|"-m pip") echo "refused: $*" >&2; exit 97 ;;
esac
exec "{python}" "$@"
"""


def clone(tmp_path: pathlib.Path, beside: str | None = None) -> pathlib.Path:
    """The files dev.sh uses, in ``<tmp>/work/clone``; ``beside="shared"``: the test tree at ../shared/comfyui."""
    root = tmp_path / "work" / "clone"
    for rel in CLONE_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, root / rel)
    if beside == "shared":
        from h3_fused_nvfp4.tools import comfy_env

        location = comfy_env.find_comfyui()
        if location is None:
            pytest.skip("no ComfyUI here to put beside the clone")
        (tmp_path / "work" / "shared").mkdir()
        (tmp_path / "work" / "shared" / "comfyui").symlink_to(location.root)
    return root


def dev_sh(root: pathlib.Path, tmp_path: pathlib.Path, *args: str, comfyui_path: str | None = None):
    log = tmp_path / "python-calls.log"
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(log=log, python=sys.executable))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    env.update(PYTHON=str(fake), VENV=str(tmp_path / "venv"))
    if comfyui_path is not None:
        env["COMFYUI_PATH"] = comfyui_path
    proc = subprocess.run(["bash", str(root / "dev.sh"), *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith(("-m venv", "-m pip"))]


@pytest.mark.parametrize("case", ["no ComfyUI anywhere", "COMFYUI_PATH not a ComfyUI"])
def test_report_without_comfyui_installs_nothing_and_says_so_in_one_line(tmp_path, case):
    root = clone(tmp_path)
    proc, calls = dev_sh(root, tmp_path, "report",
                         comfyui_path=str(tmp_path) if case == "COMFYUI_PATH not a ComfyUI" else None)
    assert proc.returncode != 0
    assert installs(calls) == [] and not (tmp_path / "venv").exists(), calls
    output = (proc.stdout + proc.stderr).strip()
    assert output.count("\n") == 0 and "Traceback" not in output, output
    assert "ComfyUI" in output and "nothing was installed" in output, output
    if case == "no ComfyUI anywhere":
        assert "no ComfyUI found" in output and "COMFYUI_PATH" in output and "../shared/comfyui" in output


@pytest.mark.parametrize("case", ["COMFYUI_PATH", "test tree beside the checkout"])
def test_report_with_a_comfyui_goes_on_to_setup(tmp_path, case):
    root = clone(tmp_path, beside="shared" if case != "COMFYUI_PATH" else None)
    comfyui_path = None
    if case == "COMFYUI_PATH":
        from h3_fused_nvfp4.tools import comfy_env

        location = comfy_env.find_comfyui()
        if location is None:
            pytest.skip("no ComfyUI here")
        comfyui_path = str(location.root)
    proc, calls = dev_sh(root, tmp_path, "report", comfyui_path=comfyui_path)
    assert "ComfyUI at" in proc.stderr, proc.stdout + proc.stderr
    assert installs(calls) and installs(calls)[0].startswith("-m venv"), calls  # setup started (and was refused here)


def test_tests_without_comfyui_say_they_will_skip_then_set_up(tmp_path):
    root = clone(tmp_path)
    proc, calls = dev_sh(root, tmp_path, "test")
    assert "no ComfyUI found" in proc.stdout and "will skip" in proc.stdout, proc.stdout + proc.stderr
    assert installs(calls), calls
