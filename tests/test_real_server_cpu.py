"""benchmarks/real_server.py on the CPU: ComfyUI's real ``main.py`` (``--cpu``) with this repository installed as a
custom node, a random-weight H3 file and LoRA, graphs queued through the HTTP API; and the parts of the GPU-only
``--dram`` mode that run without a GPU (the ncu windows of each memory mode, the verdict), on a made-up profile.

Outside CI the server test skips when ComfyUI's server dependencies are missing; with CI=1 it fails instead.
"""

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from comfy_harness import requires_comfyui
from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "real_server.py"
SERVER_MODULES = ("aiohttp", "yarl", "alembic", "sqlalchemy", "requests", "simpleeval", "blake3")
SPIN = "void at::cuda::(anonymous namespace)::spin_kernel(long)"


@pytest.fixture(scope="module")
def server_check():
    spec = importlib.util.spec_from_file_location("real_server_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_comfyui
@pytest.mark.slow
def test_quick_run_through_comfyuis_server(tmp_path):
    """Loader -> LoRA -> Toggle fused / comfy -> KSampler -> SaveLatent, and ComfyUI's UNETLoader without the pack:
    the saved latents are bit-identical, every NVFP4 call fused, the hand-over between blocks taken, and the server
    ran with ComfyUI's own flags only."""
    for module in SERVER_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            if os.environ.get("CI"):
                pytest.fail(f"{module} (ComfyUI's server needs it) missing in CI")
            pytest.skip(f"{module} (ComfyUI's server needs it) not installed (tests/requirements-test.txt)")
    out = tmp_path / "server.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "h3", "--steps", "1", "--quick", "--out",
                           str(out), "--work", str(tmp_path / "work")], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["complete"] and [s["config"] for s in result["servers"]] == ["cpu"]
    [row] = result["summary"]
    assert (row["model"], row["lora"]) == ("h3", True)
    for pair in ("fused_vs_comfy", "fused_vs_unpatched", "comfy_vs_unpatched"):
        assert row[pair]["differing"] == 0 and row[pair]["per_stream"] == [0, 0], (pair, row[pair])
    calls = row["calls_last_round"]
    assert calls["nvfp4_linears"] == calls["fused_patches"] == 20 and calls["calls_stock"] == 0, calls
    assert calls["calls_fused"] >= 20 and not calls["linears_not_called"], calls
    assert calls["compute_dtype"] == "bfloat16", calls
    # 3 blocks, 1 step: block 1 hands over to block 2 (block 0 too, unless this first fused forward's block self-check
    # ran on it: that call returns ComfyUI's block)
    assert calls["block_calls"]["blocks.1"]["handoff_out"] == calls["block_calls"]["blocks.2"]["handoff_in"] == 1
    assert calls["blocks"]["handoff_out"] == calls["blocks"]["handoff_in"] in (1, 2), calls
    assert [a["accounted"] and a["all_calls_fused"] for a in row["accounting"]] == [True], row["accounting"]
    assert {r["arm"] for r in result["runs"]} == {"fused", "comfy", "unpatched"}
    assert all(r["status"] == "success" for r in result["runs"])
    toggle = next(r for r in result["runs"] if r["arm"] == "fused")["node_text"]["toggle"]
    assert toggle.startswith("H3 fused NVFP4: patched 3 DiT + 2 refiner blocks, 20 NVFP4 layers"), toggle

    # only ComfyUI's own flags: its argument parser takes the command line as it is
    from h3_fused_nvfp4.tools import comfy_env

    comfy_env.import_comfyui()
    from comfy.cli_args import parser

    command = [arg.replace("<work>", str(tmp_path / "work")) for arg in result["servers"][0]["command"]]
    assert command[0] == "main.py"
    parser.parse_args(command[1:])
    assert str(tmp_path) not in out.read_text() and str(REPO_ROOT) not in out.read_text()
    assert proc.stdout.strip().splitlines()[-2] == "ok: True"  # the table comes last, then the JSON's path


def ncu_csv(windows) -> str:
    """Nsight Compute's --csv output: each window opened by the spin kernel, then (name, read, written) kernels."""
    lines = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    kernels = [k for window in windows for k in [(SPIN, 0, 0), *window]]
    for i, (name, read, write) in enumerate(kernels):
        for metric, unit, value in (("dram__bytes_read.sum", "byte", read), ("dram__bytes_write.sum", "byte", write),
                                    ("gpu__time_duration.sum", "usecond", 10)):
            lines.append(f'"{i}","{name}","{metric}","{unit}","{value:,}"')
    return "==PROF== Connected\n" + "\n".join(lines) + "\n"


