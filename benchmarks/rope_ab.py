"""RMSNorm + RoPE kernel variants (build switches of kernels/h3_rms_rope.cu) side by side on H3's q/k views: every
variant's output bit-compared with comfy-kitchen's rms_rope_split_half_, GPU time alone and right after a bf16 GEMM
of the qkv_proj shape that writes the q/k buffer (arms interleaved, CUDA events, median), the report's in-block
profiler figure per variant (real H3 blocks), Nsight Compute per variant.

Usage: python benchmarks/rope_ab.py --out rope-ab.json
"""

import argparse
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
from h3_fused_nvfp4.integration.report import HOST_LEAD_CYCLES, warm_up_gpu  # noqa: E402
from h3_fused_nvfp4.kernels import ops  # noqa: E402

ROWS = 37810
VARIANTS = {
    "previous": (("ROPE_PREVIOUS", 1),),
    "addressing": (("ROPE_F32_WEIGHTS", 0), ("ROPE_F32_PARTNER", 0), ("ROPE_PAIR_ROUNDING", 0)),
    "all": (),
    "no_shared_weights": (("ROPE_F32_WEIGHTS", 0),),
    "all_7_ctas": (("ROPE_MIN_CTAS", 7),),
}


def inputs():
    torch.manual_seed(440420)
    qkv = torch.randn(ROWS, 3 * 7168, device="cuda").to(torch.bfloat16)
    angles = torch.rand(ROWS, 48, device="cuda") * 100
    c, s = torch.cos(angles), torch.sin(angles)
    freqs = torch.stack([c, -s, s, c], dim=-1).reshape(1, ROWS, 1, 48, 2, 2).to(torch.bfloat16)
    qw = (torch.rand(128, device="cuda") + 0.5).to(torch.bfloat16)
    kw = (torch.rand(128, device="cuda") + 0.5).to(torch.bfloat16)
    return qkv, freqs, qw, kw


def views(t):
    return t[:, :7168].view(1, ROWS, 56, 128), t[:, 7168:14336].view(1, ROWS, 56, 128)


def run(ncu_child: bool) -> dict:
    import comfy_kitchen as ck

    qkv, freqs, qw, kw = inputs()
    expected = qkv.clone()
    ck.rms_rope_split_half_(*views(expected), freqs, qw, kw, epsilon=1e-5, rot_dim=96)
    work = qkv.clone()
    x_in = torch.randn(ROWS, 5376, device="cuda").to(torch.bfloat16)
    w_qkv = (torch.randn(3 * 7168, 5376, device="cuda") * 5376 ** -0.5).to(torch.bfloat16)
    result = {}
    for name, defines in VARIANTS.items():
        ops.EXTRA_DEFINES = defines
        got = qkv.clone()
        ops.rms_rope_split_half_(*views(got), freqs, qw, kw, 1e-5, 96)
        result[name] = {"identical_to_comfy_kitchen": bool(torch.equal(got.view(torch.int16), expected.view(torch.int16)))}
        if ncu_child:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            torch.cuda._sleep(1000)
            ops.rms_rope_split_half_(*views(work), freqs, qw, kw, 1e-5, 96)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"ARM {name}", flush=True)
    if ncu_child:
        return result

    def timed(prologue, reps):
        out = {}
        for name, defines in VARIANTS.items():
            ops.EXTRA_DEFINES = defines
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(HOST_LEAD_CYCLES)
                if prologue:
                    torch.matmul(x_in, w_qkv.t(), out=work)
                start.record()
                ops.rms_rope_split_half_(*views(work), freqs, qw, kw, 1e-5, 96)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            out[name] = times
        return out

    for key, prologue, reps in (("alone", False, 20), ("after_qkv_gemm", True, 8)):
        samples = {n: [] for n in VARIANTS}
        timed(prologue, 2)  # warm
        for _ in range(5):  # variants interleaved
            for n, t in timed(prologue, reps).items():
                samples[n] += t
        for n in VARIANTS:
            result[n][f"{key}_median_ms"] = round(statistics.median(samples[n]), 4)
    ops.EXTRA_DEFINES = ()
    return result


