"""Previous vs current kernels and launch-shape variants at H3 block shapes: bit-compared, then GPU-timed.

Usage: python benchmarks/kernel_sweep.py --out sweep.json      (events)
       ncu --csv --metrics ... --profile-from-start off python benchmarks/kernel_sweep.py --ncu-child
The previous kernels are read from kernels/previous_*.cu when present, e.g.
    git show 3dca53a:kernels/nvfp4_pack.cu > kernels/previous_nvfp4_pack.cu (and h3_rms_rope.cu likewise)
"""

import argparse
import contextlib
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import report  # noqa: E402

report.import_pack()
from h3_fused_nvfp4.integration.report import copy_bandwidth_gbs, time_ms, warm_up_gpu  # noqa: E402
from h3_fused_nvfp4.kernels import ops, runtime  # noqa: E402
from h3_fused_nvfp4.layout import Modulation, RmsNorm  # noqa: E402

M, D, F, HEADS = 37810, 5376, 14336, 56
DEV = torch.device("cuda", 0)


@contextlib.contextmanager
def variant(launch=None, rope=None, previous=False):
    saved = (dict(ops.LAUNCH), ops.module_for, ops.ROPE_DEFINES, ops.ROPE_SHARED_BYTES, ops.ROPE_THREADS,
             ops.RESIDUAL_NORM_SHARED_BYTES)
    ops.LAUNCH.update(launch or {})
    ops.RESIDUAL_NORM_SHARED_BYTES = ops.LAUNCH["RESIDUAL_NORM_THREADS"] // 32 * ops.ROW_NORM_MAX_COLS * 2
    if rope:
        stages, threads = rope
        ops.ROPE_THREADS = threads
        ops.ROPE_DEFINES = tuple((k, {"ROPE_STAGES": stages, "ROPE_THREADS": threads}.get(k, v))
                                 for k, v in saved[2])
        ops.ROPE_SHARED_BYTES = threads // 32 * stages * 2 * 4 * (2 * ops.ROPE_HEAD_DIM + 64)
    if previous:
        def previous_module(device, source="nvfp4_pack.cu"):
            return runtime.module(device.index or 0, source="previous_" + source, defines=ops.kernel_defines(source))
        ops.module_for = previous_module
    try:
        yield
    finally:
        ops.LAUNCH.clear()
        ops.LAUNCH.update(saved[0])
        (ops.module_for, ops.ROPE_DEFINES, ops.ROPE_SHARED_BYTES, ops.ROPE_THREADS,
         ops.RESIDUAL_NORM_SHARED_BYTES) = saved[1:]


