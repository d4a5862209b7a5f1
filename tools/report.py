"""The report: the self-check, verbosely, then ComfyUI's real H3 block profiled stock vs fused in one process.

Run it with ComfyUI's own Python (no pytest): ``python <pack>/report.py [--out FILE] [--dram]``. It uses the
ComfyUI it is installed in, or ``COMFYUI_PATH``, or ``../shared/comfyui`` (tools/comfy_env.py).

On a GPU: three consecutive real ``DiTBlock``s at full H3 width (37,810 tokens of the 1344x768, 124-frame layout,
random NVFP4 weights made by ComfyUI's own quantizer); the middle one is measured, so the fused arm shows its steady
state (norm statistics handed over from the block before, and to the block after). Both arms run on the same blocks
and inputs; outputs are compared byte for byte first. The JSON has the sections of the GB10 reference profile
(device, workload, capture, component1_residual, nvfp4, other_boundaries, native_pack_validation, validation,
source_artifacts), each for both arms, plus the self-check, versions and GEMM mode. ``--dram`` adds DRAM bytes read
and written per kernel from Nsight Compute (``ncu``), per category, with a GB10 projection.

On a CPU: the same comparison at a reduced width with the Python twin of the kernels: a wiring check, labelled so,
with no speed figures.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from .. import comfy_adapter
from ..core import verdicts
from ..core.linear import gemm_mode
from ..core.probes import first_difference
from ..core.verdicts import package_version
from ..kernels import cuda_ops, runtime
from ..kernels.backend import backend_for
from ..models.h3.patch import PROBE_SETS
from ..models.h3.structure import LINEAR_PATHS
from ..version import __version__
from . import comfy_env
from . import synthetic as syn

PACK_ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED = 440420
GB10_READ_BANDWIDTH_GBS = 232.0   # measured on a DGX Spark (reference profile)
GB10_SPEC_BANDWIDTH_GBS = 273.0   # LPDDR5X datasheet
HOST_LEAD_CYCLES = 2_000_000      # spin kernel ahead of each timed call: hides the host's launch overhead
PROFILE_CALLS = 5                 # profiled three-block runs per arm; each kernel's time is its median over them
NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum"
MARKER = "spin_kernel"            # torch.cuda._sleep's kernel: opens each measured window under ncu

# Kernel-name fragments -> category (first match wins).
CATEGORIES = (
    ("fused_layer_norm", ("fused_layer_norm", "residual_layer_norm")),  # LayerNorm statistics, alone or in a residual
    ("fused_rms_norm_rope", ("fused_rms_norm_rope", "fused_rms_norm_rows")),  # full-width RMSNorm (+ RoPE), in place
    ("fused_absmax", ("nvfp4_absmax",)),
    ("fused_pack", ("nvfp4_pack",)),
    # residual + norm-statistics kernels (the post-norm residuals too); bounds: the amax pass's first launch
    ("fused_row_norm", ("fused_row_norm", "fused_post_norm", "fused_modulation_bounds", "fused_norm_bounds")),
    ("fused_gated_residual", ("fused_gated_residual",)),
    ("fused_rms_rope", ("fused_rms_rope",)),
    ("emulation_dequant", ("dequantize_nvfp4",)),
    ("comfy_pack", ("quantize_nvfp4",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm100_", "sm120_", "wgmma")),
    ("rms_rope", ("rms_rope", "rope")),
    ("rms_norm", ("rms_norm", "layer_norm", "RowwiseMoments")),
    ("abs", ("AbsFunctor", "abs_kernel")),
    ("amax_reduce", ("reduce_kernel",)),
    ("silu", ("silu",)),
    ("addcmul", ("addcmul",)),
    # amax / 2688: torch runs a division by a Python scalar as a multiply by its reciprocal (BUnaryFunctor)
    ("scale_finalize", ("BUnaryFunctor", "DivFunctor", "div_true", "MulScalar", "div_kernel")),
    ("gemm_alpha", ("BinaryFunctor<float, float, float",)),  # fp32 activation scale x weight scale
    ("mul", ("MulFunctor", "mul_kernel", "BinaryFunctor<c10::BFloat16")),
    ("add", ("AddFunctor", "add_kernel", "CUDAFunctor_add", "CUDAFunctorOnSelf_add")),
    ("fill", ("FillFunctor", "fill_kernel", "memset", "Memset")),
    ("copy", ("copy", "Memcpy", "cat", "transpose")),
)
NOT_ELEMENTWISE = ("gemm", "attention", "emulation_dequant", "emulation_gemm")


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return category
    return "other_elementwise"


def label_kernels(names: list[str]) -> list[str]:
    """Categories of a kernel sequence, with three rules: a cuBLAS workspace memset counts with the GEMM after it,
    a GEMM right after NVFP4 dequantize launches is the emulated NVFP4 GEMM (no FP4 tensor cores), and the
    multiplies right after silu launches are SwiGLU's ``silu(gate) * up`` (not modulation)."""
    cats = [categorize(n) for n in names]
    for i in range(1, len(cats)):
        if cats[i] == "mul" and cats[i - 1] == "silu" or cats[i] == "mul" and cats[i - 1] == "swiglu_mul":
            cats[i] = "swiglu_mul"
    for i, n in enumerate(names):
        if cats[i] == "fill" and "emset" in n and i + 1 < len(cats) and cats[i + 1] in ("gemm", "attention"):
            cats[i] = cats[i + 1]
    for i in range(len(cats)):
        if cats[i] == "gemm" and "emset" not in names[i]:
            j = i - 1
            while j >= 0 and cats[j] == "gemm" and "emset" in names[j]:
                j -= 1
            if j >= 0 and cats[j] == "emulation_dequant":
                for m in range(j + 1, i + 1):
                    cats[m] = "emulation_gemm"
    return cats


