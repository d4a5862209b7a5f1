"""The self-check's probes of the NVFP4 Linear path, and the byte comparison every probe uses.

Each probe runs a fused op on small probe tensors (random rows plus ties, zeros, -0.0, scale underflow, NaN, +-Inf,
subnormals, rows that are not a multiple of 16 or 128, a strided view) and ComfyUI's own op sequence on the same
input, and returns None (bit-identical) or where the bytes first differ. Model fusions add their own probe sets
(models/*/probes.py); core/verdicts.py runs them and keeps the verdicts.

fp16 activations have probes of their own (``*_f16``), with fp16's hard cases: its subnormals, its overflow at 65504
(in a ``pre_quant_scale`` product, or in the table's cast), and global scales that round up and down in fp16, land in
its subnormals or on 0 (amax below about 0.16 and 8e-5).
"""

from __future__ import annotations

import torch

from .. import comfy_adapter
from .linear import FusedNVFP4Linear
from .nvfp4_weights import make_nvfp4_linear
from .verdicts import ProbeSet

# ---- byte comparison ---------------------------------------------------------------------------------------


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def first_difference(what: str, fused: torch.Tensor, comfy: torch.Tensor) -> str | None:
    """None if the two tensors hold the same bytes, else where they first differ and both values."""
    if tuple(fused.shape) != tuple(comfy.shape) or fused.dtype != comfy.dtype:
        return f"{what}: shape/dtype {tuple(fused.shape)} {fused.dtype} vs ComfyUI's {tuple(comfy.shape)} {comfy.dtype}"
    a, b = _as_bytes(fused), _as_bytes(comfy)
    ne = (a != b).nonzero()
    if ne.numel() == 0:
        return None
    item = fused.element_size()
    i = int(ne[0]) // item
    flat_f, flat_c = fused.detach().contiguous().reshape(-1), comfy.detach().contiguous().reshape(-1)
    fv, cv = flat_f[i], flat_c[i]
    show = (lambda v: f"{float(v.float()):.9g}") if fused.is_floating_point() else (lambda v: f"0x{int(v):02x}")
    index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), tuple(fused.shape))) if fused.dim() else ()
    return (f"{what} differs at index {index} (fused {show(fv)}, ComfyUI {show(cv)}; "
            f"{ne.numel()} bytes differ)")


def compare_packed(label, packed, qt) -> str | None:
    """A packed activation against ComfyUI's QuantizedTensor of the same input: global scale, codes, block scales."""
    return (first_difference(f"{label} global scale", packed.global_scale.reshape(-1), qt._params.scale.reshape(-1))
            or first_difference(f"{label} codes", packed.qdata, qt._qdata)
            or first_difference(f"{label} block scales", packed.block_scales.view(torch.uint8),
                                qt._params.block_scale.view(torch.uint8)))


def comfy_quantized(h: torch.Tensor, scale: float | None):
    """ComfyUI's NVFP4 quantization of ``h`` (dynamic scale, or the static ``scale``)."""
    s = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=h.device)
    return comfy_adapter.quantize_like_comfy(h.contiguous(), s)


def static_scale(scale: float | None, device) -> torch.Tensor | None:
    return None if scale is None else torch.tensor([scale], dtype=torch.float32, device=device)


def comfy_rms_norm(k: int, weight: torch.Tensor, eps: float):
    """ComfyUI's RMSNorm module of an NVFP4 checkpoint (mixed-precision ops), holding ``weight``: what a model block
    normalizes with."""
    ops = comfy_adapter.mixed_precision_ops(torch.bfloat16, disabled=[])
    norm = ops.RMSNorm(k, eps=eps, elementwise_affine=True, dtype=torch.bfloat16, device=weight.device)
    norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return norm


# ---- probe tensors -----------------------------------------------------------------------------------------