def tensors():
    g = torch.Generator(device=DEV).manual_seed(1234)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)

    t = {"x": rnd(M, D, scale=3), "other": rnd(M, D), "gate": rnd(5, D, scale=0.5), "sc": rnd(5, D, scale=0.3),
         "sh": rnd(5, D, scale=0.3), "mod_index": (torch.arange(M, device=DEV) * 5 // M).to(torch.int32),
         "nw": (torch.rand(D, generator=g, device=DEV) + 0.5).to(torch.bfloat16),
         "fc1": rnd(M, 2 * F, scale=2), "qkv": rnd(M, 3 * HEADS * 128, scale=2),
         "qw": (torch.rand(128, generator=g, device=DEV) + 0.5).to(torch.bfloat16),
         "kw": (torch.rand(128, generator=g, device=DEV) + 0.5).to(torch.bfloat16)}
    angles = torch.rand(M, 48, generator=g, device=DEV) * 100
    c, s = torch.cos(angles), torch.sin(angles)
    t["freqs"] = torch.stack([c, -s, s, c], dim=-1).reshape(1, M, 1, 48, 2, 2).to(torch.bfloat16)
    return t


def families(t):
    """name -> (run(state) -> output bytes, state factory, bytes moved, arms {label: variant kwargs})."""
    rstd, gs = torch.empty(M, device=DEV), torch.empty(1, device=DEV)
    norm, modn = RmsNorm(t["nw"], 1e-5, rstd), Modulation(t["sc"], t["sh"], t["mod_index"])
    work = torch.empty_like(t["x"])
    qkv = torch.empty_like(t["qkv"])
    inner = HEADS * 128

    def residual(fresh):
        if fresh:
            work.copy_(t["x"])
        ops.gated_residual_(work, t["other"], t["gate"], t["mod_index"], next_norm=norm, next_modulation=modn,
                            global_scale_out=gs)
        return [work, rstd, gs]

    def pack_nm(fresh):
        ops.norm_statistics(t["x"], norm, modulation=modn, global_scale_out=gs) if fresh else None
        return [ops.pack_nvfp4(t["x"], norm=norm, modulation=modn, global_scale=gs, out=buf_nm).qdata, buf_nm]

    def pack_swiglu(fresh):
        return [ops.pack_nvfp4(t["fc1"], swiglu=True, global_scale=gs_sw, out=buf_sw).qdata, buf_sw]

    def rope(fresh):
        if fresh:
            qkv.copy_(t["qkv"])
        q, k = qkv[:, :inner].view(1, M, HEADS, 128), qkv[:, inner:2 * inner].view(1, M, HEADS, 128)
        ops.rms_rope_split_half_(q, k, t["freqs"], t["qw"], t["kw"], 1e-5, 96)
        return [qkv]

    buf_nm = torch.empty(ops.packed_buffer_bytes(M, D), dtype=torch.uint8, device=DEV)
    buf_sw = torch.empty(ops.packed_buffer_bytes(M, F), dtype=torch.uint8, device=DEV)
    gs_sw = ops.pack_nvfp4(t["fc1"], swiglu=True).global_scale.clone()
    row = 2 * M * D
    return {
        "row_norm_residual_amax": (residual, 3 * row, {
            "previous": {"previous": True, "launch": {"RESIDUAL_NORM_THREADS": 128}}, "current": {}}),
        "pack_norm_modulate": (pack_nm, row + buf_nm.numel(), {"previous": {"previous": True}, "current": {}}),
        "pack_swiglu_table": (pack_swiglu, 2 * M * 2 * F + buf_sw.numel(), {
            "previous": {"previous": True, "launch": {"SILU_TABLE_THREADS": 512}}, "current": {}}),
        "rms_rope": (rope, 2 * 2 * M * inner * 2, {"previous": {"previous": True, "rope": (3, 256)}, "current": {}}),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--ncu-child", action="store_true")
    parser.add_argument("--arms", default="", help="comma-separated arm labels to run (default: all)")
    args = parser.parse_args()
    have_previous = (ROOT / "kernels" / "previous_nvfp4_pack.cu").exists()
    t = tensors()
    fams = families(t)
    warm_up_gpu()
    result, order = {}, []
    for fam, (run, moved, arms) in fams.items():
        reference = None
        for label, kw in arms.items():
            if (kw.get("previous") and not have_previous) or (args.arms and label not in args.arms.split(",")):
                continue
            with variant(**kw):
                out = [o.clone() for o in run(True)]
                if reference is None:
                    reference = out
                same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, reference))
                if args.ncu_child:
                    run(True)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    run(False)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                    order.append(f"{fam}/{label}")
                    continue
                samples = []
                for _ in range(3):
                    samples += time_ms(lambda: run(False), reps=20)
            ms = statistics.median(samples)
            result.setdefault(fam, {})[label] = {"identical_to_first_arm": same, "median_ms": round(ms, 4),
                                                 "gbs": round(moved / ms / 1e6, 1)}
            print(f"{fam:26s} {label:14s} same={same} {ms:.4f} ms {moved / ms / 1e6:.0f} GB/s", flush=True)
    if args.ncu_child:
        print("ARMS " + json.dumps(order))
        return
    result["copy_gbs"] = copy_bandwidth_gbs()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