def block_profile(rounds: int = 3) -> dict:
    """The report's profiler figure (the fused arm's kernels other than GEMMs, emulation and attention, of the middle
    of three real H3 blocks, cut out of a profile of the whole run, per-kernel median of PROFILE_CALLS runs) per
    variant, variants interleaved; every variant's block output bit-compared with the previous kernel's."""
    import logging

    from h3_fused_nvfp4.integration import report as rep

    rep.comfy_env.import_comfyui()
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)  # the emulated-GEMM warning
    chain = rep.BlockChain(rep.syn.H3_FULL, rep.syn.FULL_TOKENS, torch.device("cuda", 0))
    chain.arm("fused")
    result, reference = {}, None
    for name, defines in VARIANTS.items():
        ops.EXTRA_DEFINES = defines
        for _ in range(2):
            out = chain.run().clone()
        reference = out if reference is None else reference
        result[name] = {"block_identical_to_previous": bool(torch.equal(out.view(torch.int16), reference.view(torch.int16))),
                        "non_gemm_non_attention_ms": [], "rope_ms": []}
    for _ in range(rounds):
        for name, defines in VARIANTS.items():
            ops.EXTRA_DEFINES = defines
            sec = rep._sections(rep.median_kernels([rep.middle_block_profile(chain) for _ in range(rep.PROFILE_CALLS)]),
                                None, "fused")
            result[name]["non_gemm_non_attention_ms"].append(sec["other_boundaries"]["non_gemm_non_attention_ms"])
            result[name]["rope_ms"].append(sec["other_boundaries"]["rms_rope_total_ms"])
    ops.EXTRA_DEFINES = ()
    for r in result.values():
        r["median_ms"] = round(statistics.median(r["non_gemm_non_attention_ms"]), 4)
        r["rope_median_ms"] = round(statistics.median(r["rope_ms"]), 4)
    return result


def ncu_table() -> dict:
    cmd = ["ncu", "--csv", "--clock-control", "none", "--profile-from-start", "off",
           "--kernel-name", "regex:spin_kernel|h3_rms_rope",
           "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum,smsp__inst_executed.sum",
           sys.executable, __file__, "--ncu-child"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, H3_FUSED_NVFP4_SELFCHECK="skip"))
    if '"ID"' not in proc.stdout:
        return {"error": proc.stderr[-3000:] + proc.stdout[-3000:]}
    arms = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ARM ")]
    rows = list(csv.DictReader(io.StringIO(proc.stdout[proc.stdout.index('"ID"'):])))
    kernels, order = {}, []
    for r in rows:
        k = kernels.setdefault(r["ID"], {"kernel": r["Kernel Name"][:40]})
        if r["ID"] not in order:
            order.append(r["ID"])
        k[r["Metric Name"]] = r["Metric Value"]
    out, arm_i = {}, -1
    for kid in order:
        if "spin_kernel" in kernels[kid]["kernel"]:
            arm_i += 1
        elif 0 <= arm_i < len(arms):
            out[arms[arm_i]] = kernels[kid]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="rope-ab.json")
    parser.add_argument("--ncu-child", action="store_true")
    args = parser.parse_args()
    warm_up_gpu()
    if args.ncu_child:
        run(True)
        return
    result = {"command": "python benchmarks/rope_ab.py", "variants": {k: dict(v) for k, v in VARIANTS.items()}}
    result["arms"] = run(False)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    result["block"] = block_profile()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    result["ncu"] = ncu_table()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    for n, r in result["arms"].items():
        k = result["ncu"].get(n, {}) if isinstance(result["ncu"], dict) else {}
        print(f"{n:20s} exact={r['identical_to_comfy_kitchen']} alone {r['alone_median_ms']:.4f} after-GEMM "
              f"{r['after_qkv_gemm_median_ms']:.4f} ncu {k.get('gpu__time_duration.sum', '?')} ns "
              f"{k.get('smsp__inst_executed.sum', '?')} inst; in the block: rope {result['block'][n]['rope_median_ms']:.4f}, "
              f"all {result['block'][n]['median_ms']:.4f} ms, block exact={result['block'][n]['block_identical_to_previous']}",
              flush=True)


if __name__ == "__main__":
    main()
