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


def run_report(tmp_path, *args, **environment):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", H3_FUSED_NVFP4_CACHE=str(tmp_path / "cache"), **environment)
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
    ("no repetitions", ["--reps", "0"], "--reps: 0 is not a positive whole number"),
    ("negative repetitions", ["--reps=-2"], "--reps: -2 is not a positive whole number"),
])
def test_bad_arguments_are_refused_before_the_run(tmp_path, case, args, message):
    proc, _ = run_report(tmp_path, *[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "self-check" not in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "cache").exists(), "the run started"


def unwritable(path: pathlib.Path):
    """Make the existing file ``path`` unwritable to this user (root: immutable); skip where that cannot be done."""
    os.chmod(path, 0o444)
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("root, and no chattr +i here: no file is unwritable to this user")
    try:
        with open(path, "ab"):
            pytest.skip("the file stays writable to this user")
    except PermissionError:
        pass


def test_an_existing_out_file_it_cannot_write_is_refused_before_the_run(tmp_path):
    out = tmp_path / "report.json"
    out.write_text("an earlier report")
    unwritable(out)
    try:
        proc, _ = run_report(tmp_path, "--out", str(out))
    finally:
        subprocess.run(["chattr", "-i", str(out)], capture_output=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot be written" in proc.stderr and "self-check" not in proc.stdout, proc.stdout + proc.stderr
    assert out.read_text() == "an earlier report"


def test_results_are_not_lost_when_the_out_file_cannot_take_them(tmp_path):
    """A full disk at the end of the run (/dev/full: every write fails with ENOSPC): the JSON goes to a file in the
    temporary folder, named on stdout, and the exit status says it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc, _ = run_report(tmp_path, "--out", "/dev/full", "--skip-profile", TMPDIR=str(scratch))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (kept,) = scratch.glob("h3-fused-nvfp4-report-*.json")
    assert "No space left on device" in proc.stdout and str(kept) in proc.stdout, proc.stdout
    assert json.loads(kept.read_text())["selfcheck"]["summary"].startswith("self-check passed")


def test_out_given_as_one_argument_is_recorded_by_its_file_name(tmp_path):
    elsewhere, cwd = tmp_path / "elsewhere", tmp_path / "cwd"
    elsewhere.mkdir()
    cwd.mkdir()
    proc, _ = run_report(cwd, f"--out={elsewhere / 'my-gpu.json'}", "--skip-profile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (elsewhere / "my-gpu.json").read_text()
    assert json.loads(text)["source_artifacts"]["command"] == "python report.py --out=my-gpu.json --skip-profile"
    assert str(elsewhere) not in text
