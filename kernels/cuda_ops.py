"""Host wrappers of the fused kernels: validate, allocate once, launch on torch's current stream.

Public functions (all bit-identical to ComfyUI's stock ops followed by comfy-kitchen's CUDA packer):

* :func:`pack_nvfp4` - NVFP4-pack an activation read through a *source* (plain rows, RMSNorm with or without an adaLN
  modulation (scale and shift, or scale only), the modulation alone, SwiGLU of an fc1 output or of two tensors, or
  rows times a Linear's ``pre_quant_scale``), with a dynamic (device-computed), precomputed or static global scale.
  Plain and ``pre_quant_scale`` sources take bf16 or fp16 activations (fp16 with ComfyUI's fp16 arithmetic: the
  ``_f16`` kernels); the block sources take bf16.
* :func:`norm_statistics` - torch's RMSNorm rstd of every row, optionally with the amax of the (modulated)
  normalized rows (the next projection's global scale): the norm's output itself is never written.
* :func:`gated_residual_` - ``x[r] += other[r] * gate[mod_index[r]]`` in place, optionally followed in the same pass
  by :func:`norm_statistics` of the new x.
* :func:`post_norm_residual_` - ``x[r] += gate[mod_index[r]] * rms_norm(other)[r]`` (or ``+= rms_norm(other)[r]``)
  in place with ComfyUI's roundings (Z-Image's sandwich norm), or out of place from ``x_from``, the norm of ``other``
  computed in the same pass, optionally followed by :func:`norm_statistics` of the new x.
* :func:`rms_rope_split_half_` - comfy-kitchen's per-head RMSNorm + split-half RoPE for H3's q/k views, in place.
* The row kernels of a LayerNorm block (Wan), bf16 and fp16: :func:`layer_norm_statistics` (torch's LayerNorm
  mean and rstd, optionally with the next projection's global scale), :func:`residual_layer_norm_` (ComfyUI's gated
  or plain residual, then those statistics of the new rows), :func:`rms_norm_rope_` (torch's RMSNorm over the full
  width, then comfy-kitchen's interleaved RoPE, in place); their packs are sources of :func:`pack_nvfp4`
  (``layer_norm`` with ``addcmul_modulation`` or affine parameters, ``gelu``).
* ``*_support`` - ``None`` if a kernel can take these tensors, else the reason (callers fall back to ComfyUI's path
  with that reason instead of raising in the user's graph).

Layouts: layout.py. Launch shapes: :data:`LAUNCH`, the one source of these values (passed to NVRTC as ``-D``).
Kernels: kernels/csrc/packs.cu (packs and their global scales), residual_norm.cu (residuals, norm statistics,
modulation bounds, the LayerNorm block's row kernels), rms_rope.cu (RMSNorm + RoPE), built and cached by
kernels/runtime.py.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from ..layout import (
    AddcmulModulation,
    LayerNorm,
    Modulation,
    PackedActivation,
    RmsNorm,
    packed_buffer_layout,
    roundup,
    source_refusal,
)
from ..layout import rows_readable_in_place as _aligned  # what every kernel reads: 16-byte rows, unit column stride
from . import runtime

# Launch shapes. The kernels are compiled with these values (kernel_defines) and the grids computed from them.
LAUNCH = {
    "PACK_THREADS": 256, "ABSMAX_THREADS": 512, "PLAIN_ITEMS": 4, "SILU_TABLE_THREADS": 1024,
    "RESIDUAL_THREADS": 256, "ROW_NORM_THREADS": 128, "ROW_NORM_MAX_STEPS": 11, "ROW_NORM_BATCH": 2,
    "RESIDUAL_NORM_THREADS": 64, "RESIDUAL_NORM_BATCH": 6, "RESIDUAL_AMAX_BATCH": 8,
    "RESIDUAL_NORM_MIN_CTAS": 8,  # 8 CTAs x 2 warps per SM: at most 128 registers (9 or 10 spill at these batches)
    "POST_NORM_BATCH": 3,  # gate and norm-weight chunks per batch of the post-norm residuals (two tables a chunk)
    # resident CTAs of 128 threads the Z-Image row-norm amax kernels' register budget keeps (at most 64 registers:
    # without a budget ptxas spills a loop invariant of the unmodulated pass on sm_100 and later)
    "ROW_NORM_MIN_CTAS": 8,
    "PACK_MIN_CTAS": 5, "PLAIN_MIN_CTAS": 4,  # resident CTAs of 256 threads the packs' register budget keeps on sm_90
    "SILU_WINDOW_MIN_CTAS": 5,  # the windowed-silu SwiGLU pack (silu_window_table)
    # fc1-output chunks in flight per thread of the SwiGLU global scale (3 CTAs of 512 per SM)
    "SWIGLU_ABSMAX_ITEMS": 3,
}
# The silu window of the SwiGLU pack (kernels/csrc/nvfp4_common.cuh swiglu_window_x8): |x| in [2^-16, 2^8), i.e. the
# |x| bit patterns from SILU_WINDOW_LO on, SILU_WINDOW of them (24 binades of 128 values), for each sign.
SILU_WINDOW_LO, SILU_WINDOW = 0x3780, 0xC00
ABSMAX_CTAS_PER_SM = 4
# The RMSNorm + RoPE kernel handles H3's heads only: 128 dims, rotation over the first 96 (48 pairs).
# Each warp stages ROPE_STAGES quads (4 heads of q and k, 320 bytes a head) in shared memory ahead of its work.
ROPE_HEAD_DIM, ROPE_ROT_DIM, ROPE_THREADS, ROPE_THREADS_PER_HEAD, ROPE_STAGES = 128, 96, 128, 8, 3
ROPE_DEFINES = (("ROPE_HEAD_DIM", ROPE_HEAD_DIM), ("ROPE_ROT_DIM", ROPE_ROT_DIM), ("ROPE_THREADS", ROPE_THREADS),
                ("ROPE_THREADS_PER_HEAD", ROPE_THREADS_PER_HEAD), ("ROPE_STAGES", ROPE_STAGES))
ROPE_SHARED_BYTES = ROPE_THREADS // 32 * ROPE_STAGES * 2 * 4 * (2 * ROPE_HEAD_DIM + 64)
ROW_NORM_MAX_COLS = 512 * LAUNCH["ROW_NORM_MAX_STEPS"]  # one warp stages a row of up to 5632 values
# shared memory of the row-norm kernels: one staged row per warp (44 KB with 4 warps: no opt-in, fits sm_120's 99 KB);
# in the residual ones half a row of x and of other per warp (22.5 KB a CTA of two warps)
ROW_NORM_SHARED_BYTES = LAUNCH["ROW_NORM_THREADS"] // 32 * ROW_NORM_MAX_COLS * 2
RESIDUAL_NORM_SHARED_BYTES = LAUNCH["RESIDUAL_NORM_THREADS"] // 32 * ROW_NORM_MAX_COLS * 2
# The sources (kernels/csrc) and the -D constants each is built with: only those it uses.
PACKS, RESIDUAL_NORM, RMS_ROPE = "packs.cu", "residual_norm.cu", "rms_rope.cu"
_PACK_CONSTANTS = ("ABSMAX_THREADS", "PACK_MIN_CTAS", "PACK_THREADS", "PLAIN_ITEMS", "PLAIN_MIN_CTAS",
                   "SILU_TABLE_THREADS", "SILU_WINDOW_MIN_CTAS", "SWIGLU_ABSMAX_ITEMS")
_RESIDUAL_NORM_CONSTANTS = ("POST_NORM_BATCH", "RESIDUAL_AMAX_BATCH", "RESIDUAL_NORM_BATCH", "RESIDUAL_NORM_MIN_CTAS",
                            "RESIDUAL_NORM_THREADS", "RESIDUAL_THREADS", "ROW_NORM_BATCH", "ROW_NORM_MAX_STEPS",
                            "ROW_NORM_MIN_CTAS", "ROW_NORM_THREADS")
_SOURCE_CONSTANTS = {PACKS: _PACK_CONSTANTS, RESIDUAL_NORM: _RESIDUAL_NORM_CONSTANTS, RMS_ROPE: ()}
EMULATE_BLACKWELL_ENV = "H3_FUSED_NVFP4_EMULATE_BLACKWELL"
EXTRA_DEFINES: tuple = ()  # tests only: planted faults (e.g. (("NVFP4_PLANT_FAULT", 1),))


def emulating_blackwell() -> bool:
    return os.environ.get(EMULATE_BLACKWELL_ENV) == "1"


def kernel_defines(source: str = PACKS) -> tuple:
    """The ``-D`` options every build of ``source`` gets: its launch constants, the Blackwell emulation for the one
    source that converts to E2M1 (the packs), and the test-only EXTRA_DEFINES."""
    if source not in _SOURCE_CONSTANTS:
        raise ValueError(f"unknown kernel source {source!r} (kernels: {', '.join(_SOURCE_CONSTANTS)})")
    if source == RMS_ROPE:
        base = ROPE_DEFINES
    else:
        base = tuple((name, LAUNCH[name]) for name in _SOURCE_CONSTANTS[source])
    if source == PACKS:
        base += (("SILU_WINDOW", SILU_WINDOW), ("SILU_WINDOW_LO", SILU_WINDOW_LO))
    emulate = (("NVFP4_EMULATE_BLACKWELL", 1),) if source == PACKS and emulating_blackwell() else ()
    return base + emulate + tuple(EXTRA_DEFINES)


def module_for(device: torch.device, source: str = PACKS):
    index = device.index if device.index is not None else torch.cuda.current_device()
    return runtime.module(index, source=source, defines=kernel_defines(source))


# ---- ctypes mirrors of the kernel parameter structs (must match packs.cu and residual_norm.cu) -------------


class _ColumnTable(ctypes.Union):
    """packs.cu SourceParams' per-column bf16 table: the RMSNorm weight or the pre_quant_scale."""
    _fields_ = [("norm_weight", ctypes.c_void_p), ("prescale", ctypes.c_void_p)]


