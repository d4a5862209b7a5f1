"""benchmarks/full_model.py --tiny end to end on the CPU: ComfyUI's loader, the Patch node's clone, the first fused
forward with its block check, 0 differing elements in the JSON (the wiring of the GPU run at full size)."""

import json
import subprocess
import sys

from comfy_harness import requires_comfyui
from conftest import REPO_ROOT


@requires_comfyui
def test_full_model_tiny_run_is_bit_identical(tmp_path):
    out = tmp_path / "full-model-tiny.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "full_model.py"), "--tiny", "--reps", "1",
                           "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    parity = result["parity"]
    assert result["ok"] and parity["total_differing_elements"] == 0 and parity["block_check"] == "passed", parity
    assert parity["fused_linears"] == 16 and parity["fused_linear_stock_calls"] == 0, parity
    assert [f["label"] for f in result["fused"]["forwards"]] == ["first (block check)", "compared", "timed"]
    assert result["workload"]["packed_tokens"] == 7 + 2 * 5 + 2 * 4 * 4
    assert result["workload"]["stock_arm_gemm"] is None  # said on GPUs without FP4 tensor cores only
