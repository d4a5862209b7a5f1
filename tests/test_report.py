"""report.py end to end on the CPU (the labelled small run: the Python twin of the kernels against ComfyUI's real
block), as a user without a GPU would run it: a JSON with the parity verdict, and exit status 0 only when the
outputs agree bit for bit and are finite. The JSON is made to be shared: no local path of the machine in it. Bad
arguments are refused before the run."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("comfyui")


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """One CPU report run: (process, JSON text, the folders of this machine it must not name)."""
    tmp_path = tmp_path_factory.mktemp("report")
    out = tmp_path / "report.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", H3_FUSED_NVFP4_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "report.py"), "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out.read_text(), tmp_path


def test_cpu_report_compares_finite_outputs(cpu_report):
    proc, text, _ = cpu_report
    report = json.loads(text)
    v = report["validation"]
    assert v["block_output_differing_elements"] == 0
    assert v["block_output_nonfinite_elements"] == 0
    assert v["fused_linear_calls"] > 0 and v["comfy_path_fallback_calls"] == 0
    assert "CPU run" in report["workload"]["label"]
    assert "0 not finite" in proc.stdout
    assert report["workload"]["stock_arm_gemm"] is None  # on the CPU torch's scaled_mm runs ComfyUI's FP4 GEMM


def test_cpu_report_says_what_a_cpu_run_shows(cpu_report):
    proc, text, _ = cpu_report
    lines = proc.stdout.splitlines()
    for needle in ("self-check passed", "differing elements"):
        (line,) = [line for line in lines if needle in line]
        assert "no CUDA kernel ran" in line and ("CPU" in line or "Python twin" in line), line
    assert any("wiring check at a reduced width" in line and "no speed figure is measured" in line
               for line in lines), proc.stdout
    report = json.loads(text)
    assert "no CUDA kernel ran" in report["run_kind"] and "no speed figure" in report["run_kind"]
    assert "no CUDA kernel ran" in report["selfcheck"]["note"]


@pytest.mark.parametrize("device, mode, said", [("cuda", "emulated", True), ("cuda", "nvfp4", False),
                                                ("cpu", "emulated", False)])
def test_the_stock_arms_failed_fp4_gemm_is_named_where_it_happens(monkeypatch, device, mode, said):
    """On a GPU without FP4 tensor cores (the H200) ComfyUI's NVFP4 Linear tries the FP4 GEMM on every call, fails,
    warns and dequantizes; the fused one dequantizes directly. The JSON and both READMEs say so beside the times."""
    from h3_fused_nvfp4.tools import report as rep

    monkeypatch.setattr(rep, "gemm_mode", lambda d: mode)
    note = rep.stock_gemm_note(torch_device(device))
    if not said:
        assert note is None
        return
    assert "falling back to dequantization" in note and "every NVFP4 Linear call" in note, note
    assert "wall-clock" in note and "kernel GPU times count only kernels" in note, note
    for readme in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        text = " ".join(readme.read_text(encoding="utf-8").split())
        assert "falling back to dequantization" in text and "`stock_arm_gemm`" in text, readme
        assert "include that host work" in text, readme


def torch_device(kind: str):
    import torch

    return torch.device(kind, 0) if kind == "cuda" else torch.device(kind)


def test_report_json_names_no_local_path(cpu_report):
    _, text, tmp_path = cpu_report
    from h3_fused_nvfp4.tools import comfy_env

    machine = {str(tmp_path), str(ROOT), str(comfy_env.find_comfyui().root), sys.prefix, sys.executable,
               str(pathlib.Path.home()), os.getcwd()}
    for path in machine:
        assert path not in text, f"the shared JSON names {path}"
    absolute = set(re.findall(r"(?<![\w.~<>])/[\w.+-]+(?:/[\w.+-]+)*", text))
    assert not [p for p in absolute if len(p) > 1 and os.path.exists(p)], absolute
    report = json.loads(text)
    assert report["versions"]["comfyui_found_as"] in ("COMFYUI_PATH", "installed", "shared tree")
    assert report["versions"]["comfyui_folder"] == comfy_env.find_comfyui().root.name
    assert report["source_artifacts"]["command"] == "python report.py --out report.json"


def run_report(tmp_path, *args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", H3_FUSED_NVFP4_CACHE=str(tmp_path / "cache"))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "report.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("case, args, message", [
    ("missing folder", ["--out", "{tmp}/missing/report.json"], "does not exist"),
    ("a folder", ["--out", "{tmp}"], "a folder"),
    ("unknown layer", ["--static-layers", "attn.qkv"], "invalid choice: 'attn.qkv'"),
    ("unknown layer after a known one", ["--static-layers", "mlp.fc1", "--static-layers", "blocks.0.mlp.fc2"],
     "invalid choice"),
])
def test_bad_arguments_are_refused_before_the_run(tmp_path, case, args, message):
    proc, _ = run_report(tmp_path, *[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "self-check" not in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "cache").exists(), "the run started"
