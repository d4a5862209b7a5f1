"""Pack-kernel variants (launch constants) at H3 block shapes, bit-compared against the first arm of their family,
then GPU-timed side by side (arms interleaved), optionally with Nsight Compute (time, instructions, DRAM bytes) per
arm of the single-kernel families.

A family is one kernel, or a sequence as in the block (a kernel and the one that reads what it left in L2), timed
right after a bf16 GEMM of the block's shape that writes the sequence's input, so L2 and the clocks are in the state
the block leaves them in.

Usage: python benchmarks/kernel_sweep.py --out sweep.json [--ncu]
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
from h3_fused_nvfp4.integration.report import HOST_LEAD_CYCLES, copy_bandwidth_gbs, warm_up_gpu  # noqa: E402
from h3_fused_nvfp4.kernels import ops  # noqa: E402
from h3_fused_nvfp4.layout import Modulation, RmsNorm  # noqa: E402

M, D, F, INNER = 37810, 5376, 14336, 7168
DEV = torch.device("cuda", 0)
# launch constants of the arms (kernels/ops.py LAUNCH: the build and the grid), per family
FROM_END_ARMS = {"norm_pack_from_end": {"NORM_PACK_FROM_END": 1}, "norm_pack_from_start": {"NORM_PACK_FROM_END": 0}}
PLAIN_ARMS = {f"segment_steps_{n}": {"PLAIN_SEGMENT_STEPS": n} for n in (0, 1, 2)}
FAMILY_ARMS = {
    "pack_norm_modulate": FROM_END_ARMS,
    "gemm_residual_norm_pack": FROM_END_ARMS,
    "pack_plain": PLAIN_ARMS,
    "gemm_absmax_plain_pack": PLAIN_ARMS,
}
NCU_FAMILIES = ("pack_norm_modulate", "pack_plain")


@contextlib.contextmanager
def variant(launch):
    saved = dict(ops.LAUNCH)
    ops.LAUNCH.update(launch)
    try:
        yield
    finally:
        ops.LAUNCH.clear()
        ops.LAUNCH.update(saved)


def families():
    """name -> (prologue or None, timed fn, reset before the bit comparison or None, output, bytes moved)."""
    g = torch.Generator(device=DEV).manual_seed(1234)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)

    x, attn = rnd(M, D, scale=3), rnd(M, INNER)
    sc, sh, gate = rnd(5, D, scale=0.3), rnd(5, D, scale=0.3), rnd(5, D, scale=0.1)
    mod_index = (torch.arange(M, device=DEV) * 5 // M).to(torch.int32)
    nw = (torch.rand(D, generator=g, device=DEV) + 0.5).to(torch.bfloat16)
    norm, modn = RmsNorm(nw, 1e-5, torch.empty(M, device=DEV)), Modulation(sc, sh, mod_index)
    g_nm = torch.empty(1, device=DEV)
    ops.norm_statistics(x, norm, modulation=modn, global_scale_out=g_nm)
    g_pl = ops.pack_nvfp4(attn).global_scale.clone()
    bufs = {k: torch.empty(ops.packed_buffer_bytes(M, n), dtype=torch.uint8, device=DEV) for k, n in (("nm", D), ("pl", INNER))}
    # the block's out_proj GEMM (bf16 here) writes the residual's `other`; the qkv-like GEMM writes attn's stand-in
    w_out = rnd(D, INNER, scale=INNER ** -0.5)
    other = torch.empty(M, D, dtype=torch.bfloat16, device=DEV)
    w_att = rnd(INNER, INNER, scale=INNER ** -0.5)
    attn_out = torch.empty(M, INNER, dtype=torch.bfloat16, device=DEV)
    x_res, x_saved = x.clone(), x.clone()
    norm2, g2 = RmsNorm(nw, 1e-5, torch.empty(M, device=DEV)), torch.empty(1, device=DEV)

    def residual_then_pack():
        ops.gated_residual_(x_res, other, gate, mod_index, next_norm=norm2, next_modulation=modn, global_scale_out=g2)
        ops.pack_nvfp4(x_res, norm=norm2, modulation=modn, global_scale=g2, out=bufs["nm"])

    nm_bytes = x.numel() * 2 + bufs["nm"].numel()
    pl_bytes = attn.numel() * 2 + bufs["pl"].numel()
    return {
        "pack_norm_modulate": (None, lambda: ops.pack_nvfp4(x, norm=norm, modulation=modn, global_scale=g_nm, out=bufs["nm"]),
                               None, bufs["nm"], nm_bytes),
        "gemm_residual_norm_pack": (lambda: torch.matmul(attn, w_out.t(), out=other), residual_then_pack,
                                    lambda: x_res.copy_(x_saved), bufs["nm"], 3 * x.numel() * 2 + nm_bytes),
        "pack_plain": (None, lambda: ops.pack_nvfp4(attn, global_scale=g_pl, out=bufs["pl"]), None, bufs["pl"], pl_bytes),
        "gemm_absmax_plain_pack": (lambda: torch.matmul(attn, w_att.t(), out=attn_out),
                                   lambda: ops.pack_nvfp4(attn_out, out=bufs["pl"]), None, bufs["pl"],
                                   attn.numel() * 2 + pl_bytes),
    }


def time_after(prologue, fn, reps: int = 20) -> list[float]:
    """GPU ms of fn per call (CUDA events), each call right after the prologue (outside the events)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_LEAD_CYCLES)
        if prologue is not None:
            prologue()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run(ncu_child: bool) -> dict:
    fams = families()
    result = {}
    for fam, (prologue, fn, reset, out, moved) in fams.items():
        if fam not in FAMILY_ARMS or (ncu_child and fam not in NCU_FAMILIES):
            continue
        arms = FAMILY_ARMS[fam]
        reference = None
        for label, launch in arms.items():
            with variant(launch):
                if prologue is not None:
                    prologue()
                if reset is not None:
                    reset()
                out.fill_(0xA5)  # poison: every byte must be rewritten
                fn()
                got = out.clone()
                reference = got if reference is None else reference
                result.setdefault(fam, {})[label] = {"identical_to_first_arm": bool(torch.equal(got, reference))}
                if ncu_child:
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    torch.cuda._sleep(1000)
                    fn()
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                    print(f"ARM {fam}/{label}", flush=True)
                else:
                    time_after(prologue, fn, reps=3)  # warm
        if ncu_child:
            continue
        samples = {label: [] for label in arms}
        for _ in range(5):  # arms interleaved
            for label, launch in arms.items():
                with variant(launch):
                    samples[label] += time_after(prologue, fn)
        for label in arms:
            ms = statistics.median(samples[label])
            result[fam][label].update(median_ms=round(ms, 4), gbs=round(moved / ms / 1e6, 1))
            print(f"{fam:24s} {label:22s} same={result[fam][label]['identical_to_first_arm']} {ms:.4f} ms", flush=True)
    return result


