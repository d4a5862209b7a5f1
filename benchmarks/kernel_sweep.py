"""Kernel variants at H3 block shapes, bit-compared against the first arm of their family, then GPU-timed.

Usage: python benchmarks/kernel_sweep.py --out sweep.json                (events)
       python benchmarks/kernel_sweep.py --ncu --out sweep.json          (also Nsight Compute of every arm)
"""

import argparse
import contextlib
import csv
import io
import json
import os
import pathlib
import statistics
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import report  # noqa: E402

report.import_pack()
from h3_fused_nvfp4.integration.report import copy_bandwidth_gbs, time_ms, warm_up_gpu  # noqa: E402
from h3_fused_nvfp4.kernels import ops  # noqa: E402
from h3_fused_nvfp4.layout import Modulation, RmsNorm  # noqa: E402

M, D, F, INNER = 37810, 5376, 14336, 7168
DEV = torch.device("cuda", 0)
NCU_ARMS = "pack_swiglu/table1024,pack_swiglu/window5,rope/current,pack_norm_modulate/current,pack_plain/current"
SECTIONS = ["SpeedOfLight", "Occupancy", "WarpStateStats", "ComputeWorkloadAnalysis"]


@contextlib.contextmanager
def variant(launch=None, rope=None, silu=None):
    saved = (dict(ops.LAUNCH), ops.ROPE_DEFINES, ops.ROPE_SHARED_BYTES, ops.SWIGLU_SILU)
    ops.LAUNCH.update(launch or {})
    if silu:
        ops.SWIGLU_SILU = silu
    if rope:
        ops.ROPE_DEFINES = saved[1] + tuple(rope.items())
        freq_bytes = 384 if rope.get("ROPE_STAGE_FREQS") else 0
        ops.ROPE_SHARED_BYTES = ops.ROPE_THREADS // 32 * ops.ROPE_STAGES * (2 * 4 * (2 * ops.ROPE_HEAD_DIM + 64) + freq_bytes)
    try:
        yield
    finally:
        ops.LAUNCH.clear()
        ops.LAUNCH.update(saved[0])
        ops.ROPE_DEFINES, ops.ROPE_SHARED_BYTES, ops.SWIGLU_SILU = saved[1:]


def tensors():
    g = torch.Generator(device=DEV).manual_seed(1234)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)

    t = {"x": rnd(M, D, scale=3), "other": rnd(M, D), "gate": rnd(5, D, scale=0.5), "sc": rnd(5, D, scale=0.3),
         "sh": rnd(5, D, scale=0.3), "mod_index": (torch.arange(M, device=DEV) * 5 // M).to(torch.int32),
         "nw": (torch.rand(D, generator=g, device=DEV) + 0.5).to(torch.bfloat16),
         "fc1": rnd(M, 2 * F, scale=2), "qkv": rnd(M, 3 * INNER, scale=2), "attn": rnd(M, INNER),
         "qw": (torch.rand(128, generator=g, device=DEV) + 0.5).to(torch.bfloat16),
         "kw": (torch.rand(128, generator=g, device=DEV) + 0.5).to(torch.bfloat16)}
    angles = torch.rand(M, 48, generator=g, device=DEV) * 100
    c, s = torch.cos(angles), torch.sin(angles)
    t["freqs"] = torch.stack([c, -s, s, c], dim=-1).reshape(1, M, 1, 48, 2, 2).to(torch.bfloat16)
    return t


def families(t):
    """name -> (run(fresh) -> outputs, bytes moved, arms {label: variant kwargs})."""
    rstd, gs, gs2 = torch.empty(M, device=DEV), torch.empty(1, device=DEV), torch.empty(1, device=DEV)
    norm, modn = RmsNorm(t["nw"], 1e-5, rstd), Modulation(t["sc"], t["sh"], t["mod_index"])
    work, qkv = torch.empty_like(t["x"]), torch.empty_like(t["qkv"])
    fc1_work, attn_work = torch.empty_like(t["fc1"]), torch.empty_like(t["attn"])
    buf_nm = torch.empty(ops.packed_buffer_bytes(M, D), dtype=torch.uint8, device=DEV)
    buf_sw = torch.empty(ops.packed_buffer_bytes(M, F), dtype=torch.uint8, device=DEV)
    buf_pl = torch.empty(ops.packed_buffer_bytes(M, INNER), dtype=torch.uint8, device=DEV)
    gs_sw = ops.pack_nvfp4(t["fc1"], swiglu=True).global_scale.clone()

    def pack_swiglu(fresh):
        return [ops.pack_nvfp4(t["fc1"], swiglu=True, global_scale=gs_sw, out=buf_sw).qdata, buf_sw]

    def rope(fresh):
        if fresh:
            qkv.copy_(t["qkv"])
        q, k = qkv[:, :INNER].view(1, M, INNER // 128, 128), qkv[:, INNER:2 * INNER].view(1, M, INNER // 128, 128)
        ops.rms_rope_split_half_(q, k, t["freqs"], t["qw"], t["kw"], 1e-5, 96)
        return [qkv]

    def pack_nm(fresh):
        if fresh:
            ops.norm_statistics(t["x"], norm, modulation=modn, global_scale_out=gs2)
        return [ops.pack_nvfp4(t["x"], norm=norm, modulation=modn, global_scale=gs2, out=buf_nm).qdata, buf_nm]

    def pack_plain(fresh):
        return [ops.pack_nvfp4(t["attn"], static_scale=gs_sw, out=buf_pl).qdata, buf_pl]


    h_fc2 = (torch.randn(M, F, device=DEV) * 0.5).to(torch.bfloat16)
    w_fc2 = (torch.randn(F, D, device=DEV) * 0.02).to(torch.bfloat16)
    y_fc2 = torch.empty(M, D, device=DEV, dtype=torch.bfloat16)

    def pack_then_gemm(fresh):  # does the pack's L2 state slow the next GEMM (fc2's, bf16 as in the emulation)?
        ops.pack_nvfp4(t["fc1"], swiglu=True, global_scale=gs_sw, out=buf_sw)
        torch.matmul(h_fc2, w_fc2, out=y_fc2)
        return [buf_sw, y_fc2]

    def gemm_alone(fresh):
        torch.matmul(h_fc2, w_fc2, out=y_fc2)
        return [y_fc2]

    plain_scales = {"launch": {"SWIGLU_SCALE_EVICT_LAST": 0}}

    sw_in = 2 * M * 2 * F
    return {
        "pack_swiglu": (pack_swiglu, sw_in + buf_sw.numel(), {
            "table": {"silu": "table"}, "table_plain_scale_stores": {"silu": "table", **plain_scales},
            "window": {"silu": "window"}, "window_plain_scale_stores": {"silu": "window", **plain_scales},
            "evaluated": {"silu": "evaluated"}}),
        "pack_then_gemm": (pack_then_gemm, 0, {"evict_last": {"silu": "table"},
                                               "plain_scale_stores": {"silu": "table", **plain_scales},
                                               "evict_last_again": {"silu": "table"},
                                               "plain_scale_stores_again": {"silu": "table", **plain_scales}}),
        "gemm_alone": (gemm_alone, 0, {"gemm": {}}),
        "rope": (rope, 2 * 2 * M * INNER * 2, {"current": {}}),
        "pack_norm_modulate": (pack_nm, 2 * M * D + buf_nm.numel(), {"current": {}}),
        "pack_plain": (pack_plain, 2 * M * INNER + buf_pl.numel(), {"current": {}}),
    }


def same_bytes(out, reference):
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, reference))


