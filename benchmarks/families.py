"""Per-family measurement: each NVFP4 model family ComfyUI runs, stock vs the Patch node's fused clone, at the
official widths on one GPU.

Families: tools/families.py, by default all but MiniMax H3 (whose full depth benchmarks/full_model.py and report.py
measure; ``--families minimax_h3`` takes it too, at ``--layers`` blocks). One family at a time, freed before the next:

1. **Model.** A random-weight NVFP4 checkpoint at the official widths with ``--layers`` L blocks in each block list
   that sets the depth (the JSON says "L of N"; Z-Image's two refiners keep their 2 blocks), drawn and quantized by
   ComfyUI's own quantizer on the GPU, kept on the CPU like a loaded file, loaded by
   ``comfy.sd.load_diffusion_model_state_dict`` with NVFP4 compute forced on (below sm_100 the FP4 GEMM is
   *emulated*, dequantize + bf16 matmul, in both arms) and the compute dtype of ``--dtype``: ``auto`` is ComfyUI's
   own choice (fp16 for Wan, whose ``supported_inference_dtypes`` list fp16 first; bf16 for the others).
2. **Inputs.** ``family_inputs`` at the measurement resolutions (tools/families.py ``MEASUREMENT``) with
   ``--text-tokens`` text tokens, passed as ComfyUI's ``BaseModel._apply_model`` passes them: latents, text and
   float conditions in the model's compute dtype (``comfy.model_base.convert_tensor``), the timestep made from the
   sigma by the model's own ``model_sampling.timestep`` and ``process_timestep``.
3. **Arms.** Stock: the model as loaded: a warm-up forward first (ComfyUI's first emulated call on the H200 can give
   other bits than later ones), the reference forwards at sigma 0.7 and 0.3, ``--reps`` timed ones. Fused: the clone
   ``models/patch.apply_fused`` returns as the Patch node calls it (scope "block", self-check forced): its FIRST
   forward is compared too. Every output is compared as bit patterns; each arm has its median forward time (wall
   clock around a device-synced forward) and its peak memory above what was allocated before the call.
4. **Calls.** The NVFP4 Linears, how many the patch fused (PatchReport: the others with their reasons), and in one
   forward the calls on the fused path and on ComfyUI's (``FusedNVFP4Linear.calls_fused`` / ``calls_stock``) with
   each stock call's reason (``FusedNVFP4Linear.stock_reasons``, per call: the log names a reason once per process).
5. **DRAM bytes** (GPU, unless ``--no-ncu``): the same family built again in a child process under Nsight Compute
   (``ncu --clock-control none``, ``dram__bytes_read.sum``, ``dram__bytes_write.sum``, ``gpu__time_duration.sum``;
   tools/report.py ``ncu_command`` / ``run_ncu``), both arms warmed, then one forward per arm.

How kernels are attributed to the Linear INPUT path. Nsight Compute's CSV lists kernels in launch order with no
notion of which module launched them, so the child brackets every NVFP4 Linear call with marker kernels
(``torch.cuda._sleep``, the spin kernel report.py already splits its windows at; an NVTX range is pushed as well
for anyone reading the run in Nsight Systems), from forward pre- and post-hooks on the Linear modules: ComfyUI's
Linear in the stock arm, and the same module in the fused clone, whose ``forward`` the fused Linear replaces. The
stock forward is profiled whole: a marker opens it, and the windows alternate "between Linears" / "inside one
Linear". The fused forward is profiled only inside its Linears (``cudaProfilerStart`` / ``Stop`` in the hooks):
what lies between them is the same code as the stock arm's. The child writes each call's layer, rows, width, dtype
and path (fused or ComfyUI's) beside the profile, so the parent pairs windows with calls and checks their count.
Inside a Linear window, by kernel name (tools/report.py ``label_kernels``): the GEMM (``gemm`` / cuBLAS / nvjet /
cutlass) and, on an emulating GPU, the emulation (comfy-kitchen's ``dequantize_nvfp4`` kernels and the bf16 GEMM
after them) are left out. A copy kernel after the last pack (ComfyUI's Linear casts its weights after quantizing),
or before the first reduction / pack kernel while reading less than the activation (the fused Linear casts its
weights first), is a weight-cast copy, its own category; a copy there that reads the whole activation makes it
contiguous for the pack (input path). Kernels after the GEMM (output layout) are their own category. Everything
else is the input path (stock: abs, amax, scale divide, cast, zero-fill, comfy-kitchen's ``quantize_nvfp4``, alpha
multiply; fused: ``nvfp4_absmax_*`` / ``nvfp4_pack_*``). Its bytes are compared with the floor of each call:
dynamic scale = read the activation twice + write the codes (rows x width / 2) + the block scales (rows padded to
128 x width / 16 padded to 4, one byte each); static ``input_scale`` = read it once + the same writes. The fused
calls' bytes / floor must lie within 10% (flagged otherwise; ``dram__bytes_write`` counts what reaches DRAM during
the kernel, so output still in L2 when a kernel ends can put a small call below its floor). The stock forward's
other kernels are summed per category (attention, norms, elementwise mul / add / modulation, rope, copies /
layout, activation functions, bf16 GEMMs, other): where a block fusion would save bytes. GB10 projection: bytes /
232 GB/s (measured GB10 read bandwidth), for the measured L blocks and for the full-depth model (each block list's
bytes scaled by its Linear count at full depth over the measured one: N / L for the lists the depth sets).

A family with a block fusion (Z-Image, H3: the fused clone has block patches) calls its fused Linears from its
blocks, where no module hook sees them. Its child profiles the stock forward by its Linears as above, then both
arms once more by blocks: the whole forward, a marker before and after each block call (forward hooks on the block
modules, which both arms run). Every kernel of those forwards is grouped by name: the NVFP4 Linear input path
(absmax: the global-scale reductions, stock's abs and amax; packs; scales_alpha: the scale divide and GEMM alpha),
the fused blocks' residual / norm-statistics kernels, norms, rope, elementwise, activations, copies, fills, other;
the NVFP4 GEMM (and its emulation), the bf16 GEMMs and attention are left out. ``whole_forward`` in the JSON holds
the block fusion's measure: both arms' non-GEMM non-attention bytes and launches per forward (input path + rest;
the stock arm from its Linear windows, the fused arm from its block profile; a family without block fusion: its
fused input path plus the stock rest, the same ComfyUI code), fused over stock, inside and outside the blocks, the
fused blocks against their exact-fusion floor (:data:`BLOCK_FLOORS`: what a bit-identical fused block must read
and write, README), and the GB10 projection per forward and per image of :data:`STEPS_PER_IMAGE` steps (full
depth: each block list's bytes scaled as above). ``--layers 30`` measures Z-Image at full depth (give ncu the
time: ``--ncu-timeout 480``; ``--ncu-blocks-only`` leaves out the stock forward's profile by Linears, whose input
path / rest split the block profile then gives by kernel name). The README's table comes out of the JSON:
``readme_table`` in it, or ``--table RUN.json [RUN2.json]``.

    python benchmarks/families.py [--families z_image,flux2_klein] [--layers 2] [--dtype auto] [--no-ncu] --out F
    python benchmarks/families.py --tiny --out F      # CPU, tiny widths, no ncu: a wiring check, no speed figures
    python benchmarks/families.py --families wan22_14b --layers 40 --no-ncu --reps 1 --out F  # Wan's full depth:
        # bits at both sigmas (the first fused forward and its block check included), forward time, peak memory
    python benchmarks/families.py --families wan22_5b --out F   # Wan 2.2 5B at 1280x704, 121 frames

A family with a block fusion (H3, Wan: its patch describes the fused blocks, ``patch.block_fusion`` in the JSON)
calls its fused Linears itself, so the module hooks below see only the Linear calls ComfyUI's own code makes; the
block's fused kernels have categories of their own (tools/report.py ``CATEGORIES``: ``fused_layer_norm`` for the
LayerNorm statistics alone or inside a residual, ``fused_rms_norm_rope``).

Exit status 0 when every family ran, with 0 differing elements in every compared output.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import logging
import os
import pathlib
import shlex
import statistics
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The first fused forward must run the block check: no verdict from an earlier run (the selfcheck runs now).
os.environ.setdefault("H3_FUSED_NVFP4_SELFCHECK", "force")

import torch  # noqa: E402

import report  # noqa: E402  (the repository's report.py: imports this folder as the package h3_fused_nvfp4)

report.import_pack()

from h3_fused_nvfp4.core.linear import gemm_mode  # noqa: E402
from h3_fused_nvfp4.core.verdicts import package_version
from h3_fused_nvfp4.tools import comfy_env
from h3_fused_nvfp4.tools import families as fam
from h3_fused_nvfp4.tools import report as rep
from h3_fused_nvfp4.version import __version__

SIGMAS = (0.7, 0.3)
DEFAULT_FAMILIES = tuple(n for n in fam.FAMILIES if n not in ("minimax_h3", "wan22_5b"))
FULL_TEXT_TOKENS = 256  # a typical prompt's length at the measurement resolutions
FLOOR_TOLERANCE = 0.10
SEED = 440420

# Linear-window roles (see the module docstring) and the stock arm's categories of the rest of the forward.
GEMM_CATEGORIES = ("gemm", "emulation_gemm")
REDUCTION_OR_PACK = ("abs", "amax_reduce", "fused_absmax", "comfy_pack", "fused_pack")
PACKS = ("comfy_pack", "fused_pack")
ACTIVATION_NAMES = ("gelu", "silu", "tanh", "sigmoid")
REST_GROUPS = {
    "attention": "attention", "rms_norm": "norms", "rms_rope": "rope", "fused_rms_rope": "rope",
    "fused_rms_norm_rope": "rope", "fused_layer_norm": "fused_residual_norm",
    "mul": "elementwise_mul_add_modulation", "add": "elementwise_mul_add_modulation",
    "addcmul": "elementwise_mul_add_modulation", "swiglu_mul": "elementwise_mul_add_modulation",
    "scale_finalize": "elementwise_mul_add_modulation", "gemm_alpha": "elementwise_mul_add_modulation",
    "silu": "activation_functions", "copy": "copies_layout", "gemm": "bf16_gemm",
}
NOT_BYTES_OF_INTEREST = ("bf16_gemm", "attention")  # compute-bound: what a block fusion does not touch
# A whole forward profiled by blocks (a block-fusion family): every kernel by name, the rest groups above plus the
# NVFP4 Linears' input path (stock: abs, amax, scale divide, cast, zero-fill, pack, GEMM alpha; fused: the global
# scale reductions and the packs) and the fused blocks' residual / norm-statistics kernels; the NVFP4 GEMM (and its
# emulation) is left out with the bf16 GEMMs and attention.
WHOLE_GROUPS = {**REST_GROUPS, "fused_absmax": "absmax", "abs": "absmax", "amax_reduce": "absmax",
                "fused_pack": "packs", "comfy_pack": "packs", "scale_finalize": "scales_alpha",
                "gemm_alpha": "scales_alpha", "fill": "fills", "fused_row_norm": "residual_norm_kernels",
                "fused_gated_residual": "residual_norm_kernels", "emulation_dequant": "nvfp4_gemm",
                "emulation_gemm": "nvfp4_gemm"}
INPUT_PATH_GROUPS = ("absmax", "packs", "scales_alpha")
NOT_WHOLE_BYTES_OF_INTEREST = NOT_BYTES_OF_INTEREST + ("nvfp4_gemm",)
STEPS_PER_IMAGE = 8  # Z-Image Turbo's sampling steps (one forward each: no cfg)


def log(msg: str) -> None:
    print(f"[families {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- one family's model and inputs ---------------------------------------------------------------------------

def depth_description(name: str, layers: int) -> str:
    """"L of N <key>" for each config key that sets the family's depth."""
    family = fam.FAMILIES[name]
    if name == "minimax_h3":
        return f"{layers} of 50 DiT blocks (token refiner: {min(layers, 2)} of 2)"
    full = family.full
    return ", ".join(f"{layers} of {full[key]} {key}" for key in family.depth_keys)