BLOCK_ARMS = {
    "current": {},
    "plain_segment_steps_1": {"PLAIN_SEGMENT_STEPS": 1},
    "norm_pack_from_start": {"NORM_PACK_FROM_END": 0},
    "both": {"PLAIN_SEGMENT_STEPS": 1, "NORM_PACK_FROM_END": 0},
}


def block_profile(rounds: int = 3) -> dict:
    """The report's profiler figure (kernels other than GEMMs, emulation and attention of the middle of three real
    H3 blocks, per-kernel median of PROFILE_CALLS calls behind a spin kernel) per arm, arms interleaved; the block
    output of every arm bit-compared with the first arm's."""
    import logging

    from h3_fused_nvfp4.integration import report as rep

    rep.comfy_env.import_comfyui()
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)  # the emulated-GEMM warning
    chain = rep.BlockChain(rep.syn.H3_FULL, rep.syn.FULL_TOKENS, DEV)
    chain.arm("fused")
    result, reference = {}, None
    for label, launch in BLOCK_ARMS.items():
        with variant(launch):
            for _ in range(2):
                out = chain.run().clone()
        reference = out if reference is None else reference
        result[label] = {"identical_to_first_arm": bool(torch.equal(out.view(torch.int16), reference.view(torch.int16))),
                         "non_gemm_non_attention_ms": [], "kernels": None}
    for _ in range(rounds):
        for label, launch in BLOCK_ARMS.items():
            with variant(launch):
                runs = [rep.middle_block_profile(chain) for _ in range(rep.PROFILE_CALLS)]
                sec = rep._sections(rep.median_kernels(runs), None, "fused")
                result[label]["non_gemm_non_attention_ms"].append(sec["other_boundaries"]["non_gemm_non_attention_ms"])
                result[label]["kernels"] = [(k["kernel"][:32], round(k["ms"], 4)) for k in sec["kernels"]
                                            if k["category"] not in rep.NOT_ELEMENTWISE]
    for label, r in result.items():
        r["median_ms"] = round(statistics.median(r["non_gemm_non_attention_ms"]), 4)
        print(f"block {label:24s} same={r['identical_to_first_arm']} {r['median_ms']:.4f} ms {r['non_gemm_non_attention_ms']}",
              flush=True)
    return result


def ncu_table() -> dict:
    cmd = ["ncu", "--csv", "--clock-control", "none", "--profile-from-start", "off",
           "--kernel-name", "regex:spin_kernel|nvfp4_pack",
           "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum,smsp__inst_executed.sum",
           sys.executable, __file__, "--ncu-child"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
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
        k[r["Metric Name"] + " [" + r.get("Metric Unit", "") + "]"] = r["Metric Value"]
    out, arm_i = {}, -1
    for kid in order:
        if "spin_kernel" in kernels[kid]["kernel"]:
            arm_i += 1
        elif 0 <= arm_i < len(arms):
            out.setdefault(arms[arm_i], []).append(kernels[kid])
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--ncu-child", action="store_true")
    args = parser.parse_args()
    warm_up_gpu()
    if args.ncu_child:
        run(True)
        return
    result = run(False)
    result["copy_gbs"] = copy_bandwidth_gbs()
    result["block"] = block_profile()
    out_path = pathlib.Path(args.out)
    out_path.write_text(json.dumps(result, indent=1))
    if args.ncu:
        result["ncu"] = ncu_table()
        out_path.write_text(json.dumps(result, indent=1))
    for fam in FAMILY_ARMS:
        print(fam, {k: v.get("median_ms") for k, v in result[fam].items()})
    for arm, kernels in (result.get("ncu") or {}).items():
        if isinstance(kernels, list):
            print("ncu", arm, [(k["gpu__time_duration.sum [ns]"], k["smsp__inst_executed.sum [inst]"]) for k in kernels])


if __name__ == "__main__":
    main()
