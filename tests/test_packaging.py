"""Packaging: pyproject.toml against the Comfy Registry's rules, requirements.txt, and an install like a user's.

Registry rules checked (the registry's pyproject.toml specification, and ComfyUI's own parser ``comfy_config``):
``[project] name`` is the node id: lowercase here, under 100 characters, letters/digits separated by single ``-``,
``_`` or ``.``, starting with a letter, without "comfyui"; ``version`` is X.Y.Z; ``license`` is a ``{file = ...}``
table pointing at a file; ``[project.urls] Repository`` is set; ``[tool.comfy]`` has PublisherId and DisplayName
(and Icon, includes); accelerator classifiers are ones the registry knows (otherwise ComfyUI's parser drops them
all). Dependencies never name torch (ComfyUI brings its own build; a custom node must not replace it), and
requirements.txt lists exactly the pyproject dependencies.

``test_install_like_a_user`` (marked ``slow``, runs by default and in CI) puts the files a user gets into
``<tmp>/ComfyUI/custom_nodes/h3-fused-nvfp4``, resolves requirements.txt with pip (``--dry-run``: nothing is
installed), and loads that folder through ComfyUI's own custom node loader.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import comfy_harness as ch
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT_PATH = REPO_ROOT / "pyproject.toml"
REQUIREMENTS_PATH = REPO_ROOT / "requirements.txt"
WORKFLOWS = REPO_ROOT / "example_workflows"

NODE_IDS = {"H3FusedNVFP4Loader", "H3FusedNVFP4Patch", "H3FusedNVFP4Toggle", "H3FusedNVFP4Calibrate",
            "H3FusedNVFP4SaveCalibrated"}
FOLDER_NAME = "h3-fused-nvfp4"  # what a registry install names the folder: the node id

# The oldest ComfyUI the pack declares (requires-comfyui) and the comfy-kitchen its requirements.txt pins: the lower
# bound must admit it (and every later ComfyUI's pin), or installing the pack would move ComfyUI's own comfy-kitchen.
OLDEST_COMFYUI = "0.33.0"
OLDEST_COMFYUI_COMFY_KITCHEN_PIN = "0.2.31"

NAME_RE = re.compile(r"^[a-z][a-z0-9]*(?:[-_.][a-z0-9]+)*$")
SEMVER_RE = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
PUBLISHER_RE = re.compile(r"^[a-z][a-z0-9-]*$")
# "Environment :: ..." values ComfyUI's comfy_config parser accepts (any other one makes it drop them all)
REGISTRY_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                         "GPU :: Apple Metal"}
TORCH_PACKAGES = {"torch", "torchvision", "torchaudio", "triton"}

NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "Name or service not known", "Network is unreachable", "Connection refused", "ConnectTimeout",
                  "ReadTimeout", "Could not fetch URL", "ProxyError", "SSLError")


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads(PYPROJECT_PATH.read_text(encoding="utf-8"))


def requirement_lines(path: pathlib.Path) -> list[str]:
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            assert not line.startswith("-"), f"{path.name}: options/nested files not expected in runtime deps: {line}"
            lines.append(line)
    return lines


def normalized(requirements) -> dict[str, str]:
    out = {}
    for text in requirements:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name not in out, f"{name} listed twice"
        out[name] = str(req.specifier) + (f"; {req.marker}" if req.marker else "")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# pyproject.toml
# ---------------------------------------------------------------------------------------------------------------------


def test_project_name_is_a_valid_node_id(pyproject):
    name = pyproject["project"]["name"]
    assert name == FOLDER_NAME
    assert len(name) < 100
    assert name == name.lower()
    assert NAME_RE.fullmatch(name), f"{name!r}: letters/digits separated by single - _ or ., starting with a letter"
    assert "comfyui" not in name.lower().replace("-", "").replace("_", "").replace(".", "")


def test_version_is_semver_and_consistent(pyproject):
    version = pyproject["project"]["version"]
    assert SEMVER_RE.fullmatch(version), f"{version!r} is not X.Y.Z"
    init = (REPO_ROOT / "version.py").read_text(encoding="utf-8")
    assert re.search(r'^__version__ = "([^"]+)"$', init, re.M).group(1) == version
    for workflow in WORKFLOWS.glob("*.json"):  # our nodes carry the pack's registry id and version
        for node in json.loads(workflow.read_text(encoding="utf-8"))["nodes"]:
            if node["type"] in NODE_IDS:
                assert node["properties"]["cnr_id"] == pyproject["project"]["name"], workflow.name
                assert node["properties"]["ver"] == version, workflow.name


def test_web_extension_and_example_workflows():
    """ComfyUI serves WEB_DIRECTORY to its frontend; the extension there draws the decision text of every pack node
    (tests/browser/ runs it). Every example workflow has the thumbnail the Templates dialog shows."""
    import h3_fused_nvfp4

    assert h3_fused_nvfp4.WEB_DIRECTORY == "./web"
    script = (REPO_ROOT / "web" / "h3_fused_nvfp4.js").read_text(encoding="utf-8")
    assert 'from "../../scripts/app.js"' in script and "app.registerExtension(" in script
    assert all(f'"{node_id}"' in script for node_id in NODE_IDS)
    workflows = sorted(WORKFLOWS.glob("*.json"))
    assert workflows and all(w.with_suffix(".jpg").is_file() for w in workflows), workflows


def test_project_metadata(pyproject):
    project = pyproject["project"]
    assert project["description"].strip()
    assert (REPO_ROOT / project["readme"]).is_file()
    assert Version("3.10") in SpecifierSet(project["requires-python"])
    license_ = project["license"]
    assert isinstance(license_, dict) and set(license_) == {"file"}, "license must be a {file = ...} table"
    text = (REPO_ROOT / license_["file"]).read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "Permission is hereby granted, free of charge" in text
    assert "H3 Fused NVFP4 contributors" in text
    assert "License :: OSI Approved :: MIT License" in project["classifiers"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", project["urls"]["Repository"])


def test_classifiers_known_to_the_registry(pyproject):
    classifiers = pyproject["project"]["classifiers"]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert accelerators == ["GPU :: NVIDIA CUDA"]
    assert set(accelerators) <= REGISTRY_ACCELERATORS
    for c in classifiers:
        if c.startswith("Operating System :: "):
            assert c.split(" :: ")[1] in ("Microsoft", "POSIX", "MacOS", "OS Independent"), c


def test_tool_comfy(pyproject):
    comfy = pyproject["tool"]["comfy"]
    assert PUBLISHER_RE.fullmatch(comfy["PublisherId"])
    assert comfy["DisplayName"].strip()
    assert "comfyui" not in comfy["DisplayName"].lower()
    assert comfy["Icon"] == "" or re.fullmatch(r"https://\S+", comfy["Icon"])
    assert (REPO_ROOT / comfy["Icon"].rsplit("/", 1)[-1]).is_file(), "the icon the registry links to is in the repo"
    assert isinstance(comfy.get("includes", []), list)
    # The ComfyUI the tests run (its H3 code is what the pack is checked against) must satisfy the declared range.
    spec = SpecifierSet(comfy["requires-comfyui"])
    assert Version(_tested_comfyui_version()) in spec and Version("0.3.64") not in spec  # 0.3.x: no MiniMax H3


def _tested_comfyui_version() -> str:
    from h3_fused_nvfp4.tools import comfy_env

    location = comfy_env.find_comfyui()
    if location is None:
        pytest.skip("no ComfyUI to compare the declared range with")
    text = (location.root / "comfyui_version.py").read_text()
    return re.search(r'__version__\s*=\s*"([^"]+)"', text).group(1)


# ---------------------------------------------------------------------------------------------------------------------
# dependencies
# ---------------------------------------------------------------------------------------------------------------------


def test_dependencies_never_name_torch(pyproject):
    for source, requirements in (("pyproject.toml", pyproject["project"]["dependencies"]),
                                 ("requirements.txt", requirement_lines(REQUIREMENTS_PATH))):
        names = {canonicalize_name(Requirement(r).name) for r in requirements}
        assert not names & TORCH_PACKAGES, f"{source} names {names & TORCH_PACKAGES}"
        assert not any(n.startswith("nvidia-") for n in names), source
    for line in REQUIREMENTS_PATH.read_text(encoding="utf-8").splitlines():
        code = line.split("#", 1)[0]
        assert not re.search(r"\btorch", code), f"requirements.txt: {line!r}"


def test_requirements_txt_matches_pyproject(pyproject):
    assert normalized(requirement_lines(REQUIREMENTS_PATH)) == normalized(pyproject["project"]["dependencies"])


def _comfy_kitchen_spec(requirements) -> SpecifierSet:
    deps = {canonicalize_name(Requirement(r).name): Requirement(r) for r in requirements}
    return deps["comfy-kitchen"].specifier


def test_comfy_kitchen_bound_never_moves_a_supported_comfyuis_pin(pyproject):
    assert pyproject["tool"]["comfy"]["requires-comfyui"] == f">={OLDEST_COMFYUI}", "update OLDEST_COMFYUI's pin"
    for source, spec in (("pyproject.toml", _comfy_kitchen_spec(pyproject["project"]["dependencies"])),
                         ("requirements.txt", _comfy_kitchen_spec(requirement_lines(REQUIREMENTS_PATH)))):
        assert str(spec).startswith(">="), f"{source}: a lower bound only (ComfyUI pins comfy-kitchen exactly)"
        assert Version(OLDEST_COMFYUI_COMFY_KITCHEN_PIN) in spec, f"{source}: {spec} moves ComfyUI " \
            f"{OLDEST_COMFYUI} off comfy-kitchen=={OLDEST_COMFYUI_COMFY_KITCHEN_PIN}"
    # the ComfyUI the tests run: its own pin is admitted too
    from h3_fused_nvfp4.tools import comfy_env

    location = comfy_env.find_comfyui()
    if location is not None and (location.root / "requirements.txt").is_file():
        pins = re.findall(r"^comfy-kitchen\s*==\s*([\w.]+)", (location.root / "requirements.txt").read_text(), re.M)
        for pin in pins:
            assert Version(pin) in _comfy_kitchen_spec(pyproject["project"]["dependencies"]), pin
        if _tested_comfyui_version() == OLDEST_COMFYUI:
            assert pins == [OLDEST_COMFYUI_COMFY_KITCHEN_PIN]


def test_comfy_kitchen_bound_admits_the_installed_one(pyproject):
    spec = _comfy_kitchen_spec(pyproject["project"]["dependencies"])
    try:
        from importlib.metadata import version

        installed = version("comfy-kitchen")
    except Exception:  # not installed in this environment
        return
    assert Version(installed) in spec, f"installed comfy-kitchen {installed} outside {spec}"


def test_comfyui_parses_pyproject(comfyui, pyproject):
    """ComfyUI's loader reads pyproject.toml with comfy_config (the registry CLI's schema)."""
    pytest.importorskip("pydantic_settings")
    from comfy_config import config_parser

    config = config_parser.extract_node_configuration(str(REPO_ROOT))
    project = pyproject["project"]
    assert config.project.name == project["name"]
    assert config.project.version == project["version"]
    assert config.project.license.file == "LICENSE"
    assert config.project.urls.repository == project["urls"]["Repository"]
    assert config.project.dependencies == project["dependencies"]
    assert config.project.supported_accelerators == ["GPU :: NVIDIA CUDA"]
    assert config.tool_comfy.publisher_id == pyproject["tool"]["comfy"]["PublisherId"]
    assert config.tool_comfy.display_name == pyproject["tool"]["comfy"]["DisplayName"]


# ---------------------------------------------------------------------------------------------------------------------
# install like a user
# ---------------------------------------------------------------------------------------------------------------------


def user_files() -> list[str]:
    """The files a clone of this repository has: tracked plus not-yet-committed, never git-ignored ones."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                             check=True, capture_output=True, timeout=30).stdout
        files = [f for f in out.decode().split("\0") if f and (REPO_ROOT / f).is_file()]
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    skip = {".git", "__pycache__", ".pytest_cache", ".whl", ".venv", ".third_party", "build"}  # no git: .gitignore's
    return [str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO_ROOT).parts) and p.suffix not in (".pyc", ".cubin")]


