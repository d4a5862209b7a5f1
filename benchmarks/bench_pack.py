"""Benchmark: ComfyUI's NVFP4 activation pack vs the fused kernels, side by side in one process.

For each H3 input width at 37,810 rows: ComfyUI's path (its ``TensorCoreNVFP4Layout.quantize``: torch amax/abs/div/
cast + comfy-kitchen's CUDA pack with its zero-filled scale buffer, then the GEMM alpha product comfy-kitchen's GEMM
wrapper computes) against the fused path (one reduction that also writes
alpha, one pack), in dynamic and static-scale mode. Equality of the packed bytes is checked first. Reports
median times over alternating repeats, the ratio, bytes moved and achieved bandwidth against a measured
device-to-device copy, and kernel launches per projection from torch.profiler.

Usage: python benchmarks/bench_pack.py --out benchmarks/h200-pack.json
       python benchmarks/bench_pack.py --shapes wan --dtype fp16 --out F   # Wan 2.2 14B's Linear inputs in fp16
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import report  # noqa: E402  (the repository's report.py: imports this folder as the package h3_fused_nvfp4)

report.import_pack()

from h3_fused_nvfp4.kernels import cuda_ops as ops  # noqa: E402
from h3_fused_nvfp4.tools import comfy_env  # noqa: E402
from h3_fused_nvfp4.tools import synthetic as syn
from h3_fused_nvfp4.tools.report import (  # noqa: E402
    HOST_LEAD_CYCLES,
    MARKER,
    copy_bandwidth_gbs,
    device_info,
    kernel_profile,
    time_ms,
    warm_up_gpu,
)

# rows and Linear input widths: H3 at 1344x768, 124 frames (37,810 tokens: out_proj / qkv_proj and fc1, fc2 input);
# Wan 2.2 14B at 832x480, 81 frames (21 x 30 x 52 = 32,760 tokens: attention and ffn.0 inputs, ffn.2 input)
SHAPES = {"h3": (sum(syn.FULL_TOKENS), (5376, 7168, 14336)), "wan": (21 * 30 * 52, (5120, 13824))}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def kernel_times_ms(fn, reps=10):
    """Median GPU duration of each kernel ``fn`` launches, by kernel name (torch.profiler / CUPTI timestamps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.cuda._sleep(HOST_LEAD_CYCLES)
            fn()
        torch.cuda.synchronize()
    durations: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and MARKER not in e.name:
            durations.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    return {name: statistics.median(v) for name, v in durations.items()}




def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "pack.json"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="h3")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype")
    args = parser.parse_args()
    rows, widths = SHAPES[args.shapes]
    dtype = DTYPES[args.dtype]
    comfy_env.import_comfyui()
    from comfy.quant_ops import TensorCoreNVFP4Layout

    torch.manual_seed(440420)
    warm_up_gpu()
    copy_gbs = copy_bandwidth_gbs()
    results = []
    w2 = torch.tensor([2.5e-4], dtype=torch.float32, device="cuda")
    for k in widths:
        x = (torch.randn(rows, k, device="cuda") * 2).to(dtype)
        static = torch.tensor([0.01], dtype=torch.float32, device="cuda")

        def comfy_dynamic():
            q, params = TensorCoreNVFP4Layout.quantize(x)
            return q, params.block_scale, params.scale, params.scale * w2

        def comfy_static():
            q, params = TensorCoreNVFP4Layout.quantize(x, scale=static)
            return q, params.block_scale, params.scale

        def fused_dynamic():
            return ops.pack_nvfp4(x, weight_scale_2=w2)

        def fused_static():  # as the fused Linear packs: the GEMM alpha written by the pack
            return ops.pack_nvfp4(x, static_scale=static, weight_scale_2=w2)

        q, s, g, alpha = comfy_dynamic()
        f = fused_dynamic()
        equal = (torch.equal(q, f.qdata) and torch.equal(s.view(torch.uint8), f.block_scales.view(torch.uint8))
                 and torch.equal(g.reshape(1), f.global_scale) and torch.equal(alpha.reshape(1), f.alpha))
        fs = fused_static()
        qs, ss, _ = comfy_static()
        equal_static = (torch.equal(qs, fs.qdata) and torch.equal((static * w2).reshape(1), fs.alpha)
                        and torch.equal(ss.view(torch.uint8), fs.block_scales.view(torch.uint8)))

        arms = {"comfy_dynamic": comfy_dynamic, "fused_dynamic": fused_dynamic,
                "comfy_static": comfy_static, "fused_static": fused_static}
        samples = {name: [] for name in arms}
        for _ in range(3):  # alternate arms so clock or thermal drift hits both
            for name, fn in arms.items():
                samples[name] += time_ms(fn, reps=args.reps // 3 or 1)
        med = {name: statistics.median(v) for name, v in samples.items()}

        in_bytes = rows * k * x.element_size()
        out_bytes = f.qdata.numel() + f.block_scales.numel()
        # Per fused kernel (profiler durations): the reduction reads the input once, the pack reads it again and
        # writes the output.
        kernels = kernel_times_ms(fused_dynamic)
        reduction_ms = next(v for n, v in kernels.items() if n.startswith("nvfp4_absmax"))
        pack_ms = next(v for n, v in kernels.items() if n.startswith("nvfp4_pack"))
        row = {
            "rows": rows, "cols": k, "dtype": str(dtype).removeprefix("torch."),
            "bit_identical_dynamic": equal, "bit_identical_static": equal_static,
            "median_ms": med,
            "speedup_dynamic": med["comfy_dynamic"] / med["fused_dynamic"],
            "speedup_static": med["comfy_static"] / med["fused_static"],
            "bytes": {"input": in_bytes, "output": out_bytes,
                      "fused_dynamic_moved": 2 * in_bytes + out_bytes, "fused_static_moved": in_bytes + out_bytes},
            "fused_kernel_ms": {"reduction": reduction_ms, "pack": pack_ms},
            "achieved_gbs": {
                "fused_dynamic": (2 * in_bytes + out_bytes) / (med["fused_dynamic"] * 1e-3) / 1e9,
                "fused_static": (in_bytes + out_bytes) / (med["fused_static"] * 1e-3) / 1e9,
                "reduction_kernel": in_bytes / (reduction_ms * 1e-3) / 1e9,
                "pack_kernel": (in_bytes + out_bytes) / (pack_ms * 1e-3) / 1e9,
            },
            "launches_per_projection": {name: len(kernel_profile(fn)) for name, fn in arms.items()},
        }
        row["fraction_of_copy_bandwidth"] = {n: v / copy_gbs for n, v in row["achieved_gbs"].items()}
        results.append(row)

    report = {
        "benchmark": "nvfp4 activation pack, Comfy path vs fused",
        "command": shlex.join(["python", "benchmarks/bench_pack.py", *sys.argv[1:]]),
        "timing": "GPU time: CUDA events with a spin kernel queued ahead of each call (host launch overhead "
                  "excluded); per-kernel times from torch.profiler",
        "device": device_info(torch.device("cuda", 0)),
        "copy_bandwidth_gbs_read_plus_write": copy_gbs,
        "results": results,
    }
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'K':>6} {'comfy dyn':>10} {'fused dyn':>10} {'x':>5} {'comfy st':>9} {'fused st':>9} {'x':>5} "
          f"{'%copy dyn':>9} {'%copy red':>9} {'%copy pack':>10} {'exact':>6} launches")
    for r in results:
        m, frac = r["median_ms"], r["fraction_of_copy_bandwidth"]
        print(f"{r['cols']:>6} {m['comfy_dynamic']:>10.3f} {m['fused_dynamic']:>10.3f} {r['speedup_dynamic']:>5.2f} "
              f"{m['comfy_static']:>9.3f} {m['fused_static']:>9.3f} {r['speedup_static']:>5.2f} "
              f"{100 * frac['fused_dynamic']:>8.0f}% {100 * frac['reduction_kernel']:>8.0f}% "
              f"{100 * frac['pack_kernel']:>9.0f}% "
              f"{str(r['bit_identical_dynamic'] and r['bit_identical_static']):>6} {r['launches_per_projection']}")


if __name__ == "__main__":
    main()