# ---- device measurements -------------------------------------------------------------------------------------

def _pack_version() -> str:
    return __version__


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "python": platform.python_version(),
            "comfy_kitchen": package_version("comfy-kitchen")}
    if device.type != "cuda":
        return {"name": "cpu", **info}
    props = torch.cuda.get_device_properties(device)
    info.update(name=props.name, compute_capability=f"SM{props.major}{props.minor}", sms=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1))
    try:
        query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader",
                              "-i", str(device.index or 0)],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        info.update(dict(zip(query.split(","), [v.strip() for v in out.split(",")])))
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def stock_gemm_note(device: torch.device) -> str | None:
    """What ComfyUI's own NVFP4 Linear (the stock arm) does on a GPU without FP4 tensor cores and the fused Linear
    does not (core/linear.py goes straight to the dequantizing GEMM there); None where the FP4 GEMM runs, and on
    the CPU, where torch's scaled_mm computes it."""
    if device.type != "cuda" or gemm_mode(device) == "nvfp4":
        return None
    return ("stock arm on this GPU (no FP4 tensor cores), every NVFP4 Linear call: comfy-kitchen first tries its FP4 "
            "GEMM, which raises, then dequantizes ('NVFP4 scaled_mm failed ... falling back to dequantization', a "
            "warning ComfyUI's server logs once per call; this run silences that logger). The fused arm dequantizes "
            "directly. That host work is in the stock arm's wall-clock forward times; kernel GPU times count only "
            "kernels")


def warm_up_gpu(seconds: float = 3.0) -> None:
    """Bring clocks up before measuring (the first milliseconds of a cold GPU run slower)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (the memory ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), reps=20, warmup=3)
    return 2 * src.numel() / (statistics.median(times) * 1e-3) / 1e9


def time_ms(fn, reps: int = 30, warmup: int = 5) -> list[float]:
    """GPU time of one call of ``fn`` per repeat (CUDA events, a spin kernel ahead of each call so the host's
    launch overhead overlaps it, as inside a running model)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_LEAD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def kernel_profile(fn) -> list[dict]:
    """The CUDA kernels one call of ``fn`` launches, in order: name, category, GPU ms (torch.profiler)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    names = [e.name for e in events]
    cats = label_kernels(names)
    return [{"kernel": n[:160], "category": c, "ms": getattr(e, "device_time_total", 0.0) / 1e3}
            for n, c, e in zip(names, cats, events)]


def middle_block_profile(chain: "BlockChain") -> list[dict]:
    """The middle block's kernels, cut out of one profile of the whole three-block run: each kernel runs after its
    real predecessor (block 0's last kernels before the middle block's first), with no host sync in between, as in a
    running model. Two one-cycle spin kernels mark the middle block's ends."""
    def marked(fn):
        torch.cuda._sleep(1)
        fn()
        torch.cuda._sleep(1)

    kernels = kernel_profile(lambda: chain.run(marked))
    marks = [i for i, k in enumerate(kernels) if MARKER in k["kernel"]]
    if len(marks) != 2:
        raise RuntimeError(f"expected the middle block between two {MARKER} markers, found {len(marks)}")
    return kernels[marks[0] + 1:marks[1]]