def pip(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def report_installs(path: pathlib.Path) -> list[tuple[str, str]]:
    report = json.loads(path.read_text(encoding="utf-8"))
    return [(canonicalize_name(i["metadata"]["name"]), i["metadata"]["version"]) for i in report["install"]]


@pytest.fixture
def restore_node_mappings(comfyui):
    """Loading a second copy of the pack re-registers our node ids; put the previous classes back afterwards."""
    nodes = comfyui.nodes
    saved = {k: nodes.NODE_CLASS_MAPPINGS.get(k) for k in NODE_IDS}
    saved_names = {k: nodes.NODE_DISPLAY_NAME_MAPPINGS.get(k) for k in NODE_IDS}
    yield
    for mapping, before in ((nodes.NODE_CLASS_MAPPINGS, saved), (nodes.NODE_DISPLAY_NAME_MAPPINGS, saved_names)):
        for key, value in before.items():
            if value is None:
                mapping.pop(key, None)
            else:
                mapping[key] = value


def copy_user_files(target: pathlib.Path) -> None:
    files = user_files()
    assert "pyproject.toml" in files and "requirements.txt" in files and "__init__.py" in files
    for rel in files:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, target / rel)


@pytest.mark.slow
def test_install_like_a_user(tmp_path, comfyui, restore_node_mappings):
    custom_nodes = tmp_path / "ComfyUI" / "custom_nodes"
    target = custom_nodes / FOLDER_NAME
    copy_user_files(target)
    requirements = target / "requirements.txt"

    # 1. In a ComfyUI environment (this one: torch, ComfyUI's and the test dependencies), the pack's requirements
    #    are already met: pip would install nothing, torch included. Offline.
    offline = tmp_path / "offline.json"
    run = pip("install", "--dry-run", "--no-index", "--quiet", "--report", str(offline), "-r", str(requirements))
    assert run.returncode == 0, run.stdout + run.stderr
    assert report_installs(offline) == [], "pip would change this ComfyUI environment"

    # 2. Into an empty environment (nothing installed counts): the whole closure, resolved from the package index,
    #    has no torch and no CUDA wheels. Skipped without network.
    online = tmp_path / "online.json"
    run = pip("install", "--dry-run", "--ignore-installed", "--quiet", "--timeout", "15", "--retries", "1",
              "--report", str(online), "-r", str(requirements))
    if run.returncode != 0 and any(e in run.stdout + run.stderr for e in NETWORK_ERRORS):
        resolved = None
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        resolved = report_installs(online)
        names = {name for name, _ in resolved}
        assert names >= {"comfy-kitchen", "numpy", "safetensors"}
        assert not names & TORCH_PACKAGES and not any(n.startswith("nvidia-") for n in names), resolved

    # 3. ComfyUI's own loader, from custom_nodes/<node id>, as at startup.
    pack = ch.load_custom_node_pack(target)
    assert not hasattr(pack.module, "NODE_CLASS_MAPPINGS")  # V3 only
    assert set(pack.node_ids) == NODE_IDS
    assert not [line for line in pack.log if "pyproject.toml" in line], pack.log
    assert pathlib.Path(comfyui.nodes.EXTENSION_WEB_DIRS[FOLDER_NAME]) == target / "web"  # WEB_DIRECTORY
    for node_id in NODE_IDS:
        cls = comfyui.nodes.NODE_CLASS_MAPPINGS[node_id]
        assert cls.RELATIVE_PYTHON_MODULE == f"custom_nodes.{FOLDER_NAME}"
        assert pathlib.Path(sys.modules[cls.__module__].__file__).is_relative_to(target)

    if resolved is None:
        pytest.skip("package index unreachable: checked offline resolution and loading only")