def build_model(name: str, width: str, layers: int, device: torch.device, seed: int):
    """The family's random NVFP4 checkpoint loaded by ComfyUI's loader: (ModelPatcher, load record)."""
    import comfy.sd

    t0 = time.perf_counter()
    sd, metadata = fam.family_state_dict(name, width=width, layers=layers, seed=seed, device=str(device))
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    made = time.perf_counter() - t0
    t1 = time.perf_counter()
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
    del sd
    if patcher is None:
        raise RuntimeError(f"ComfyUI did not detect the {name} checkpoint")
    model_class = type(patcher.model.diffusion_model).__name__
    if model_class != fam.FAMILIES[name].model_class:
        raise RuntimeError(f"ComfyUI built a {model_class} for {name}, expected {fam.FAMILIES[name].model_class}")
    config = patcher.model.model_config
    return patcher, {"checkpoint_gib": round(nbytes / 2**30, 3), "make_seconds": round(made, 1),
                     "load_seconds": round(time.perf_counter() - t1, 1), "model_class": model_class,
                     "comfyui_model_config": type(config).__name__,
                     "supported_inference_dtypes": [str(d).replace("torch.", "")
                                                    for d in config.supported_inference_dtypes]}


def comfy_inputs(name: str, patcher, width: str, tokens: int, sigma: float, device: torch.device, seed: int):
    """``(args, kwargs)`` of the diffusion model's forward at ``sigma``, as ComfyUI's ``BaseModel._apply_model``
    passes them: latents, text and float conditions in the compute dtype, the family's own timestep."""
    from comfy.model_base import convert_tensor

    base = patcher.model
    dtype = base.get_dtype_inference()
    inputs = fam.family_inputs(name, base.diffusion_model, width=width, tokens=tokens, seed=seed).to(device)

    def cast(value):
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return convert_tensor(value, dtype, device) if isinstance(value, torch.Tensor) else value

    latents = cast(inputs.args[0])
    timestep = base.model_sampling.timestep(torch.full((1,), sigma, device=device)).float()
    timestep = base.process_timestep(timestep, x=latents)
    args = (latents, timestep, cast(inputs.args[2]), *inputs.args[3:])
    kwargs = {k: (v if k == "minimax_payload" else cast(v)) for k, v in inputs.kwargs.items()}
    return args, kwargs


