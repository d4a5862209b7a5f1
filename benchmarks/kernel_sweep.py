"""Kernel variants at H3 block shapes, bit-compared against the first arm of their family, then GPU-timed.

Usage: python benchmarks/kernel_sweep.py --out sweep.json                (events)
       python benchmarks/kernel_sweep.py --ncu --out sweep.json          (also Nsight Compute of the NCU_ARMS)
       python benchmarks/kernel_sweep.py --chain --out sweep.json        (the fused block's kernel times, synced vs
                                                                          back to back: chain.json)
       python benchmarks/kernel_sweep.py --chain-packs --out sweep.json  (the block's norm-modulate packs on their
                                                                          real inputs and mixes: chain-packs.json)
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
NCU_ARMS = ("absmax_pack_swiglu/absmax_items_1,absmax_pack_swiglu/absmax_items_2,absmax_pack_swiglu/absmax_items_3,"
            "absmax_pack_swiglu/absmax_items_4,pack_swiglu_table/items_1,pack_swiglu_table/items_2")
SECTIONS = ["SpeedOfLight", "Occupancy", "WarpStateStats"]


@contextlib.contextmanager
def variant(launch=None, rope=None, silu=None):
    saved = (dict(ops.LAUNCH), ops.ROPE_DEFINES, ops.ROPE_SHARED_BYTES, ops.SWIGLU_SILU)
    ops.LAUNCH.update(launch or {})
    if silu:
        ops.SWIGLU_SILU = silu
    if rope:
        merged = dict(saved[1])
        merged.update(rope)
        ops.ROPE_DEFINES = tuple(merged.items())
        ops.ROPE_SHARED_BYTES = merged["ROPE_THREADS"] // 32 * merged["ROPE_STAGES"] * 2 * 4 * (2 * 128 + 64)
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


    res_work = torch.empty_like(t["x"])
    g_res = torch.empty(1, device=DEV)
    norm2 = RmsNorm(t["nw"], 1e-5, torch.empty(M, device=DEV))

    def residual_pack(fresh):
        if fresh:
            res_work.copy_(t["x"])
        ops.gated_residual_(res_work, t["other"], t["gate"], t["mod_index"], next_norm=norm2, next_modulation=modn,
                            global_scale_out=g_res)
        return [res_work, norm2.rstd, g_res,
                ops.pack_nvfp4(res_work, norm=norm2, modulation=modn, global_scale=g_res, out=buf_nm).qdata, buf_nm]

    def absmax_pack_swiglu(fresh):
        return [ops.pack_nvfp4(t["fc1"], swiglu=True, out=buf_sw).qdata, buf_sw]

    def absmax_pack_plain(fresh):
        return [ops.pack_nvfp4(t["attn"], out=buf_pl).qdata, buf_pl]

    sw_in = 2 * M * 2 * F

    def order(pairs, last_first):
        return {"launch": {"PACK_ROW_PAIRS": pairs, "PACK_LAST_ROWS_FIRST": last_first}}

    arms4 = {"pairs_last_first": order(1, 1), "rows_first_first": order(0, 0), "pairs_first_first": order(1, 0),
             "rows_last_first": order(0, 1)}
    arms2 = {"pairs_last_first": order(1, 1), "rows_first_first": order(0, 0)}
    def items(absmax_items, pack_items=1):
        return {"launch": {"SWIGLU_ABSMAX_ITEMS": absmax_items, "SWIGLU_ITEMS": pack_items}}

    return {
        "absmax_pack_swiglu": (absmax_pack_swiglu, 0, {f"absmax_items_{n}": items(n) for n in (1, 2, 3, 4)}),
        "pack_swiglu_table": (pack_swiglu, sw_in + buf_sw.numel(), {"items_1": items(1, 1), "items_2": items(1, 2)}),
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
    cmd += ["--kernel-name", "regex:spin_kernel|nvfp4_|h3_|elementwise",
            "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum,"
            "lts__t_sectors_srcunit_tex_op_read.sum,smsp__inst_executed.sum",
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


def chain_profile(reps=3):
    """The fused block's kernel times as the report takes them (host sync, then the middle block alone in the
    profiler) against the middle block of three run back to back inside one profiler window."""
    from h3_fused_nvfp4.integration import report as rep, synthetic as syn
    from torch.profiler import ProfilerActivity, profile

    from h3_fused_nvfp4.integration import comfy_env

    comfy_env.import_comfyui()
    chain = rep.BlockChain(syn.H3_FULL, syn.FULL_TOKENS, DEV)
    chain.arm("fused")
    for _ in range(2):
        chain.run()
    torch.cuda.synchronize()
    out = {}

    def rest(kernels):
        return [k for k in kernels if k["category"] not in rep.NOT_ELEMENTWISE]

    for _ in range(reps):
        kernels = []
        chain.run(lambda fn: kernels.extend(rep.kernel_profile(fn)))
        out.setdefault("synced_middle_block", []).append([round(k["ms"], 4) for k in rest(kernels)])
        for label, lead in (("back_to_back_1_cycle_marker", 1), ("back_to_back_spin_marker", rep.HOST_LEAD_CYCLES)):
            def marked(fn):
                torch.cuda._sleep(lead)
                fn()
                torch.cuda._sleep(1)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                chain.run(marked)
                torch.cuda.synchronize()
            events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
            names = [e.name for e in events]
            marks = [i for i, n in enumerate(names) if "sleep" in n.lower() or "spin" in n.lower()]
            cats = rep.label_kernels(names)
            inner = [{"kernel": n, "category": c, "ms": e.device_time_total / 1e3}
                     for n, c, e in list(zip(names, cats, events))[marks[0] + 1:marks[1]]]
            out.setdefault(label, []).append([round(k["ms"], 4) for k in rest(inner)])
    out["kernels"] = [k["kernel"][:40] for k in rest(kernels)]
    for label in ("synced_middle_block", "back_to_back_1_cycle_marker", "back_to_back_spin_marker"):
        runs = out[label]
        print(f"{label:30s} first kernel {[r[0] for r in runs]} sum {[round(sum(r), 4) for r in runs]}", flush=True)
    return out


def chain_packs():
    """The block's two norm-modulate packs (qkv_proj, fc1) on the inputs the real block gives them, and on every
    mix of those inputs: which one makes the qkv_proj pack slower."""
    from h3_fused_nvfp4.integration import comfy_env, report as rep, synthetic as syn

    comfy_env.import_comfyui()
    chain = rep.BlockChain(syn.H3_FULL, syn.FULL_TOKENS, DEV)
    chain.arm("fused")
    chain.run()
    calls = []
    real = ops.pack_nvfp4

    def recording(x, *a, **kw):
        if kw.get("norm") is not None:
            calls.append({"x": x.clone(), "norm": kw["norm"], "modulation": kw["modulation"],
                          "g": kw["global_scale"].clone(), "w2": kw.get("weight_scale_2")})
        return real(x, *a, **kw)

    ops.pack_nvfp4 = recording
    try:
        chain.run()
    finally:
        ops.pack_nvfp4 = real
    torch.cuda.synchronize()
    calls = [{**c, "norm": RmsNorm(c["norm"].weight, c["norm"].eps, c["norm"].rstd.clone()),
              "modulation": Modulation(c["modulation"].scale.clone(), c["modulation"].shift.clone(),
                                       c["modulation"].mod_index)} for c in calls]
    print("recorded norm-modulate packs:", len(calls), flush=True)
    qkv, fc1 = calls[2], calls[3]  # block 1 (the middle one): its qkv_proj, then its fc1
    buf = torch.empty(ops.packed_buffer_bytes(M, D), dtype=torch.uint8, device=DEV)
    out = {}
    for label, (xs, ns, ms, gs) in {
            "qkv_inputs": (qkv, qkv, qkv, qkv), "fc1_inputs": (fc1, fc1, fc1, fc1),
            "qkv_x_fc1_rest": (qkv, fc1, fc1, fc1), "fc1_x_qkv_rest": (fc1, qkv, qkv, qkv),
            "qkv_tables_fc1_rest": (fc1, fc1, qkv, fc1), "qkv_norm_fc1_rest": (fc1, qkv, fc1, fc1),
            "qkv_scale_fc1_rest": (fc1, fc1, fc1, qkv)}.items():
        fn = lambda: ops.pack_nvfp4(xs["x"], norm=ns["norm"], modulation=ms["modulation"], global_scale=gs["g"], out=buf)
        samples = []
        for _ in range(3):
            samples += time_ms(fn, reps=20)
        out[label] = round(statistics.median(samples), 4)
        print(f"chain pack {label:22s} {out[label]:.4f} ms", flush=True)
    for name, c in (("qkv", qkv), ("fc1", fc1)):
        x = c["x"].float()
        out[name + "_stats"] = {"x_absmax": float(x.abs().max()), "x_zero_fraction": float((x == 0).float().mean()),
                                "x_subnormal_fraction": float(((x != 0) & (x.abs() < 1.1754944e-38)).float().mean()),
                                "x_nonfinite": int((~torch.isfinite(x)).sum()), "g": float(c["g"]),
                                "rstd_min": float(c["norm"].rstd.min()), "rstd_max": float(c["norm"].rstd.max()),
                                "table_rows": c["modulation"].scale.shape[0],
                                "scale_absmax": float(c["modulation"].scale.float().abs().max()),
                                "weight_absmax": float(c["norm"].weight.float().abs().max())}
        print(name, out[name + "_stats"], flush=True)
    return out


def chain_out(reps=3):
    """The fused block's kernel times with the packs' output buffers allocated per call (as shipped) or fixed per
    pack role, at several offsets: does the qkv_proj pack's slowness follow its output's placement?"""
    from h3_fused_nvfp4.integration import comfy_env, report as rep, synthetic as syn

    comfy_env.import_comfyui()
    chain = rep.BlockChain(syn.H3_FULL, syn.FULL_TOKENS, DEV)
    chain.arm("fused")
    real = ops.pack_nvfp4
    state = {"offset": None, "calls": 0, "bufs": {}, "ptrs": []}

    def placed(x, *a, **kw):
        role = state["calls"] % 4  # qkv_proj, out_proj, fc1, fc2 in each block
        state["calls"] += 1
        k = x.shape[1] // 2 if kw.get("swiglu") else x.shape[1]
        if state["offset"] is not None and kw.get("out") is None:
            need = ops.packed_buffer_bytes(x.shape[0], k)
            buf = state["bufs"].get(role)
            if buf is None:
                buf = state["bufs"][role] = torch.empty(need + (64 << 20), dtype=torch.uint8, device=x.device)
            off = state["offset"]
            kw["out"] = buf[off:off + need]
        out = real(x, *a, **kw)
        state["ptrs"].append((role, x.data_ptr() % (1 << 30), out.qdata.data_ptr() % (1 << 30)))
        return out

    ops.pack_nvfp4 = placed
    result = {}
    try:
        for label, offset in (("per_call", None), ("fixed_0", 0), ("fixed_1MB", 1 << 20),
                              ("fixed_2MB_64KB", (2 << 20) + (64 << 10)), ("fixed_40MB_4KB", (40 << 20) + 4096),
                              ("per_call_again", None)):
            state["offset"], state["bufs"] = offset, {}
            for _ in range(2):
                chain.run()
            torch.cuda.synchronize()
            runs = []
            for _ in range(reps):
                kernels = []
                state["ptrs"] = []
                chain.run(lambda fn: kernels.extend(rep.kernel_profile(fn)))
                rest = [k for k in kernels if k["category"] not in rep.NOT_ELEMENTWISE]
                nm = [round(k["ms"], 4) for k in rest if k["kernel"].startswith("nvfp4_pack_norm_modulate")]
                runs.append({"norm_modulate_packs_ms": nm, "non_gemm_ms": round(sum(k["ms"] for k in rest), 4),
                             "pack_ptrs_mod_1GB": state["ptrs"][4:8]})
            result[label] = runs
            print(label, [(r["norm_modulate_packs_ms"], r["non_gemm_ms"]) for r in runs], flush=True)
    finally:
        ops.pack_nvfp4 = real
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--ncu-child", action="store_true")
    parser.add_argument("--ncu-arms", default="")
    parser.add_argument("--families", default="")
    parser.add_argument("--chain", action="store_true")
    parser.add_argument("--chain-packs", action="store_true")
    parser.add_argument("--chain-out", action="store_true")
    parser.add_argument("--qkv-probe", action="store_true")
    parser.add_argument("--after-gemm", action="store_true")
    parser.add_argument("--qkv-probe-child", action="store_true")
    args = parser.parse_args()
    if args.after_gemm:
        warm_up_gpu()
        pathlib.Path(args.out).with_name("after-gemm.json").write_text(json.dumps(after_gemm(), indent=1))
        return
    if args.qkv_probe_child:
        qkv_probe_child()
        return
    if args.qkv_probe:
        warm_up_gpu()
        pathlib.Path(args.out).with_name("qkv-probe.json").write_text(json.dumps(qkv_probe(pathlib.Path(args.out).parent), indent=1))
        return
    if args.chain:
        warm_up_gpu()
        pathlib.Path(args.out).with_name("chain.json").write_text(json.dumps(chain_profile(), indent=1))
        return
    if args.chain_out:
        warm_up_gpu()
        pathlib.Path(args.out).with_name("chain-out.json").write_text(json.dumps(chain_out(), indent=1))
        return
    if args.chain_packs:
        warm_up_gpu()
        pathlib.Path(args.out).with_name("chain-packs.json").write_text(json.dumps(chain_packs(), indent=1))
        return
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



def qkv_probe_child():
    """Under ncu: the fused arm's three blocks in one window (spin marker first)."""
    from h3_fused_nvfp4.integration import comfy_env, report as rep, synthetic as syn

    comfy_env.import_comfyui()
    chain = rep.BlockChain(syn.H3_FULL, syn.FULL_TOKENS, DEV)
    chain.arm("fused")
    for _ in range(2):
        chain.run()
    torch.cuda.synchronize()
    chain.work.copy_(chain.inputs[0])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.cuda._sleep(1000)
    for i in range(3):
        chain.call(i)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def qkv_probe(out_dir):
    """Each norm-modulate pack of three consecutive fused blocks (qkv_proj, fc1 of each), in ncu and in the
    profiler: is the qkv_proj pack slower only where it opens the measured window?"""
    from h3_fused_nvfp4.integration import comfy_env, report as rep, synthetic as syn

    cmd = ["ncu", "--csv", "--clock-control", "none", "--profile-from-start", "off",
           "--metrics", "gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum",
           "--kernel-name", "regex:nvfp4_pack|spin", sys.executable, __file__, "--qkv-probe-child"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, H3_FUSED_NVFP4_SELFCHECK="skip"))
    rows = list(csv.DictReader(io.StringIO(proc.stdout[proc.stdout.index('"ID"'):]))) if '"ID"' in proc.stdout else []
    ncu = {}
    for r in rows:
        ncu.setdefault(r["ID"], {"kernel": r["Kernel Name"][:40]})[r["Metric Name"]] = r["Metric Value"]
    comfy_env.import_comfyui()
    chain = rep.BlockChain(syn.H3_FULL, syn.FULL_TOKENS, DEV)
    chain.arm("fused")
    for _ in range(2):
        chain.run()
    prof = []
    for _ in range(3):
        chain.work.copy_(chain.inputs[0])
        kernels = rep.kernel_profile(lambda: [chain.call(i) for i in range(3)])
        prof.append([round(k["ms"], 4) for k in kernels if k["kernel"].startswith("nvfp4_pack_norm_modulate")])
    out = {"ncu": list(ncu.values()), "ncu_error": None if rows else proc.stderr[-2000:] + proc.stdout[-2000:],
           "profiler_norm_modulate_packs_ms": prof}
    print(json.dumps(out, indent=1), flush=True)
    return out