STOCK = [("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<c10::BFloat16>>", 4000, 4000),
         ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", 9000, 9000),
         ("void comfy::quantize_nvfp4_kernel", 4000, 1000)]
FUSED = [("h3_row_norm_stats", 4000, 0), ("nvfp4_pack_norm", 4000, 1000),
         ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", 9000, 9000)]


def test_dram_windows_and_verdict(server_check):
    """Each memory mode's ncu output gives the comfy and the fused block (GEMMs left out of the bytes); the default
    mode's fused bytes over classic mode's decide, with equal latents in every mode."""
    dynamic = server_check.block_windows(ncu_csv([STOCK, FUSED + [("h3_gated_residual", 50, 0)]]))
    classic = server_check.block_windows(ncu_csv([STOCK, FUSED]))
    assert dynamic["comfy"]["non_gemm_non_attention_dram_bytes"] == 13000
    assert classic["fused"]["non_gemm_non_attention_dram_bytes"] == 9000
    assert dynamic["fused"]["non_gemm_non_attention_launches"] == 3
    equal = {"latents_fused_vs_comfy": {"differing": 0}}
    verdict = server_check.dram_verdict({"dynamic": dict(dynamic, **equal), "classic": dict(classic, **equal)})
    assert verdict == {"fused_dynamic_over_classic": round(9050 / 9000, 4), "ok": True}
    over = server_check.block_windows(ncu_csv([STOCK, FUSED + [("h3_gated_residual", 100, 0)]]))
    assert not server_check.dram_verdict({"dynamic": dict(over, **equal), "classic": dict(classic, **equal)})["ok"]
    differs = {"latents_fused_vs_comfy": {"differing": 3}}
    assert not server_check.dram_verdict({"dynamic": dict(dynamic, **differs), "classic": dict(classic, **equal)})["ok"]
    missing = server_check.block_windows(ncu_csv([STOCK]))
    assert "found 1" in missing["error"]
    assert server_check.dram_verdict({"classic": dict(classic, **equal)})["ok"] is False


def test_every_call_must_be_accounted_for(server_check):
    """A fused run's accounting: Linears without a fused patch must be counted in the node text, every patched
    Linear called, every call on ComfyUI's path with its reason in the log."""
    calls = {"nvfp4_linears": 4, "fused_patches": 4, "calls_fused": 7, "calls_stock": 1,
             "stock_reasons": {"inside torch.compile (stock path is traced instead)": 1}, "linears_not_called": []}
    logged = {"stock_log": [{"where": "blocks.0.mlp.fc2", "reason": "inside torch.compile (stock path is traced "
                                                                      "instead)"}], "pack_log": []}
    record = {"calls": calls, "node_text": {"toggle": "H3 fused NVFP4: ... 4 NVFP4 layers"}, **logged}
    assert server_check.accounting(record) == {"accounted": True, "why": "", "all_calls_fused": False}
    assert not server_check.accounting(dict(record, stock_log=[]))["accounted"]
    left = dict(calls, fused_patches=3)
    assert not server_check.accounting(dict(record, calls=left))["accounted"]
    text = {"toggle": "H3 fused NVFP4: ... 4 NVFP4 layers (...), 1 left on ComfyUI's path (x: y)"}
    assert server_check.accounting(dict(record, calls=left, node_text=text))["accounted"]
    uncalled = dict(calls, linears_not_called=["blocks.0.attn.qkv_proj"])
    assert not server_check.accounting(dict(record, calls=uncalled))["accounted"]
    assert not server_check.accounting({"node_text": {}, "stock_log": [], "pack_log": []})["accounted"]


def test_a_reason_logged_in_an_earlier_run_of_the_same_server_counts(server_check):
    """The pack logs each reason once per layer and process: a later run's call on ComfyUI's path is accounted for
    by the line an earlier run of the same server logged, not by another server's."""
    reason = "inside torch.compile (stock path is traced instead)"
    calls = {"nvfp4_linears": 1, "fused_patches": 1, "calls_fused": 0, "calls_stock": 1, "stock_reasons": {reason: 1},
             "linears_not_called": []}
    first = {"config": "classic", "calls": calls, "node_text": {}, "pack_log": [],
             "stock_log": [{"where": "blocks.0.mlp.fc2", "reason": reason}]}
    second = dict(first, stock_log=[])
    other = dict(first, config="dynamic", stock_log=[])
    runs = [first, other, second]
    assert server_check.accounting(second, server_check.logged_until(runs, second))["accounted"]
    assert not server_check.accounting(other, server_check.logged_until(runs, other))["accounted"]
