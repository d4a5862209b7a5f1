"""SageAttention on H3's q/k/v views: stock head-major call vs token-major call, side by side.

Times ComfyUI's sage backend (tests/h3_mirror.py mirrors ``attention_sage``) on the same [S, 3 x 7168] qkv
buffer called the two ways a block can call it: head-major views with ``skip_reshape=True`` (stock H3: sage's
HND path, output copied back to token-major) and token-major views with ``skip_reshape=False`` (sage's NHD path,
no output copy). Also PyTorch SDPA both ways (the same kernel sees the same views). Checks equal bits first.

Usage: python benchmarks/attention_layout.py [--out benchmarks/h200-attention-layout.json] [--tokens 37810]
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
import h3_mirror as mirror  # noqa: E402
from bench_pack import device_info, time_ms, warm_up_gpu  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "attention-layout.json"))
    parser.add_argument("--tokens", type=int, default=37810)
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    s, heads, dim = args.tokens, mirror.H3_HEADS, mirror.H3_HEAD_DIM
    torch.manual_seed(440420)
    qkv = (torch.randn(s, 3 * heads * dim, device="cuda") * 2).to(torch.bfloat16)
    q, k, v = qkv.split(heads * dim, dim=-1)
    head_major = [t.view(s, heads, dim).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    token_major = [t.view(1, s, heads * dim) for t in (q, k, v)]
    backends = {"pytorch": mirror.sdpa_attention}
    try:
        import sageattention  # noqa: F401

        backends["sage"] = mirror.sage_attention
    except ImportError:
        pass
    warm_up_gpu()
    results = {}
    for name, fn in backends.items():
        calls = {"head_major_stock": lambda fn=fn: fn(*head_major, heads, skip_reshape=True),
                 "token_major_fused": lambda fn=fn: fn(*token_major, heads, skip_reshape=False)}
        outs = {c: f() for c, f in calls.items()}
        same = torch.equal(outs["head_major_stock"].view(torch.int16), outs["token_major_fused"].view(torch.int16))
        samples = {c: [] for c in calls}
        for _ in range(2):  # alternate, so clock drift hits both
            for c, f in calls.items():
                samples[c] += time_ms(f, reps=args.reps // 2 or 1)
        med = {c: statistics.median(v) for c, v in samples.items()}
        results[name] = {"bit_identical": same, "median_ms": med,
                         "token_major_vs_head_major": med["token_major_fused"] / med["head_major_stock"]}
        print(f"{name:8s} head-major {med['head_major_stock']:8.3f} ms  token-major {med['token_major_fused']:8.3f} ms"
              f"  ratio {results[name]['token_major_vs_head_major']:.3f}  identical {same}")
    pathlib.Path(args.out).write_text(json.dumps({
        "benchmark": "attention call layout on H3 q/k/v views (stock head-major vs token-major)",
        "command": f"python benchmarks/attention_layout.py --out {args.out}", "device": device_info(),
        "tokens": s, "heads": heads, "head_dim": dim, "results": results}, indent=1))


if __name__ == "__main__":
    main()
