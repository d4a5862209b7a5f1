"""The self-check's probes of the fused ops of Wan's block, in fp16 (ComfyUI's compute dtype for Wan on NVIDIA GPUs:
the ``*_f16`` ops) and bf16.

Each probe runs fused ops on probe tensors and ComfyUI's own ops on the same input, and returns None (bit-identical)
or where the bytes first differ (core/probes.py: the byte comparison and ComfyUI's NVFP4 quantizer):

* ``layer_norm``: the LayerNorm statistics (with the next projection's global scale) and the packs that read them,
  against ComfyUI's LayerNorm module (without affine parameters and followed by the block's modulation
  ``torch.addcmul(shift, norm(x), 1 + scale)``, as norm1 / norm2; with them, as norm3) and its quantizer, at Wan
  2.2 14B's width and a width that is not a multiple of 512; also the pack reducing its own scale, and a static scale
  on rows with NaN and inf and modulation that overflows to inf (fp16) or rounds 1 + scale on a tie;
* ``residual_layer_norm``: the block's residuals (``torch.addcmul(x, y, gate)``, ``x + y``) with the statistics of the
  new rows, in place and into another buffer, and the packs after them;
* ``rms_norm_rope``: ComfyUI's RMSNorm module over the full width followed by its ``apply_rope1`` (q and k), and the
  RMSNorm alone (the cross-attention q), at Wan's width (40 heads of 128) and a narrower one, rope tables with zeros,
  -0.0 and fp32 subnormals;
* ``pack_gelu``: ComfyUI's eager GELU (tanh) of a down projection's input and its quantizer, on every bit pattern of
  the dtype (static scale) and on random rows (dynamic).

Hard cases of the rows: zeros, a constant row (variance 0), heavy tails, outliers, subnormals, values near the
dtype's largest, -0.0, a large mean with a small spread; 37 rows (not a multiple of 16 or 128). The ``pack_*``
aliases are the packs a probe above checks.
"""

from __future__ import annotations

import torch

from ... import comfy_adapter
from ...core.probes import comfy_quantized, compare_packed, first_difference, static_scale
from ...core.verdicts import ProbeSet
from ...layout import AddcmulModulation, LayerNorm

F16, BF16 = torch.float16, torch.bfloat16
WIDTHS = (5120, 1040)  # Wan 2.2 14B's width, and one whose rows end inside a 512-column step
ROWS = 37
EPS = 1e-6  # Wan's norms
STATIC = 2.0 / 2688 * 1.5


def _largest(dtype) -> float:
    return 3.0e4 if dtype == F16 else 1.0e30


def probe_rows(device, k: int, dtype, seed: int, *, finite: bool = True, big: float | None = None) -> torch.Tensor:
    """[ROWS, k] rows of ``dtype`` with the hard cases (module docstring); ``finite=False`` adds NaN and +-inf."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((ROWS, k), generator=gen)
    x[1] *= torch.exp(2 * torch.randn(k, generator=gen))  # heavy tails
    x[2, ::97] = 3.0e3                                     # outliers
    x[3] = 0.0                                             # zeros: rstd = rsqrt(eps)
    x[4] = 0.75                                            # constant: variance 0
    x[5] *= 1e-4                                           # fp16: partly subnormal
    x[6] *= 2.0 ** -20                                     # fp16: all subnormal
    x[7] = (x[7] * (big or _largest(dtype)) / 4).clamp(-(big or _largest(dtype)), big or _largest(dtype))
    x[8, ::2], x[8, 1::2] = -0.0, 0.0
    x[9] += 100.0                                          # a large mean, a small spread
    if not finite:
        x[10, 5], x[11, 7], x[12, 9] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype).to(device)


def probe_modulation(device, k: int, dtype, seed: int, *, extreme: bool = False):
    """The addcmul modulation of the probes: (AddcmulModulation, the scale and shift rows of each token). Table rows
    with 1 + scale on rounding ties and = 0; ``extreme``: scales whose products overflow to inf."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scale = torch.randn((6, k), generator=gen) * 0.5
    shift = torch.randn((6, k), generator=gen) * 0.5
    tie = 2.0 ** -11 if dtype == F16 else 2.0 ** -8
    scale[2, :16], scale[2, 16:32] = tie, 3 * tie  # 1 + scale halfway between two values: rounds down, then up
    scale[3] = -1.0                                # 1 + scale = 0: h = shift
    if extreme:
        scale[4] = 6.0e4 if dtype == F16 else 3.0e38
    index = torch.randint(0, 6, (ROWS,), generator=gen)
    index[:8] = 4
    scale, shift = scale.to(dtype).to(device), shift.to(dtype).to(device)
    rows = index.to(device)
    return (AddcmulModulation(scale, shift, index.to(torch.int32).to(device)), scale[rows], shift[rows])


