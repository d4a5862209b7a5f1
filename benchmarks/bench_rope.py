"""comfy-kitchen's rms_rope_split_half_ vs the fused H3 kernel on the 37,810-token q/k views (equal bytes first).

Usage: python benchmarks/bench_rope.py --out benchmarks/h200-rope.json
"""

import argparse
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import report  # noqa: E402  (the repository's report.py: imports this folder as the package h3_fused_nvfp4)

report.import_pack()
from h3_fused_nvfp4.kernels import cuda_ops as ops  # noqa: E402
from h3_fused_nvfp4.tools.report import copy_bandwidth_gbs, device_info, time_ms, warm_up_gpu  # noqa: E402


def main():
    import comfy_kitchen as ck

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "rope.json"))
    args = parser.parse_args()
    rows = 37810
    torch.manual_seed(440420)
    qkv = torch.randn(rows, 3 * 7168, device="cuda").to(torch.bfloat16)
    angles = torch.rand(rows, 48, device="cuda") * 100
    c, s = torch.cos(angles), torch.sin(angles)
    freqs = torch.stack([c, -s, s, c], dim=-1).reshape(1, rows, 1, 48, 2, 2).to(torch.bfloat16)
    qw = (torch.rand(128, device="cuda") + 0.5).to(torch.bfloat16)
    kw = (torch.rand(128, device="cuda") + 0.5).to(torch.bfloat16)

    def views(t):
        return t[:, :7168].view(1, rows, 56, 128), t[:, 7168:14336].view(1, rows, 56, 128)

    warm_up_gpu()
    a, b = qkv.clone(), qkv.clone()
    ck.rms_rope_split_half_(*views(a), freqs, qw, kw, epsilon=1e-5, rot_dim=96)
    ops.rms_rope_split_half_(*views(b), freqs, qw, kw, 1e-5, 96)
    equal = torch.equal(a.view(torch.int16), b.view(torch.int16))
    work = qkv.clone()
    arms = {"comfy_kitchen": lambda: ck.rms_rope_split_half_(*views(work), freqs, qw, kw, epsilon=1e-5, rot_dim=96),
            "fused": lambda: ops.rms_rope_split_half_(*views(work), freqs, qw, kw, 1e-5, 96)}
    samples = {k: [] for k in arms}
    for _ in range(3):
        for name, fn in arms.items():
            samples[name] += time_ms(fn, reps=10)
    med = {k: statistics.median(v) for k, v in samples.items()}
    moved = 2 * 2 * rows * 7168 * 2  # q and k read once and written once
    copy = copy_bandwidth_gbs()
    report = {"benchmark": "rms_rope_split_half_ on H3 q/k views", "command": "python benchmarks/bench_rope.py",
              "device": device_info(torch.device("cuda", 0)), "rows": rows, "bit_identical": equal, "median_ms": med,
              "speedup": med["comfy_kitchen"] / med["fused"], "bytes_moved": moved,
              "achieved_gbs": {k: moved / (v * 1e-3) / 1e9 for k, v in med.items()},
              "copy_bandwidth_gbs_read_plus_write": copy}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"rms_rope: ck {med['comfy_kitchen']:.3f} ms  fused {med['fused']:.3f} ms  x{report['speedup']:.2f}  "
          f"exact {equal}  fused {report['achieved_gbs']['fused']:.0f} GB/s of {copy:.0f}")


if __name__ == "__main__":
    main()