def probe_activations(device, k: int = 1056, seed: int = 7) -> dict[str, tuple[torch.Tensor, float | None]]:
    """Named probe activations and the static scale each is packed with (None: dynamic)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = 129  # not a multiple of 16 or 128
    random = (torch.randn((rows, k), generator=gen) * 2.0).to(torch.bfloat16).to(device)
    # Hard cases, static scale 1 so that E2M1 boundaries are exact ties: one 16-block per pattern.
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    patterns = [
        ties,
        [0.0] * 16,
        [-0.0] * 16,
        [1e-30] * 8 + [-1e-30] * 8,                          # block scale underflows to 0
        [2.0 ** -130, -(2.0 ** -133)] * 8,                   # bf16 subnormals
        [3.0e38, -3.0e38] + [1.0] * 14,                      # huge
        [float("nan")] + [1.0] * 15,
        [float("inf"), -1.0] + [0.5] * 14,
        [float("-inf")] + [0.0] * 15,
        [0.125 * (i - 8) for i in range(16)],
    ]
    hard = torch.zeros((33, 512), dtype=torch.float32)
    hard[:] = torch.randn((33, 512), generator=gen)
    for r, pattern in enumerate(patterns):
        hard[r, 16 * r:16 * r + 16] = torch.tensor(pattern)
        hard[r + len(patterns), 16 * (r + 1):16 * (r + 1) + 16] = torch.tensor(pattern) * 0.5
    hard = hard.to(torch.bfloat16).to(device)
    wide = (torch.randn((40, k + 64), generator=gen)).to(torch.bfloat16).to(device)
    finite_hard = torch.nan_to_num(hard.float(), nan=0.0, posinf=5.0, neginf=-5.0).to(torch.bfloat16)
    return {
        "random rows, dynamic scale": (random, None),
        "random rows, static scale": (random, 2.0 / 2688 * 1.5),
        "hard cases, static scale 1": (hard, 1.0),
        "hard cases without NaN/inf, dynamic scale": (finite_hard.to(device), None),
        "hard cases with NaN/inf, dynamic scale": (hard, None),
        "strided view, dynamic scale": (wide[:, 32:32 + k], None),
    }


F16 = torch.float16
# One 16-block per pattern, packed with static scale 1 (and dynamically, in rows of random values): fp16's hard cases.
F16_PATTERNS = [
    [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0],
    [0.0] * 16,
    [-0.0] * 16,
    [1e-7] * 8 + [-1e-7] * 8,                            # fp16 subnormals, block scale underflows to 0
    [2.0 ** -14, -(2.0 ** -24)] * 8,                     # smallest normal and subnormal
    [3.0 * 2.0 ** -20, -(5.0 * 2.0 ** -22)] * 8,         # subnormals with several significant bits
    [65504.0, -65504.0] + [1.0] * 14,                    # fp16's largest
    [float("nan")] + [1.0] * 15,
    [float("inf"), -1.0] + [0.5] * 14,
    [float("-inf")] + [0.0] * 15,
    [0.125 * (i - 8) for i in range(16)],
]


def probe_activations_f16(device, k: int = 528, seed: int = 9) -> dict[str, tuple[torch.Tensor, float | None]]:
    """Named fp16 probe activations and the static scale each is packed with (None: dynamic): random rows, fp16's
    hard cases, rows whose dynamic scale is an fp16 subnormal or 0, a strided view (smaller than the bf16 ones:
    the CPU self-check's time budget)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    random = (torch.randn((65, k), generator=gen) * 2.0).to(F16).to(device)
    hard = torch.randn((2 * len(F16_PATTERNS) + 1, 512), generator=gen)
    for r, pattern in enumerate(F16_PATTERNS):
        hard[r, 16 * r:16 * r + 16] = torch.tensor(pattern)
        hard[r + len(F16_PATTERNS), 16 * (r + 1):16 * (r + 1) + 16] = torch.tensor(pattern) * 0.5
    hard = hard.to(F16)
    finite_hard = torch.nan_to_num(hard.float(), nan=0.0, posinf=5.0, neginf=-5.0).to(F16)
    small = torch.randn((33, 256), generator=gen)
    wide = (torch.randn((20, k + 64), generator=gen)).to(F16).to(device)
    return {
        "fp16 random rows, dynamic scale": (random, None),
        "fp16 random rows, static scale": (random, 2.0 / 2688 * 1.5),
        "fp16 hard cases, static scale 1": (hard.to(device), 1.0),
        "fp16 hard cases without NaN/inf, dynamic scale": (finite_hard.to(device), None),
        "fp16 hard cases with NaN/inf, dynamic scale": (hard.to(device), None),
        "fp16 rows with a subnormal dynamic scale": ((small * 0.02).to(F16).to(device), None),
        "fp16 rows whose dynamic scale is 0": ((small * 1e-5).to(F16).to(device), None),
        "fp16 strided view, dynamic scale": (wide[:, 32:32 + k], None),
    }


def scale_rounding_amaxes_f16(count: int = 12) -> list[float]:
    """fp16 amax values whose ComfyUI scale ``amax * fp32(1/2688)`` rounds to fp16 upward and downward, with the
    scale an fp16 normal (amax from 1) and subnormal (amax from 0.01), and amaxes whose scale rounds to 0, to the
    smallest subnormal, and to the smallest normal."""
    inv = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    found = []
    for start in (1.0, 0.01):
        bits = int(torch.tensor(start, dtype=F16).view(torch.int16))
        up, down = [], []
        while len(up) < count // 4 or len(down) < count // 4:
            bits += 1
            value = torch.tensor([bits], dtype=torch.int16).view(F16)
            exact = value.float() * inv
            rounded = exact.to(F16).float()
            if rounded > exact and len(up) < count // 4:
                up.append(float(value))
            elif rounded < exact and len(down) < count // 4:
                down.append(float(value))
        found += up + down
    return found + [5e-5, 1e-4, 2.0 ** -14 * 2688]


def scale_rounding_amaxes(count: int = 12) -> list[float]:
    """bf16 amax values whose ComfyUI scale ``amax * fp32(1/2688)`` rounds to bf16 upward (half of them) and
    downward: any change of that rounding changes the scale of one of them."""
    inv = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    up, down = [], []
    bits = 0x3F80  # bf16 1.0, then every following bf16 value
    while len(up) < count // 2 or len(down) < count // 2:
        bits += 1
        value = torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16)
        low = int((value.float() * inv).view(torch.int32)) & 0xFFFF
        if low > 0x8000 and len(up) < count // 2:
            up.append(float(value))
        elif 0 < low < 0x8000 and len(down) < count // 2:
            down.append(float(value))
    return up + down


