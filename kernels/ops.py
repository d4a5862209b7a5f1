"""Host wrappers of the fused kernels: validate, allocate once, launch on torch's current stream.

Public functions (all bit-identical to ComfyUI's stock ops followed by comfy-kitchen's CUDA packer):

* :func:`pack_nvfp4` - NVFP4-pack an activation read through a *source* (plain rows, adaLN-modulated rows,
  or SwiGLU of an fc1 output), with a dynamic (device-computed) or static global scale.
* :func:`gated_residual_` - ``x[r] += other[r] * gate[mod_index[r]]`` in place.
* :func:`rms_rope_split_half_` - comfy-kitchen's per-head RMSNorm + split-half RoPE for H3's q/k views, in place.
* :func:`pack_support`, :func:`rms_rope_support` - ``None`` if the kernel can take these tensors, else the reason
  (callers fall back to ComfyUI's path with that reason instead of raising in the user's graph).
* :func:`silu_table` - torch's bf16 silu of all 65,536 bf16 values, built once per device; the SwiGLU pack looks
  silu up in it (from shared memory) where 128 KB of shared memory per CTA is available.

Layouts (must match reference/nvfp4.py and kernels/nvfp4_pack.cu): qdata ``uint8 [roundup(M,16), K/2]``
with the even element in the high nibble; block scales ``float8_e4m3fn [roundup(roundup(M,16),128),
roundup(K/16,4)]`` in cuBLAS's 128x4 tiled layout, padding bytes 0.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from . import runtime

# ---- ctypes mirrors of the kernel parameter structs (must match nvfp4_pack.cu) ----------------------------


class _SourceParams(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_row_stride", ctypes.c_int64), ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64), ("up_offset", ctypes.c_int64), ("mod_scale", ctypes.c_void_p),
        ("mod_shift", ctypes.c_void_p), ("mod_row_stride", ctypes.c_int64), ("mod_index", ctypes.c_void_p),
        ("silu_table", ctypes.c_void_p),
    ]


class _PackParams(ctypes.Structure):
    _fields_ = [
        ("src", _SourceParams), ("global_scale", ctypes.c_void_p), ("qdata", ctypes.c_void_p),
        ("scales", ctypes.c_void_p), ("rows16", ctypes.c_int64), ("rows128", ctypes.c_int64),
        ("groups", ctypes.c_int64),
    ]


class _AbsmaxParams(ctypes.Structure):
    _fields_ = [
        ("src", _SourceParams), ("workspace", ctypes.c_void_p), ("global_scale_out", ctypes.c_void_p),
        ("alpha_out", ctypes.c_void_p), ("weight_scale_2", ctypes.c_void_p),
    ]


class _GatedResidualParams(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("x_row_stride", ctypes.c_int64), ("other", ctypes.c_void_p),
        ("other_row_stride", ctypes.c_int64), ("gate", ctypes.c_void_p), ("gate_row_stride", ctypes.c_int64),
        ("mod_index", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
    ]


# Launch shape; must match the defaults in nvfp4_pack.cu. TUNING_DEFINES overrides both (benchmarks only).
DEFAULT_TUNING = {"PACK_THREADS": 256, "ABSMAX_THREADS": 512, "ITEMS": 1, "ABSMAX_CTAS_PER_SM": 4,
                  "SILU_TABLE_THREADS": 512, "SILU_TABLE": 1}
RESIDUAL_THREADS = 256
TUNING_DEFINES: tuple = ()


def _module(device: torch.device):
    mod = runtime.module(device.index, defines=TUNING_DEFINES)
    tuning = {**DEFAULT_TUNING, **{k: int(v) for k, v in mod.defines.items() if k in DEFAULT_TUNING}}
    return mod, tuning


def _roundup(v: int, m: int) -> int:
    return (v + m - 1) // m * m


# ---- sources ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Modulation:
    """adaLN modulation applied on the fly: ``h = bf16(bf16(x * bf16(1 + scale[m])) + shift[m])``.

    ``scale``/``shift``: bf16 ``[rows, K]`` tables (row stride free, unit column stride), ``mod_index``: int32
    ``[M]`` on the device, the table row of every token.
    """

    scale: torch.Tensor
    shift: torch.Tensor
    mod_index: torch.Tensor


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.dim() < 2 or t.stride(0) % 8 == 0)


def pack_support(x: torch.Tensor, *, swiglu: bool = False, modulation: Modulation | None = None) -> str | None:
    """``None`` if the fused pack accepts these inputs, otherwise a human-readable reason."""
    if not x.is_cuda:
        return "the activation is not on a CUDA device"
    if x.dtype != torch.bfloat16:
        return f"the activation is {x.dtype}, the fused pack takes bfloat16"
    if x.dim() != 2:
        return f"the activation must be 2-D, got {x.dim()}-D"
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    if k % 16 or (swiglu and x.shape[1] % 2):
        return f"the feature width {k} is not a multiple of 16"
    if not _aligned(x):
        return "the activation rows are not 16-byte aligned with unit column stride"
    if modulation is not None:
        for name in ("scale", "shift"):
            t = getattr(modulation, name)
            if t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != k or not _aligned(t) or t.device != x.device:
                return f"the modulation {name} table must be bf16 [rows, {k}], 16-byte aligned, on {x.device}"
        if modulation.scale.stride() != modulation.shift.stride():
            return "the modulation scale and shift tables must share one row stride"
        idx = modulation.mod_index
        if idx.dtype != torch.int32 or idx.shape != (x.shape[0],) or idx.device != x.device:
            return "the modulation index must be int32 [M] on the activation's device"
    if _roundup(x.shape[0], 128) * (_roundup(k // 16, 4) // 4) * 8 >= 2**31:
        return "the activation is too large for one launch"  # the kernels index with 32-bit integers
    return None


def _source(x: torch.Tensor, k: int, swiglu: bool, modulation: Modulation | None) -> _SourceParams:
    src = _SourceParams(x.data_ptr(), x.stride(0), x.shape[0], k, k if swiglu else 0, None, None, 0, None)
    if modulation is not None:
        src.mod_scale = modulation.scale.data_ptr()
        src.mod_shift = modulation.shift.data_ptr()
        src.mod_row_stride = modulation.scale.stride(0)
        src.mod_index = modulation.mod_index.data_ptr()
    return src


def _variant(swiglu: bool, modulation: Modulation | None) -> str:
    if swiglu and modulation is not None:
        raise ValueError("a source is either SwiGLU or modulated, not both")
    return "swiglu" if swiglu else ("modulate" if modulation is not None else "plain")


# ---- global-scale workspace: {amax bits, finished-CTA counter}, re-armed by the kernel itself -------------

_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_workspace_lock = threading.Lock()


def _workspace(device: torch.device, stream: int) -> torch.Tensor:
    key = (device.index, stream)
    ws = _workspaces.get(key)
    if ws is None:
        with _workspace_lock:
            ws = _workspaces.setdefault(key, torch.zeros(2, dtype=torch.int32, device=device))
    return ws


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


def _silu_table_fits(mod) -> bool:
    """The table kernel needs 128 KB of shared memory per CTA (sm_90 / sm_100 have 227 KB, sm_120 has 99 KB)."""
    return mod.max_shared_per_block >= SILU_TABLE_SHARED_BYTES


# ---- public API -------------------------------------------------------------------------------------------

@dataclass
class PackedActivation:
    qdata: torch.Tensor         # uint8 [rows16, K/2]
    block_scales: torch.Tensor  # float8_e4m3fn [rows128, roundup(K/16, 4)], swizzled
    global_scale: torch.Tensor  # fp32 [1]
    alpha: torch.Tensor | None  # fp32 [1]: global_scale * weight_scale_2 (dynamic mode with a weight scale)
    rows: int
    cols: int


def _buffer_layout(rows: int, k: int) -> tuple[int, int, int, int, int]:
    """(qdata bytes, scale offset, scale bytes, scalar offset, total bytes) of the single output buffer."""
    rows16 = _roundup(rows, 16)
    q_bytes = rows16 * (k // 2)
    s_off = _roundup(q_bytes, 256)
    s_bytes = _roundup(rows16, 128) * _roundup(k // 16, 4)
    g_off = _roundup(s_off + s_bytes, 16)
    return q_bytes, s_off, s_bytes, g_off, g_off + 8


def packed_buffer_bytes(rows: int, k: int) -> int:
    """Size of the uint8 buffer :func:`pack_nvfp4` writes (pass one as ``out`` to reuse or poison it)."""
    return _buffer_layout(rows, k)[4]


def pack_nvfp4(
    x: torch.Tensor,
    *,
    static_scale: torch.Tensor | None = None,
    weight_scale_2: torch.Tensor | None = None,
    swiglu: bool = False,
    modulation: Modulation | None = None,
    out: torch.Tensor | None = None,
) -> PackedActivation:
    """NVFP4-pack ``h = source(x)`` exactly like comfy-kitchen's CUDA ``quantize_nvfp4`` after ComfyUI's ops.

    Args:
        x: bf16 ``[M, K]`` (``[M, 2K]`` fc1 output for ``swiglu=True``: gate half first), any row stride that
            keeps rows 16-byte aligned; read in place.
        out: optional contiguous uint8 buffer of :func:`packed_buffer_bytes` bytes to write into.
        static_scale: fp32 one-element device tensor (the layer's ``input_scale``); ``None`` = dynamic scale
            ``bf16(amax|h| / 2688)`` computed on the device in one extra launch.
        weight_scale_2: fp32 one-element device tensor; in dynamic mode the GEMM alpha (activation scale x
            weight scale) is written next to the global scale, so no follow-up launch computes it.
        swiglu / modulation: the source, see the module docstring.

    Two launches in dynamic mode (reduction, pack), one in static mode; no host sync, one allocation.
    """
    reason = pack_support(x, swiglu=swiglu, modulation=modulation)
    if reason is not None:
        raise ValueError(reason)
    variant = _variant(swiglu, modulation)
    rows = x.shape[0]
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    rows16 = _roundup(rows, 16)
    rows128 = _roundup(rows16, 128)
    groups = _roundup(k // 16, 4) // 4
    q_bytes, s_off, s_bytes, g_off, total = _buffer_layout(rows, k)
    if out is None:
        buf = torch.empty(total, dtype=torch.uint8, device=x.device)  # qdata | scales | g, alpha
    elif out.dtype != torch.uint8 or out.numel() < total or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous uint8 buffer of at least {total} bytes on {x.device}")
    else:
        buf = out.reshape(-1)
    qdata = buf[:q_bytes].view(rows16, k // 2)
    scales = buf[s_off:s_off + s_bytes].view(rows128, groups * 4).view(torch.float8_e4m3fn)
    scalars = buf[g_off:g_off + 8].view(torch.float32)

    mod, tuning = _module(x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    src = _source(x, k, swiglu, modulation)
    alpha = None
    if static_scale is None:
        want_alpha = weight_scale_2 is not None
        params = _AbsmaxParams(
            src, _workspace(x.device, stream).data_ptr(), scalars.data_ptr(),
            scalars.data_ptr() + 4 if want_alpha else None,
            weight_scale_2.data_ptr() if want_alpha else None,
        )
        chunks = rows * (k // 8)
        threads = tuning["ABSMAX_THREADS"]
        grid = max(1, min(-(-chunks // (threads * tuning["ITEMS"])), mod.sm_count * tuning["ABSMAX_CTAS_PER_SM"]))
        mod.launch(f"nvfp4_absmax_{variant}", grid, threads, params, stream)
        global_scale = scalars[0:1]
        alpha = scalars[1:2] if want_alpha else None
    else:
        global_scale = static_scale.reshape(1)
    kernel, threads, shared = f"nvfp4_pack_{variant}", tuning["PACK_THREADS"], 0
    grid = max(1, min(-(-rows128 // (threads // 32)), mod.sm_count * 64))  # one warp per row
    if variant == "swiglu" and tuning["SILU_TABLE"] and _silu_table_fits(mod):
        src.silu_table = silu_table(x.device).data_ptr()
        kernel, threads, shared = "nvfp4_pack_swiglu_table", tuning["SILU_TABLE_THREADS"], SILU_TABLE_SHARED_BYTES
        grid = max(1, min(-(-rows128 // (threads // 32)), mod.sm_count))  # one CTA per SM, persistent
    params = _PackParams(src, global_scale.data_ptr(), qdata.data_ptr(), scales.view(torch.uint8).data_ptr(),
                         rows16, rows128, groups)
    mod.launch(kernel, grid, threads, params, stream, shared_bytes=shared)
    return PackedActivation(qdata, scales, global_scale, alpha, rows, k)


def gated_residual_(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor, mod_index: torch.Tensor) -> torch.Tensor:
    """In place ``x[r] = bf16(x[r] + other[r] * gate[mod_index[r]])``, torch's CUDA ``addcmul_`` arithmetic."""
    for name, t in (("x", x), ("other", other), ("gate", gate)):
        if t.dtype != torch.bfloat16 or t.dim() != 2 or not _aligned(t) or t.device != x.device:
            raise ValueError(f"{name} must be a 16-byte aligned bf16 2-D tensor on {x.device}")
    if other.shape != x.shape or gate.shape[1] != x.shape[1] or x.shape[1] % 8:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, other {tuple(other.shape)}, gate {tuple(gate.shape)}")
    if mod_index.dtype != torch.int32 or mod_index.shape != (x.shape[0],):
        raise ValueError("mod_index must be int32 [M]")
    mod, _ = _module(x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    params = _GatedResidualParams(
        x.data_ptr(), x.stride(0), other.data_ptr(), other.stride(0), gate.data_ptr(), gate.stride(0),
        mod_index.data_ptr(), x.shape[0], x.shape[1],
    )
    chunks = x.shape[0] * (x.shape[1] // 8)
    grid = max(1, min(-(-chunks // RESIDUAL_THREADS), mod.sm_count * 32))
    mod.launch("h3_gated_residual", grid, RESIDUAL_THREADS, params, stream)
    return x


# ---- per-head RMSNorm + split-half RoPE (kernels/h3_rms_rope.cu) -------------------------------------------

class _RmsRopeParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("row_stride", ctypes.c_int64), ("freqs", ctypes.c_void_p),
        ("q_weight", ctypes.c_void_p), ("k_weight", ctypes.c_void_p), ("tokens", ctypes.c_int64),
        ("heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("rot_dim", ctypes.c_int32), ("eps", ctypes.c_float),
    ]


ROPE_THREADS = 256  # must match h3_rms_rope.cu
ROPE_HEAD_DIM, ROPE_ROT_DIM = 128, 96
ROPE_THREADS_PER_HEAD = 8  # must match h3_rms_rope.cu; each thread accesses 8 bytes at a time


def rms_rope_support(q, k, freqs, q_weight, k_weight, rot_dim) -> str | None:
    """``None`` if :func:`rms_rope_split_half_` takes these tensors (H3's layout), else the reason."""
    if not (q.is_cuda and k.is_cuda and freqs.is_cuda):
        return "not on a CUDA device"
    if any(t.dtype != torch.bfloat16 for t in (q, k, freqs, q_weight, k_weight)):
        return "q, k, rope table and norm weights must all be bfloat16"
    if q.dim() != 4 or q.shape != k.shape or q.shape[0] != 1 or q.shape[-1] != ROPE_HEAD_DIM or rot_dim != ROPE_ROT_DIM:
        return f"only [1, S, H, {ROPE_HEAD_DIM}] q/k with rot_dim {ROPE_ROT_DIM} (H3) are handled"
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
    if any(t.data_ptr() % 8 for t in (q, k, q_weight, k_weight)) or q.stride(1) % 4:
        return "q, k and the norm weights must be 8-byte aligned (the kernel makes 8-byte accesses)"
    return None


def rms_rope_split_half_(q, k, freqs, q_weight, k_weight, epsilon: float, rot_dim: int):
    """In place: comfy-kitchen's ``rms_rope_split_half_`` for H3's layout, same bits, one read and one write."""
    reason = rms_rope_support(q, k, freqs, q_weight, k_weight, rot_dim)
    if reason is not None:
        raise ValueError(reason)
    mod = runtime.module(q.device.index, source="h3_rms_rope.cu", defines=TUNING_DEFINES)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    tokens, heads = q.shape[1], q.shape[2]
    params = _RmsRopeParams(q.data_ptr(), k.data_ptr(), q.stride(1), freqs.data_ptr(), q_weight.data_ptr(),
                            k_weight.data_ptr(), tokens, heads, ROPE_HEAD_DIM, rot_dim, float(epsilon))
    grid = max(1, min(-(-(tokens * heads) // (ROPE_THREADS // ROPE_THREADS_PER_HEAD)), mod.sm_count * 32))
    mod.launch("h3_rms_rope_split_half", grid, ROPE_THREADS, params, stream)
    return q, k