def fresh(value):
    """A copy of the forward's tensors (a model may write into its inputs)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(fresh(v) for v in value)
    return value


class Arm:
    """One ModelPatcher (stock or the fused clone), loaded the way sampling loads it, and its forwards."""

    def __init__(self, name: str, patcher, device: torch.device):
        self.name, self.patcher, self.device = name, patcher, device
        self.forwards: list[dict] = []

    def forward(self, inputs, label: str, sigma: float, before_call=None, after_call=None) -> list[torch.Tensor]:
        """One forward on a fresh copy of ``inputs``; ``before_call()`` runs once the model is loaded, right before
        the diffusion model is called, ``after_call()`` right after it returns (where a profile opens and closes:
        loading and copying the outputs stay out of it)."""
        import comfy.model_management as mm

        mm.load_models_gpu([self.patcher])  # applies this clone's object patches, as sampling does
        dm = self.patcher.model.diffusion_model
        options = dict(self.patcher.model_options.get("transformer_options", {}))
        args, kwargs = fresh(inputs)
        sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        if before_call is not None:
            before_call()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = dm(*args, **kwargs, transformer_options=options)
        if after_call is not None:
            after_call()
        sync(self.device)
        record = {"label": label, "sigma": sigma, "seconds": round(time.perf_counter() - t0, 4)}
        if cuda:
            record["peak_extra_gib"] = round((torch.cuda.max_memory_allocated(self.device) - base) / 2**30, 3)
        self.forwards.append(record)
        outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        return [o.detach().clone() for o in outputs]

    def summary(self) -> dict:
        timed = [f for f in self.forwards if f["label"] == "timed"]
        out = {"forwards": self.forwards,
               "forward_seconds_median": round(statistics.median(f["seconds"] for f in timed), 4) if timed else None}
        if timed and "peak_extra_gib" in timed[0]:
            out["peak_extra_gib_timed_max"] = max(f["peak_extra_gib"] for f in timed)
        return out


def fused_linears(patcher) -> dict:
    """Layer name (below ``diffusion_model.``) -> the fused Linear object patched into this clone."""
    from h3_fused_nvfp4.core.linear import FusedNVFP4Linear

    prefix, suffix = "diffusion_model.", ".forward"
    return {key[len(prefix):-len(suffix)]: patch for key, patch in patcher.object_patches.items()
            if isinstance(patch, FusedNVFP4Linear)}


def fused_blocks(patcher) -> dict:
    """Block name (below ``diffusion_model.``) -> the fused block (a family's block fusion) patched into this clone."""
    from h3_fused_nvfp4.blocks.fused_block import FusedBlock

    prefix, suffix = "diffusion_model.", ".forward"
    return {key[len(prefix):-len(suffix)]: patch for key, patch in patcher.object_patches.items()
            if isinstance(patch, FusedBlock)}


def block_fusion_counts(blocks: dict) -> dict:
    """What the fused blocks did so far, summed over the blocks (blocks/fused_block.py ``counts``: fused forwards,
    folded norms, residual kernels, hand-overs), and the calls on which Linears reading one tensor shared its pack."""
    counts = sum((b.counts for b in blocks.values()), collections.Counter())
    shared = [g for g in (getattr(b, "w1_w3", None) for b in blocks.values()) if g is not None]
    return {"blocks": len(blocks), **dict(sorted(counts.items())),
            **({"shared_packs": sum(g.shared_packs for g in shared)} if shared else {})}


def stock_reasons(linears: dict) -> collections.Counter:
    """Calls the fused Linears left on ComfyUI's path so far, by reason (the pack's log names a reason once per
    process; each fused Linear counts every call)."""
    return sum((v.stock_reasons for v in linears.values()), collections.Counter())


def call_counts(linears: dict) -> tuple[int, int]:
    return sum(v.calls_fused for v in linears.values()), sum(v.calls_stock for v in linears.values())


# ---- Linear call windows: hooks on every NVFP4 Linear module -------------------------------------------------

class CudaMarks:
    """What the ncu child's windows are made of on the GPU: spin-kernel markers, profiler start / stop, and NVTX
    ranges (these only label the run for Nsight Systems: left out where this torch build has none)."""

    def __init__(self):
        try:
            torch.cuda.nvtx.range_push("nvtx check")
            torch.cuda.nvtx.range_pop()
            self.nvtx = True
        except (RuntimeError, AttributeError):
            self.nvtx = False

    def marker(self, cycles: int = 1) -> None:
        torch.cuda._sleep(cycles)

    def profiler_start(self) -> None:
        torch.cuda.cudart().cudaProfilerStart()

    def profiler_stop(self) -> None:
        torch.cuda.cudart().cudaProfilerStop()

    def range_push(self, name: str) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)

    def range_pop(self) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_pop()


class LinearCalls:
    """Forward pre- and post-hooks on every NVFP4 Linear of a diffusion model: each call's layer, rows, width,
    activation dtype and path (``fused`` when its fused Linear counted a fused call, else ``stock``), and with
    ``marks`` (:class:`CudaMarks`) the ncu windows of ``marking`` (see the module docstring):

    * ``None``: record only;
    * ``"forward"``: a marker before and after each call (the whole forward is being profiled);
    * ``"linears"``: profiling started before each call and stopped after it, a marker opening each window."""

    def __init__(self, diffusion_model, marks=None):
        from h3_fused_nvfp4.core.patching import nvfp4_linears

        self.modules = nvfp4_linears(diffusion_model)
        self.marks = marks
        self.fused: dict = {}
        self.marking: str | None = None
        self.calls: list[dict] = []
        self._before: tuple[int, int] | None = None
        self._handles = []
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def start(self, fused: dict, marking: str | None) -> None:
        if marking is not None and self.marks is None:
            raise ValueError("marking ncu windows needs marks")
        self.fused, self.marking, self.calls = fused, marking, []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, name):
        def hook(module, args):
            x = args[0]
            linear = self.fused.get(name)
            self._before = (linear.calls_fused, linear.calls_stock) if linear is not None else None
            self.calls.append({"layer": name, "rows": x.numel() // x.shape[-1], "width": int(x.shape[-1]),
                               "element_bytes": x.element_size(), "dtype": str(x.dtype).replace("torch.", ""),
                               "static_scale": getattr(module, "input_scale", None) is not None})
            if self.marking is not None:
                self.marks.range_push(f"nvfp4_linear {name}")
                if self.marking == "linears":
                    self.marks.profiler_start()
                self.marks.marker()
        return hook

    def _post(self, name):
        def hook(module, args, output):
            linear = self.fused.get(name)
            fused = linear is not None and self._before is not None and linear.calls_fused > self._before[0]
            self.calls[-1]["path"] = "fused" if fused else "stock"
            if self.marking == "forward":
                self.marks.marker()
            elif self.marking == "linears":
                self.marks.profiler_stop()
            if self.marking is not None:
                self.marks.range_pop()
        return hook


class BlockCalls:
    """Forward pre- and post-hooks on the modules of a fused clone's blocks (``blocks``: name -> module; the same
    modules run the stock arm): each call's block, rows, tokens, width and, where the family has one
    (:data:`BLOCK_FLOORS`), the exact-fusion floor of the call; with ``marks`` and ``marking == "blocks"`` a marker
    before and after each call (the whole forward is being profiled)."""

    def __init__(self, blocks: dict, family: str, marks=None):
        self.marks = marks
        self.floor = BLOCK_FLOORS.get(family)
        self.marking: str | None = None
        self.calls: list[dict] = []
        self._handles = []
        for name, module in blocks.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name, module)))
            self._handles.append(module.register_forward_hook(self._post()))

    def start(self, marking: str | None) -> None:
        if marking is not None and self.marks is None:
            raise ValueError("marking ncu windows needs marks")
        self.marking, self.calls = marking, []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, name, module):
        def hook(_, args):
            x = args[0]
            call = {"block": name, "rows": x.numel() // x.shape[-1], "tokens": int(x.shape[-2]),
                    "width": int(x.shape[-1])}
            if self.floor is not None:
                call["floor_bytes"] = self.floor(module, x)
            self.calls.append(call)
            if self.marking == "blocks":
                self.marks.range_push(f"block {name}")
                self.marks.marker()
        return hook

    def _post(self):
        def hook(module, args, output):
            if self.marking == "blocks":
                self.marks.marker()
                self.marks.range_pop()
        return hook


def packed_bytes(rows: int, width: int) -> int:
    """NVFP4 codes and swizzled block scales of an ``[rows, width]`` activation (rows padded to 128 and width / 16
    to 4 in the scales)."""
    return rows * width // 2 + -(-rows // 128) * 128 * (-(-(width // 16) // 4) * 4)


def zimage_block_floor(block, x: torch.Tensor) -> int:
    """What a bit-identical fused ``JointTransformerBlock`` must read and write outside its GEMMs and attention, for
    input ``x`` ``[B, S, D]`` (README, *Z-Image Turbo's exact-fusion floor*): with A the bytes of a bf16 [rows, D]
    tensor, F of a [rows, FFN] one, P(T) their codes and scales, R the RoPE table (fp32 [1, S, 1, head_dim / 2, 2, 2])
    - qkv's input A + P(A) (its statistics and amax come from the previous block), q / k RMSNorm + RoPE 4A + R, out's
    input 2A + P(A) (A with a static scale), two residuals with the next norm's statistics 3A each, w1 / w3's input A
    + P(A) (one pack per distinct scale), w2's input 4F + P(F) (2F static)."""
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    ffn = block.feed_forward.w1.out_features
    a, f = rows * dim * 2, rows * ffn * 2
    rope = x.shape[-2] * block.attention.head_dim // 2 * 4 * 4

    def static(linear) -> bool:
        return getattr(linear, "input_scale", None) is not None

    w13_scales = {None if not static(m) else float(m.input_scale) for m in (block.feed_forward.w1,
                                                                           block.feed_forward.w3)}
    return (a + packed_bytes(rows, dim)  # qkv
            + 4 * a + rope  # q / k RMSNorm + RoPE
            + (1 if static(block.attention.out) else 2) * a + packed_bytes(rows, dim)  # out
            + 2 * 3 * a  # the residuals
            + a + len(w13_scales) * packed_bytes(rows, dim)  # w1 / w3
            + (2 if static(block.feed_forward.w2) else 4) * f + packed_bytes(rows, ffn))  # w2