# ---- the probes --------------------------------------------------------------------------------------------

def check_global_scale(backend, device, dtype=torch.bfloat16) -> str | None:
    """ComfyUI's dynamic scale of ``dtype`` activations, at amaxes whose scale rounds up, down and (fp16) into the
    subnormals and to 0."""
    f16 = dtype == F16
    gen = torch.Generator(device="cpu").manual_seed(6 if f16 else 5)
    for amax in (scale_rounding_amaxes_f16() if f16 else scale_rounding_amaxes()):
        x = (torch.rand((17, 32), generator=gen) * 2 - 1) * amax * 0.9
        x[5, 7] = -amax
        x = x.to(dtype).to(device)
        label = f"{'fp16 ' if f16 else ''}dynamic scale of amax {amax}"
        diff = compare_packed(label, backend.pack_nvfp4(x), comfy_quantized(x, None))
        if diff:
            return diff
    return None


def check_global_scale_f16(backend, device) -> str | None:
    return check_global_scale(backend, device, F16)


def check_pack(backend, device, cases=probe_activations) -> str | None:
    for label, (x, scale) in cases(device).items():
        packed = backend.pack_nvfp4(x, static_scale=static_scale(scale, device))
        diff = compare_packed(label, packed, comfy_quantized(x, scale))
        if diff:
            return diff
    return None


def check_pack_f16(backend, device) -> str | None:
    return check_pack(backend, device, probe_activations_f16)


def prescale_table(k: int, seed: int = 11) -> torch.Tensor:
    """A ``pre_quant_scale`` table [k] in fp32 (as ModelOpt stores it): AWQ-like factors around 1, and hard entries:
    zeros, -0.0, negatives, values that overflow to inf or underflow to 0 / bf16 subnormals in the cast to bf16, and
    values whose cast is a rounding tie."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    table = torch.exp(torch.randn((k,), generator=gen) * 0.7)
    hard = [0.0, -0.0, -1.0, -0.37, 3.0e38, 3.4e38, -3.4e38, 1e-38, 2.0 ** -130, -(2.0 ** -133), 1e-45, 2.0 ** 100,
            2.0 ** -100, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 448.0, 1.0 / 448]
    table[:len(hard)] = torch.tensor(hard)
    table[k // 2:k // 2 + len(hard)] = torch.tensor(hard)
    return table


def prescale_activations(device, k: int = 1056, *, dtype=torch.bfloat16
                         ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float | None]]:
    """Named probe activations for the prescale pack, each with its fp32 table and static scale (None: dynamic):
    :func:`probe_activations` (fp16: :func:`probe_activations_f16`) times :func:`prescale_table` (fp16:
    :func:`prescale_table_f16`), and the same with the table's non-finite entries and extremes clamped."""
    f16 = dtype == F16
    acts = probe_activations_f16(device, k=k) if f16 else probe_activations(device, k=k)
    tag = "fp16 " if f16 else ""
    make_table, limit = (prescale_table_f16, 1e3) if f16 else (prescale_table, 1e4)
    random, _ = acts[f"{tag}random rows, dynamic scale"]
    finite_hard, _ = acts[f"{tag}hard cases without NaN/inf, dynamic scale"]
    hard, _ = acts[f"{tag}hard cases with NaN/inf, dynamic scale"]
    strided, _ = acts[f"{tag}strided view, dynamic scale"]
    table, hard_table = make_table(k), make_table(hard.shape[1])
    finite_table = torch.nan_to_num(table, posinf=2.0, neginf=-2.0).clamp(-limit, limit)
    return {
        f"{tag}random rows x hard table, dynamic scale": (random, table, None),
        f"{tag}random rows x finite table, static scale": (random, finite_table, 2.0 / 2688 * 1.5),
        f"{tag}hard cases x hard table, static scale 1": (hard, hard_table, 1.0),
        f"{tag}hard cases without NaN/inf x finite table, dynamic scale": (finite_hard, finite_table[:hard.shape[1]],
                                                                           None),
        f"{tag}strided view x finite table, dynamic scale": (strided, finite_table, None),
    }


