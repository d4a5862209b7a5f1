"""report.py end to end on the CPU (the labelled small run: the Python twin of the kernels against ComfyUI's real
block), as a user without a GPU would run it: a JSON with the parity verdict, and exit status 0 only when the
outputs agree bit for bit and are finite."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("comfyui")


def test_cpu_report_compares_finite_outputs(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", H3_FUSED_NVFP4_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "report.py"), "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    v = report["validation"]
    assert v["block_output_differing_elements"] == 0
    assert v["block_output_nonfinite_elements"] == 0
    assert v["fused_linear_calls"] > 0 and v["comfy_path_fallback_calls"] == 0
    assert "CPU run" in report["workload"]["label"]
    assert "0 not finite" in proc.stdout