# A python for dev.sh's VENV that is this test environment, except that it refuses to create or install anything.
REFUSING_PYTHON = """#!/bin/sh
case "$1 $2" in
  "-m venv"|"-m pip") echo "refused: $*" >&2; exit 97 ;;
esac
exec "{python}" "$@"
"""
# A few tests that import the pack and ComfyUI and load the pack through ComfyUI's loader from the folder they run in.
DEV_SH_TEST_SELECTION = "test_pack_loads_as_v3_through_comfyui_loader or test_comfyui_parses_pyproject"


def comfyui_like_tree(root: pathlib.Path, comfyui_root: pathlib.Path) -> pathlib.Path:
    """``root`` made a ComfyUI: links to every entry of the real one (its pytest.ini included) but ``custom_nodes``,
    which is a folder of its own; returns that folder."""
    root.mkdir(parents=True)
    for entry in comfyui_root.iterdir():
        if entry.name != "custom_nodes":
            (root / entry.name).symlink_to(entry)
    (root / "custom_nodes").mkdir()
    return root / "custom_nodes"


def dev_sh_venv(tmp_path: pathlib.Path) -> pathlib.Path:
    """dev.sh's VENV: this environment (lint tools included), its setup stamp, a python that refuses to install."""
    stamp = pathlib.Path(sys.prefix) / ".dev-setup-stamp"
    if not stamp.is_file():
        pytest.skip(f"this environment ({sys.prefix}) was not made by ./dev.sh setup")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy2(stamp, venv / ".dev-setup-stamp")
    python = venv / "bin" / "python"
    python.write_text(REFUSING_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    for tool in ("lint-imports", "ruff"):
        (venv / "bin" / tool).symlink_to(pathlib.Path(sys.executable).parent / tool)
    return venv


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="dev.sh is a bash script")
@pytest.mark.parametrize("folder", [FOLDER_NAME, "h3-fused-nvfp4-main"])  # git, the registry, Manager; a zip download
def test_dev_sh_test_passes_in_a_clone_in_comfyui_custom_nodes(tmp_path, comfyui, folder):
    """The README's install folder: ``./dev.sh test`` in ``ComfyUI/custom_nodes/<folder>`` (a ComfyUI with its own
    pytest.ini above the clone) finds that ComfyUI, lints, and passes; the pack loads through ComfyUI's loader from
    there."""
    target = comfyui_like_tree(tmp_path / "ComfyUI", comfyui.root) / folder
    copy_user_files(target)
    venv = dev_sh_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "H3_FUSED_NVFP4_CACHE", "PYTEST_ADDOPTS")}
    env.update(VENV=str(venv), PYTHON=str(venv / "bin" / "python"))
    proc = subprocess.run(["bash", "dev.sh", "test", "-k", DEV_SH_TEST_SELECTION], cwd=target,
                          env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert "refused:" not in output, "dev.sh tried to install: this environment's setup stamp is stale\n" + output
    assert f"dev.sh: ComfyUI at {tmp_path / 'ComfyUI'} (installed)" in output, output
    assert proc.returncode == 0, output
    summary = re.search(r"^(\d+) passed, \d+ deselected in ", proc.stdout, re.M)
    assert summary and int(summary.group(1)) == 2, output
    assert "dev.sh: tests passed" in output