def prescale_activations_f16(device, k: int = 528) -> dict[str, tuple[torch.Tensor, torch.Tensor, float | None]]:
    """The fp16 prescale probe cases (:func:`prescale_activations` for fp16 activations)."""
    return prescale_activations(device, k, dtype=F16)


def prescale_table_f16(k: int, seed: int = 13) -> torch.Tensor:
    """An fp32 ``pre_quant_scale`` table [k] for fp16 activations: :func:`prescale_table`'s entries (most of its hard
    ones overflow or underflow in the fp16 cast) and fp16's own: values just below, at and above its overflow
    threshold, its subnormals and the values whose cast is a rounding tie, and factors that push products of
    ordinary activations to +-inf (3e4) or into the fp16 subnormals (1e-6)."""
    table = prescale_table(k, seed)
    hard = [65504.0, 65519.0, 65520.0, 7e4, -7e4, 3e4, -3e4, 1e4, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-6, -1e-6,
            1e-5, 6e-5, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11]
    table[len(hard) + 20:2 * len(hard) + 20] = torch.tensor(hard)
    table[k // 2 + 20:k // 2 + 20 + len(hard)] = torch.tensor(hard)
    return table


def comfy_prescaled(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ComfyUI's NVFP4 Linear's first step: the input times ``pre_quant_scale`` cast to the input dtype."""
    return x * comfy_adapter.cast_to_device(table, x.device, x.dtype)


def check_pack_prescale(backend, device, cases=prescale_activations) -> str | None:
    """The pack of ``x * pre_quant_scale`` (the table cast to the activation dtype as ComfyUI casts it) against
    ComfyUI's multiply and quantizer."""
    for label, (x, table, scale) in cases(device).items():
        prescale = comfy_adapter.cast_to_device(table, torch.device(device), x.dtype).contiguous()
        packed = backend.pack_nvfp4(x, static_scale=static_scale(scale, device), prescale=prescale)
        diff = compare_packed(label, packed, comfy_quantized(comfy_prescaled(x, table), scale))
        if diff:
            return diff
    return None


def check_pack_prescale_f16(backend, device) -> str | None:
    return check_pack_prescale(backend, device, prescale_activations_f16)


def check_linear(backend, device, dtype=torch.bfloat16) -> str | None:
    """The fused NVFP4 Linear (pack + device-alpha GEMM) against the stock NVFP4 Linear forward."""
    layer = make_nvfp4_linear(5376, 256, seed=29, device=device, compute_dtype=dtype)
    fused = FusedNVFP4Linear(layer, "self-check linear")
    x, _ = probe_activations(device, k=5376)["random rows, dynamic scale"]
    x = x.to(dtype)
    with torch.inference_mode():
        stock, out = layer(x), fused(x)
    if fused.calls_fused != 1:
        return "the fused Linear refused the probe"
    return first_difference("NVFP4 Linear output", out, stock)


def check_linear_f16(backend, device) -> str | None:
    return check_linear(backend, device, F16)


def linear_comfy_source() -> str:
    """Hash of ComfyUI's NVFP4 Linear and quantizer classes (what the Linear path reproduces)."""
    try:
        ops = comfy_adapter.mixed_precision_ops()
        return comfy_adapter.source_hash([ops.Linear, comfy_adapter.quant_ops().TensorCoreNVFP4Layout])
    except Exception as exc:  # no ComfyUI (tests of the pack alone): the hash says so
        return f"unavailable: {type(exc).__name__}"


LINEAR_PROBES = ProbeSet(
    name="nvfp4_linear",
    probes={"global_scale": check_global_scale, "pack": check_pack, "pack_prescale": check_pack_prescale,
            "linear": check_linear, "global_scale_f16": check_global_scale_f16, "pack_f16": check_pack_f16,
            "pack_prescale_f16": check_pack_prescale_f16, "linear_f16": check_linear_f16},
    comfy_source=linear_comfy_source,
    shares_global_scale=("pack", "pack_prescale"),
    shares_global_scale_f16=("pack_f16", "pack_prescale_f16"),
    needs_fp4_gemm=("linear", "linear_f16"),
)
