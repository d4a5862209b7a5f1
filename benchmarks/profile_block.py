"""Profile one MiniMax H3 block: ComfyUI's stock path vs the fused path, both arms in one process.

Builds one H3 DiTBlock (tests/h3_mirror.py: ComfyUI's DiTBlock and NVFP4 Linear, op for op) with random NVFP4
weights (seed 440420) and the 1344x768, 124-frame token layout: 100 text + 414 audio + 37,296 video = 37,810
tokens in three segments with distinct modulation rows. NVFP4 compute is forced on, so activations take ComfyUI's
pack path on any GPU; below sm_100 the FP4 GEMM is *emulated* in both arms (dequantize + bf16 matmul), as
comfy-kitchen's dispatch does, and the JSON reports times with and without it.

Checks parity first (block output bytes, stock vs fused), then times both arms (CUDA events, medians of
alternating repeats), then captures one block of each arm with torch.profiler and groups its kernels into the
sections of the GB10 reference profile (launch counts, modulation / gated residual, NVFP4 pack components,
other boundaries, bytes of intermediates).

On a machine without a GPU it runs the same comparison at a small width on the CPU (Python reference backend)
and reports parity and wall times only.

Usage: python benchmarks/profile_block.py [--out benchmarks/h200-block-profile.json] [--tokens-video 37296]
                                         [--attention pytorch|sage]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import logging

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import conftest  # noqa: E402,F401  (imports this repository as h3_fused_nvfp4)
import h3_mirror as mirror  # noqa: E402
from h3_mirror import object_patches  # noqa: E402
from bench_pack import copy_bandwidth_gbs, device_info, warm_up_gpu  # noqa: E402

from h3_fused_nvfp4.integration import patch  # noqa: E402
from h3_fused_nvfp4.integration.linear import gemm_mode  # noqa: E402

SEED = 440420
# comfy-kitchen logs a warning per call when the FP4 GEMM is unavailable (sm_90) and it dequantizes instead.
logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)
TEXT, AUDIO, VIDEO = 100, 414, 37296  # 1344x768, 124 frames: 37 x 24 x 42 video rows, 2 x 207 audio rows

# Kernel-name fragments -> category (first match wins).
CATEGORIES = (
    ("fused_absmax", ("nvfp4_absmax",)),
    ("fused_pack", ("nvfp4_pack",)),
    ("fused_gated_residual", ("h3_gated_residual",)),
    ("emulation_dequant", ("dequantize_nvfp4",)),
    ("comfy_pack", ("quantize_nvfp4",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm100_", "wgmma")),
    ("rms_rope", ("rms_rope", "rope")),
    ("rms_norm", ("rms_norm", "layer_norm", "RowwiseMoments")),
    ("abs", ("AbsFunctor", "abs_kernel")),
    ("amax_reduce", ("reduce_kernel",)),
    ("silu", ("silu",)),
    ("addcmul", ("addcmul",)),
    ("mul", ("MulFunctor", "mul_kernel")),
    ("add", ("AddFunctor", "add_kernel", "CUDAFunctor_add")),
    ("div", ("DivFunctor", "div_true", "MulScalar", "div_kernel")),
    ("fill", ("FillFunctor", "fill_kernel", "memset")),
    ("copy", ("copy", "Memcpy", "cat", "transpose")),
)


def categorize(name: str) -> str:
    for category, keys in CATEGORIES:
        if any(k.lower() in name.lower() for k in keys):
            return category
    return "other_elementwise"


class Holder(torch.nn.Module):
    """Stands in for the diffusion model: ``blocks[0]`` is the block under test."""

    def __init__(self, block):
        super().__init__()
        self.blocks = torch.nn.ModuleList([block])


def build(device, width_scale: str, tokens_video: int, static_layers=()):
    if width_scale == "full":
        dims = dict(hidden=mirror.H3_HIDDEN, heads=mirror.H3_HEADS, head_dim=mirror.H3_HEAD_DIM, ffn=mirror.H3_FFN,
                    t_dim=mirror.H3_T_DIM)
        text, audio, video = TEXT, AUDIO, tokens_video
    else:  # CPU: the same structure at reduced width and length
        dims = dict(hidden=256, heads=4, head_dim=64, ffn=512, t_dim=256)
        text, audio, video = 20, 46, 277
    block = mirror.make_block(dims["hidden"], dims["heads"], dims["head_dim"], dims["ffn"], dims["t_dim"], seed=SEED,
                              device=device, static_scale_layers=static_layers)
    inputs = mirror.make_inputs(text, audio, video, seed=SEED + 1, device=device, hidden=dims["hidden"],
                                head_dim=dims["head_dim"], t_dim=dims["t_dim"], n_timesteps=2)
    return Holder(block), inputs, dims


def run_block(holder, inputs, x_work, fresh=True):
    """One block forward on ``x_work`` (updated in place); ``fresh`` first copies the inputs into it."""
    x, t_emb, segments, rope = inputs
    if fresh:
        x_work.copy_(x)
    with torch.inference_mode():
        return holder.blocks[0](x_work, t_emb, segments, rope, transformer_options={})


def time_arm(fn, reps, prepare=lambda: None):
    """Median-ready samples of ``fn``; ``prepare`` (not timed) resets the inputs before every repetition."""
    times = []
    for _ in range(reps):
        prepare()
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return times


MARKER = "spin_kernel"  # torch.cuda._sleep: brackets SageAttention's kernels (tests/h3_mirror.py, profiling only)
LAYOUT_COPY_WORDS = ("transpose", "permute", "copy", "pad")


def kernel_profile(fn, prepare=lambda: None):
    """One call of ``fn`` under torch.profiler: (launches, per-category dict, timeline, attention internals).

    Categories come from kernel names, with three rules on the sequence: a cuBLAS/cuDNN workspace memset counts
    with the library call that follows it; a GEMM right after NVFP4 dequantize launches is the emulated NVFP4
    GEMM (sm_90); kernels between two marker launches are SageAttention's internals (listed, layout copies
    flagged, counted as attention)."""
    from torch.profiler import ProfilerActivity, profile

    prepare()
    fn()
    prepare()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    kernels = []  # [category, name, ms]
    inside_attention = False
    internals = []
    for e in events:
        if MARKER in e.name:
            inside_attention = not inside_attention
            continue
        ms = e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
        if inside_attention:
            internals.append({"kernel": e.name[:120], "ms": round(ms, 4),
                              "layout_copy": any(w in e.name.lower() for w in LAYOUT_COPY_WORDS)})
            kernels.append(["attention", e.name, ms])
        else:
            kernels.append([categorize(e.name), e.name, ms])
    library_memsets = 0
    for i, k in enumerate(kernels):
        if k[0] == "fill" and "Memset" in k[1] and i + 1 < len(kernels) and kernels[i + 1][0] in ("gemm", "attention"):
            # cuBLAS and cuDNN clear their workspace right before their kernel: count it with the library call.
            k[0] = kernels[i + 1][0]
            library_memsets += 1
    for i, k in enumerate(kernels):
        if k[0] != "gemm" or "Memset" in k[1]:
            continue
        j = i - 1
        while j >= 0 and kernels[j][0] == "gemm" and "Memset" in kernels[j][1]:
            j -= 1
        if j >= 0 and kernels[j][0] == "emulation_dequant":
            for m in range(j + 1, i + 1):
                kernels[m][0] = "emulation_gemm"
    per_cat: dict[str, dict] = {}
    timeline = []
    for cat, name, ms in kernels:
        timeline.append(f"{cat}: {name[:90]}")
        slot = per_cat.setdefault(cat, {"launches": 0, "ms": 0.0, "kernels": set()})
        slot["launches"] += 1
        slot["ms"] += ms
        slot["kernels"].add(name[:120])
    for slot in per_cat.values():
        slot["kernels"] = sorted(slot["kernels"])
        slot["ms"] = round(slot["ms"], 4)
    per_cat["library_workspace_memsets"] = {"launches": library_memsets, "ms": 0.0, "kernels": []}
    return len(kernels), per_cat, timeline, internals


def intermediate_bytes(rows: int, dims: dict, arm: str) -> dict:
    """Analytic bytes of intermediates written for the four projections' inputs (bf16 = 2 bytes).

    stock: modulation writes h twice (mul_, add_) for qkv_proj and fc1; torch.amax's abs() writes a copy of every
    packed input; SwiGLU writes silu(gate) and the product; every input is packed (codes + scales).
    fused: only the packed codes and scales are written.
    """
    h, inner, ffn = dims["hidden"], dims["heads"] * dims["head_dim"], dims["ffn"]
    packed = {k: rows * k // 2 + ((rows + 127) // 128 * 128) * ((k // 16 + 3) // 4 * 4) for k in (h, inner, ffn)}
    if arm == "fused":
        parts = {"packed": 2 * packed[h] + packed[inner] + packed[ffn]}
    else:
        parts = {
            "modulation": 2 * 2 * rows * h * 2,
            "abs_for_amax": rows * (2 * h + inner + ffn) * 2,
            "swiglu": 2 * rows * ffn * 2,
            "packed": 2 * packed[h] + packed[inner] + packed[ffn],
        }
    parts["total"] = sum(parts.values())
    return parts


def sections(launches, cats, block_ms, rows, dims, arm):
    def ms(*names):
        return round(sum(cats.get(n, {}).get("ms", 0.0) for n in names), 4)

    def n(*names):
        return sum(cats.get(n, {}).get("launches", 0) for n in names)

    excluded = ("gemm", "attention", "emulation_dequant", "emulation_gemm", "library_workspace_memsets")
    other_ms = round(sum(v["ms"] for k, v in cats.items() if k not in excluded), 4)
    excluding = launches - n("attention", "emulation_dequant", "emulation_gemm")
    return {
        "block_ms_median": round(block_ms, 3),
        "capture": {
            "tool": "torch.profiler (CUDA activity), one warmed block",
            "kernel_launches": launches,
            "kernel_launches_excluding_attention_and_emulation": excluding,
            "cublas_cudnn_workspace_memsets_included_above": n("library_workspace_memsets"),
            "note": "emulation = NVFP4 dequantize launches and the bf16 GEMMs (with their cuBLAS workspace "
                    "memsets) that consume them; a GPU with FP4 tensor cores runs one NVFP4 GEMM per projection "
                    "instead" if n("emulation_gemm") else "no emulation on this GPU",
        },
        "gemm": {"launches": n("gemm"), "ms": ms("gemm"),
                 "emulated_nvfp4_gemm_launches": n("emulation_gemm"), "emulated_nvfp4_gemm_ms": ms("emulation_gemm"),
                 "emulation_dequant_launches": n("emulation_dequant"),
                 "emulation_dequant_ms": ms("emulation_dequant")},
        "attention": {"launches": n("attention"), "ms": ms("attention")},
        "non_gemm_non_attention": {"launches": launches - n("gemm", "attention", "emulation_dequant", "emulation_gemm"),
                                   "ms": other_ms},
        "component1_residual": {
            "modulation_launches": n("mul", "add") if arm == "stock" else 0,
            "modulation_ms": ms("mul", "add") if arm == "stock" else 0.0,
            "gate_add_launches": n("addcmul", "fused_gated_residual"),
            "gate_add_ms": ms("addcmul", "fused_gated_residual"),
        },
        "nvfp4": {
            "activation_pack_launches": n("comfy_pack", "fused_pack"),
            "activation_pack_ms": ms("comfy_pack", "fused_pack"),
            "absmax_launches": n("abs", "amax_reduce", "fused_absmax"),
            "absmax_ms": ms("abs", "amax_reduce", "fused_absmax"),
            "scale_and_alpha_launches": n("div"),
            "block_scale_zero_launches": n("fill"),
            "intermediate_bytes_across_four_projections": intermediate_bytes(rows, dims, arm),
        },
        "other_boundaries": {
            "layout_copy_launches": n("copy"), "layout_copy_ms": ms("copy"),
            "swiglu_silu_ms": ms("silu"), "rms_rope_ms": ms("rms_rope"), "rms_norm_ms": ms("rms_norm"),
        },
        "kernels_by_category": cats,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens-video", type=int, default=VIDEO)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--attention", choices=("pytorch", "sage"), default="pytorch",
                        help="ComfyUI's global attention backend in both arms (sage: --use-sage-attention)")
    args = parser.parse_args()
    if args.attention == "sage":
        import sageattention  # noqa: F401  (benchmarks/build_sageattention.sh)

        mirror.GLOBAL_ATTENTION["function"] = mirror.sage_attention
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    out_path = pathlib.Path(args.out or ROOT / "benchmarks" / ("block-profile.json" if cuda else "block-profile-cpu.json"))

    holder, inputs, dims = build(device, "full" if cuda else "small", args.tokens_video,
                                 static_layers=())
    x = inputs[0]
    rows = x.shape[0]
    patches, report = patch.build_patches(holder, "block")
    work = torch.empty_like(x)

    if cuda:
        warm_up_gpu()
    stock = run_block(holder, inputs, work).clone()
    with object_patches(holder, patches):
        fused = run_block(holder, inputs, work).clone()
    differing = int((stock.view(torch.int16) != fused.view(torch.int16)).sum())
    max_abs = float((stock.float() - fused.float()).abs().max())
    fused_linears = [v for v in patches.values() if type(v).__name__ == "FusedNVFP4Linear"]

    # Every repetition starts from the same input (the copy happens outside the measurement), so both arms see
    # identical data: attention and GEMM power draw, and hence clocks, do not drift apart between the arms.
    def reset():
        work.copy_(x)

    def stock_arm():
        run_block(holder, inputs, work, fresh=False)

    def fused_arm():
        with object_patches(holder, patches):
            run_block(holder, inputs, work, fresh=False)

    samples = {"stock": [], "fused": []}
    for _ in range(2):
        samples["stock"] += time_arm(stock_arm, args.reps // 2 or 1, reset)
        samples["fused"] += time_arm(fused_arm, args.reps // 2 or 1, reset)
    med = {k: statistics.median(v) for k, v in samples.items()}

    result = {
        "benchmark": "one MiniMax H3 DiTBlock, ComfyUI stock path vs fused NVFP4 path",
        "command": "python benchmarks/profile_block.py" + (f" --out {args.out}" if args.out else "")
        + (f" --attention {args.attention}" if args.attention != "pytorch" else ""),
        "device": device_info() if cuda else {"name": "cpu", "torch": torch.__version__},
        "workload": {
            "resolution": [1344, 768], "frames": 124, "packed_tokens": rows, "segments": len(inputs[2]),
            "hidden": dims["hidden"], "heads": dims["heads"], "ffn": dims["ffn"], "seed": SEED,
            "attention": {"pytorch": "pytorch SDPA (ComfyUI's pytorch backend)",
                          "sage": "SageAttention 2 (ComfyUI's sage backend): stock head-major call (HND), fused "
                                  "token-major call (NHD)"}[args.attention],
            "gemm": (gemm_mode(x.device) if cuda else "emulated") + (
                "" if cuda and gemm_mode(x.device) == "nvfp4" else
                ": no FP4 tensor cores, NVFP4 GEMM emulated in BOTH arms by dequantize + bf16 matmul"),
            "width": "full H3" if cuda else "reduced (CPU reference run)",
        },
        "parity": {"block_output_differing_elements": differing, "block_output_max_abs_diff": max_abs,
                   "fused_linear_calls": sum(v.calls_fused for v in fused_linears),
                   "stock_fallback_calls": sum(v.calls_stock for v in fused_linears)},
        "median_ms": med,
        "speedup_block": med["stock"] / med["fused"],
    }
    if cuda:
        result["copy_bandwidth_gbs_read_plus_write"] = copy_bandwidth_gbs()
        mirror.SAGE_PROFILE_MARKERS = args.attention == "sage"
        for arm, fn in (("stock", stock_arm), ("fused", fused_arm)):
            launches, cats, timeline, internals = kernel_profile(fn, reset)
            result[arm] = sections(launches, cats, med[arm], rows, dims, arm)
            result[arm]["kernel_sequence"] = timeline
            if internals:
                result[arm]["attention_internals"] = {
                    "kernels": internals,
                    "layout_copies_inside_attention_library": [k["kernel"] for k in internals if k["layout_copy"]],
                }
        mirror.SAGE_PROFILE_MARKERS = False
        s, f = result["stock"], result["fused"]
        for arm in ("stock", "fused"):
            r = result[arm]
            r["block_ms_without_gemm_and_emulation"] = round(
                r["block_ms_median"] - r["gemm"]["ms"] - r["gemm"]["emulated_nvfp4_gemm_ms"]
                - r["gemm"]["emulation_dequant_ms"], 3)
        result["summary"] = {
            "non_gemm_non_attention_ms": {"stock": s["non_gemm_non_attention"]["ms"],
                                          "fused": f["non_gemm_non_attention"]["ms"]},
            "non_gemm_non_attention_speedup": s["non_gemm_non_attention"]["ms"] / max(f["non_gemm_non_attention"]["ms"], 1e-9),
            "launches_excluding_attention_and_emulation": {
                "stock": s["capture"]["kernel_launches_excluding_attention_and_emulation"],
                "fused": f["capture"]["kernel_launches_excluding_attention_and_emulation"]},
            # With FP4 tensor cores each NVFP4 projection is one GEMM launch instead of its emulation.
            "launches_excluding_attention_with_native_fp4_gemm": {
                arm: result[arm]["capture"]["kernel_launches_excluding_attention_and_emulation"]
                + (4 if result[arm]["gemm"]["emulated_nvfp4_gemm_launches"] else 0) for arm in ("stock", "fused")},
            "layout_copy_launches": {"stock": s["other_boundaries"]["layout_copy_launches"],
                                     "fused": f["other_boundaries"]["layout_copy_launches"]},
            "intermediate_bytes_ratio": f["nvfp4"]["intermediate_bytes_across_four_projections"]["total"]
            / s["nvfp4"]["intermediate_bytes_across_four_projections"]["total"],
        }
    out_path.write_text(json.dumps(result, indent=1))

    print(f"{result['workload']['width']} block, {rows} tokens, GEMM: {result['workload']['gemm']}")
    print(f"parity: {differing} differing elements, max |diff| {max_abs}")
    print(f"block median ms: stock {med['stock']:.3f}  fused {med['fused']:.3f}  x{result['speedup_block']:.3f}")
    if cuda:
        sm = result["summary"]
        print(f"non-GEMM non-attention ms: stock {sm['non_gemm_non_attention_ms']['stock']:.3f}  "
              f"fused {sm['non_gemm_non_attention_ms']['fused']:.3f}  x{sm['non_gemm_non_attention_speedup']:.2f}")
        print(f"launches (excl. attention+emulation): {sm['launches_excluding_attention_and_emulation']}  "
              f"with a native FP4 GEMM: {sm['launches_excluding_attention_with_native_fp4_gemm']}  "
              f"layout copies: {sm['layout_copy_launches']}  "
              f"intermediate bytes fused/stock: {sm['intermediate_bytes_ratio']:.3f}")
    print(f"JSON: {out_path}")
    return 0 if differing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