def run_arms(fams, ncu_child, only=()):
    result = {}
    for fam, (run, moved, arms) in fams.items():
        reference = None
        for label, kw in arms.items():
            if ncu_child and only and f"{fam}/{label}" not in only:
                continue
            with variant(**kw):
                out = [o.clone() for o in run(True)]
                if reference is None:
                    reference = out
                same = same_bytes(out, reference)
                if ncu_child:
                    if fam.endswith("_pair"):
                        continue
                    run(True)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    torch.cuda._sleep(1000)
                    run(False)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                    print(f"ARM {fam}/{label}", flush=True)
                    continue
                samples = []
                for _ in range(3):
                    samples += time_ms(lambda: run(False), reps=20)
            ms = statistics.median(samples)
            entry = {"identical_to_first_arm": same, "median_ms": round(ms, 4)}
            if moved:
                entry["gbs"] = round(moved / ms / 1e6, 1)
            result.setdefault(fam, {})[label] = entry
            print(f"{fam:20s} {label:14s} same={same} {ms:.4f} ms", flush=True)
    return result


def ncu_table(out_dir):
    cmd = ["ncu", "--csv", "--page", "details", "--clock-control", "none", "--profile-from-start", "off"]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += ["--kernel-name", "regex:spin_kernel|nvfp4_pack|h3_rms_rope",
            "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum",
            sys.executable, __file__, "--ncu-child", "--ncu-arms", NCU_ARMS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    (out_dir / "ncu.csv").write_text(proc.stdout[-3_000_000:])
    if '"ID"' not in proc.stdout:
        return {"error": proc.stderr[-3000:] + proc.stdout[-3000:]}
    arms = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ARM ")]
    rows = list(csv.DictReader(io.StringIO(proc.stdout[proc.stdout.index('"ID"'):])))
    kernels, order = {}, []
    for r in rows:
        k = kernels.setdefault(r["ID"], {"kernel": r["Kernel Name"][:60]})
        if r["ID"] not in order:
            order.append(r["ID"])
        k[r["Metric Name"] + " [" + r.get("Metric Unit", "") + "]"] = r["Metric Value"]
    # each arm's window: spin marker, then its kernels
    out, arm_i = {}, -1
    for kid in order:
        k = kernels[kid]
        if "spin_kernel" in k["kernel"]:
            arm_i += 1
            continue
        if 0 <= arm_i < len(arms):
            out.setdefault(arms[arm_i], []).append(k)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--ncu-child", action="store_true")
    parser.add_argument("--ncu-arms", default="")
    parser.add_argument("--families", default="")
    args = parser.parse_args()
    t = tensors()
    fams = families(t)
    if args.families:
        fams = {k: v for k, v in fams.items() if k in args.families.split(",")}
    warm_up_gpu()
    if args.ncu_child:
        run_arms(fams, True, tuple(a for a in args.ncu_arms.split(",") if a))
        return
    result = run_arms(fams, False)
    result["copy_gbs"] = copy_bandwidth_gbs()
    out_path = pathlib.Path(args.out)
    out_path.write_text(json.dumps(result, indent=1))
    if args.ncu:
        os.environ["H3_FUSED_NVFP4_SELFCHECK"] = "skip"
        result["ncu"] = ncu_table(out_path.parent)
        out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