def median_kernels(runs: list[list[dict]]) -> list[dict]:
    """Per-kernel median over profiled calls that launched the same kernel sequence."""
    first = runs[0]
    if any([k["kernel"] for k in r] != [k["kernel"] for k in first] for r in runs[1:]):
        raise RuntimeError("the profiled calls launched different kernel sequences")
    return [{**k, "ms": statistics.median(r[i]["ms"] for r in runs)} for i, k in enumerate(first)]


def by_category(kernels: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for k in kernels:
        slot = out.setdefault(k["category"], {"launches": 0, "ms": 0.0})
        slot["launches"] += 1
        slot["ms"] += k.get("ms", 0.0)
    return {c: {"launches": v["launches"], "ms": round(v["ms"], 4)} for c, v in sorted(out.items())}


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Differing elements as bit patterns (NaN == NaN of the same bits, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"outputs of other shapes / dtypes: {tuple(a.shape)} {a.dtype} "
                             f"vs {tuple(b.shape)} {b.dtype}")
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


# ---- the blocks --------------------------------------------------------------------------------------------

class BlockChain:
    """Three consecutive real DiTBlocks and their inputs; ``arm("comfy" | "fused")`` switches the patches."""

    def __init__(self, dims, tokens, device, static_layers=(), seed=SEED):
        self.blocks = [syn.make_dit_block(dims, seed=seed + i, device=device, static_layers=static_layers)
                       for i in range(3)]
        self.inputs = syn.make_block_inputs(dims, tokens, seed=seed + 7, device=device, n_timesteps=2)
        # block check "passed": the report compares the arms itself
        self.patcher, self.patches = syn.fused_patcher(self.blocks, "block", device=device)
        self.work = torch.empty_like(self.inputs[0])
        self.current = "comfy"

    def arm(self, name: str) -> None:
        if name != self.current:
            if name == "fused":
                self.patcher.patch_model(load_weights=False)
            else:
                self.patcher.unpatch_model()
            self.current = name

    def call(self, i: int) -> torch.Tensor:
        _, t_emb, segments, rope = self.inputs
        with torch.inference_mode():
            return self.blocks[i](self.work, t_emb, segments, rope, transformer_options={"block_index": i})

    def run(self, measure=None) -> torch.Tensor:
        """All three blocks on a fresh copy of the input; ``measure(fn)`` wraps the middle block's call."""
        self.work.copy_(self.inputs[0])
        self.call(0)
        (measure or (lambda fn: fn()))(lambda: self.call(1))
        return self.call(2)


def _sections(kernels: list[dict], block_ms: float | None, arm: str) -> dict:
    cats = by_category(kernels)

    def ms(*names):
        return round(sum(cats.get(n, {}).get("ms", 0.0) for n in names), 4)

    def n(*names):
        return sum(cats.get(n, {}).get("launches", 0) for n in names)

    rest = [k for k in kernels if k["category"] not in NOT_ELEMENTWISE]
    return {
        "capture": {"tool": f"torch.profiler (CUDA activity), the middle of three warmed blocks, cut out of a profile "
                            f"of the whole three-block run (no host sync before it): per-kernel median of "
                            f"{PROFILE_CALLS} runs",
                    "kernel_launches": len(kernels),
                    "launches_excluding_gemm_attention_and_emulation": len(rest),
                    "block_ms_median": None if block_ms is None else round(block_ms, 3)},
        "component1_residual": {
            "modulation_launches": n("mul", "add"),
            "modulation_total_ms": ms("mul", "add"),
            "gate_add_launches": n("addcmul", "fused_gated_residual", "fused_row_norm"),
            "gate_add_total_ms": ms("addcmul", "fused_gated_residual", "fused_row_norm"),
            "note": "fused: the gated residual kernels also produce the next RMSNorm's statistics and the next "
                    "projection's amax (fused_row_norm_*)" if arm == "fused" else "stock ComfyUI ops",
        },
        "nvfp4": {
            "gemm_launches": n("gemm", "emulation_gemm"), "gemm_total_ms": ms("gemm", "emulation_gemm"),
            "emulated_gemm": n("emulation_gemm") > 0,
            "emulation_dequant_launches": n("emulation_dequant"), "emulation_dequant_ms": ms("emulation_dequant"),
            "activation_pack_launches": n("comfy_pack", "fused_pack"),
            "activation_pack_total_ms": ms("comfy_pack", "fused_pack"),
            "absmax_launches": n("abs", "amax_reduce", "fused_absmax"),
            "absmax_total_ms": ms("abs", "amax_reduce", "fused_absmax"),
            "scale_finalize_launches": n("scale_finalize"), "gemm_alpha_launches": n("gemm_alpha"),
            "block_scale_zero_launches": n("fill"),
        },
        "other_boundaries": {
            "layout_copy_launches": n("copy"), "layout_copy_total_ms": ms("copy"),
            "swiglu_silu_total_ms": ms("silu", "swiglu_mul"), "rms_rope_total_ms": ms("rms_rope", "fused_rms_rope"),
            "rms_norm_total_ms": ms("rms_norm"), "row_norm_kernels_ms": ms("fused_row_norm"),
            "non_gemm_non_attention_ms": round(sum(k["ms"] for k in rest), 4),
            "non_gemm_non_attention_launches": len(rest),
        },
        "kernels": kernels,
        "by_category": cats,
    }


def pack_validation(device, rows: int = 37810) -> dict:
    """The fused pack against ComfyUI's ``QuantizedTensor.from_float`` at H3's three input widths."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    out = {"validated_feature_widths": [], "rows": rows}
    for k in (5376, 7168, 14336):
        x = (torch.randn((rows, k), generator=gen, device=device) * 3).to(torch.bfloat16)
        qt = comfy_adapter.quantize_like_comfy(x)
        packed = cuda_ops.pack_nvfp4(x)
        out[str(k)] = {
            "qdata_difference_count": int((packed.qdata != qt._qdata).sum()),
            "block_scale_difference_count": int((packed.block_scales.view(torch.uint8)
                                                 != qt._params.block_scale.view(torch.uint8)).sum()),
            "global_scale": (first_difference("g", packed.global_scale.reshape(1), qt._params.scale.reshape(1))
                             or "equal"),
        }
        out["validated_feature_widths"].append(k)
    return out


def _both(comfy: dict, fused: dict, key: str) -> dict:
    return {"comfy": comfy[key], "fused": fused[key]}


def profile_blocks(args, device) -> dict:
    dims = syn.H3_FULL if device.type == "cuda" else syn.H3_SMALL
    tokens = syn.FULL_TOKENS if device.type == "cuda" else (19, 46, 245)
    static = tuple(LINEAR_PATHS) if args.all_static else tuple(args.static_layers or ())
    chain = BlockChain(dims, tokens, device, static_layers=static)
    rows = chain.inputs[0].shape[0]
    # Both arms twice before comparing: ComfyUI's emulated GEMM path gives other bits on its very first call.
    outputs = {}
    for _ in range(2):
        for arm in ("comfy", "fused"):
            chain.arm(arm)
            outputs[arm] = chain.run().clone()
    differing = int((outputs["comfy"].view(torch.int16) != outputs["fused"].view(torch.int16)).sum())
    max_abs = float((outputs["comfy"].float() - outputs["fused"].float()).abs().nan_to_num(0).max())
    # equal bits could still be equal NaNs: the comparison only means something on finite outputs
    nonfinite = int((~torch.isfinite(outputs["fused"].float())).sum())
    linears = [v for v in chain.patches.values() if type(v).__name__ == "FusedNVFP4Linear"]
    result = {
        "workload": {"resolution": [1344, 768] if device.type == "cuda" else None,
                     "frames": 124 if device.type == "cuda" else None, "packed_tokens": rows,
                     "segments": len(chain.inputs[2]),
                     "blocks": "3 consecutive real DiTBlocks, the middle one measured",
                     "dims": dims.label, "seed": SEED, "static_input_scale_layers": list(static),
                     "attention": "ComfyUI's optimized_attention (the running ComfyUI's backend)",
                     "gemm": gemm_mode(device) + ("" if gemm_mode(device) == "nvfp4" else
                                                  ": no FP4 tensor cores here, the NVFP4 GEMM is EMULATED in both arms "
                                                  "(dequantize + bf16 matmul)"),
                     "stock_arm_gemm": stock_gemm_note(device)},
        "validation": {"block_output_differing_elements": differing, "block_output_max_abs_diff": max_abs,
                       "block_output_nonfinite_elements": nonfinite,
                       "fused_linear_calls": sum(v.calls_fused for v in linears),
                       "comfy_path_fallback_calls": sum(v.calls_stock for v in linears)},
    }
    if device.type != "cuda":
        label = ("CPU run at a reduced width: the Python twin of the kernels against ComfyUI's real block (a wiring "
                 "check; no kernels ran, no speed figures)")
        result["workload"]["label"] = label
        for key in ("capture", "component1_residual", "nvfp4", "other_boundaries", "native_pack_validation"):
            result[key] = {"comfy": None, "fused": None, "note": "not measured: " + label}
        return result
    warm_up_gpu()
    samples = {"comfy": [], "fused": []}
    for _ in range(args.reps):
        for arm in ("comfy", "fused"):
            chain.arm(arm)
            times = []

            def measure(fn):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(HOST_LEAD_CYCLES)
                start.record()
                fn()
                end.record()
                times.append((start, end))

            chain.run(measure)
            torch.cuda.synchronize()
            samples[arm].append(times[0][0].elapsed_time(times[0][1]))
    sections = {}
    for arm in ("comfy", "fused"):
        chain.arm(arm)
        # as earlier reports took it: one call right after a host sync (its first kernel starts on an idle GPU)
        after_sync = []
        chain.run(lambda fn: after_sync.extend(kernel_profile(fn)))
        runs = [middle_block_profile(chain) for _ in range(PROFILE_CALLS)]
        sections[arm] = _sections(median_kernels(runs), statistics.median(samples[arm]), arm)
        sections[arm]["other_boundaries"]["non_gemm_non_attention_ms_one_call_after_host_sync"] = _sections(
            after_sync, None, arm)["other_boundaries"]["non_gemm_non_attention_ms"]
    chain.arm("comfy")
    for key in ("capture", "component1_residual", "nvfp4", "other_boundaries"):
        result[key] = _both(sections["comfy"], sections["fused"], key)
    result["kernel_sequences"] = {arm: sections[arm]["kernels"] for arm in sections}
    c, f = (sections[a]["other_boundaries"]["non_gemm_non_attention_ms"] for a in ("comfy", "fused"))
    result["summary"] = {"block_ms_median": {a: sections[a]["capture"]["block_ms_median"] for a in sections},
                         "non_gemm_non_attention_ms": {"comfy": c, "fused": f},
                         "non_gemm_non_attention_ms_one_call_after_host_sync": {
                             a: sections[a]["other_boundaries"]["non_gemm_non_attention_ms_one_call_after_host_sync"]
                             for a in sections},
                         "non_gemm_non_attention_speedup": round(c / max(f, 1e-9), 3)}
    return result


# ---- DRAM bytes from Nsight Compute ------------------------------------------------------------------------

def _ncu_child(args) -> int:
    """Under ncu: one warmed middle block per arm between cudaProfilerStart/Stop, each window opened by a spin
    kernel (the marker the parent splits the kernel list at)."""
    device = torch.device("cuda", 0)
    static = tuple(LINEAR_PATHS) if args.all_static else tuple(args.static_layers or ())
    chain = BlockChain(syn.H3_FULL, syn.FULL_TOKENS, device, static_layers=static)
    for arm in ("comfy", "fused", "comfy", "fused"):
        chain.arm(arm)
        chain.run()
    torch.cuda.synchronize()
    for arm in ("comfy", "fused"):
        chain.arm(arm)

        def window(fn):
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            torch.cuda._sleep(1000)
            fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()

        chain.run(window)
    torch.cuda.synchronize()
    return 0


def _unit_scale(unit: str) -> float:
    """ncu metric units -> bytes or milliseconds (ncu writes e.g. byte, Kbyte, Mbyte, nsecond, usecond or ns)."""
    u = unit.strip().lower()
    if "byte" in u or u in ("b", "kb", "mb", "gb"):
        return {"k": 1e3, "m": 1e6, "g": 1e9}.get(u[0], 1.0) if u[0] in "kmg" else 1.0
    return {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3,
            "second": 1e3}.get(u, 1.0)


def _parse_ncu(text: str) -> list[list[dict]]:
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    kernels: dict[str, dict] = {}
    order = []
    for r in rows:
        kid = r["ID"]
        if kid not in kernels:
            kernels[kid] = {"kernel": r["Kernel Name"][:160]}
            order.append(kid)
        value = float(r["Metric Value"].replace(",", "")) if r["Metric Value"] not in ("", "n/a") else 0.0
        kernels[kid][r["Metric Name"]] = value * _unit_scale(r.get("Metric Unit", ""))
    windows: list[list[dict]] = []
    for kid in order:
        k = kernels[kid]
        if MARKER in k["kernel"]:
            windows.append([])
            continue
        if windows:
            windows[-1].append(k)
    return windows


def ncu_prefix(log_file: str | None = None) -> list[str]:
    """Nsight Compute with this report's metrics per kernel, clocks left as they are, and only the kernels between
    ``cudaProfilerStart`` and ``cudaProfilerStop``; its CSV on stdout or in ``log_file``. The command follows."""
    ncu = os.environ.get("NCU", "ncu")
    return [ncu, "--csv", "--metrics", NCU_METRICS, "--clock-control", "none", "--profile-from-start", "off",
            *(["--log-file", log_file] if log_file else [])]


def ncu_command(script: pathlib.Path, child_args: list[str]) -> list[str]:
    """The Nsight Compute command (:func:`ncu_prefix`) that runs ``script`` with ``child_args``."""
    return [*ncu_prefix(), sys.executable, str(script), *child_args]


def ncu_windows(text: str) -> list[list[dict]]:
    """Nsight Compute's CSV split at the :data:`MARKER` spin kernels: each window's kernels, each with ``bytes``
    (DRAM read + written) and ``ms``."""
    windows = _parse_ncu(text)
    for kernels in windows:
        for k in kernels:
            k["bytes"] = k.get("dram__bytes_read.sum", 0.0) + k.get("dram__bytes_write.sum", 0.0)
            k["ms"] = k.get("gpu__time_duration.sum", 0.0)
    return windows


def run_ncu(cmd: list[str], timeout: float) -> tuple[list[list[dict]] | None, str | None]:
    """Run an :func:`ncu_command` (self-check skipped: the child measures, the parent's run checks) and split its
    kernels at the :data:`MARKER` spin kernels: ``(windows, None)``, each kernel with ``bytes`` (DRAM read +
    written) and ``ms``, or ``(None, why not)``."""
    env = dict(os.environ, H3_FUSED_NVFP4_SELFCHECK="skip")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:  # ncu missing or past its time: the rest of the report stays
        return None, f"ncu did not run: {type(exc).__name__}: {exc}"
    if proc.returncode != 0 or '"ID"' not in proc.stdout:
        return None, f"ncu failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}"
    return ncu_windows(proc.stdout), None


def dram_bytes(args) -> dict:
    """Run this report's ncu child under Nsight Compute and turn its CSV into bytes per kernel and category."""
    child = ["--ncu-child"]
    if args.all_static:
        child.append("--all-static")
    for layer in args.static_layers or ():
        child += ["--static-layers", layer]
    cmd = ncu_command(PACK_ROOT / "report.py", child)
    windows, error = run_ncu(cmd, args.ncu_timeout)
    if error is not None:
        return {"error": error, "command": shlex.join(cmd)}
    if len(windows) != 2:
        return {"error": f"expected 2 measured windows in the ncu output, found {len(windows)}"}
    out = {"command": shlex.join(cmd), "tool": "Nsight Compute",
           "scope": "the middle of three warmed blocks, each kernel replayed with flushed caches (ncu default)"}
    for arm, kernels in zip(("comfy", "fused"), windows):
        out[arm] = block_dram(kernels)
    return out


def block_dram(kernels: list[dict]) -> dict:
    """One measured block's kernels (an :func:`ncu_windows` window) in the report's layout: the scope's DRAM bytes,
    launches and ncu time (everything but GEMMs and attention), a GB10 projection, bytes per category and kernel."""
    for k, cat in zip(kernels, label_kernels([k["kernel"] for k in kernels])):
        k["category"] = cat
    rest = [k for k in kernels if k["category"] not in NOT_ELEMENTWISE]
    total = sum(k["bytes"] for k in rest)
    return {
        "non_gemm_non_attention_dram_bytes": total,
        "non_gemm_non_attention_dram_gb": round(total / 1e9, 3),
        "non_gemm_non_attention_launches": len(rest),
        "non_gemm_non_attention_ncu_ms": round(sum(k["ms"] for k in rest), 4),
        "gb10_projection_ms_at_232_gbs": round(total / (GB10_READ_BANDWIDTH_GBS * 1e9) * 1e3, 2),
        "gb10_projection_ms_at_273_gbs": round(total / (GB10_SPEC_BANDWIDTH_GBS * 1e9) * 1e3, 2),
        "by_category_gb": {c: round(sum(k["bytes"] for k in kernels if k["category"] == c) / 1e9, 4)
                           for c in sorted({k["category"] for k in kernels})},
        "kernels": [{"kernel": k["kernel"], "category": k["category"], "gb": round(k["bytes"] / 1e9, 4),
                     "read_gb": round(k.get("dram__bytes_read.sum", 0.0) / 1e9, 4),
                     "write_gb": round(k.get("dram__bytes_write.sum", 0.0) / 1e9, 4),
                     "ms": round(k["ms"], 4)} for k in kernels],
    }


# ---- what the JSON may say about this machine ----------------------------------------------------------------

def out_problem(out: str | None) -> str | None:
    """Why the JSON could not be written to ``out`` (None: it can; None stands for the default name in the current
    folder), found before the run."""
    path = pathlib.Path(out) if out else pathlib.Path.cwd() / "h3-fused-nvfp4-report.json"
    if path.is_dir():
        return f"--out {out}: a folder; give a file name, e.g. {path / 'my-gpu.json'}"
    folder = path.parent
    if not folder.is_dir():
        return f"--out {out}: the folder {folder} does not exist"
    if path.exists():
        try:
            with open(path, "ab"):  # opened as the write will open it, nothing changed
                pass
        except OSError as exc:
            return f"--out {out}: the file cannot be written ({exc.strerror or exc})"
    elif not os.access(folder, os.W_OK):
        return f"--out {out}: the folder {folder} is not writable"
    return None


def positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return value


def write_report(out: pathlib.Path, text: str) -> tuple[pathlib.Path | None, str | None]:
    """Write the JSON: a regular file (or a new one) is replaced whole (a complete temporary file renamed over it,
    never a partial one), anything else (a device, a pipe) is written to. Where that fails (a full disk), the JSON
    goes to a new file in the temporary folder, so the run's results are not lost. Returns (where it went, None if
    at ``out`` else why ``out`` failed); (None, why) where both failed."""
    data = text.encode()
    try:
        if out.exists() and not out.is_file():
            with open(out, "wb") as handle:
                handle.write(data)
        else:
            runtime.atomic_write(out, data)
        return out, None
    except OSError as exc:
        problem = f"{exc.strerror or exc}"
    try:
        fd, kept = tempfile.mkstemp(prefix="h3-fused-nvfp4-report-", suffix=".json")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return pathlib.Path(kept), problem
    except OSError as exc:
        return None, f"{problem}; the temporary folder failed too: {exc.strerror or exc}"


def local_paths(comfy_root: pathlib.Path | None) -> list[tuple[str, str]]:
    """(absolute local path, what the shared JSON says instead), longest first: the JSON is made to be shared, so
    it names folders by role, never by where they are on this machine."""
    places = [(comfy_root, "<ComfyUI>"), (PACK_ROOT, "<pack>"), (pathlib.Path(sys.executable).parent, "<python>"),
              (pathlib.Path(sys.prefix), "<python env>"), (pathlib.Path(sys.base_prefix), "<python>"),
              (pathlib.Path.cwd(), "."), (pathlib.Path.home(), "~")]
    pairs = {}
    for path, label in places:
        if path is None:
            continue
        for variant in {str(path), str(path.resolve())}:
            if len(variant) > 1:  # never "/"
                pairs.setdefault(variant, label)
    return sorted(pairs.items(), key=lambda kv: -len(kv[0]))


def without_local_paths(value, pairs: list[tuple[str, str]]):
    """``value`` (JSON data) with every local path of ``pairs`` replaced by its label."""
    if isinstance(value, str):
        for path, label in pairs:
            value = value.replace(path, label)
        return value
    if isinstance(value, dict):
        return {k: without_local_paths(v, pairs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_local_paths(v, pairs) for v in value]
    return value


def shared_argument(arg: str) -> str:
    """A command-line argument as the JSON records it: an absolute path by its file name only, also as the value
    of ``--option=/path``."""
    option, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    return option + equals + (pathlib.Path(value).name if os.path.isabs(value) else value)


CPU_NOTE = ("CPU run: a wiring check at a reduced width with the Python twin of the kernels against ComfyUI's real "
            "code; no CUDA kernel ran and no speed figure is measured (run it on an NVIDIA GPU for those)")


# ---- main --------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file (default: h3-fused-nvfp4-report-<gpu>.json in the current folder)")
    parser.add_argument("--reps", type=positive_count, default=6, help="timed repetitions per arm")
    parser.add_argument("--dram", action="store_true", help="DRAM bytes per kernel from Nsight Compute (ncu)")
    parser.add_argument("--all-static", action="store_true", help="every projection with a static input_scale")
    parser.add_argument("--static-layers", action="append", choices=LINEAR_PATHS, metavar="LAYER",
                        help=f"a projection with a static input_scale: one of {', '.join(LINEAR_PATHS)} (repeatable)")
    parser.add_argument("--skip-profile", action="store_true", help="the self-check only")
    parser.add_argument("--ncu-timeout", type=int, default=900)
    parser.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.ncu_child:
        problem = out_problem(args.out)
        if problem:
            parser.error(problem)  # before the run, not after it

    comfy = comfy_env.import_comfyui()
    # comfy-kitchen warns on every emulated FP4 GEMM (no FP4 tensor cores): the JSON names the emulation instead.
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)
    if args.ncu_child:
        return _ncu_child(args)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cpu = device.type != "cuda"
    print(f"H3 fused NVFP4 report: ComfyUI {comfy.version} at {comfy.location.root} ({comfy.location.how}); "
          f"device {device_info(device).get('name')}; torch {torch.__version__}")
    if cpu:
        print(f"  {CPU_NOTE}")
    os.environ.setdefault(verdicts.SELFCHECK_ENV, "force")
    verdict = verdicts.kernel_verdict(device, PROBE_SETS, backend_for(device))
    for name, r in verdict.ops.items():
        state = {True: "ok", False: "FAILED", None: "n/a"}[r.ok]
        print(f"  self-check {name:15s} {state:6s} {r.ms:7.1f} ms  {r.detail}")
    where = " on the CPU, Python twin of the kernels (no CUDA kernel ran)" if cpu else ""
    print(f"  {verdict.summary()}{where}")
    result = {"device": device_info(device),
              "versions": {"comfyui": comfy.version, "comfyui_folder": comfy.location.root.name,
                           "comfyui_found_as": comfy.location.how, "comfy_kitchen": package_version("comfy-kitchen"),
                           "torch": torch.__version__, "pack": _pack_version()},
              "gemm_mode": gemm_mode(device),
              "selfcheck": verdict.to_json() | {"summary": verdict.summary(), "origin": verdict.origin}}
    if cpu:
        result["run_kind"] = CPU_NOTE
        result["selfcheck"]["note"] = ("on the CPU the self-check compares the Python twin of the kernels with "
                                       "ComfyUI's ops: no CUDA kernel ran")
    h3_missing = comfy_env.h3_importable()
    if args.skip_profile or h3_missing:
        result["workload"] = {"skipped": h3_missing or "--skip-profile"}
    else:
        profile = profile_blocks(args, device)
        result.update(profile)
        if device.type == "cuda":
            result["device"]["copy_bandwidth_gbs_read_plus_write"] = round(copy_bandwidth_gbs(), 1)
            result["native_pack_validation"] = pack_validation(device)
            if args.dram:
                result["dram"] = dram_bytes(args)
    command = ["python report.py", *map(shared_argument, argv if argv is not None else sys.argv[1:])]
    result["source_artifacts"] = {"command": " ".join(command), "pack": PACK_ROOT.name}
    # Made to be shared: no local path of this machine (the pack, ComfyUI, Python, the home and current folders).
    result = without_local_paths(json.loads(json.dumps(result, default=str)), local_paths(comfy.location.root))
    name = (result["device"].get("name", "cpu")).replace(" ", "-").lower()
    out = pathlib.Path(args.out or f"h3-fused-nvfp4-report-{name}.json")
    text = json.dumps(result, indent=1, default=str)
    written, problem = write_report(out, text)
    v = result.get("validation", {})
    if v:
        scope = (" (CPU wiring check at a reduced width, Python twin: no CUDA kernel ran, no speed measured)"
                 if cpu else "")
        print(f"block output{scope}: {v['block_output_differing_elements']} differing elements "
              f"(max |diff| {v['block_output_max_abs_diff']}), {v['block_output_nonfinite_elements']} not finite")
    if "summary" in result:
        s = result["summary"]
        print(f"middle block median ms: {s['block_ms_median']}; non-GEMM non-attention ms "
              f"{s['non_gemm_non_attention_ms']} (x{s['non_gemm_non_attention_speedup']})")
    if "dram" in result and "error" not in result["dram"]:
        d = result["dram"]
        print(f"DRAM bytes, non-GEMM non-attention: comfy {d['comfy']['non_gemm_non_attention_dram_gb']} GB "
              f"({d['comfy']['non_gemm_non_attention_launches']} launches), fused "
              f"{d['fused']['non_gemm_non_attention_dram_gb']} GB ({d['fused']['non_gemm_non_attention_launches']} "
              f"launches); GB10 projection {d['comfy']['gb10_projection_ms_at_232_gbs']} -> "
              f"{d['fused']['gb10_projection_ms_at_232_gbs']} ms")
    elif "dram" in result:
        print(f"DRAM bytes: {result['dram']['error'][:500]}")
    if problem is None:
        print(f"JSON: {out}")
    elif written is not None:
        print(f"could not write {out} ({problem}); the JSON is in {written}")
    else:
        print(f"could not write {out} ({problem}); the JSON follows\n{text}")
    return 0 if problem is None and (not v or (v["block_output_differing_elements"] == 0
                                               and v["block_output_nonfinite_elements"] == 0)) else 1
