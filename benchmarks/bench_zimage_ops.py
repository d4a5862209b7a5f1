"""Benchmark: Z-Image Turbo's fused ops against ComfyUI's op sequences, side by side in one process.

At 1024x1024 (4352 rows of width 3840, FFN 10240, batch 1) each step of the fused block (tests/zimage_block.py)
against the ComfyUI ops it replaces: the qkv input (RMSNorm, modulate, quantize), the residual with the FFN input
(post-norm, tanh gate, add, RMSNorm, modulate, quantize for w1 and for w3), w2's input (SwiGLU of w1's and w3's
outputs, quantize), the same residual handing on to the next block's qkv input, and a refiner block's residual and
FFN input. Equal bytes first, then median GPU times over alternating repeats. Also two ComfyUI ops alone: comfy-
kitchen's rms_rope on Z-Image's q / k views (which the fused block keeps: its bytes should be one read and one write
of q and k plus the table) and the k / v copy of JointAttention's repeat (which the fused block skips).

``--ncu``: DRAM bytes read + written per kernel of each sequence from Nsight Compute (the child runs each arm once,
warmed, in its own profiler window), with the bytes a sequence must move (benchmarks/DECISIONS.md, Z-Image) beside.

Usage: python benchmarks/bench_zimage_ops.py [--ncu] --out zimage-ops.json
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
from h3_fused_nvfp4.layout import Modulation, RmsNorm  # noqa: E402
from h3_fused_nvfp4.models.zimage.modulation import adaln_row_index  # noqa: E402
from h3_fused_nvfp4.tools import comfy_env  # noqa: E402
from h3_fused_nvfp4.tools.report import (  # noqa: E402
    copy_bandwidth_gbs,
    device_info,
    kernel_profile,
    ncu_command,
    run_ncu,
    time_ms,
    warm_up_gpu,
)

ROWS, DIM, FFN, HEADS = 4352, 3840, 10240, 30
EPS = 1e-5
P = 0.28125  # NVFP4 codes and block scales per byte of a bf16 tensor


class Case:
    """The tensors of one block at Z-Image's shapes and each sequence's two arms (functions returning tensors to
    compare)."""

    def __init__(self, rows: int):
        import comfy.ldm.lumina.model as m
        from comfy.ldm.flux.layers import EmbedND
        from comfy.quant_ops import QuantizedTensor

        from h3_fused_nvfp4.core.probes import comfy_rms_norm

        self.m, self.rows = m, rows
        gen = torch.Generator(device="cuda").manual_seed(440420)

        def randn(*shape, scale=1.0):
            return (torch.randn(shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

        self.x, self.out, self.y = randn(rows, DIM, scale=2), randn(rows, DIM), randn(rows, DIM)
        self.x1, self.x3 = randn(rows, FFN, scale=3), randn(rows, FFN, scale=3)
        weights = [(1 + torch.randn(DIM, generator=gen, device="cuda") * 0.1).to(torch.bfloat16) for _ in range(3)]
        self.w_norm1, self.w_norm2, self.w_ffn1 = weights
        self.norm1, self.norm2, self.ffn_norm1 = (comfy_rms_norm(DIM, w, EPS) for w in weights)
        scale_msa, gate_msa, self.scale_mlp, _ = randn(1, 4 * DIM, scale=0.5).chunk(4, dim=1)
        self.scale_msa, self.gate_msa = scale_msa, gate_msa
        self.index = adaln_row_index(1, rows, 1).to("cuda")
        self.tanh_gate = gate_msa.tanh()
        self.quantize = lambda h: QuantizedTensor.from_float(h, "TensorCoreNVFP4Layout")
        qkv = randn(rows, 3 * DIM)
        self.q = qkv[:, :DIM].view(1, rows, HEADS, DIM // HEADS)
        self.k = qkv[:, DIM:2 * DIM].view(1, rows, HEADS, DIM // HEADS)
        self.v = qkv[:, 2 * DIM:].view(1, rows, HEADS, DIM // HEADS)
        ids = torch.zeros((1, rows, 3))
        ids[0, :, 1], ids[0, :, 2] = (torch.arange(rows) // 64).float(), (torch.arange(rows) % 64).float()
        self.freqs = EmbedND(dim=128, theta=256.0, axes_dim=[32, 48, 48])(ids).movedim(1, 2).to("cuda")
        self.qk_weights = randn(128, scale=0.1) + 1, randn(128, scale=0.1) + 1

    @staticmethod
    def _qt(qt):
        return qt._qdata, qt._params.block_scale.view(torch.uint8), qt._params.scale.reshape(1)

    @staticmethod
    def _packed(p):
        return p.qdata, p.block_scales.view(torch.uint8), p.global_scale.reshape(1)

    def _norm(self, weight):
        return RmsNorm(weight, EPS, torch.empty(self.rows, dtype=torch.float32, device="cuda"))

    def sequences(self) -> dict:
        """name: (ComfyUI's ops, the fused ops from a fresh copy of x (compared), the fused ops alone (timed: the
        residuals update x in place, call after call), bytes the fused step must move)."""
        m, rows = self.m, self.rows
        g = torch.empty(1, dtype=torch.float32, device="cuda")
        mod_msa = Modulation(self.scale_msa, None, self.index)
        mod_mlp = Modulation(self.scale_mlp, None, self.index)
        x3, out3 = self.x.view(1, rows, DIM), self.out.view(1, rows, DIM)  # ComfyUI's [B, S, D] token stream
        x_work = self.x.clone()

        def rows2d(t):
            return t.reshape(rows, -1)

        def qkv_input_comfy():
            return self._qt(self.quantize(rows2d(m.modulate(self.norm1(x3), self.scale_msa))))

        def qkv_input_fused():
            norm = self._norm(self.w_norm1)
            ops.norm_statistics(self.x, norm, modulation=mod_msa, global_scale_out=g)
            return self._packed(ops.pack_nvfp4(self.x, global_scale=g, modulation=mod_msa, norm=norm))

        def residual_comfy(next_norm, scale, gated, packs):
            x = x3 + (m.apply_gate(self.tanh_gate.unsqueeze(1), self.norm2(out3)) if gated else self.norm2(out3))
            h = rows2d(m.modulate(next_norm(x), scale) if scale is not None else next_norm(x))
            q = self._qt(self.quantize(h))
            for _ in range(packs - 1):  # w3 quantizes the same input again
                self.quantize(h)
            return (rows2d(x), *q)

        def residual_fused(weight, modulation, gated, fresh):
            x = x_work.copy_(self.x) if fresh else x_work
            norm = self._norm(weight)
            ops.post_norm_residual_(x, self.out, self.w_norm2, EPS, self.tanh_gate if gated else None,
                                    self.index if gated else None, next_norm=norm, next_modulation=modulation,
                                    global_scale_out=g)
            return (x, *self._packed(ops.pack_nvfp4(x, global_scale=g, modulation=modulation, norm=norm)))

        def swiglu_comfy():
            return self._qt(self.quantize(m.FeedForward._forward_silu_gating(None, self.x1, self.x3)))

        def swiglu_fused():
            return self._packed(ops.pack_nvfp4(self.x1, swiglu=True, up=self.x3))

        A, F = 2 * rows * DIM, 2 * rows * FFN
        residual = 3 * A + A + P * A  # x and out in, x out; x again for the pack, the pack out
        steps = {"qkv_input": (qkv_input_comfy, qkv_input_fused, qkv_input_fused, A + P * A),
                 "swiglu_w2_input": (swiglu_comfy, swiglu_fused, swiglu_fused, 4 * F + P * F)}
        for name, weight, modulation, gated, comfy_norm, comfy_scale, packs in (
                ("residual_ffn_input", self.w_ffn1, mod_mlp, True, self.ffn_norm1, self.scale_mlp, 2),
                ("residual_next_qkv_input", self.w_norm1, mod_msa, True, self.norm1, self.scale_msa, 1),
                ("refiner_residual_ffn_input", self.w_ffn1, None, False, self.ffn_norm1, None, 2)):
            steps[name] = (
                lambda n=comfy_norm, sc=comfy_scale, gt=gated, k=packs: residual_comfy(n, sc, gt, k),
                lambda w=weight, md=modulation, gt=gated: residual_fused(w, md, gt, True),
                lambda w=weight, md=modulation, gt=gated: residual_fused(w, md, gt, False),
                residual)
        return steps

    def comfy_only(self) -> dict:
        """ComfyUI ops the fused block keeps (rms_rope) or skips (the k / v repeat), with the bytes they must move."""
        import comfy.quant_ops

        qw, kw = self.qk_weights
        A = 2 * self.rows * DIM
        table = self.freqs.numel() * self.freqs.element_size()
        return {
            "rms_rope": (lambda: comfy.quant_ops.ck.rms_rope(self.q, self.k, self.freqs, qw, kw, 1.1920929e-07),
                         4 * A + table),
            "kv_repeat": (lambda: (self.k.unsqueeze(3).repeat(1, 1, 1, 1, 1).flatten(2, 3),
                                   self.v.unsqueeze(3).repeat(1, 1, 1, 1, 1).flatten(2, 3)), 4 * A),
        }


def _equal(a, b) -> bool:
    """The same bytes in each pair of tensors (-0.0 is not 0.0, a NaN equals the same NaN)."""
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return len(a) == len(b) and all(u.shape == v.shape and u.dtype == v.dtype and torch.equal(
        u.contiguous().view(views[u.element_size()]), v.contiguous().view(views[v.element_size()]))
        for u, v in zip(a, b))


def ncu_child(rows: int) -> int:
    """Under ncu: each sequence's arms once (warmed) in their own window, opened by a spin kernel."""
    case = Case(rows)
    fns = [fn for comfy, _, fused, _ in case.sequences().values() for fn in (comfy, fused)]
    fns += [fn for fn, _ in case.comfy_only().values()]
    for fn in fns:
        fn()
    for fn in fns:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda._sleep(1000)
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "zimage-ops.json"))
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--ncu", action="store_true", help="DRAM bytes per kernel from Nsight Compute")
    parser.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ncu-timeout", type=float, default=300)
    args = parser.parse_args()
    comfy_env.import_comfyui()
    if args.ncu_child:
        return ncu_child(args.rows)
    torch.manual_seed(440420)
    warm_up_gpu()
    copy_gbs = copy_bandwidth_gbs()
    case = Case(args.rows)
    results = {}
    for name, (comfy, fused_checked, fused, must_move) in case.sequences().items():
        equal = _equal(comfy(), fused_checked())
        samples = {"comfy": [], "fused": []}
        for _ in range(3):  # alternate arms so clock or thermal drift hits both
            samples["comfy"] += time_ms(comfy, reps=args.reps // 3 or 1)
            samples["fused"] += time_ms(fused, reps=args.reps // 3 or 1)
        med = {arm: statistics.median(v) for arm, v in samples.items()}
        results[name] = {"bit_identical": equal, "median_ms": med, "speedup": med["comfy"] / med["fused"],
                         "fused_must_move_bytes": must_move,
                         "launches": {"comfy": len(kernel_profile(comfy)), "fused": len(kernel_profile(fused))}}
    for name, (fn, must_move) in case.comfy_only().items():
        med = statistics.median(time_ms(fn, reps=args.reps))
        results[name] = {"median_ms": {"comfy": med}, "must_move_bytes": must_move,
                         "fraction_of_copy_bandwidth": must_move / (med * 1e-3) / 1e9 / copy_gbs,
                         "launches": {"comfy": len(kernel_profile(fn))}}
    out = {"benchmark": "Z-Image Turbo's fused ops vs ComfyUI's op sequences",
           "command": shlex.join(["python", "benchmarks/bench_zimage_ops.py", *sys.argv[1:]]),
           "timing": "GPU time: CUDA events with a spin kernel queued ahead of each call (host launch overhead "
                     "excluded)",
           "rows": args.rows, "device": device_info(torch.device("cuda", 0)),
           "copy_bandwidth_gbs_read_plus_write": copy_gbs, "results": results}
    if args.ncu:
        cmd = ncu_command(pathlib.Path(__file__).resolve(), ["--ncu-child", "--rows", str(args.rows)])
        windows, error = run_ncu(cmd, args.ncu_timeout)
        arms = [(n, arm) for n in case.sequences() for arm in ("comfy", "fused")] + [(n, "comfy")
                                                                                    for n in case.comfy_only()]
        if error is None and len(windows) != len(arms):
            error = f"expected {len(arms)} measured windows in the ncu output, found {len(windows)}"
        out["ncu"] = {"command": shlex.join(cmd), "error": error}
        for (name, arm), kernels in zip(arms, windows or []):
            results[name].setdefault("dram_gb", {})[arm] = round(sum(k["bytes"] for k in kernels) / 1e9, 4)
            results[name].setdefault("kernels", {})[arm] = [
                {"kernel": k["kernel"], "gb": round(k["bytes"] / 1e9, 4), "ms": round(k["ms"], 4)} for k in kernels]
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, {args.rows} rows")
    for name, r in results.items():
        med = r["median_ms"]
        line = f"{name:>28}: " + " ".join(f"{arm} {ms:.3f} ms" for arm, ms in med.items())
        if "speedup" in r:
            line += f" x{r['speedup']:.2f} exact {r['bit_identical']} launches {r['launches']}"
        if "dram_gb" in r:
            must = r.get("fused_must_move_bytes", r.get("must_move_bytes"))
            line += f" DRAM {r['dram_gb']} GB (must move {must / 1e9:.3f})"
        print(line)
    return 0 if all(r.get("bit_identical", True) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
