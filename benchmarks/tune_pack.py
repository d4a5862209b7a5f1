"""Tuning sweep for the pack kernels: launch shapes and the sm_90 software E2M1 variant, side by side.

Every variant's output is compared byte for byte with the default build before it is timed.
Usage: python benchmarks/tune_pack.py --out benchmarks/h200-tune.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import conftest  # noqa: E402,F401
from bench_pack import time_ms, warm_up_gpu  # noqa: E402

from h3_fused_nvfp4.kernels import ops  # noqa: E402

ROWS = 37810
# "probe_*" variants are timing probes that compute wrong bytes on purpose (expected to show DIFF): they bound
# how much of the time is the E2M1 conversion or the scale stores (both removed: the memory pattern alone).
VARIANTS = {
    "default": (),
    "plain_items2": (("PLAIN_ITEMS", "2"),),
    "items2": (("ITEMS", "2"),),
    "pack_threads512": (("PACK_THREADS", "512"),),
    "silu_formula": (("SILU_TABLE", "0"),),
    "e2m1_value_at_a_time": (("E2M1_SW_IMPL", "3"),),
    "probe_no_e2m1": (("E2M1_SW_IMPL", "9"),),
    "probe_no_scale_store": (("PACK_SKIP_SCALE_STORE", "1"),),
    "probe_memory_only": (("E2M1_SW_IMPL", "9"), ("PACK_SKIP_SCALE_STORE", "1")),
}


def cases():
    torch.manual_seed(440420)
    x5 = (torch.randn(ROWS, 5376, device="cuda") * 2).to(torch.bfloat16)
    x7 = (torch.randn(ROWS, 7168, device="cuda") * 2).to(torch.bfloat16)
    x14 = (torch.randn(ROWS, 14336, device="cuda") * 2).to(torch.bfloat16)
    y = (torch.randn(ROWS, 28672, device="cuda") * 2).to(torch.bfloat16)
    ada = (torch.randn(6, 6 * 5376, device="cuda") * 0.5).to(torch.bfloat16)
    idx = torch.zeros(ROWS, dtype=torch.int32, device="cuda")
    idx[100:514] = 2
    idx[514:] = 3
    mod = ops.Modulation(ada[:, 5376:2 * 5376], ada[:, :5376], idx)
    static = torch.tensor([0.01], device="cuda")
    w2 = torch.tensor([2.5e-4], device="cuda")
    return {
        "plain5376_static": lambda: ops.pack_nvfp4(x5, static_scale=static),
        "plain7168_static": lambda: ops.pack_nvfp4(x7, static_scale=static),
        "plain14336_static": lambda: ops.pack_nvfp4(x14, static_scale=static),
        "plain5376_dynamic": lambda: ops.pack_nvfp4(x5, weight_scale_2=w2),
        "plain14336_dynamic": lambda: ops.pack_nvfp4(x14, weight_scale_2=w2),
        "modulate5376_dynamic": lambda: ops.pack_nvfp4(x5, weight_scale_2=w2, modulation=mod),
        "swiglu14336_dynamic": lambda: ops.pack_nvfp4(y, weight_scale_2=w2, swiglu=True),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "tune.json"))
    args = parser.parse_args()
    warm_up_gpu()
    fns = cases()
    reference = {}
    results = {}
    samples = {v: {c: [] for c in fns} for v in VARIANTS}
    for rnd in range(3):  # rounds over all variants, so drift in clocks hits every variant alike
        for vname, defines in VARIANTS.items():
            ops.TUNING_DEFINES = defines
            results.setdefault(vname, {})
            for cname, fn in fns.items():
                if rnd == 0:
                    p = fn()
                    out = (p.qdata.clone(), p.block_scales.view(torch.uint8).clone(), p.global_scale.clone())
                    if vname == "default":
                        reference[cname] = out
                    same = all(torch.equal(a, b) for a, b in zip(out, reference[cname]))
                    results[vname][cname] = {"bit_identical": same}
                samples[vname][cname] += time_ms(fn, reps=10)
    for vname in VARIANTS:
        for cname in fns:
            results[vname][cname]["ms"] = statistics.median(samples[vname][cname])
    ops.TUNING_DEFINES = ()
    pathlib.Path(args.out).write_text(json.dumps({"rows": ROWS, "variants": {k: list(v) for k, v in VARIANTS.items()},
                                                  "results": results}, indent=1))
    names = list(fns)
    print(f"{'variant':16s}" + "".join(f"{n[:18]:>20s}" for n in names))
    for vname, row in results.items():
        print(f"{vname:16s}" + "".join(f"{row[n]['ms']:>14.3f}{'' if row[n]['bit_identical'] else ' DIFF':>6s}" for n in names))


if __name__ == "__main__":
    main()