BLOCK_FLOORS = {"z_image": zimage_block_floor}  # family -> its fused block's exact-fusion floor per call


def floor_bytes(call: dict) -> int:
    """The least DRAM traffic of one call's activation pack: read the activation (twice with a dynamic scale: the
    amax, then the pack), write the codes and the block scales (swizzled: rows padded to 128, width / 16 padded
    to 4, one byte each)."""
    rows, width = call["rows"], call["width"]
    activation = rows * width * call["element_bytes"]
    scales = -(-rows // 128) * 128 * (-(-(width // 16) // 4) * 4)
    return activation * (1 if call["static_scale"] else 2) + rows * width // 2 + scales


# ---- the measured run of one family --------------------------------------------------------------------------

def measure_family(name: str, args, device: torch.device) -> dict:
    """Steps 1-4 of the module docstring for one family: its JSON section."""
    from h3_fused_nvfp4.models import patch

    width = "tiny" if args.tiny else "full"
    tokens = args.text_tokens or (7 if args.tiny else FULL_TEXT_TOKENS)
    section: dict = {"title": fam.FAMILIES[name].title, "depth": depth_description(name, args.layers),
                     "resolution_w_h_frames": list((fam.TINY if args.tiny else fam.MEASUREMENT)[name]),
                     "text_tokens": tokens}
    log(f"{name}: building {width} width, {section['depth']}")
    stock_patcher, section["load"] = build_model(name, width, args.layers, device, args.seed)
    base = stock_patcher.model
    section["dtype"] = str(base.get_dtype_inference()).replace("torch.", "")
    section["dtype_choice"] = "ComfyUI's choice" if args.dtype == "auto" else f"forced {args.dtype}"
    section["gemm"] = gemm_mode(device)
    inputs = {s: comfy_inputs(name, stock_patcher, width, tokens, s, device, args.seed + 1) for s in SIGMAS}
    latents = inputs[SIGMAS[0]][0][0]
    section["latent_shapes"] = [list(t.shape) for t in (latents if isinstance(latents, (list, tuple)) else [latents])]
    log(f"{name}: {section['load']['comfyui_model_config']} in {section['dtype']} ({section['dtype_choice']}), "
        f"latents {section['latent_shapes']}, {tokens} text tokens")

    stock = Arm("stock", stock_patcher, device)
    stock.forward(inputs[SIGMAS[0]], "warm-up", SIGMAS[0])
    reference = {s: stock.forward(inputs[s], "reference", s) for s in SIGMAS}
    for _ in range(args.reps):
        stock.forward(inputs[SIGMAS[0]], "timed", SIGMAS[0])

    fused_patcher, patch_report = patch.apply_fused(stock_patcher, "block", allow_reference_backend=args.tiny)
    linears = fused_linears(fused_patcher)
    blocks = fused_blocks(fused_patcher)
    recorder = LinearCalls(base.diffusion_model)
    recorder.start(linears, marking=None)
    fused = Arm("fused", fused_patcher, device)
    compared, per_forward = {}, []
    try:
        for i, s in enumerate(SIGMAS):
            before, reasons_before = call_counts(linears), stock_reasons(linears)
            blocks_before = collections.Counter(block_fusion_counts(blocks))
            got = fused.forward(inputs[s], "first" if i == 0 else "compared", s)
            after = call_counts(linears)
            per_forward.append({"fused": after[0] - before[0], "stock": after[1] - before[1],
                                "stock_reasons": dict(stock_reasons(linears) - reasons_before),
                                "hooked_calls": len(recorder.calls),
                                "block_fusion": dict(collections.Counter(block_fusion_counts(blocks))
                                                     - blocks_before)})
            recorder.calls = []
            compared[f"sigma_{s}"] = [rep.differing(a, b) for a, b in zip(got, reference[s])]
            if len(got) != len(reference[s]):
                raise RuntimeError(f"fused forward returned {len(got)} outputs, stock {len(reference[s])}")
            log(f"{name}: sigma {s}: {compared[f'sigma_{s}']} differing elements; NVFP4 Linear calls fused "
                f"{per_forward[-1]['fused']}, ComfyUI's path {per_forward[-1]['stock']}")
    finally:
        recorder.remove()
    for _ in range(args.reps):
        fused.forward(inputs[SIGMAS[0]], "timed", SIGMAS[0])

    # A block fusion's first forward runs the block check (ComfyUI's blocks answer it, unpatched): its Linear calls
    # are counted from the next forward on; every other family's first forward is measured
    steady = per_forward[1:] if blocks else per_forward
    measured = steady[0]
    calls = measured["fused"] + measured["stock"]
    section["patch"] = {"summary": patch_report.summary(), "applied": patch_report.applied,
                        "reason": patch_report.reason, "nvfp4_linears": len(linears) or len(recorder.modules),
                        "fused_linears": len(patch_report.layers), "left_on_comfyui_path": patch_report.left,
                        "block_fusion": patch_report.blocks}
    index = per_forward.index(measured)
    section["calls"] = {
        "measured_forward": (f"the {'first' if index == 0 else 'second'} fused forward (sigma {SIGMAS[index]})"
                             + ("; the first one runs the block check" if blocks else "")),
        "nvfp4_linear_calls": calls, "fused": measured["fused"], "stock": measured["stock"],
        "fused_share": round(measured["fused"] / calls, 4) if calls else None,
        "stock_reasons": measured["stock_reasons"],
        "hooked_module_calls": measured["hooked_calls"],
        "every_call_seen_by_the_module_hooks": measured["hooked_calls"] == calls,
        "same_in_every_compared_forward": all((f["fused"], f["stock"]) == (measured["fused"], measured["stock"])
                                              for f in steady),
    }
    if measured["hooked_calls"] != calls:
        section["calls"]["note"] = ("the module hooks saw another number of NVFP4 Linear calls than the fused Linears "
                                    "counted: a block fusion calls its fused Linears itself (and its block check "
                                    "ComfyUI's), so under ncu this family's fused forward is profiled by blocks")
    if blocks:
        section["block_fusion"] = {
            "blocks": len(blocks),
            "first_forward": per_forward[0]["block_fusion"],
            "last_compared_forward": per_forward[-1]["block_fusion"],
            "how": "counts of the fused blocks (blocks/fused_block.py): fused forwards, norms folded into the next "
                   "pack, residual kernels, norm statistics handed to / taken from the next block, shared packs; "
                   "the first forward runs the block check (ComfyUI's block answers that call)"}
    total = sum(sum(v) for v in compared.values())
    section["parity"] = {"differing_elements": compared, "total_differing_elements": total,
                         "first_fused_forward_included": True, "outputs": len(reference[SIGMAS[0]])}
    section["stock"], section["fused"] = stock.summary(), fused.summary()
    if args.reps and device.type == "cuda":
        section["speedup_forward"] = round(section["stock"]["forward_seconds_median"]
                                           / section["fused"]["forward_seconds_median"], 4)
    return section


def free_models() -> None:
    """Give the last family's memory back before the next one is built (the caller holds no reference)."""
    import comfy.model_management as mm

    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- under Nsight Compute ------------------------------------------------------------------------------------

def ncu_child(args, device: torch.device, marks=None) -> int:
    """One family under ncu: both arms warmed, then the stock forward profiled whole and the fused forward inside
    its Linears; each arm's calls written to ``args.ncu_child`` for the parent. ``marks``: :class:`CudaMarks`
    (a test passes a recorder of the marks instead, on the CPU at tiny widths)."""
    from h3_fused_nvfp4.models import patch

    marks = marks or CudaMarks()
    (name,) = args.families
    width = "tiny" if args.tiny else "full"
    tokens = args.text_tokens or (7 if args.tiny else FULL_TEXT_TOKENS)
    stock_patcher, _ = build_model(name, width, args.layers, device, args.seed)
    inputs = comfy_inputs(name, stock_patcher, width, tokens, SIGMAS[0], device, args.seed + 1)
    stock = Arm("stock", stock_patcher, device)
    for _ in range(2):
        stock.forward(inputs, "warm-up", SIGMAS[0])
    fused_patcher, _ = patch.apply_fused(stock_patcher, "block", allow_reference_backend=args.tiny)
    fused = Arm("fused", fused_patcher, device)
    fused.forward(inputs, "warm-up", SIGMAS[0])
    dm = stock_patcher.model.diffusion_model
    recorder = LinearCalls(dm, marks)
    blocks = {n: dm.get_submodule(n) for n in fused_blocks(fused_patcher)}
    block_recorder = BlockCalls(blocks, name, marks)

    def open_forward_window():
        marks.profiler_start()
        marks.marker(1000)

    # (arm, fused Linears, scope): the stock forward by its Linears; a block-fusion family's two arms by blocks as
    # well (the fused blocks call their Linears themselves), another family's fused Linears one by one
    profiles = [] if blocks and args.ncu_blocks_only else [(stock, {}, "forward")]
    if blocks:
        profiles += [(stock, {}, "blocks"), (fused, fused_linears(fused_patcher), "blocks")]
    else:
        profiles += [(fused, fused_linears(fused_patcher), "linears")]
    arms = []
    for arm, linears, scope in profiles:
        recorder.start(linears, scope if scope != "blocks" else None)
        block_recorder.start(scope if scope == "blocks" else None)
        arm.forward(inputs, "profiled", SIGMAS[0], before_call=open_forward_window if scope != "linears" else None,
                    after_call=marks.profiler_stop)
        arms.append({"arm": arm.name, "scope": scope,
                     "calls": block_recorder.calls if scope == "blocks" else recorder.calls})
    recorder.remove()
    block_recorder.remove()
    pathlib.Path(args.ncu_child).write_text(json.dumps({"family": name, "arms": arms}))
    return 0


def arm_windows(arm: dict) -> int:
    """Marker windows one profiled arm opens: a whole forward 1 + 2 per call (Linear or block), the fused Linears
    profiled alone 1 per call."""
    return len(arm["calls"]) if arm["scope"] == "linears" else 1 + 2 * len(arm["calls"])


def expected_windows(arms: list[dict]) -> int:
    return sum(arm_windows(a) for a in arms)


def linear_window_roles(kernels: list[dict], activation_bytes: int) -> list[str]:
    """Each kernel's role inside one Linear call's window (see the module docstring). A copy ahead of the first
    reduction / pack kernel that reads at least the activation's bytes makes the activation contiguous for the
    pack: input path; a smaller one casts weights."""
    cats = rep.label_kernels([k["kernel"] for k in kernels])
    gemm_at = next((i for i, c in enumerate(cats) if c in GEMM_CATEGORIES or c == "emulation_dequant"), len(cats))
    first_input = next((i for i, c in enumerate(cats[:gemm_at]) if c in REDUCTION_OR_PACK), gemm_at)
    packs = [i for i, c in enumerate(cats[:gemm_at]) if c in PACKS]
    roles = []
    for i, (k, c) in enumerate(zip(kernels, cats)):
        if c in GEMM_CATEGORIES:
            roles.append("gemm")
        elif c == "emulation_dequant":
            roles.append("emulation_dequant")
        elif i > gemm_at:
            roles.append("after_gemm")
        elif c == "copy" and packs and i > packs[-1]:
            roles.append("weight_cast")
        elif c == "copy" and i < first_input:
            reads_activation = k.get("dram__bytes_read.sum", 0.0) >= 0.9 * activation_bytes
            roles.append("input_path" if reads_activation else "weight_cast")
        else:
            roles.append("input_path")
    return roles


def rest_group(kernel_name: str, category: str) -> str:
    """The stock forward's kernels outside the NVFP4 Linears, by what a block fusion would fold."""
    if any(a in kernel_name.lower() for a in ACTIVATION_NAMES):
        return "activation_functions"
    return REST_GROUPS.get(category, "other")


def _totals(kernels: list[dict]) -> dict:
    total = sum(k["bytes"] for k in kernels)
    return {"launches": len(kernels), "dram_gb": round(total / 1e9, 4),
            "ncu_ms": round(sum(k["ms"] for k in kernels), 4)}


def _gb10_ms(nbytes: float) -> float:
    return round(nbytes / (rep.GB10_READ_BANDWIDTH_GBS * 1e9) * 1e3, 3)


def attribute_arm(arm: dict, windows: list[list[dict]], depth_scale: dict[str, float]) -> dict:
    """One arm's kernels by role: the Linear input path per call against its floor, per layer kind, and (stock, the
    whole forward) the rest by category."""
    calls = arm["calls"]
    linear_windows = windows[1::2] if arm["scope"] == "forward" else windows
    roles: dict[str, list[dict]] = collections.defaultdict(list)
    per_kind: dict[str, dict] = {}
    by_path = {p: {"input_bytes": 0.0, "floor_bytes": 0, "calls": 0, "launches": 0} for p in ("fused", "stock")}
    full_depth = {"input_bytes": 0.0, "floor_bytes": 0.0}
    input_categories: dict[str, list[dict]] = collections.defaultdict(list)
    for call, kernels in zip(calls, linear_windows):
        cats = rep.label_kernels([k["kernel"] for k in kernels])
        input_bytes, launches = 0.0, 0
        activation_bytes = call["rows"] * call["width"] * call["element_bytes"]
        for k, role, cat in zip(kernels, linear_window_roles(kernels, activation_bytes), cats):
            roles[role].append(k)
            if role == "input_path":
                input_bytes += k["bytes"]
                launches += 1
                input_categories[cat].append(k)
        floor = floor_bytes(call)
        slot = by_path[call["path"]]
        slot["input_bytes"] += input_bytes
        slot["floor_bytes"] += floor
        slot["calls"] += 1
        slot["launches"] += launches
        scale = depth_scale.get(fam.block_collection(call["layer"]), 1.0)
        full_depth["input_bytes"] += input_bytes * scale
        full_depth["floor_bytes"] += floor * scale
        kind = ".".join("*" if part.isdigit() else part for part in call["layer"].split("."))
        entry = per_kind.setdefault(kind, {"calls": 0, "rows": call["rows"], "width": call["width"],
                                           "path": call["path"], "input_gb": 0.0, "floor_gb": 0.0, "launches": 0})
        entry["calls"] += 1
        entry["input_gb"] += input_bytes / 1e9
        entry["floor_gb"] += floor / 1e9
        entry["launches"] += launches
    input_total = sum(s["input_bytes"] for s in by_path.values())
    floor_total = sum(s["floor_bytes"] for s in by_path.values())
    out = {
        "linear_calls": len(calls),
        "linear_input_path": {
            **_totals(roles["input_path"]),
            "floor_gb": round(floor_total / 1e9, 4),
            "bytes_over_floor": round(input_total / floor_total, 4) if floor_total else None,
            "gb10_ms_at_232_gbs": _gb10_ms(input_total),
            "by_category": {c: _totals(ks) for c, ks in sorted(input_categories.items())},
            "by_path": {p: {"calls": s["calls"], "launches": s["launches"], "dram_gb": round(s["input_bytes"] / 1e9, 4),
                            "floor_gb": round(s["floor_bytes"] / 1e9, 4),
                            "bytes_over_floor": round(s["input_bytes"] / s["floor_bytes"], 4) if s["floor_bytes"]
                            else None} for p, s in by_path.items() if s["calls"]},
            "full_depth_gb": round(full_depth["input_bytes"] / 1e9, 4),
            "full_depth_gb10_ms_at_232_gbs": _gb10_ms(full_depth["input_bytes"]),
        },
        "weight_cast": _totals(roles["weight_cast"]),
        "gemm": _totals(roles["gemm"]),
        "emulation_dequant": _totals(roles["emulation_dequant"]),
        "after_gemm": _totals(roles["after_gemm"]),
        "per_layer_kind": {k: {**v, "input_gb": round(v["input_gb"], 4), "floor_gb": round(v["floor_gb"], 4)}
                           for k, v in per_kind.items()},
    }
    if arm["scope"] == "forward":
        rest = [k for window in windows[0::2] for k in window]
        cats = rep.label_kernels([k["kernel"] for k in rest])
        groups: dict[str, list[dict]] = collections.defaultdict(list)
        for k, cat in zip(rest, cats):
            groups[rest_group(k["kernel"], cat)].append(k)
        non_gemm = [k for g, ks in groups.items() if g not in NOT_BYTES_OF_INTEREST for k in ks]
        out["rest_of_forward"] = {
            "by_category": {g: _totals(ks) for g, ks in sorted(groups.items(), key=lambda kv: -sum(
                k["bytes"] for k in kv[1]))},
            "non_gemm_non_attention": _totals(non_gemm),
            "non_gemm_non_attention_gb10_ms_at_232_gbs": _gb10_ms(sum(k["bytes"] for k in non_gemm)),
            "largest_other_kernels": [{"kernel": k["kernel"], "gb": round(k["bytes"] / 1e9, 4)} for k in sorted(
                groups.get("other", []), key=lambda k: -k["bytes"])[:8]],
        }
    return out


def whole_group(kernel_name: str, category: str) -> str:
    """A kernel of a forward profiled by blocks, by what it does (:data:`WHOLE_GROUPS`)."""
    if category not in WHOLE_GROUPS and any(a in kernel_name.lower() for a in ACTIVATION_NAMES):
        return "activation_functions"
    return WHOLE_GROUPS.get(category, "other")


def _by_group(kernels: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for k, cat in zip(kernels, rep.label_kernels([k["kernel"] for k in kernels])):
        groups[whole_group(k["kernel"], cat)].append(k)
    return groups


def _of_interest(groups: dict[str, list[dict]]) -> list[dict]:
    return [k for g, ks in groups.items() if g not in NOT_WHOLE_BYTES_OF_INTEREST for k in ks]


def attribute_blocks(arm: dict, windows: list[list[dict]], depth_scale: dict[str, float]) -> dict:
    """A whole forward profiled by blocks (windows: before the first block, then each block call and what follows
    it): its non-GEMM non-attention kernels by group, the NVFP4 Linears' input path and the rest, inside the blocks
    and outside them, per block list, against the blocks' exact-fusion floor where the family has one, and scaled to
    full depth (each block list's bytes x its full-depth count / the measured one; outside the blocks as measured)."""
    calls = arm["calls"]
    inside, outside = windows[1::2], windows[0::2]
    everything = [k for window in windows for k in window]
    groups = _by_group(everything)
    counted = _of_interest(groups)
    input_path = [k for g in INPUT_PATH_GROUPS for k in groups.get(g, [])]
    per_list: dict[str, dict] = {}
    full_depth = sum(k["bytes"] for k in _of_interest(_by_group([k for w in outside for k in w])))
    for call, kernels in zip(calls, inside):
        chain = fam.block_collection(call["block"])
        nbytes = sum(k["bytes"] for k in _of_interest(_by_group(kernels)))
        entry = per_list.setdefault(chain, {"calls": 0, "rows": call["rows"], "bytes": 0.0, "launches": 0,
                                            "floor_bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += nbytes
        entry["launches"] += len(_of_interest(_by_group(kernels)))
        entry["floor_bytes"] += call.get("floor_bytes", 0)
        full_depth += nbytes * depth_scale.get(chain, 1.0)
    inside_kernels = [k for w in inside for k in w]
    inside_bytes = sum(k["bytes"] for k in _of_interest(_by_group(inside_kernels)))
    floor = sum(c.get("floor_bytes", 0) for c in calls) if all("floor_bytes" in c for c in calls) and calls else None
    total = sum(k["bytes"] for k in counted)
    return {
        "block_calls": len(calls),
        "non_gemm_non_attention": {
            **_totals(counted),
            "input_path": _totals(input_path),
            "rest": _totals([k for g, ks in groups.items() if g not in INPUT_PATH_GROUPS
                             and g not in NOT_WHOLE_BYTES_OF_INTEREST for k in ks]),
            "by_category": {g: _totals(ks) for g, ks in sorted(groups.items(), key=lambda kv: -sum(
                k["bytes"] for k in kv[1])) if g not in NOT_WHOLE_BYTES_OF_INTEREST},
            "inside_blocks": _totals(_of_interest(_by_group(inside_kernels))),
            "outside_blocks": _totals(_of_interest(_by_group([k for w in outside for k in w]))),
            "per_block_list": {c: {"calls": e["calls"], "rows_per_call": e["rows"], "launches": e["launches"],
                                   "dram_gb": round(e["bytes"] / 1e9, 4),
                                   **({"floor_gb": round(e["floor_bytes"] / 1e9, 4)} if floor is not None else {})}
                               for c, e in per_list.items()},
            "gb10_ms_at_232_gbs": _gb10_ms(total),
            "full_depth_gb": round(full_depth / 1e9, 4),
            "full_depth_gb10_ms_at_232_gbs": _gb10_ms(full_depth),
        },
        "blocks_floor": None if floor is None else {
            "floor_gb": round(floor / 1e9, 4), "inside_blocks_gb": round(inside_bytes / 1e9, 4),
            "inside_blocks_over_floor": round(inside_bytes / floor, 4) if floor else None},
        "excluded": {g: _totals(groups.get(g, [])) for g in NOT_WHOLE_BYTES_OF_INTEREST},
        "largest_other_kernels": [{"kernel": k["kernel"], "gb": round(k["bytes"] / 1e9, 4)} for k in sorted(
            groups.get("other", []), key=lambda k: -k["bytes"])[:8]],
    }


def _gb(nbytes: float) -> float:
    return round(nbytes / 1e9, 4)


def whole_forward(out: dict) -> dict:
    """Both arms' non-GEMM non-attention DRAM bytes and launches per forward, the NVFP4 Linears' input path and the
    rest (issue 31's measure): the stock forward by its Linears; the fused one by blocks where the family has a
    block fusion (its blocks call their Linears themselves), else its Linears' input path plus the stock rest (the
    same ComfyUI code runs between them). With the blocks' exact-fusion floor and the GB10 projection per forward
    and per image of :data:`STEPS_PER_IMAGE` steps."""
    if "stock" in out:
        stock = out["stock"]
        s_input, s_rest = stock["linear_input_path"], stock["rest_of_forward"]["non_gemm_non_attention"]
        s_how = "the stock forward by its Linears: their windows' input path, the kernels between them by name"
    else:
        stock = out["stock_blocks"]["non_gemm_non_attention"]
        s_input, s_rest = stock["input_path"], stock["rest"]
        s_how = "the whole stock forward by kernel name (profiled by blocks)"
    s_total = {"launches": s_input["launches"] + s_rest["launches"], "dram_gb": _gb(
        (s_input["dram_gb"] + s_rest["dram_gb"]) * 1e9)}
    if "fused_blocks" in out:
        f = out["fused_blocks"]["non_gemm_non_attention"]
        fused = {"input_path": f["input_path"], "rest": f["rest"],
                 "total": {"launches": f["launches"], "dram_gb": f["dram_gb"]}, "by_category": f["by_category"],
                 "how": "the whole fused forward by kernel name (profiled by blocks)"}
    else:
        f_input = out["fused"]["linear_input_path"]
        fused = {"input_path": {k: f_input[k] for k in ("launches", "dram_gb")}, "rest": s_rest,
                 "total": {"launches": f_input["launches"] + s_rest["launches"],
                           "dram_gb": _gb((f_input["dram_gb"] + s_rest["dram_gb"]) * 1e9)},
                 "how": "the fused Linears' input path plus the stock forward's rest (the same ComfyUI code)"}
    ratio = round(fused["total"]["dram_gb"] / s_total["dram_gb"], 4) if s_total["dram_gb"] else None
    section = {
        "what": "non-GEMM non-attention DRAM bytes and launches per forward (NVFP4 Linear input path + the rest)",
        "stock": {"input_path": {k: s_input[k] for k in ("launches", "dram_gb")},
                  "rest": {k: s_rest[k] for k in ("launches", "dram_gb")}, "total": s_total, "how": s_how},
        "fused": fused,
        "fused_over_stock": ratio,
        "at_most_0.45x_stock": None if ratio is None else ratio <= 0.45,
    }
    projection = {"stock": s_total["dram_gb"], "fused": fused["total"]["dram_gb"]}
    full = {}
    if "stock_blocks" in out and "fused_blocks" in out:
        blocks = {arm: out[f"{arm}_blocks"] for arm in ("stock", "fused")}
        full = {arm: b["non_gemm_non_attention"]["full_depth_gb"] for arm, b in blocks.items()}
        section["blocks"] = {arm: b["non_gemm_non_attention"]["inside_blocks"] for arm, b in blocks.items()}
        section["outside_blocks"] = {arm: b["non_gemm_non_attention"]["outside_blocks"] for arm, b in blocks.items()}
        section["stock_by_blocks_total"] = {k: blocks["stock"]["non_gemm_non_attention"][k]
                                            for k in ("launches", "dram_gb")}
        floor = blocks["fused"]["blocks_floor"]
        if floor is not None:
            over = floor["inside_blocks_over_floor"]
            section["blocks_exact_fusion_floor"] = {
                **floor, "within_10pct": None if over is None else abs(over - 1) <= FLOOR_TOLERANCE,
                "note": "the floor counts every byte once; measured bytes can lie below it where a tensor is still "
                        "in the GPU's L2 (the H200 has 60 MB)"}
    section["gb10_at_232_gbs"] = {
        "per_forward_ms": {arm: _gb10_ms(gb * 1e9) for arm, gb in projection.items()},
        f"per_{STEPS_PER_IMAGE}_step_image_s": {arm: round(_gb10_ms(gb * 1e9) * STEPS_PER_IMAGE / 1e3, 3)
                                                 for arm, gb in projection.items()},
    }
    if full:
        section["gb10_at_232_gbs"]["full_depth_per_forward_ms"] = {arm: _gb10_ms(gb * 1e9) for arm, gb in full.items()}
        section["gb10_at_232_gbs"][f"full_depth_per_{STEPS_PER_IMAGE}_step_image_s"] = {
            arm: round(_gb10_ms(gb * 1e9) * STEPS_PER_IMAGE / 1e3, 3) for arm, gb in full.items()}
        section["full_depth_gb"] = full
    return section


def dram_section(name: str, args) -> dict:
    """Run one family's ncu child and attribute its kernels (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = pathlib.Path(tmp) / "calls.json"
        child = ["--ncu-child", str(sidecar), "--families", name, "--layers", str(args.layers), "--dtype", args.dtype,
                 "--seed", str(args.seed)] + (["--ncu-blocks-only"] if args.ncu_blocks_only else [])
        if args.text_tokens:
            child += ["--text-tokens", str(args.text_tokens)]
        cmd = rep.ncu_command(pathlib.Path(__file__).resolve(), child)
        t0 = time.perf_counter()
        windows, error = rep.run_ncu(cmd, args.ncu_timeout)
        seconds = round(time.perf_counter() - t0, 1)
        if error is not None:  # its temporary folder is no path the shared JSON should name
            return {"error": error.replace(tmp, "<tmp>"), "seconds": seconds}
        if not sidecar.exists():
            return {"error": "the ncu child wrote no call list", "seconds": seconds}
        arms = json.loads(sidecar.read_text())["arms"]
    expected = expected_windows(arms)
    if len(windows) != expected:
        return {"error": f"{len(windows)} marker windows in the ncu output, {expected} expected from the calls",
                "seconds": seconds}
    full_counts = fam.quantized_linear_counts(name, width="full")
    measured_counts = fam.quantized_linear_counts(name, width="full", layers=args.layers)
    depth_scale = {c: full_counts[c] / n for c, n in measured_counts.items()}
    out = {"tool": "Nsight Compute (--clock-control none; each kernel replayed with flushed caches, ncu's default)",
           "ncu_options": shlex.join(cmd[1:cmd.index(sys.executable)]), "seconds": seconds,
           "full_depth_scale": {"per_block_list": {c: round(s, 3) for c, s in depth_scale.items()},
                                "how": "each block list's Linear-input bytes x its NVFP4 Linear count at full "
                                       "depth / the measured count (N / L for the lists the depth sets)"}}
    start = 0
    for arm in arms:
        n = arm_windows(arm)
        if arm["scope"] == "blocks":
            out[f"{arm['arm']}_blocks"] = attribute_blocks(arm, windows[start:start + n], depth_scale)
        else:
            out[arm["arm"]] = attribute_arm(arm, windows[start:start + n], depth_scale)
        start += n
    if ("stock" in out or "stock_blocks" in out) and ("fused" in out or "fused_blocks" in out):
        out["whole_forward"] = whole_forward(out)
    if "stock" in out and ("fused" in out or "fused_blocks" in out):
        s = out["stock"]["linear_input_path"]
        ratio = None
        if "fused" in out:
            f = out["fused"]["linear_input_path"]
            fused_calls = f["by_path"].get("fused")
            ratio = fused_calls["bytes_over_floor"] if fused_calls else None
            fused_ms = {"measured": f["gb10_ms_at_232_gbs"], "full": f["full_depth_gb10_ms_at_232_gbs"]}
        else:  # a block fusion: its Linears' input path (global-scale reductions, packs) by kernel name
            f = out["fused_blocks"]["non_gemm_non_attention"]["input_path"]
            fused_ms = {"measured": _gb10_ms(f["dram_gb"] * 1e9), "full": None}
        out["summary"] = {
            "linear_input_gb": {"stock": s["dram_gb"], "fused": f["dram_gb"]},
            "linear_input_launches": {"stock": s["launches"], "fused": f["launches"]},
            "fused_calls_bytes_over_floor": ratio,
            "fused_within_10pct_of_floor": None if ratio is None else abs(ratio - 1) <= FLOOR_TOLERANCE,
            "gb10_ms_at_232_gbs_measured_layers": {"stock": s["gb10_ms_at_232_gbs"], "fused": fused_ms["measured"]},
            "gb10_ms_at_232_gbs_full_depth": {"stock": s["full_depth_gb10_ms_at_232_gbs"], "fused": fused_ms["full"]},
        }
        if "fused" not in out:
            out["summary"]["note"] = ("the fused blocks fold norms, modulation and SwiGLU into their packs, which read "
                                      "other tensors than ComfyUI's Linear inputs: the per-call floor of the Linear "
                                      "input path does not apply; whole_forward compares the blocks with theirs")
        if ratio is not None and abs(ratio - 1) > FLOOR_TOLERANCE:
            out["summary"]["flag"] = (f"fused input-path bytes are {ratio:.3f}x the floor: outside "
                                      f"{FLOOR_TOLERANCE:.0%}")
    return out


# ---- main ----------------------------------------------------------------------------------------------------

def summary_row(name: str, section: dict) -> dict:
    if "error" in section:
        return {"family": name, "error": section["error"][:200]}
    calls, dram = section["calls"], section.get("dram", {}).get("summary", {})
    return {"family": name, "dtype": section["dtype"], "depth": section["depth"],
            "linears_fused": f"{section['patch']['fused_linears']}/{section['patch']['nvfp4_linears']}",
            "calls_fused_share": calls["fused_share"],
            "differing": section["parity"]["total_differing_elements"],
            "stock_s": section["stock"]["forward_seconds_median"],
            "fused_s": section["fused"]["forward_seconds_median"],
            "peak_gib": [section["stock"].get("peak_extra_gib_timed_max"),
                         section["fused"].get("peak_extra_gib_timed_max")],
            "input_gb": dram.get("linear_input_gb"), "over_floor": dram.get("fused_calls_bytes_over_floor"),
            "gb10_ms_full_depth": dram.get("gb10_ms_at_232_gbs_full_depth"),
            "non_gemm_gb": {arm: w["total"]["dram_gb"] for arm, w in whole.items() if arm in ("stock", "fused")}
            if (whole := section.get("dram", {}).get("whole_forward")) else None}


def print_table(rows: list[dict]) -> None:
    header = ("family", "dtype", "fused Linears", "calls fused", "differing", "forward s stock->fused",
              "peak GiB", "input GB stock->fused", "fused/floor", "GB10 ms full depth", "non-GEMM GB stock->fused")
    lines = [header]
    for r in rows:
        if "error" in r:
            lines.append((r["family"], "ERROR", r["error"][:80], "", "", "", "", "", "", "", ""))
            continue

        def pair(v, fmt="{}"):
            if isinstance(v, dict):
                v = [v.get("stock"), v.get("fused")]
            if v is None or all(x is None for x in v):
                return "-"
            return "->".join("-" if x is None else fmt.format(x) for x in v)
        lines.append((r["family"], r["dtype"], r["linears_fused"],
                      "-" if r["calls_fused_share"] is None else f"{r['calls_fused_share']:.0%}", str(r["differing"]),
                      pair([r["stock_s"], r["fused_s"]], "{:.3f}"), pair(r["peak_gib"], "{:.2f}"),
                      pair(r["input_gb"], "{:.3f}"), "-" if r["over_floor"] is None else f"{r['over_floor']:.3f}",
                      pair(r["gb10_ms_full_depth"], "{:.1f}"), pair(r.get("non_gemm_gb"), "{:.3f}")))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths)))


def readme_table(results: list[dict]) -> list[str]:
    """README's table of the whole-forward measurement (Markdown lines), one row per measured family of each result
    (the JSON of a run, e.g. one at 2 layers and one with --layers 30): non-GEMM non-attention DRAM bytes per forward
    as NVFP4 Linear input path + rest, launches, fused over stock, the fused blocks over their exact-fusion floor,
    the GB10 projection per forward and per image, the output bits and the NVFP4 calls fused."""
    lines = ["| Model | measured | output | NVFP4 calls fused | non-GEMM non-attention GB per forward: input path + "
             "rest | launches | fused / stock | blocks / floor | GB10 ms per forward | "
             f"GB10 s per {STEPS_PER_IMAGE}-step image |", "|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for name, section in result.get("families", {}).items():
            whole = section.get("dram", {}).get("whole_forward")
            if whole is None or "error" in section:
                continue
            st, fu = whole["stock"], whole["fused"]

            def split(arm):
                return (f"{arm['input_path']['dram_gb']:.2f} + {arm['rest']['dram_gb']:.2f} = "
                        f"{arm['total']['dram_gb']:.2f}")

            floor = (whole.get("blocks_exact_fusion_floor") or {}).get("inside_blocks_over_floor")
            gb10 = whole["gb10_at_232_gbs"]
            image = gb10[f"per_{STEPS_PER_IMAGE}_step_image_s"]
            calls = section["calls"]
            lines.append(
                f"| {section['title']} ({section['load']['model_class']}) | {section['depth']}, "
                f"{'x'.join(map(str, section['resolution_w_h_frames'][:2]))}, {section['dtype']} | "
                f"{section['parity']['total_differing_elements']} differing | {calls['fused']} of "
                f"{calls['nvfp4_linear_calls']} | {split(st)} -> **{split(fu)}** | {st['total']['launches']} -> "
                f"**{fu['total']['launches']}** | {whole['fused_over_stock']:.2f} | "
                f"{'-' if floor is None else format(floor, '.2f')} | "
                f"{gb10['per_forward_ms']['stock']:.0f} -> **{gb10['per_forward_ms']['fused']:.0f}** | "
                f"{image['stock']:.2f} -> **{image['fused']:.2f}** |")
    return lines


def write_shared(result: dict, out_path: pathlib.Path, comfy_root: pathlib.Path) -> None:
    """The JSON, made to be shared: no local path of this machine (the pack, ComfyUI, Python, the home and current
    folders)."""
    shared = rep.without_local_paths(json.loads(json.dumps(result, default=str)), rep.local_paths(comfy_root))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(shared, indent=1) + "\n")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", type=lambda s: [n for n in s.split(",") if n], default=list(DEFAULT_FAMILIES),
                        help=f"comma-separated, of {', '.join(fam.FAMILIES)} (default: {','.join(DEFAULT_FAMILIES)})")
    parser.add_argument("--layers", type=int, default=2, help="blocks in each block list that sets the depth")
    parser.add_argument("--dtype", choices=comfy_env.COMPUTE_DTYPES, default="auto",
                        help="compute dtype of the diffusion model (auto: ComfyUI's choice; Wan: fp16)")
    parser.add_argument("--text-tokens", type=int, default=None,
                        help=f"text tokens (default {FULL_TEXT_TOKENS}; --tiny: 7)")
    parser.add_argument("--reps", type=int, default=3, help="timed forwards per arm")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute DRAM bytes")
    parser.add_argument("--ncu-timeout", type=int, default=240, help="seconds for each family's ncu child")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny widths, no ncu: a wiring check")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/families.json, else "
                                                    "benchmarks/out/families.json)")
    parser.add_argument("--ncu-blocks-only", action="store_true",
                        help="a block-fusion family: profile both arms by blocks only (no stock profile by Linears)")
    parser.add_argument("--table", nargs="+", default=None, metavar="JSON",
                        help="print README's whole-forward table from the JSON of earlier runs and exit")
    parser.add_argument("--ncu-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.families:
        parser.error("--families names no family")
    unknown = [n for n in args.families if n not in fam.FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(fam.FAMILIES)}")
    if args.ncu_child and len(args.families) != 1:
        parser.error("the ncu child measures one family")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.table:
        print("\n".join(readme_table([json.loads(pathlib.Path(p).read_text()) for p in args.table])))
        return 0
    info = comfy_env.import_comfyui()
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)  # the emulated-GEMM warning
    if args.tiny:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("families.py: no CUDA device; use --tiny for the CPU wiring check", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    comfy_env.force_nvfp4_compute(args.dtype)
    if args.ncu_child:
        with fam.detection_reads_metadata() if args.tiny else contextlib.nullcontext():
            return ncu_child(args, device)
    out_path = pathlib.Path(args.out or pathlib.Path(os.environ.get("OUT", ROOT / "benchmarks" / "out"))
                            / ("families-tiny.json" if args.tiny else "families.json"))
    run_ncu = device.type == "cuda" and not args.no_ncu
    result = {
        "benchmark": "per NVFP4 model family: ComfyUI stock vs the Patch node's fused clone, one forward",
        "command": "python " + " ".join(shlex.quote(rep.shared_argument(a)) for a in ["benchmarks/families.py", *argv]),
        "device": rep.device_info(device),
        "versions": {"comfyui": info.version, "comfy_kitchen": package_version("comfy-kitchen"),
                     "torch": torch.__version__, "pack": __version__},
        "settings": {"width": "tiny (CPU wiring check: Python twin of the kernels, no speed figures)" if args.tiny
                     else "full (official widths)", "layers": args.layers, "dtype": args.dtype,
                     "sigmas": list(SIGMAS), "reps": args.reps, "seed": args.seed,
                     "nvfp4_compute": "forced on (GEMM emulated below sm_100)",
                     "stock_arm_gemm": rep.stock_gemm_note(device),
                     "ncu": "yes" if run_ncu else ("no: --tiny runs on the CPU, without Nsight Compute" if args.tiny
                                                   else "no: --no-ncu")},
        "families": {},
    }
    ok = True
    for name in args.families:
        t0 = time.perf_counter()
        try:
            # tiny Z-Image and Qwen-Image files are detected at their widths only when detection reads the metadata
            with fam.detection_reads_metadata() if args.tiny else contextlib.nullcontext():
                section = measure_family(name, args, device)
        except Exception as exc:  # one family's failure is reported, the others still run
            log(f"{name}: FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            section = {"error": f"{type(exc).__name__}: {exc}"}
        free_models()
        section["seconds"] = round(time.perf_counter() - t0, 1)
        if run_ncu and "error" not in section:
            log(f"{name}: Nsight Compute child")
            try:
                section["dram"] = dram_section(name, args)
            except Exception as exc:  # the measured run above stays in the JSON
                section["dram"] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            if "error" in section["dram"]:
                log(f"{name}: ncu: {section['dram']['error'][:500]}")
            else:
                log(f"{name}: ncu in {section['dram']['seconds']} s: {section['dram'].get('summary')}")
        ok = ok and "error" not in section and section["parity"]["total_differing_elements"] == 0
        result["families"][name] = section
        result["summary"] = [summary_row(n, s) for n, s in result["families"].items()]
        result["readme_table"] = readme_table([result])
        result["ok"] = ok
        result["complete"] = name == args.families[-1]
        # after each family: a run stopped by its time limit keeps what it measured
        write_shared(result, out_path, info.location.root)
        log(f"{name}: done in {section['seconds']} s; wrote {out_path}")
    if args.tiny:
        print("tiny widths on the CPU: a wiring check (Python twin of the kernels, no Nsight Compute, "
              "no speed figures)")
    if len(result["readme_table"]) > 2:
        print("\n".join(result["readme_table"]))
    print_table(result["summary"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