class _RowOffset(ctypes.Union):
    """packs.cu SourceParams: SwiGLU's up values (an offset inside the row: UpInRow; a second tensor: UpBeside) or a
    folded LayerNorm's per-row mean."""
    _fields_ = [("up_offset", ctypes.c_int64), ("up", ctypes.c_void_p), ("mean", ctypes.c_void_p)]


class _ShiftTable(ctypes.Union):
    """packs.cu SourceParams: the adaLN shift rows or a folded LayerNorm's bias."""
    _fields_ = [("mod_shift", ctypes.c_void_p), ("norm_bias", ctypes.c_void_p)]


class _ActivationTable(ctypes.Union):
    """packs.cu SourceParams: torch's silu (SwiGLU) or gelu (GELU) of every 16-bit pattern."""
    _fields_ = [("silu_table", ctypes.c_void_p), ("gelu_table", ctypes.c_void_p)]


class _SourceParams(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_row_stride", ctypes.c_int64), ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64), ("row_offset", _RowOffset), ("mod_scale", ctypes.c_void_p),
        ("shift_table", _ShiftTable), ("mod_row_stride", ctypes.c_int64), ("mod_index", ctypes.c_void_p),
        ("activation_table", _ActivationTable), ("rstd", ctypes.c_void_p), ("column_table", _ColumnTable),
    ]
    _anonymous_ = ("row_offset", "shift_table", "activation_table", "column_table")


class _PackParams(ctypes.Structure):
    _fields_ = [
        ("src", _SourceParams), ("global_scale", ctypes.c_void_p), ("qdata", ctypes.c_void_p),
        ("scales", ctypes.c_void_p), ("rows16", ctypes.c_int64), ("rows128", ctypes.c_int64),
        ("groups", ctypes.c_int64), ("alpha_out", ctypes.c_void_p), ("weight_scale_2", ctypes.c_void_p),
    ]


class _GlobalScaleOut(ctypes.Structure):
    _fields_ = [("workspace", ctypes.c_void_p), ("global_scale", ctypes.c_void_p)]


class _AbsmaxParams(ctypes.Structure):
    _fields_ = [("src", _SourceParams), ("out", _GlobalScaleOut)]