def _affine(device, k: int, dtype, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = 1.0 + torch.randn(k, generator=gen) * 0.1
    bias = torch.randn(k, generator=gen) * 0.05
    weight[:8], weight[8:16], bias[16:24] = 0.0, -1.0, 40.0
    return weight.to(dtype).to(device), bias.to(dtype).to(device)


def comfy_layer_norm(k: int, dtype, device, weight=None, bias=None):
    """ComfyUI's LayerNorm module of a quantized Wan checkpoint (mixed-precision ops), holding ``weight`` / ``bias``."""
    ops = comfy_adapter.mixed_precision_ops(dtype, disabled=[])
    norm = ops.LayerNorm(k, EPS, elementwise_affine=weight is not None, device=device, dtype=dtype)
    if weight is not None:
        norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        norm.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    return norm


def comfy_rms_norm(k: int, dtype, weight):
    ops = comfy_adapter.mixed_precision_ops(dtype, disabled=[])
    norm = ops.RMSNorm(k, eps=EPS, elementwise_affine=True, device=weight.device, dtype=dtype)
    norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return norm


def comfy_modulate(n: torch.Tensor, scale_rows: torch.Tensor, shift_rows: torch.Tensor) -> torch.Tensor:
    """The modulation of ComfyUI's WanAttentionBlock.forward, ``torch.addcmul(shift, norm(x), 1 + scale)``."""
    return torch.addcmul(shift_rows, n, 1 + scale_rows)


def statistics_for(x: torch.Tensor, weight=None, bias=None) -> LayerNorm:
    empty = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    return LayerNorm(weight, bias, EPS, empty, empty.clone())


def _scale_out(device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)


# ---- the probes --------------------------------------------------------------------------------------------

def check_layer_norm(backend, device, dtype=BF16) -> str | None:
    tag = "fp16 " if dtype == F16 else ""
    for k in WIDTHS:
        x = probe_rows(device, k, dtype, seed=k)
        modulation, scale_rows, shift_rows = probe_modulation(device, k, dtype, seed=k + 1)
        h = comfy_modulate(comfy_layer_norm(k, dtype, device)(x), scale_rows, shift_rows)
        norm, g = statistics_for(x), _scale_out(device)
        backend.layer_norm_statistics(x, norm, modulation=modulation, global_scale_out=g)
        diff = (compare_packed(f"{tag}LayerNorm + modulation, scale from the statistics, width {k}",
                               backend.pack_nvfp4(x, global_scale=g, layer_norm=norm, addcmul_modulation=modulation),
                               comfy_quantized(h, None))
                or compare_packed(f"{tag}LayerNorm + modulation, scale from the pack, width {k}",
                                  backend.pack_nvfp4(x, layer_norm=norm, addcmul_modulation=modulation),
                                  comfy_quantized(h, None)))
        if diff:
            return diff
        weight, bias = _affine(device, k, dtype, seed=k + 2)
        affine = statistics_for(x, weight, bias)
        backend.layer_norm_statistics(x, affine, global_scale_out=g)
        diff = compare_packed(f"{tag}LayerNorm with weight and bias, width {k}",
                              backend.pack_nvfp4(x, global_scale=g, layer_norm=affine),
                              comfy_quantized(comfy_layer_norm(k, dtype, device, weight, bias)(x), None))
        if diff:
            return diff
        # NaN / inf rows, and modulation that overflows: a static scale (a dynamic one would be NaN for all)
        x = probe_rows(device, k, dtype, seed=k + 3, finite=False)
        modulation, scale_rows, shift_rows = probe_modulation(device, k, dtype, seed=k + 4, extreme=True)
        norm = statistics_for(x)
        backend.layer_norm_statistics(x, norm)
        h = comfy_modulate(comfy_layer_norm(k, dtype, device)(x), scale_rows, shift_rows)
        diff = compare_packed(f"{tag}LayerNorm + modulation with NaN, inf and overflow, static scale, width {k}",
                              backend.pack_nvfp4(x, static_scale=static_scale(STATIC, device), layer_norm=norm,
                                                 addcmul_modulation=modulation), comfy_quantized(h, STATIC))
        if diff:
            return diff
    return None


def check_residual_layer_norm(backend, device, dtype=BF16) -> str | None:
    tag = "fp16 " if dtype == F16 else ""
    for k in WIDTHS:
        x = probe_rows(device, k, dtype, seed=k + 5, big=_largest(dtype) / 2)  # x + y * gate stays finite
        gen = torch.Generator(device="cpu").manual_seed(k + 6)
        y = (torch.randn(x.shape, generator=gen) * 2).to(dtype).to(device)
        gates = (torch.randn((6, k), generator=gen) * 0.3).to(dtype).to(device)
        modulation, scale_rows, shift_rows = probe_modulation(device, k, dtype, seed=k + 7)
        # gated residual in place, the next norm modulated (norm2 -> ffn.0 and the next block's norm1 -> q, k, v)
        fused, comfy = x.clone(), torch.addcmul(x, y, gates[modulation.mod_index.long()])
        norm, g = statistics_for(x), _scale_out(device)
        backend.residual_layer_norm_(fused, y, norm, gate=gates, mod_index=modulation.mod_index,
                                     next_modulation=modulation, global_scale_out=g)
        h = comfy_modulate(comfy_layer_norm(k, dtype, device)(comfy), scale_rows, shift_rows)
        diff = (first_difference(f"{tag}gated residual with LayerNorm statistics, width {k}", fused, comfy)
                or compare_packed(f"{tag}pack after the gated residual's statistics, width {k}",
                                  backend.pack_nvfp4(fused, global_scale=g, layer_norm=norm,
                                                     addcmul_modulation=modulation), comfy_quantized(h, None)))
        if diff:
            return diff
        # plain residual into another buffer, the next norm with weight and bias (norm3 -> cross-attention q)
        weight, bias = _affine(device, k, dtype, seed=k + 8)
        out, comfy = torch.empty_like(x), x + y
        affine = statistics_for(x, weight, bias)
        backend.residual_layer_norm_(x, y, affine, out=out, global_scale_out=g)
        h = comfy_layer_norm(k, dtype, device, weight, bias)(comfy)
        diff = (first_difference(f"{tag}residual add with LayerNorm statistics, width {k}", out, comfy)
                or compare_packed(f"{tag}pack after the residual add's statistics, width {k}",
                                  backend.pack_nvfp4(out, global_scale=g, layer_norm=affine), comfy_quantized(h, None)))
        if diff:
            return diff
        # statistics only (static scales), gated
        fused, comfy = x.clone(), torch.addcmul(x, y, gates[modulation.mod_index.long()])
        norm = statistics_for(x)
        backend.residual_layer_norm_(fused, y, norm, gate=gates, mod_index=modulation.mod_index)
        h = comfy_modulate(comfy_layer_norm(k, dtype, device)(comfy), scale_rows, shift_rows)
        diff = compare_packed(f"{tag}pack after the gated residual's statistics, static scale, width {k}",
                              backend.pack_nvfp4(fused, static_scale=static_scale(STATIC, device), layer_norm=norm,
                                                 addcmul_modulation=modulation), comfy_quantized(h, STATIC))
        if diff:
            return diff
    return None


def rope_table(positions: int, head_dim: int, seed: int, device) -> torch.Tensor:
    """An fp32 rope table [positions, head_dim / 2, 2, 2] of rotations [[c, -s], [s, c]], with exact zeros and ones,
    -0.0 and fp32 subnormals among the entries."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    angles = torch.rand((positions, head_dim // 2), generator=gen) * 40
    angles[0] = 0.0
    c, s = torch.cos(angles), torch.sin(angles)
    s[1, :4], s[1, 4:8] = 1e-39, -0.0
    return torch.stack([c, -s, s, c], dim=-1).view(positions, head_dim // 2, 2, 2).to(device)


def check_rms_norm_rope(backend, device, dtype=BF16) -> str | None:
    tag = "fp16 " if dtype == F16 else ""
    for heads, batch, positions in ((40, 1, 5), (8, 2, 18)):  # Wan 2.2 14B's 40 heads of 128, and 8 heads
        k, head_dim = 128 * heads, 128
        q = probe_rows(device, k, dtype, seed=heads)[: batch * positions]
        kk = probe_rows(device, k, dtype, seed=heads + 1)[: batch * positions]
        q_weight, _ = _affine(device, k, dtype, seed=heads + 2)
        k_weight, _ = _affine(device, k, dtype, seed=heads + 3)
        freqs = rope_table(positions, head_dim, seed=heads + 4, device=device)
        comfy_freqs = freqs.unsqueeze(1).unsqueeze(0)  # ComfyUI's [1, S, 1, D / 2, 2, 2]
        expected = []
        for x, weight in ((q, q_weight), (kk, k_weight)):
            n = comfy_rms_norm(k, dtype, weight)(x)
            expected.append(comfy_adapter.apply_rope1(n.view(batch, positions, heads, head_dim), comfy_freqs))
        fq, fk = q.clone(), kk.clone()
        backend.rms_norm_rope_(fq, fk, q_weight, k_weight, EPS, freqs=freqs, positions=positions)
        diff = (first_difference(f"{tag}q after RMSNorm + RoPE, {heads} heads", fq, expected[0].reshape(q.shape))
                or first_difference(f"{tag}k after RMSNorm + RoPE, {heads} heads", fk, expected[1].reshape(q.shape)))
        if diff:
            return diff
        fq = q.clone()
        backend.rms_norm_rope_(fq, None, q_weight, None, EPS)
        diff = first_difference(f"{tag}q after RMSNorm, {heads} heads", fq, comfy_rms_norm(k, dtype, q_weight)(q))
        if diff:
            return diff
    return None


def check_pack_gelu(backend, device, dtype=BF16) -> str | None:
    tag = "fp16 " if dtype == F16 else ""
    bits = torch.arange(65536, dtype=torch.int32)
    every = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(dtype).view(2048, 32).to(device)
    diff = compare_packed(f"{tag}GELU of every bit pattern, static scale 1",
                          backend.pack_nvfp4(every, static_scale=static_scale(1.0, device), gelu=True),
                          comfy_quantized(comfy_adapter.eager_gelu_tanh(every), 1.0))
    if diff:
        return diff
    for k in WIDTHS:
        f = probe_rows(device, k, dtype, seed=k + 9)
        diff = compare_packed(f"{tag}GELU of rows, dynamic scale, width {k}", backend.pack_nvfp4(f, gelu=True),
                              comfy_quantized(comfy_adapter.eager_gelu_tanh(f), None))
        if diff:
            return diff
    return None


def check_layer_norm_f16(backend, device) -> str | None:
    return check_layer_norm(backend, device, F16)


def check_residual_layer_norm_f16(backend, device) -> str | None:
    return check_residual_layer_norm(backend, device, F16)


def check_rms_norm_rope_f16(backend, device) -> str | None:
    return check_rms_norm_rope(backend, device, F16)


def check_pack_gelu_f16(backend, device) -> str | None:
    return check_pack_gelu(backend, device, F16)


def wan_comfy_source() -> str:
    """Hash of the ComfyUI code the Wan fusions reproduce or replace: the block and attention forwards, repeat_e,
    the feed-forward and its eager activation, apply_rope1, the LayerNorm / RMSNorm ops."""
    try:
        m = comfy_adapter.wan_model_module()
        ops = comfy_adapter.comfy_ops()
        mixed = comfy_adapter.mixed_precision_ops()
        return comfy_adapter.source_hash([
            m.WanAttentionBlock.forward, m.WanSelfAttention.forward, m.WanT2VCrossAttention.forward,
            m.WanI2VCrossAttention.forward, getattr(m, "WanFeedForward", None), m.repeat_e, m.apply_rope1,
            getattr(ops, "linear_input_act", None), getattr(ops, "_eager_input_act", None), mixed.LayerNorm,
            mixed.RMSNorm])
    except Exception as exc:  # no ComfyUI Wan (tests of the pack alone): the hash says so
        return f"unavailable: {type(exc).__name__}"


_PACKS = ("pack_layer_norm_modulate", "pack_layer_norm_affine")
WAN_PROBES = ProbeSet(
    name="wan",
    probes={"layer_norm": check_layer_norm, "residual_layer_norm": check_residual_layer_norm,
            "rms_norm_rope": check_rms_norm_rope, "pack_gelu": check_pack_gelu,
            "layer_norm_f16": check_layer_norm_f16, "residual_layer_norm_f16": check_residual_layer_norm_f16,
            "rms_norm_rope_f16": check_rms_norm_rope_f16, "pack_gelu_f16": check_pack_gelu_f16},
    comfy_source=wan_comfy_source,
    shares_global_scale=("layer_norm", "residual_layer_norm", "pack_gelu") + _PACKS,
    shares_global_scale_f16=("layer_norm_f16", "residual_layer_norm_f16", "pack_gelu_f16")
    + tuple(f"{p}_f16" for p in _PACKS),
    aliases={**{p: "layer_norm" for p in _PACKS}, **{f"{p}_f16": "layer_norm_f16" for p in _PACKS}},
)