def after_gemm():
    """Kernels timed right after the bf16 GEMM that writes their input (events from the GEMM's end), first rows
    first or last rows first: does the order of a kernel's first reads decide how much of the GEMM's output it still
    finds in L2?"""
    g = torch.Generator(device=DEV).manual_seed(99)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)

    t = tensors()
    a_d, a_inner = rnd(M, D), rnd(M, INNER)
    w_qkv, w_fc1, w_out = rnd(D, 3 * INNER, scale=0.02), rnd(D, 2 * F, scale=0.02), rnd(INNER, D, scale=0.02)
    qkv, fc1, other = torch.empty(M, 3 * INNER, device=DEV, dtype=torch.bfloat16), \
        torch.empty(M, 2 * F, device=DEV, dtype=torch.bfloat16), torch.empty(M, D, device=DEV, dtype=torch.bfloat16)
    buf_sw = torch.empty(ops.packed_buffer_bytes(M, F), dtype=torch.uint8, device=DEV)
    buf_nm = torch.empty(ops.packed_buffer_bytes(M, D), dtype=torch.uint8, device=DEV)
    res_work = torch.empty_like(t["x"])
    modn = Modulation(t["sc"], t["sh"], t["mod_index"])
    norm2 = RmsNorm(t["nw"], 1e-5, torch.empty(M, device=DEV))
    g_res = torch.empty(1, device=DEV)

    def rope_parts():
        torch.mm(a_d, w_qkv, out=qkv)
        def kernels():
            q, k = qkv[:, :INNER].view(1, M, INNER // 128, 128), qkv[:, INNER:2 * INNER].view(1, M, INNER // 128, 128)
            ops.rms_rope_split_half_(q, k, t["freqs"], t["qw"], t["kw"], 1e-5, 96)
        return [kernels], lambda: [qkv]

    def swiglu_parts():
        torch.mm(a_d, w_fc1, out=fc1)
        return [lambda: ops.pack_nvfp4(fc1, swiglu=True, out=buf_sw)], lambda: [buf_sw]

    def residual_parts():
        torch.mm(a_inner, w_out, out=other)
        return [lambda: ops.gated_residual_(res_work, other, t["gate"], t["mod_index"], next_norm=norm2,
                                            next_modulation=modn, global_scale_out=g_res),
                lambda: ops.pack_nvfp4(res_work, norm=norm2, modulation=modn, global_scale=g_res, out=buf_nm)], \
            lambda: [res_work, norm2.rstd, g_res, buf_nm]

    def order(**kw):
        rope = {"ROPE_LAST_FIRST": kw.pop("rope")} if "rope" in kw else None
        return {"launch": kw, "rope": rope}

    fams = {
        "rope_after_qkv_gemm": (rope_parts, {"first_rows_first": order(rope=0), "last_rows_first": order(rope=1)}),
        "swiglu_scale_pack_after_fc1_gemm": (swiglu_parts, {
            "scale_first_rows_first": order(SWIGLU_ABSMAX_LAST_FIRST=0),
            "scale_last_rows_first": order(SWIGLU_ABSMAX_LAST_FIRST=1)}),
        "residual_fc1_pack_after_out_proj_gemm": (residual_parts, {
            "residual_first_pack_last": order(RESIDUAL_LAST_FIRST=0, NORM_PACK_LAST_FIRST=1),
            "residual_last_pack_first": order(RESIDUAL_LAST_FIRST=1, NORM_PACK_LAST_FIRST=0),
            "residual_last_pack_last": order(RESIDUAL_LAST_FIRST=1, NORM_PACK_LAST_FIRST=1),
            "residual_first_pack_first": order(RESIDUAL_LAST_FIRST=0, NORM_PACK_LAST_FIRST=0)}),
    }
    result = {}
    for fam, (parts, arms) in fams.items():
        reference = None
        for label, kw in arms.items():
            with variant(**kw):
                res_work.copy_(t["x"])
                kernels, outputs = parts()
                for k in kernels:
                    k()
                out = [o.clone() for o in outputs()]
                reference = reference or out
                same = same_bytes(out, reference)
                times = []
                for _ in range(30):
                    kernels, _ = parts()
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(kernels) + 1)]
                    events[0].record()
                    for k, e in zip(kernels, events[1:]):
                        k()
                        e.record()
                    times.append(events)
                torch.cuda.synchronize()
                per_kernel = [statistics.median(ev[i].elapsed_time(ev[i + 1]) for ev in times[5:])
                              for i in range(len(times[0]) - 1)]
            entry = {"identical_to_first_arm": same, "median_ms_per_kernel": [round(v, 4) for v in per_kernel],
                     "median_ms_total": round(sum(per_kernel), 4)}
            result.setdefault(fam, {})[label] = entry
            print(f"{fam:38s} {label:26s} same={same} {entry['median_ms_per_kernel']} {entry['median_ms_total']}",
                  flush=True)
    return result


if __name__ == "__main__":
    main()