class _GatedResidualParams(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_row_stride", ctypes.c_int64), ("other", ctypes.c_void_p),
        ("other_row_stride", ctypes.c_int64), ("gate", ctypes.c_void_p), ("gate_row_stride", ctypes.c_int64),
        ("mod_index", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
    ]


class _RowNormParams(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_row_stride", ctypes.c_int64), ("other", ctypes.c_void_p),
        ("other_row_stride", ctypes.c_int64), ("gate", ctypes.c_void_p), ("gate_row_stride", ctypes.c_int64),
        ("mod_index", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
        ("norm_weight", ctypes.c_void_p), ("eps", ctypes.c_float), ("rstd", ctypes.c_void_p),
        ("mod_scale", ctypes.c_void_p), ("mod_shift", ctypes.c_void_p), ("mod_row_stride", ctypes.c_int64),
        ("out", _GlobalScaleOut), ("bound_scale", ctypes.c_void_p), ("bound_shift", ctypes.c_void_p),
        ("other_weight", ctypes.c_void_p), ("other_eps", ctypes.c_float), ("x_from", ctypes.c_void_p),
    ]


class _ModBoundsParams(ctypes.Structure):
    _fields_ = [
        ("norm_weight", ctypes.c_void_p), ("mod_scale", ctypes.c_void_p), ("mod_shift", ctypes.c_void_p),
        ("mod_row_stride", ctypes.c_int64), ("table_rows", ctypes.c_int64), ("cols", ctypes.c_int64),
        ("bound_scale", ctypes.c_void_p), ("bound_shift", ctypes.c_void_p),
    ]


# ---- validation --------------------------------------------------------------------------------------------

def _modulation_refusal(modulation: Modulation, x: torch.Tensor, k: int) -> str | None:
    for name in ("scale", "shift"):
        t = getattr(modulation, name)
        if t is None:  # the scale-only form
            continue
        if t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != k or not _aligned(t) or t.device != x.device:
            return f"the modulation {name} table must be bf16 [rows, {k}], 16-byte aligned, on {x.device}"
    if modulation.shift is not None and modulation.scale.stride() != modulation.shift.stride():
        return "the modulation scale and shift tables must share one row stride"
    idx = modulation.mod_index
    if idx.dtype != torch.int32 or idx.shape != (x.shape[0],) or idx.device != x.device:
        return "the modulation index must be int32 [M] on the activation's device"
    return None


def rms_norm_support(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None if the kernels reproduce torch's CUDA ``rms_norm(x, weight)`` for these tensors, else why not."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or x.dim() != 2:
        return "only 2-D bf16 CUDA activations"
    if weight.dtype != x.dtype:  # torch itself takes its composite path then (other bits)
        return f"the norm weight is {weight.dtype}, the activation {x.dtype}"
    k = x.shape[1]
    if k % 16 or k > ROW_NORM_MAX_COLS:
        return f"the width {k} is not a multiple of 16 up to {ROW_NORM_MAX_COLS}"
    if not _aligned(x) or weight.stride(-1) != 1 or weight.data_ptr() % 16:
        return "the rows and the norm weight must be 16-byte aligned"
    if x.shape[0] * max(x.stride(0), k) >= 2**31:
        return "the activation is too large for one launch"
    return None


# The fp16 twin of each plain and pre_quant_scale kernel is named with this suffix (layout.py PACK_DTYPE_NAMES).
KERNEL_SUFFIX = {torch.bfloat16: "", torch.float16: "_f16"}


def pack_support(x: torch.Tensor, *, swiglu: bool = False, modulation: Modulation | None = None,
                 norm: RmsNorm | None = None, prescale: torch.Tensor | None = None,
                 up: torch.Tensor | None = None, layer_norm: LayerNorm | None = None,
                 addcmul_modulation: AddcmulModulation | None = None, gelu: bool = False) -> str | None:
    """``None`` if the fused pack accepts these inputs, otherwise a human-readable reason."""
    if not x.is_cuda:
        return "the activation is not on a CUDA device"
    reason = source_refusal(x, swiglu=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up,
                            layer_norm=layer_norm, addcmul_modulation=addcmul_modulation, gelu=gelu)
    if reason is not None:
        return reason
    if layer_norm is not None:
        reason = _layer_norm_tables_refusal(layer_norm, addcmul_modulation)
        if reason is not None:
            return reason
    k = x.shape[1] // 2 if swiglu and up is None else x.shape[1]
    if not _aligned(x):
        return "the activation rows are not 16-byte aligned with unit column stride"
    if up is not None and (not _aligned(up) or up.stride(0) != x.stride(0)):
        return "the SwiGLU up rows must be 16-byte aligned with the gates' row stride"
    if prescale is not None and not _aligned(prescale):
        return "the pre_quant_scale table must be contiguous and 16-byte aligned"
    if modulation is not None:
        reason = _modulation_refusal(modulation, x, k)
        if reason is not None:
            return reason
    if norm is not None:
        reason = rms_norm_support(x, norm.weight)
        if reason is not None:
            return reason
        if norm.rstd.dtype != torch.float32 or norm.rstd.shape != (x.shape[0],) or norm.rstd.device != x.device:
            return "the norm statistics must be fp32 [M] on the activation's device"
    if roundup(x.shape[0], 128) * (roundup(k // 16, 4) // 4) * 8 >= 2**31:
        return "the activation is too large for one launch"  # the kernels index with 32-bit integers
    return None


def residual_support(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor, *,
                     next_norm: RmsNorm | None = None) -> str | None:
    for name, t in (("x", x), ("other", other), ("gate", gate)):
        if not t.is_cuda or t.dtype != torch.bfloat16 or t.dim() != 2 or not _aligned(t) or t.device != x.device:
            return f"{name} must be a 16-byte aligned bf16 2-D tensor on the GPU"
    if other.shape != x.shape or gate.shape[1] != x.shape[1] or x.shape[1] % 8:
        return f"shape mismatch: x {tuple(x.shape)}, other {tuple(other.shape)}, gate {tuple(gate.shape)}"
    if next_norm is not None:
        return rms_norm_support(x, next_norm.weight)
    if x.shape[0] * x.stride(0) >= 2**31:
        return "the activation is too large for one launch"
    return None


# ---- per-(device, stream) workspace of the grid-wide amax: {amax bits, finished-CTA counter} -------------------

_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_workspace_lock = threading.Lock()


def _workspace(device: torch.device, stream: int) -> torch.Tensor:
    key = (device.index, stream)
    ws = _workspaces.get(key)
    if ws is None:
        with _workspace_lock:
            ws = _workspaces.setdefault(key, torch.zeros(2, dtype=torch.int32, device=device))
    return ws


def _global_scale_out(device, stream, out: torch.Tensor) -> _GlobalScaleOut:
    return _GlobalScaleOut(_workspace(device, stream).data_ptr(), out.data_ptr())


# ---- per-(device, stream) tables of the amax bounds (residual_norm.cu, fused_modulation_bounds) -----------------
# Stream-ordered reuse: every amax launch rebuilds them right before it, on the same stream.

_bounds: dict[tuple[int, int], torch.Tensor] = {}


def _launch_bounds_tables(mod, stream: int, x: torch.Tensor, norm: RmsNorm,
                          modulation: Modulation | None) -> tuple[int, int]:
    """Build the amax bounds of every modulation row (one row without a modulation) for ``norm``'s weight; returns
    the two tables' addresses."""
    rows, k = (modulation.scale.shape[0] if modulation is not None else 1), x.shape[1]
    entries = rows * k + rows * k // 8  # bf16 per column, then bf16 per 8 columns (16-byte aligned: k % 16 == 0)
    key = (x.device.index, stream)
    table = _bounds.get(key)
    if table is None or table.numel() < entries:
        with _workspace_lock:
            # at least 8 modulation rows at H3's width (8 x (5376 + 5376 / 8)): the usual calls never reallocate
            table = _bounds[key] = torch.empty(max(entries, 8 * 6048), dtype=torch.int16, device=x.device)
    scale_bounds, shift_bounds = table.data_ptr(), table.data_ptr() + 2 * rows * k
    params = _ModBoundsParams(norm.weight.data_ptr(), None, None, 0, rows, k, scale_bounds, shift_bounds)
    if modulation is not None:
        params.mod_scale, params.mod_row_stride = modulation.scale.data_ptr(), modulation.scale.stride(0)
        params.mod_shift = modulation.shift.data_ptr() if modulation.shift is not None else None
    grid = max(1, min(-(-rows * (k // 8) // 256), mod.sm_count * 8))
    mod.launch(_BOUNDS_KERNELS[_form(modulation)], grid, 256, params, stream)
    return scale_bounds, shift_bounds


# The modulation forms of a normalized source (nvfp4_common.cuh ScaleShift, ScaleOnly, Unmodulated) and the kernels
# of each: the bounds of the amax pass, the statistics with the amax, the normalized pack.
_BOUNDS_KERNELS = {"scale_shift": "fused_modulation_bounds", "scale": "fused_modulation_bounds_scale",
                   "none": "fused_norm_bounds"}
_AMAX_KERNELS = {"scale_shift": "fused_row_norm_amax", "scale": "fused_row_norm_amax_scale",
                 "none": "fused_row_norm_amax_norm"}
_NORM_PACK_VARIANTS = {"scale_shift": "norm_modulate", "scale": "norm_scale", "none": "norm"}


def _form(modulation: Modulation | None) -> str:
    if modulation is None:
        return "none"
    return "scale" if modulation.shift is None else "scale_shift"


# ---- SwiGLU silu table: torch's own bf16 silu of every bf16 bit pattern --------------------------------------

SILU_TABLE_SHARED_BYTES = 65536 * 2
_silu_tables: dict[int, torch.Tensor] = {}


def silu_table(device: torch.device) -> torch.Tensor:
    """bf16 ``[65536]``: entry ``b`` is ``torch.nn.functional.silu`` of the bf16 value with bit pattern ``b``.

    Built once per device by torch itself, so a lookup returns exactly what ComfyUI's ``silu`` computes
    (stream-ordered, no host sync)."""
    table = _silu_tables.get(device.index)
    if table is None:
        bits = torch.arange(65536, dtype=torch.int32, device=device)
        values = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)
        table = _silu_tables.setdefault(device.index, torch.nn.functional.silu(values).contiguous())
    return table


SILU_WINDOW_SHARED_BYTES = 2 * SILU_WINDOW * 2
# How the SwiGLU pack gets silu: None picks the whole table where it fits (sm_90, sm_100, sm_103, sm_110: 227 KB of
# shared memory a CTA) and its 12 KB window elsewhere (sm_120 / sm_121: 99 KB). The table is the faster of the two
# where both fit (benchmarks/README.md, tuning log of the load paths). Tests force "table" and "window".
SWIGLU_SILU: str | None = None
_silu_window_tables: dict[int, torch.Tensor] = {}


def silu_window_table(device: torch.device) -> torch.Tensor:
    """bf16 ``[2 * SILU_WINDOW]``: the entries of :func:`silu_table` for |x| in [2^-16, 2^8), positive x first."""
    table = _silu_window_tables.get(device.index)
    if table is None:
        full = silu_table(device)
        lo, hi = SILU_WINDOW_LO, SILU_WINDOW_LO + SILU_WINDOW
        table = _silu_window_tables.setdefault(device.index, torch.cat([full[lo:hi], full[0x8000 + lo:0x8000 + hi]]))
    return table


def _swiglu_silu(mod) -> str:
    """The table kernel needs 128 KB of shared memory per CTA (sm_90 / sm_100 have 227 KB, sm_120 has 99 KB); the
    Blackwell emulation build takes the sm_120 path (the window)."""
    fits = mod.max_shared_per_block >= SILU_TABLE_SHARED_BYTES and not emulating_blackwell()
    if SWIGLU_SILU is None or (SWIGLU_SILU == "table" and not fits):
        return "table" if fits else "window"
    return SWIGLU_SILU


# ---- GELU table: torch's own GELU (tanh approximation) of every 16-bit pattern ---------------------------------

GELU_TABLE_SHARED_BYTES = 65536 * 2
_gelu_tables: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def gelu_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[65536]`` of ``dtype``: entry ``b`` is ``torch.nn.functional.gelu(approximate="tanh")`` of the ``dtype``
    value with bit pattern ``b``.

    Built once per device and dtype by torch itself, so a lookup returns exactly what ComfyUI's eager GELU of a
    down-projection's input computes (stream-ordered, no host sync)."""
    key = (device.index, dtype)
    table = _gelu_tables.get(key)
    if table is None:
        bits = torch.arange(65536, dtype=torch.int32, device=device)
        values = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(dtype)
        table = _gelu_tables.setdefault(key, torch.nn.functional.gelu(values, approximate="tanh").contiguous())
    return table


# How the GELU pack reads the table: None picks shared memory where 128 KB fit (sm_90, sm_100, sm_103, sm_110) and
# global memory through L1 elsewhere (sm_120 / sm_121, and the Blackwell emulation build, which takes the sm_120
# path). Tests force "table" and "global".
GELU_LOOKUP: str | None = None


def _gelu_lookup(mod) -> str:
    fits = mod.max_shared_per_block >= GELU_TABLE_SHARED_BYTES and not emulating_blackwell()
    if GELU_LOOKUP is None or (GELU_LOOKUP == "table" and not fits):
        return "table" if fits else "global"
    return GELU_LOOKUP


# ---- public API -------------------------------------------------------------------------------------------

def packed_buffer_bytes(rows: int, k: int) -> int:
    """Size of the uint8 buffer :func:`pack_nvfp4` writes (pass one as ``out`` to reuse or poison it)."""
    return packed_buffer_layout(rows, k)[4]


def _source(x: torch.Tensor, k: int, swiglu: bool, modulation: Modulation | None, norm: RmsNorm | None,
            prescale: torch.Tensor | None = None, up: torch.Tensor | None = None,
            layer_norm: LayerNorm | None = None, addcmul_modulation: AddcmulModulation | None = None):
    src = _SourceParams(x.data_ptr(), x.stride(0), x.shape[0], k)
    if up is not None:
        src.up = up.data_ptr()
    else:
        src.up_offset = k if swiglu else 0
    if layer_norm is not None:
        src.mean, src.rstd = layer_norm.mean.data_ptr(), layer_norm.rstd.data_ptr()
        if layer_norm.weight is not None:
            src.norm_weight, src.norm_bias = layer_norm.weight.data_ptr(), layer_norm.bias.data_ptr()
    if addcmul_modulation is not None:
        src.mod_scale, src.mod_shift = addcmul_modulation.scale.data_ptr(), addcmul_modulation.shift.data_ptr()
        src.mod_row_stride = addcmul_modulation.scale.stride(0)
        src.mod_index = addcmul_modulation.mod_index.data_ptr()
    if prescale is not None:
        src.prescale = prescale.data_ptr()
    if modulation is not None:
        src.mod_scale = modulation.scale.data_ptr()
        src.mod_shift = modulation.shift.data_ptr() if modulation.shift is not None else None
        src.mod_row_stride = modulation.scale.stride(0)
        src.mod_index = modulation.mod_index.data_ptr()
    if norm is not None:
        src.rstd = norm.rstd.data_ptr()
        src.norm_weight = norm.weight.data_ptr()
    return src


def _variant(swiglu: bool, modulation: Modulation | None, norm: RmsNorm | None,
             prescale: torch.Tensor | None = None, up: torch.Tensor | None = None,
             layer_norm: LayerNorm | None = None, gelu: bool = False) -> str:
    if gelu:
        return "gelu"
    if layer_norm is not None:
        return "layer_norm_affine" if layer_norm.weight is not None else "layer_norm_modulate"
    if swiglu:
        return "swiglu_pair" if up is not None else "swiglu"
    if prescale is not None:
        return "prescale"
    if norm is not None:
        return _NORM_PACK_VARIANTS[_form(modulation)]
    return "modulate" if modulation is not None else "plain"


def pack_nvfp4(
    x: torch.Tensor,
    *,
    static_scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    weight_scale_2: torch.Tensor | None = None,
    swiglu: bool = False,
    modulation: Modulation | None = None,
    norm: RmsNorm | None = None,
    prescale: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    layer_norm: LayerNorm | None = None,
    addcmul_modulation: AddcmulModulation | None = None,
    gelu: bool = False,
) -> PackedActivation:
    """NVFP4-pack ``h = source(x)`` exactly like comfy-kitchen's CUDA ``quantize_nvfp4`` after ComfyUI's ops.

    Args:
        x: bf16 ``[M, K]`` (``[M, 2K]`` fc1 output for ``swiglu=True`` without ``up``: gate half first), any row
            stride that keeps rows 16-byte aligned; read in place. fp16 for the plain and ``prescale`` sources (then
            every rounding ComfyUI makes in the activation dtype is an fp16 rounding: the global scale, the
            multiply).
        static_scale: fp32 one-element device tensor (the layer's ``input_scale``).
        global_scale: fp32 one-element device tensor already holding ComfyUI's dynamic scale of ``h`` (written by
            :func:`norm_statistics` / :func:`gated_residual_` earlier on the stream).
            Neither: the dynamic scale ``dtype(amax|h| / 2688)`` is computed here in one extra launch.
        weight_scale_2: fp32 one-element device tensor; the pack then writes the GEMM alpha (activation scale x
            weight scale, dynamic, precomputed or static) next to the global scale, so no follow-up launch computes
            it and nothing holds a product of an earlier call.
        modulation / norm / swiglu: the source (module docstring).
        up: with ``swiglu=True``, the up values as a second ``[M, K]`` tensor with x's row stride: ``h =
            silu(x) * up`` (Z-Image's ``F.silu(w1(h)) * w3(h)``).
        prescale: ``[K]`` contiguous, in x's dtype: ``h = x * prescale`` (torch's bf16 or fp16 multiply), a Linear's
            ``pre_quant_scale`` cast to the activation dtype as ComfyUI's NVFP4 Linear casts it. Plain rows only.
        out: optional contiguous uint8 buffer of :func:`packed_buffer_bytes` bytes to write into.
        layer_norm / addcmul_modulation / gelu: the sources of a LayerNorm block, bf16 or fp16 (module docstring):
            torch's LayerNorm from the statistics of :func:`layer_norm_statistics` / :func:`residual_layer_norm_`
            followed by ComfyUI's addcmul modulation, or with its affine parameters; GELU (tanh) of the rows.

    One launch with a static or precomputed scale, two otherwise; no host sync, one allocation.
    """
    reason = pack_support(x, swiglu=swiglu, modulation=modulation, norm=norm, prescale=prescale, up=up,
                          layer_norm=layer_norm, addcmul_modulation=addcmul_modulation, gelu=gelu)
    if reason is not None:
        raise ValueError(reason)
    if static_scale is not None and global_scale is not None:
        raise ValueError("pass a static or a precomputed global scale, not both")
    if global_scale is None and static_scale is None and norm is not None:
        raise ValueError("a normalized source takes its global scale from norm_statistics")
    variant = _variant(swiglu, modulation, norm, prescale, up, layer_norm, gelu)
    suffix = KERNEL_SUFFIX[x.dtype]  # the fp16 kernels: same launch shapes as their bf16 twins
    rows = x.shape[0]
    k = x.shape[1] // 2 if swiglu and up is None else x.shape[1]
    rows16, rows128, groups = roundup(rows, 16), roundup(roundup(rows, 16), 128), roundup(k // 16, 4) // 4
    q_bytes, s_off, s_bytes, g_off, total = packed_buffer_layout(rows, k)
    if out is None:
        buf = torch.empty(total, dtype=torch.uint8, device=x.device)  # qdata | scales | g, alpha
    elif out.dtype != torch.uint8 or out.numel() < total or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous uint8 buffer of at least {total} bytes on {x.device}")
    else:
        buf = out.reshape(-1)
    qdata = buf[:q_bytes].view(rows16, k // 2)
    scales = buf[s_off:s_off + s_bytes].view(rows128, groups * 4).view(torch.float8_e4m3fn)
    scalars = buf[g_off:g_off + 8].view(torch.float32)

    mod = module_for(x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    src = _source(x, k, swiglu, modulation, norm, prescale, up, layer_norm, addcmul_modulation)
    if gelu:
        src.gelu_table = gelu_table(x.device, x.dtype).data_ptr()
    if static_scale is not None:
        global_scale = static_scale.reshape(1)
    elif global_scale is not None:
        global_scale = global_scale.reshape(1)
    else:
        params = _AbsmaxParams(src, _global_scale_out(x.device, stream, scalars[0:1]))
        chunks = rows * (k // 8)
        threads = LAUNCH["ABSMAX_THREADS"]
        items = {"plain": LAUNCH["PLAIN_ITEMS"], "swiglu": LAUNCH["SWIGLU_ABSMAX_ITEMS"],
                 "swiglu_pair": LAUNCH["SWIGLU_ABSMAX_ITEMS"]}.get(variant, 1)  # packs.cu
        per_sm = min(ABSMAX_CTAS_PER_SM, mod.resident_ctas(f"nvfp4_absmax_{variant}{suffix}", threads, 0))
        grid = max(1, min(-(-chunks // (threads * items)), mod.sm_count * per_sm))
        mod.launch(f"nvfp4_absmax_{variant}{suffix}", grid, threads, params, stream)
        global_scale = scalars[0:1]
    want_alpha = weight_scale_2 is not None
    kernel, threads, shared = f"nvfp4_pack_{variant}{suffix}", LAUNCH["PACK_THREADS"], 0
    if gelu and _gelu_lookup(mod) == "table":  # the whole table in shared memory: one CTA per SM, persistent
        variant, kernel = "gelu_table", f"nvfp4_pack_gelu_table{suffix}"
        threads, shared = LAUNCH["SILU_TABLE_THREADS"], GELU_TABLE_SHARED_BYTES
    units = _pack_units(variant, rows128, groups)
    grid = max(1, min(-(-units // (threads // 32)), mod.sm_count * (1 if variant == "gelu_table" else 64)))  # warp/unit
    silu = _swiglu_silu(mod) if swiglu else None
    if silu == "window":  # persistent: each CTA copies the window once
        src.silu_table = silu_window_table(x.device).data_ptr()
        kernel, shared = f"nvfp4_pack_{variant}_window", SILU_WINDOW_SHARED_BYTES
        grid = max(1, min(grid, mod.sm_count * mod.resident_ctas(kernel, threads, shared)))
    elif silu == "table":
        src.silu_table = silu_table(x.device).data_ptr()
        kernel, threads, shared = f"nvfp4_pack_{variant}_table", LAUNCH["SILU_TABLE_THREADS"], SILU_TABLE_SHARED_BYTES
        grid = max(1, min(-(-units // (threads // 32)), mod.sm_count))  # one CTA per SM, persistent
    params = _PackParams(src, global_scale.data_ptr(), qdata.data_ptr(), scales.view(torch.uint8).data_ptr(),
                         rows16, rows128, groups, scalars[1:2].data_ptr() if want_alpha else None,
                         weight_scale_2.data_ptr() if want_alpha else None)
    mod.launch(kernel, grid, threads, params, stream, shared_bytes=shared)
    return PackedActivation(qdata, scales, global_scale, scalars[1:2] if want_alpha else None, rows, k)


def _pack_units(variant: str, rows128: int, groups: int) -> int:
    """Warp units of work of a pack (packs.cu pack_body): one row of a SwiGLU source or of the shared-table GELU
    pack, two rows of the modulated, normalized, prescaled and global-table GELU ones; for the plain one, single steps
    (PLAIN_ITEMS blocks a lane, 16 lanes a row) of two rows where the rows split into whole steps
    (PlainSource::kSegmentSteps), else whole pairs."""
    if variant.startswith("swiglu") or variant == "gelu_table":
        return rows128
    seg_lanes = 16 * LAUNCH["PLAIN_ITEMS"] if variant == "plain" else 0
    lanes_per_row = 4 * groups
    segments = lanes_per_row // seg_lanes if seg_lanes and lanes_per_row % seg_lanes == 0 else 1
    return rows128 // 2 * segments


def _row_norm_launch(kernel: str, x, norm: RmsNorm, *, other=None, gate=None, mod_index=None,
                     modulation: Modulation | None = None, global_scale_out=None,
                     other_norm: tuple[torch.Tensor, float] | None = None, x_from=None) -> None:
    """``other_norm``: (weight, eps) of the norm of ``other`` (the post-norm residuals); ``x_from``: the stream the
    out-of-place post-norm residuals read (x's row stride)."""
    mod = module_for(x.device, RESIDUAL_NORM)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    params = _RowNormParams(x.data_ptr(), x.stride(0), None, 0, None, 0, None, x.shape[0], x.shape[1],
                            norm.weight.data_ptr(), float(norm.eps), norm.rstd.data_ptr())
    if x_from is not None:
        params.x_from = x_from.data_ptr()
    if other is not None:
        params.other, params.other_row_stride = other.data_ptr(), other.stride(0)
    if gate is not None:
        params.gate, params.gate_row_stride = gate.data_ptr(), gate.stride(0)
    if other_norm is not None:
        params.other_weight, params.other_eps = other_norm[0].data_ptr(), float(other_norm[1])
    index = mod_index if mod_index is not None else (modulation.mod_index if modulation is not None else None)
    if index is not None:
        params.mod_index = index.data_ptr()
    if global_scale_out is not None:
        if modulation is not None:
            params.mod_scale, params.mod_row_stride = modulation.scale.data_ptr(), modulation.scale.stride(0)
            params.mod_shift = modulation.shift.data_ptr() if modulation.shift is not None else None
        params.out = _global_scale_out(x.device, stream, global_scale_out)
        params.bound_scale, params.bound_shift = _launch_bounds_tables(mod, stream, x, norm, modulation)
    if other is not None:  # persistent CTAs of two warps, one row at a time, copying the next while finishing it
        threads, shared = LAUNCH["RESIDUAL_NORM_THREADS"], RESIDUAL_NORM_SHARED_BYTES
        grid = max(1, min(x.shape[0], mod.sm_count * mod.resident_ctas(kernel, threads, shared)))
    else:  # one warp per row
        threads = LAUNCH["ROW_NORM_THREADS"]
        shared = ROW_NORM_SHARED_BYTES if global_scale_out is not None else 0  # the amax pass stages the row
        grid = max(1, min(-(-x.shape[0] // (threads // 32)), mod.sm_count * 16))
    mod.launch(kernel, grid, threads, params, stream, shared_bytes=shared)


def _check_norm_outputs(x, norm: RmsNorm, modulation, global_scale_out):
    reason = rms_norm_support(x, norm.weight)
    if reason is None and (norm.rstd.dtype != torch.float32 or norm.rstd.shape != (x.shape[0],)
                           or not norm.rstd.is_contiguous() or norm.rstd.device != x.device):
        reason = "rstd must be a contiguous fp32 [M] tensor on the activation's device"
    if reason is None and global_scale_out is not None:
        if modulation is not None:
            reason = _modulation_refusal(modulation, x, x.shape[1])
        if reason is None and (global_scale_out.dtype != torch.float32 or global_scale_out.numel() != 1
                               or global_scale_out.device != x.device):
            reason = "global_scale_out must be an fp32 one-element tensor on the activation's device"
    if reason is not None:
        raise ValueError(reason)


def norm_statistics(x: torch.Tensor, norm: RmsNorm, *, modulation: Modulation | None = None,
                    global_scale_out: torch.Tensor | None = None) -> None:
    """Write torch's CUDA RMSNorm ``rstd`` of every row of ``x`` into ``norm.rstd``; with ``global_scale_out``, also
    ComfyUI's dynamic global scale of ``modulate(rms_norm(x))`` (of ``rms_norm(x)`` without a modulation). One read
    of ``x``; with the global scale a small launch first builds the amax pass's bounds table."""
    _check_norm_outputs(x, norm, modulation, global_scale_out)
    kernel = _AMAX_KERNELS[_form(modulation)] if global_scale_out is not None else "fused_row_norm_stats"
    _row_norm_launch(kernel, x, norm, modulation=modulation, global_scale_out=global_scale_out)


def gated_residual_(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor, mod_index: torch.Tensor, *,
                    next_norm: RmsNorm | None = None, next_modulation: Modulation | None = None,
                    global_scale_out: torch.Tensor | None = None) -> torch.Tensor:
    """In place ``x[r] = bf16(x[r] + other[r] * gate[mod_index[r]])`` (torch's CUDA ``addcmul_`` arithmetic); with
    ``next_norm`` the same pass also does :func:`norm_statistics` of the new x."""
    reason = residual_support(x, other, gate, next_norm=next_norm)
    if reason is not None:
        raise ValueError(reason)
    if mod_index.dtype != torch.int32 or mod_index.shape != (x.shape[0],):
        raise ValueError("mod_index must be int32 [M]")
    if next_norm is not None:
        _check_norm_outputs(x, next_norm, next_modulation, global_scale_out)
        kernel = "fused_row_norm_residual_amax" if global_scale_out is not None else "fused_row_norm_residual_stats"
        _row_norm_launch(kernel, x, next_norm, other=other, gate=gate, mod_index=mod_index,
                         modulation=next_modulation, global_scale_out=global_scale_out)
        return x
    mod = module_for(x.device, RESIDUAL_NORM)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    params = _GatedResidualParams(
        x.data_ptr(), x.stride(0), other.data_ptr(), other.stride(0), gate.data_ptr(), gate.stride(0),
        mod_index.data_ptr(), x.shape[0], x.shape[1],
    )
    chunks = x.shape[0] * (x.shape[1] // 8)
    threads = LAUNCH["RESIDUAL_THREADS"]
    grid = max(1, min(-(-chunks // threads), mod.sm_count * 32))
    mod.launch("fused_gated_residual", grid, threads, params, stream)
    return x


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (a.shape[0] - 1) * a.stride(0) * a.element_size() + a.shape[1] * a.element_size()
    b1 = b0 + (b.shape[0] - 1) * b.stride(0) * b.element_size() + b.shape[1] * b.element_size()
    return a0 < b1 and b0 < a1


def post_norm_residual_support(x: torch.Tensor, other: torch.Tensor, other_weight: torch.Tensor,
                               gate: torch.Tensor | None = None, *, next_norm: RmsNorm | None = None,
                               next_modulation: Modulation | None = None,
                               x_from: torch.Tensor | None = None) -> str | None:
    """``None`` if :func:`post_norm_residual_` takes these tensors, else the reason."""
    if x_from is not None:
        if (not x_from.is_cuda or x_from.dtype != torch.bfloat16 or x_from.shape != x.shape or not _aligned(x_from)
                or x_from.device != x.device or x_from.stride(0) != x.stride(0)):
            return "x_from must be a 16-byte aligned bf16 tensor of x's shape and row stride on the GPU"
        if _overlap(x_from, x):
            return "x_from and x overlap (the out-of-place residual reads one and writes the other)"
    for name, t in (("x", x), ("other", other), ("gate", gate)):
        if t is not None and (not t.is_cuda or t.dtype != torch.bfloat16 or t.dim() != 2 or not _aligned(t)
                              or t.device != x.device):
            return f"{name} must be a 16-byte aligned bf16 2-D tensor on the GPU"
    if other.shape != x.shape or (gate is not None and gate.shape[1] != x.shape[1]):
        return f"shape mismatch: x {tuple(x.shape)}, other {tuple(other.shape)}"
    reason = rms_norm_support(other, other_weight)
    if reason is not None:
        return f"the norm of the residual's input: {reason}"
    if next_modulation is not None and (gate is None or next_modulation.shift is not None):
        return ("the post-norm residuals hand on to a scale-only modulation (gated, Z-Image's modulated blocks) or "
                "to none (ungated, its refiner blocks)")
    return rms_norm_support(x, next_norm.weight) if next_norm is not None else None


# Statistics of a post-norm residual whose new x has no next norm: its kernel writes them here (4 bytes a row).
_scratch_rstd: dict[tuple[int, int], torch.Tensor] = {}


def _scratch_norm(x: torch.Tensor, stream: int) -> RmsNorm:
    key = (x.device.index, stream)
    buf = _scratch_rstd.get(key)
    if buf is None or buf.numel() < x.shape[0]:
        with _workspace_lock:
            buf = _scratch_rstd[key] = torch.empty(max(x.shape[0], 8192), dtype=torch.float32, device=x.device)
    return RmsNorm(buf, 1.0, buf[: x.shape[0]])  # the weight is not read by the statistics


def post_norm_residual_(x: torch.Tensor, other: torch.Tensor, other_weight: torch.Tensor, other_eps: float,
                        gate: torch.Tensor | None, mod_index: torch.Tensor | None, *,
                        next_norm: RmsNorm | None = None, next_modulation: Modulation | None = None,
                        global_scale_out: torch.Tensor | None = None,
                        x_from: torch.Tensor | None = None) -> torch.Tensor:
    """In place, with ComfyUI's roundings (Z-Image's ``x + apply_gate(tanh(gate), norm2(other))``):
    ``x[r] = bf16(x[r] + bf16(gate[mod_index[r]] * n[r]))``, ``n = bf16(w * (rstd * other))`` torch's CUDA
    ``rms_norm(other, w, other_eps)``; without a gate ``x[r] = bf16(x[r] + n[r])`` (its refiner blocks). ``gate``:
    bf16 rows (the tanh of the adaLN gate, computed by torch). With ``next_norm`` the same pass also does
    :func:`norm_statistics` of the new x (a gated residual hands on to a scale-only ``next_modulation``, an ungated
    one to none). ``x_from``: out of place, ``x[r] = bf16(x_from[r] + ...)`` (x's row stride, no overlap; x is
    only written). One read of x (or x_from) and other, one write of x."""
    reason = post_norm_residual_support(x, other, other_weight, gate, next_norm=next_norm,
                                        next_modulation=next_modulation, x_from=x_from)
    if reason is not None:
        raise ValueError(reason)
    if gate is not None and (mod_index is None or mod_index.dtype != torch.int32 or mod_index.shape != (x.shape[0],)):
        raise ValueError("mod_index must be int32 [M]")
    stream = torch.cuda.current_stream(x.device).cuda_stream
    if next_norm is not None:
        _check_norm_outputs(x, next_norm, next_modulation, global_scale_out)
    elif global_scale_out is not None:
        raise ValueError("the amax of the next projection's input needs its norm")
    if gate is not None and global_scale_out is not None and next_modulation is None:
        raise ValueError("a gated post-norm residual's amax takes the scale-only modulation of the next projection")
    if next_modulation is not None and next_modulation.mod_index.data_ptr() != mod_index.data_ptr():
        raise ValueError("the gate and the next modulation read one modulation index (the kernel reads mod_index)")
    stage = "gated_" if gate is not None else ""
    if global_scale_out is None:
        kernel = f"fused_post_norm_residual_{stage}stats"
    else:
        kernel = f"fused_post_norm_residual_{stage}" + ("amax_scale" if gate is not None else "amax_norm")
    _row_norm_launch(kernel + ("_from" if x_from is not None else ""), x,
                     next_norm if next_norm is not None else _scratch_norm(x, stream), other=other, gate=gate,
                     mod_index=mod_index, modulation=next_modulation, global_scale_out=global_scale_out,
                     other_norm=(other_weight, other_eps), x_from=x_from)
    return x


# ---- per-head RMSNorm + split-half RoPE (kernels/csrc/rms_rope.cu) --------------------------------------

class _RmsRopeParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("row_stride", ctypes.c_int64), ("freqs", ctypes.c_void_p),
        ("q_weight", ctypes.c_void_p), ("k_weight", ctypes.c_void_p), ("tokens", ctypes.c_int64),
        ("heads", ctypes.c_int32), ("eps", ctypes.c_float),
    ]


def rms_rope_support(q, k, freqs, q_weight, k_weight, rot_dim) -> str | None:
    """``None`` if :func:`rms_rope_split_half_` takes these tensors (H3's layout), else the reason."""
    if not (q.is_cuda and k.is_cuda and freqs.is_cuda):
        return "not on a CUDA device"
    if any(t.dtype != torch.bfloat16 for t in (q, k, freqs, q_weight, k_weight)):
        return "q, k, rope table and norm weights must all be bfloat16"
    if q.dim() != 4 or q.shape != k.shape or q.shape[0] != 1 or q.shape[-1] != ROPE_HEAD_DIM or rot_dim != ROPE_ROT_DIM:
        return f"only [1, S, H, {ROPE_HEAD_DIM}] q/k with rot_dim {ROPE_ROT_DIM} are handled"
    if q.stride(-1) != 1 or q.stride(-2) != ROPE_HEAD_DIM or k.stride() != q.stride():
        return "q and k must be head-contiguous views with equal strides"
    s = q.shape[1]
    if freqs.shape != (1, s, 1, rot_dim // 2, 2, 2) or not freqs.is_contiguous() or freqs.data_ptr() % 8:
        return "the rope table must be a contiguous [1, S, 1, rot/2, 2, 2] tensor"
    if q_weight.shape != (ROPE_HEAD_DIM,) or k_weight.shape != (ROPE_HEAD_DIM,) or not (
            q_weight.is_contiguous() and k_weight.is_contiguous()):
        return "norm weights must be contiguous [head_dim]"
    if s * q.shape[2] >= 2**31:
        return "too many tokens for one launch"
    if any(t.data_ptr() % 16 for t in (q, k)) or q.stride(1) % 8 or any(t.data_ptr() % 8 for t in (q_weight, k_weight)):
        return "q and k rows must be 16-byte aligned (16-byte copies) and the norm weights 8-byte aligned"
    return None


def rms_rope_split_half_(q, k, freqs, q_weight, k_weight, epsilon: float, rot_dim: int):
    """In place: comfy-kitchen's ``rms_rope_split_half_`` for H3's layout, same bits, one read and one write."""
    reason = rms_rope_support(q, k, freqs, q_weight, k_weight, rot_dim)
    if reason is not None:
        raise ValueError(reason)
    mod = module_for(q.device, RMS_ROPE)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    tokens, heads = q.shape[1], q.shape[2]
    params = _RmsRopeParams(q.data_ptr(), k.data_ptr(), q.stride(1), freqs.data_ptr(), q_weight.data_ptr(),
                            k_weight.data_ptr(), tokens, heads, float(epsilon))
    # every warp takes an equal contiguous range of quads: exactly the CTAs the GPU holds at once, or fewer
    quads = tokens * -(-heads // 4)
    resident = mod.sm_count * mod.resident_ctas("fused_rms_rope_split_half", ROPE_THREADS, ROPE_SHARED_BYTES)
    grid = max(1, min(-(-quads // (ROPE_THREADS // 32)), resident))
    mod.launch("fused_rms_rope_split_half", grid, ROPE_THREADS, params, stream, shared_bytes=ROPE_SHARED_BYTES)
    return q, k


# ---- the row kernels of a LayerNorm block (kernels/csrc/residual_norm.cu layer_norm_*, rms_norm_*) ---------------

class _LayerNormParams(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_row_stride", ctypes.c_int64), ("out", ctypes.c_void_p),
        ("out_row_stride", ctypes.c_int64), ("other", ctypes.c_void_p), ("other_row_stride", ctypes.c_int64),
        ("gate", ctypes.c_void_p), ("gate_row_stride", ctypes.c_int64), ("mod_index", ctypes.c_void_p),
        ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("eps", ctypes.c_float), ("mean", ctypes.c_void_p),
        ("rstd", ctypes.c_void_p), ("norm_weight", ctypes.c_void_p), ("norm_bias", ctypes.c_void_p),
        ("mod_scale", ctypes.c_void_p), ("mod_shift", ctypes.c_void_p), ("mod_row_stride", ctypes.c_int64),
        ("out_scale", _GlobalScaleOut),
    ]


class _RmsRopeRowParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("q_row_stride", ctypes.c_int64), ("k", ctypes.c_void_p),
        ("k_row_stride", ctypes.c_int64), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
        ("q_weight", ctypes.c_void_p), ("k_weight", ctypes.c_void_p), ("eps", ctypes.c_float),
        ("freqs", ctypes.c_void_p), ("positions", ctypes.c_int64), ("head_dim", ctypes.c_int32),
    ]


_ROW_DTYPES = (torch.bfloat16, torch.float16)


def _column_table_refusal(name: str, t: torch.Tensor, x: torch.Tensor) -> str | None:
    if t.dtype != x.dtype or tuple(t.shape) != (x.shape[1],) or not t.is_contiguous() or t.data_ptr() % 16 \
            or t.device != x.device:
        return f"the {name} must be a contiguous, 16-byte aligned {x.dtype} [{x.shape[1]}] tensor on {x.device}"
    return None


def _row_refusal(x: torch.Tensor, what: str = "activation") -> str | None:
    """The rows every row kernel reads (torch's vectorized layer_norm / rms_norm kernel runs for these too): 2-D, bf16
    or fp16 on the GPU, a width that is a multiple of 16 up to ROW_NORM_MAX_COLS, 16-byte aligned rows."""
    if not x.is_cuda or x.dtype not in _ROW_DTYPES or x.dim() != 2:
        return f"the {what} must be a 2-D bf16 or fp16 CUDA tensor"
    k = x.shape[1]
    if k % 16 or k > ROW_NORM_MAX_COLS:
        return f"the width {k} is not a multiple of 16 up to {ROW_NORM_MAX_COLS}"
    if not _aligned(x):
        return f"the {what} rows must be 16-byte aligned with unit column stride"
    if x.shape[0] * max(x.stride(0), k) >= 2**31:
        return f"the {what} is too large for one launch"
    return None


def _layer_norm_tables_refusal(norm: LayerNorm, modulation: AddcmulModulation | None) -> str | None:
    """Alignment of what the kernels read besides the rows (layout.layer_norm_source_refusal has the shapes)."""
    if norm.weight is not None:
        for name, t in (("LayerNorm weight", norm.weight), ("LayerNorm bias", norm.bias)):
            if not t.is_contiguous() or t.data_ptr() % 16:
                return f"the {name} must be contiguous and 16-byte aligned"
    if modulation is not None and not (_aligned(modulation.scale) and _aligned(modulation.shift)):
        return "the modulation tables must be 16-byte aligned with unit column stride"
    if not (norm.mean.is_contiguous() and norm.rstd.is_contiguous()):
        return "the LayerNorm statistics must be contiguous"
    return None


def layer_norm_support(x: torch.Tensor, norm: LayerNorm, *, modulation: AddcmulModulation | None = None,
                       global_scale_out: torch.Tensor | None = None) -> str | None:
    """None if the kernels reproduce torch's CUDA ``layer_norm`` statistics of ``x`` (and, with ``global_scale_out``,
    the dynamic global scale of the next projection's input, the norm followed by ``modulation`` or with its affine
    parameters), else why not."""
    reason = _row_refusal(x)
    if reason is not None:
        return reason
    if (norm.weight is None) != (norm.bias is None):
        return "a LayerNorm with a weight but no bias (or the reverse): torch's kernel takes another branch"
    for name, t in (("LayerNorm weight", norm.weight), ("LayerNorm bias", norm.bias)):
        if t is not None:
            reason = _column_table_refusal(name, t, x)
            if reason is not None:
                return reason
    for name, t in (("mean", norm.mean), ("rstd", norm.rstd)):
        if t.dtype != torch.float32 or tuple(t.shape) != (x.shape[0],) or not t.is_contiguous() or t.device != x.device:
            return f"the LayerNorm {name} must be a contiguous fp32 [M] tensor on the activation's device"
    if global_scale_out is not None:
        if global_scale_out.dtype != torch.float32 or global_scale_out.numel() != 1 \
                or global_scale_out.device != x.device:
            return "global_scale_out must be an fp32 one-element tensor on the activation's device"
        reason = source_refusal(x, layer_norm=norm, addcmul_modulation=modulation)
        if reason is None:
            reason = _layer_norm_tables_refusal(norm, modulation)
        if reason is not None:
            return f"the next projection's input: {reason}"
    elif modulation is not None:
        return "a modulation is only read for the next projection's amax (global_scale_out)"
    return None


def residual_layer_norm_support(x: torch.Tensor, other: torch.Tensor, next_norm: LayerNorm, *,
                                gate: torch.Tensor | None = None, mod_index: torch.Tensor | None = None,
                                out: torch.Tensor | None = None, next_modulation: AddcmulModulation | None = None,
                                global_scale_out: torch.Tensor | None = None) -> str | None:
    """None if :func:`residual_layer_norm_` takes these tensors, else why not."""
    for name, t in (("x", x), ("other", other), ("out", out if out is not None else x)):
        reason = _row_refusal(t, name)
        if reason is not None:
            return reason
        if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
            return f"{name} must be a {x.dtype} {tuple(x.shape)} tensor on {x.device}, like x"
    if gate is not None:
        if gate.dtype != x.dtype or gate.dim() != 2 or gate.shape[1] != x.shape[1] or not _aligned(gate) \
                or gate.device != x.device:
            return f"the gate table must be a 16-byte aligned {x.dtype} [rows, {x.shape[1]}] tensor on {x.device}"
    if gate is not None or next_modulation is not None:
        index = mod_index if mod_index is not None else getattr(next_modulation, "mod_index", None)
        if index is None or index.dtype != torch.int32 or tuple(index.shape) != (x.shape[0],) \
                or index.device != x.device:
            return "the modulation index must be int32 [M] on the activation's device"
        if next_modulation is not None and mod_index is not None and next_modulation.mod_index is not mod_index:
            return "the gate and the next modulation read one modulation index"
    return layer_norm_support(x, next_norm, modulation=next_modulation, global_scale_out=global_scale_out)


def _layer_norm_launch(kernel: str, x: torch.Tensor, norm: LayerNorm, *, out=None, other=None, gate=None,
                       mod_index=None, modulation: AddcmulModulation | None = None, global_scale_out=None) -> None:
    mod = module_for(x.device, RESIDUAL_NORM)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    params = _LayerNormParams(x.data_ptr(), x.stride(0))
    params.rows, params.cols, params.eps = x.shape[0], x.shape[1], float(norm.eps)
    params.mean, params.rstd = norm.mean.data_ptr(), norm.rstd.data_ptr()
    if other is not None:
        params.out, params.out_row_stride = out.data_ptr(), out.stride(0)
        params.other, params.other_row_stride = other.data_ptr(), other.stride(0)
    if gate is not None:
        params.gate, params.gate_row_stride = gate.data_ptr(), gate.stride(0)
    index = mod_index if mod_index is not None else (modulation.mod_index if modulation is not None else None)
    if index is not None:
        params.mod_index = index.data_ptr()
    if global_scale_out is not None:
        if modulation is not None:
            params.mod_scale, params.mod_shift = modulation.scale.data_ptr(), modulation.shift.data_ptr()
            params.mod_row_stride = modulation.scale.stride(0)
        else:
            params.norm_weight, params.norm_bias = norm.weight.data_ptr(), norm.bias.data_ptr()
        params.out_scale = _global_scale_out(x.device, stream, global_scale_out)
    threads = LAUNCH["ROW_NORM_THREADS"]
    shared = ROW_NORM_SHARED_BYTES if global_scale_out is not None else 0  # the amax pass reads the staged row
    grid = max(1, min(-(-x.shape[0] // (threads // 32)), mod.sm_count * 16))  # one warp per row
    mod.launch(kernel, grid, threads, params, stream, shared_bytes=shared)


def _layer_norm_kernel(residual: str, norm: LayerNorm, modulation, global_scale_out, dtype) -> str:
    amax = "stats" if global_scale_out is None else "modulated_amax" if modulation is not None else "affine_amax"
    return f"fused_{residual}layer_norm_{amax}{KERNEL_SUFFIX[dtype]}"


def layer_norm_statistics(x: torch.Tensor, norm: LayerNorm, *, modulation: AddcmulModulation | None = None,
                          global_scale_out: torch.Tensor | None = None) -> None:
    """Write torch's CUDA ``layer_norm`` statistics of every row of ``x`` (bf16 or fp16) into ``norm.mean`` and
    ``norm.rstd``; with ``global_scale_out``, also ComfyUI's dynamic global scale of the next projection's input:
    ``addcmul(shift, layer_norm(x), 1 + scale)`` with ``modulation`` (norm without affine parameters), else the
    norm with its weight and bias. One read of ``x``; the norm's output is never written."""
    reason = layer_norm_support(x, norm, modulation=modulation, global_scale_out=global_scale_out)
    if reason is not None:
        raise ValueError(reason)
    _layer_norm_launch(_layer_norm_kernel("", norm, modulation, global_scale_out, x.dtype), x, norm,
                       modulation=modulation, global_scale_out=global_scale_out)


def residual_layer_norm_(x: torch.Tensor, other: torch.Tensor, next_norm: LayerNorm, *,
                         gate: torch.Tensor | None = None, mod_index: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, next_modulation: AddcmulModulation | None = None,
                         global_scale_out: torch.Tensor | None = None) -> torch.Tensor:
    """ComfyUI's residual of a LayerNorm block, ``out[r] = addcmul(x[r], other[r], gate[mod_index[r]])`` (``gate``
    given) or ``x[r] + other[r]`` (torch's CUDA arithmetic on bf16 / fp16), written to ``out`` (default: ``x``, in
    place), and in the same pass :func:`layer_norm_statistics` of the new rows with ``next_norm`` (and the next
    projection's global scale with ``global_scale_out``). Returns ``out``."""
    out = x if out is None else out
    reason = residual_layer_norm_support(x, other, next_norm, gate=gate, mod_index=mod_index, out=out,
                                         next_modulation=next_modulation, global_scale_out=global_scale_out)
    if reason is not None:
        raise ValueError(reason)
    residual = "gated_residual_" if gate is not None else "add_residual_"
    _layer_norm_launch(_layer_norm_kernel(residual, next_norm, next_modulation, global_scale_out, x.dtype), x,
                       next_norm, out=out, other=other, gate=gate, mod_index=mod_index, modulation=next_modulation,
                       global_scale_out=global_scale_out)
    return out


def rms_norm_rope_support(q: torch.Tensor, k: torch.Tensor | None, q_weight: torch.Tensor,
                          k_weight: torch.Tensor | None, *, freqs: torch.Tensor | None = None,
                          positions: int | None = None) -> str | None:
    """None if :func:`rms_norm_rope_` takes these tensors, else why not."""
    for name, t, w in (("q", q, q_weight), ("k", k, k_weight)):
        if t is None:
            continue
        reason = _row_refusal(t, name)
        if reason is not None:
            return reason
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            return "q and k must have one shape, dtype and device"
        reason = _column_table_refusal(f"{name} norm weight", w, t) if w is not None else f"no {name} norm weight"
        if reason is not None:
            return reason
    if freqs is None:
        return None
    if positions is None or positions <= 0 or q.shape[0] % positions:
        return f"the rows ({q.shape[0]}) must be whole batch items of {positions} positions"
    if freqs.dtype != torch.float32 or freqs.dim() != 4 or tuple(freqs.shape[2:]) != (2, 2) or freqs.device != q.device:
        return "the rope table must be fp32 [positions, head_dim / 2, 2, 2] on q's device"
    head_dim = 2 * freqs.shape[1]
    if head_dim % 8 or q.shape[1] % head_dim or freqs.shape[0] < positions:
        return f"head_dim {head_dim} (from the rope table) must be a multiple of 8 dividing the width {q.shape[1]}, " \
               f"with a rotation for each of the {positions} positions"
    if not freqs.is_contiguous() or freqs.data_ptr() % 16:
        return "the rope table must be contiguous and 16-byte aligned"
    return None


def rms_norm_rope_(q: torch.Tensor, k: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor | None,
                   eps: float, *, freqs: torch.Tensor | None = None, positions: int | None = None):
    """In place on ``q`` (and ``k``): torch's CUDA ``rms_norm`` over the full width (``[M, D]`` rows, weights
    ``[D]``), then with ``freqs`` comfy-kitchen's interleaved RoPE (``apply_rope1``) of each head: row ``r`` rotates
    with ``freqs[r % positions]``, ``freqs`` fp32 ``[positions, head_dim / 2, 2, 2]`` (ComfyUI's rope table without
    its unit dimensions). One read and one write of each element. Returns ``(q, k)``."""
    reason = rms_norm_rope_support(q, k, q_weight, k_weight, freqs=freqs, positions=positions)
    if reason is not None:
        raise ValueError(reason)
    mod = module_for(q.device, RESIDUAL_NORM)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    params = _RmsRopeRowParams(q.data_ptr(), q.stride(0), k.data_ptr() if k is not None else None,
                               k.stride(0) if k is not None else 0, q.shape[0], q.shape[1], q_weight.data_ptr(),
                               k_weight.data_ptr() if k is not None else None, float(eps))
    if freqs is not None:
        params.freqs, params.positions, params.head_dim = freqs.data_ptr(), positions, 2 * freqs.shape[1]
    kernel = ("fused_rms_norm_rope" if freqs is not None else "fused_rms_norm_rows") + KERNEL_SUFFIX[q.dtype]
    threads = LAUNCH["ROW_NORM_THREADS"]
    units = q.shape[0] * (2 if k is not None else 1)
    grid = max(1, min(-(-units // (threads // 32)), mod.sm_count * 16))  # one warp per row
    mod.launch(kernel, grid, threads, params, stream, shared_bytes=ROW_NORM_SHARED_BYTES)
    return q, k
