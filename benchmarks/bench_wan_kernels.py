"""Benchmark: the fused ops of Wan's block against ComfyUI's ops for the same step, one step at a time, side by side
in one process (the whole block is measured when the family block lands).

Wan 2.2 14B at 832x480, 81 frames (32,760 tokens, D 5120, FFN 13,824; ``--model wan22_5b``: 1280x704, 121 frames,
27,280 tokens, D 3072, FFN 14,336), fp16 (ComfyUI's choice; ``--dtype bf16``). For each step of the block
(benchmarks/DECISIONS.md, Wan's block) ComfyUI's ops as its WanAttentionBlock runs them (its LayerNorm and RMSNorm
modules, the modulation and residual ``torch.addcmul`` / add with ``repeat_e``, comfy-kitchen's ``apply_rope1``, the
eager GELU, ``QuantizedTensor.from_float`` for each Linear that reads the result) against the fused kernels. The
outputs are compared first (equal bytes); then median GPU times over alternating repeats, the bytes the fused step
must move (the design's, in T / P / F units) and its achieved bandwidth against a measured device-to-device copy.
Dynamic global scales, as ComfyUI computes them without an ``input_scale``.

Usage: python benchmarks/bench_wan_kernels.py --out benchmarks/h200-wan-kernels.json
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
sys.path.insert(0, str(ROOT / "tests"))  # tests/wan_block_spec.py: the block's modulation tables as ComfyUI builds them
import report  # noqa: E402  (the repository's report.py: imports this folder as the package h3_fused_nvfp4)

report.import_pack()

from h3_fused_nvfp4 import comfy_adapter  # noqa: E402
from h3_fused_nvfp4.kernels import cuda_ops as ops  # noqa: E402
from h3_fused_nvfp4.layout import LayerNorm  # noqa: E402
from h3_fused_nvfp4.tools import comfy_env  # noqa: E402
from h3_fused_nvfp4.tools.report import copy_bandwidth_gbs, device_info, time_ms, warm_up_gpu  # noqa: E402

MODELS = {"wan22_14b": ((21, 30, 52), 5120, 13824, 40), "wan22_5b": ((31, 22, 40), 3072, 14336, 24)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
EPS = 1e-6


def _same(a, b) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same_pack(packed, qt) -> bool:
    return (_same(packed.qdata, qt._qdata) and _same(packed.block_scales, qt._params.block_scale)
            and _same(packed.global_scale.reshape(1), qt._params.scale.reshape(1).to(torch.float32)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "wan-kernels.json"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--model", choices=sorted(MODELS), default="wan22_14b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    args = parser.parse_args()
    comfy_env.import_comfyui()
    import comfy.ldm.flux.layers
    import comfy.ldm.flux.math
    import comfy.ldm.wan.model as m
    from comfy.quant_ops import QuantizedTensor
    from wan_block_spec import block_tables, modulation_index

    from h3_fused_nvfp4.core import probes as core_probes
    from h3_fused_nvfp4.core import verdicts
    from h3_fused_nvfp4.models.wan import probes

    grid, dim, ffn, heads = MODELS[args.model]
    dtype = DTYPES[args.dtype]
    rows = grid[0] * grid[1] * grid[2]
    torch.manual_seed(440420)
    warm_up_gpu()
    copy_gbs = copy_bandwidth_gbs()

    def quantize(h):
        return QuantizedTensor.from_float(h.reshape(-1, h.shape[-1]), "TensorCoreNVFP4Layout")

    x = (torch.randn(1, rows, dim, device="cuda") * 2).to(dtype)
    y = (torch.randn(1, rows, dim, device="cuda") * 2).to(dtype)
    f = (torch.randn(1, rows, ffn, device="cuda") * 2).to(dtype)
    e = (torch.randn(1, 1, 6, dim, device="cuda") * 0.3).to(dtype)

    class Block:
        modulation = (torch.randn(1, 6, dim, device="cuda") * dim ** -0.5).to(dtype)

    chunks = (Block.modulation.unsqueeze(0) + e).unbind(2)  # what ComfyUI's block computes: [B, F, D] each
    tables = block_tables(Block, e, x, modulation_index(e, x))
    weight, bias = probes._affine("cuda", dim, dtype, seed=3)
    ln = probes.comfy_layer_norm(dim, dtype, "cuda")
    ln3 = probes.comfy_layer_norm(dim, dtype, "cuda", weight, bias)
    qw, _ = probes._affine("cuda", dim, dtype, seed=4)
    rms = probes.comfy_rms_norm(dim, dtype, qw)
    ids = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).reshape(1, -1, 3)
    d = dim // heads
    embed = comfy.ldm.flux.layers.EmbedND(dim=d, theta=10000.0, axes_dim=[d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
    freqs = embed(ids.to(dtype).cuda()).movedim(1, 2)  # as WanModel.rope_encode makes it
    table = freqs[0, :, 0].contiguous()
    x2, y2, f2 = x.view(rows, dim), y.view(rows, dim), f.view(rows, ffn)
    stats = LayerNorm(None, None, EPS, torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda"))
    stats3 = LayerNorm(weight, bias, EPS, torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda"))
    g = torch.empty(1, device="cuda")
    out = torch.empty_like(x2)
    q, k = x2.clone(), y2.clone()
    mod1, mod2 = tables.modulation(0, 1), tables.modulation(3, 4)

    def comfy_modulated(n, shift, scale):
        return torch.addcmul(m.repeat_e(shift, x), n, 1 + m.repeat_e(scale, x))

    # step -> (ComfyUI's ops, fused ops, the check (ComfyUI's result, fused result) -> bool, fused bytes in T units)
    T, F_ = rows * dim * 2, rows * ffn * 2
    P, P_F = 0.28125 * T, 0.28125 * F_
    steps = {
        "norm1 statistics + q/k/v amax": (
            lambda: quantize(comfy_modulated(ln(x), chunks[0], chunks[1])),
            lambda: ops.layer_norm_statistics(x2, stats, modulation=mod1, global_scale_out=g),
            None, T),
        "q/k/v pack (one for the three)": (
            lambda: [quantize(comfy_modulated(ln(x), chunks[0], chunks[1])) for _ in range(3)],
            lambda: ops.pack_nvfp4(x2, global_scale=g, layer_norm=stats, addcmul_modulation=mod1),
            lambda c, fu: _same_pack(fu, c[0]), T + P),
        "q, k: RMSNorm + RoPE": (
            lambda: [comfy.ldm.flux.math.apply_rope1(rms(t).view(1, rows, heads, d), freqs) for t in (x, y)],
            lambda: ops.rms_norm_rope_(q, k, qw, qw, EPS, freqs=table, positions=rows),
            None, 4 * T),
        "x = addcmul(x, o, e2) + norm3 statistics + cross q amax": (
            lambda: quantize(ln3(torch.addcmul(x, y, m.repeat_e(chunks[2], x)))),
            lambda: ops.residual_layer_norm_(x2, y2, stats3, gate=tables.e[2], mod_index=tables.mod_index, out=out,
                                             global_scale_out=g),
            None, 3 * T),
        "cross q pack (norm3 affine)": (
            lambda: quantize(ln3(x)),
            lambda: ops.pack_nvfp4(out, global_scale=g, layer_norm=stats3),  # the new x of the step before
            None, T + P),
        "x = x + o + norm2 statistics + ffn.0 amax": (
            lambda: quantize(comfy_modulated(ln(x + y), chunks[3], chunks[4])),
            lambda: ops.residual_layer_norm_(x2, y2, stats, out=out, next_modulation=mod2, global_scale_out=g),
            None, 3 * T),
        "ffn.2 pack of gelu(ffn.0 output)": (
            lambda: quantize(comfy_adapter.eager_gelu_tanh(f)),
            lambda: ops.pack_nvfp4(f2, gelu=True),
            lambda c, fu: _same_pack(fu, c), 2 * F_ + P_F),
    }
    results = []
    for name, (comfy_fn, fused_fn, check, fused_bytes) in steps.items():
        equal = None
        if check is not None:
            equal = bool(check(comfy_fn(), fused_fn()))
        samples = {"comfy": [], "fused": []}
        for _ in range(3):  # alternate arms so clock or thermal drift hits both
            samples["comfy"] += time_ms(comfy_fn, reps=args.reps // 3 or 1)
            samples["fused"] += time_ms(fused_fn, reps=args.reps // 3 or 1)
        med = {arm: statistics.median(v) for arm, v in samples.items()}
        gbs = fused_bytes / (med["fused"] * 1e-3) / 1e9
        results.append({"step": name, "bit_identical": equal, "median_ms": med,
                        "speedup": med["comfy"] / med["fused"], "fused_bytes": fused_bytes, "fused_gbs": gbs,
                        "fused_fraction_of_copy_bandwidth": gbs / copy_gbs})
    # every kernel's parity is tests/test_gpu_wan_kernels.py's; here the packs that are compared above, and the probes
    probe_results = verdicts.run_probes(ops, torch.device("cuda", 0), (probes.WAN_PROBES, core_probes.LINEAR_PROBES))
    result = {
        "benchmark": "Wan block steps, ComfyUI's ops vs the fused kernels",
        "command": shlex.join(["python", "benchmarks/bench_wan_kernels.py", *sys.argv[1:]]),
        "model": args.model, "dtype": args.dtype, "rows": rows, "dim": dim, "ffn": ffn,
        "timing": "GPU time: CUDA events with a spin kernel queued ahead of each call (host launch overhead excluded)",
        "device": device_info(torch.device("cuda", 0)),
        "copy_bandwidth_gbs_read_plus_write": copy_gbs,
        "probes": {n: r.ok for n, r in probe_results.items()},
        "steps": results,
        "fused_total_ms": sum(r["median_ms"]["fused"] for r in results),
        "fused_total_bytes": sum(r["fused_bytes"] for r in results),
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    probes_ok = all(v is not False for v in result["probes"].values())
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; probes {'all bit-identical' if probes_ok else result['probes']}")
    print(f"{'step':58} {'comfy ms':>9} {'fused ms':>9} {'x':>6} {'fused GB/s':>10} {'%copy':>6} exact")
    for r in results:
        print(f"{r['step']:58} {r['median_ms']['comfy']:>9.3f} {r['median_ms']['fused']:>9.3f} {r['speedup']:>6.2f} "
              f"{r['fused_gbs']:>10.0f} {100 * r['fused_fraction_of_copy_bandwidth']:>5.0f}% {r['bit_identical']}")
    sys.exit(0 if probes_ok and all(r["bit_identical"] is not False for r in results) else 1)


if __name__ == "__main__":
    main()
