"""The self-check's probes of Z-Image's fused ops.

Each probe runs a fused op on small probe tensors and ComfyUI's own op sequence of ``comfy/ldm/lumina/model.py`` on
the same input, and compares the bytes (core/probes.py has the comparison and the hard activations): the
normalized pack with the scale-only modulation against ComfyUI's RMSNorm module, lumina's ``modulate`` and
ComfyUI's quantizer; the same without a modulation (the refiner blocks); the post-norm residual against ``x +
apply_gate(tanh(gate), norm2(out))`` and ``x + norm2(out)`` (in place, and out of place into a new stream, its input
left as it is) followed by the next norm's pack; the SwiGLU of two tensors against
``FeedForward._forward_silu_gating``. Z-Image's width (3840) and another one (the norm reduction
depends on K), two batch entries of 37 tokens (rows not a multiple of 16), adaLN rows as the views of one adaLN
output that ComfyUI's ``chunk(4)`` makes, with and without ``timestep_zero_index``, rows with zeros, -0.0, outliers,
tiny and heavy-tailed values, dynamic and static global scales. The norm weights of the dynamic cases are chosen so
that ComfyUI's global scale rounds up to bf16: a scale rounded any other way (truncated) differs for certain.

The per-head RMSNorm + RoPE of q and k stays comfy-kitchen's ``rms_rope`` (it reads and writes q and k once:
benchmarks/DECISIONS.md, Z-Image), so it has no probe here.
"""

from __future__ import annotations

import torch

from ... import comfy_adapter
from ...core.probes import (
    comfy_quantized,
    comfy_rms_norm,
    compare_packed,
    first_difference,
    probe_activations,
    static_scale,
)
from ...core.verdicts import ProbeSet
from ...layout import Modulation, RmsNorm
from .modulation import adaln_row_index

BATCH, TOKENS = 2, 37
WIDTHS = (3840, 1040)  # Z-Image's hidden size, and one whose norm reduction ends mid-step
EPS = 1e-5  # Z-Image's norm_eps
# omni / reference-image calls: two slices of the token range take the second half of the adaLN rows
TIMESTEP_ZERO_INDEX = [(30, 37), (3, 9)]
STATIC_SCALE = 3.0 / 2688


def _lumina():
    return comfy_adapter.lumina_model_module()


def _tokens(device, k: int, seed: int) -> torch.Tensor:
    """[BATCH, TOKENS, k] bf16: random rows over many binades plus hard rows (a heavy-tailed row, outliers, an
    all-zero and an all -0.0 row, a tiny row, NaN-free: the norm statistics of real activations)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((BATCH, TOKENS, k), generator=gen) * torch.exp2(torch.randint(-6, 6, (BATCH, TOKENS, 1),
                                                                                  generator=gen).float())
    x[0, 1] *= torch.exp(2 * torch.randn(k, generator=gen))
    x[0, 2, ::97] = 3.0e3
    x[0, 3] = 0.0
    x[1, 4] = -0.0
    x[1, 5] *= 1e-3
    return x.to(torch.bfloat16).to(device)


def _weight(device, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (1.0 + torch.randn(k, generator=gen) * 0.1).to(torch.bfloat16).to(device)


def _adaln_chunks(device, rows: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The four [rows, k] views ComfyUI's ``adaLN_modulation(t).chunk(4, dim=1)`` makes (row stride 4k): scale_msa,
    gate_msa, scale_mlp, gate_mlp."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = (torch.randn((rows, 4 * k), generator=gen) * 0.5).to(torch.bfloat16).to(device)
    return out.chunk(4, dim=1)


def _cases(device, k: int, seed: int):
    """(label, timestep_zero_index, adaLN table rows, int32 row index of the tokens) of each probe case."""
    for tzi in (None, TIMESTEP_ZERO_INDEX):
        rows = BATCH * (2 if tzi else 1)
        index = adaln_row_index(BATCH, TOKENS, rows, tzi).to(device)
        yield f"width {k}{', timestep_zero_index' if tzi else ''}", tzi, rows, index


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _scale_rounds_up(h: torch.Tensor) -> bool:
    """Whether ComfyUI's dynamic global scale of ``h``, ``bf16(amax|h| * fp32(1/2688))``, rounds up (the fp32
    product's dropped half is above one half of a bf16 step)."""
    product = h.abs().max().float() * torch.tensor(1.0 / 2688.0, dtype=torch.float32, device=h.device)
    return int(product.view(torch.int32)) & 0xFFFF > 0x8000


def _weight_rounding_up(weight: torch.Tensor, stock_of) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` times the first factor 1 + i/64 for which ComfyUI's global scale of ``stock_of(weight)`` (the
    stock activation built with that norm weight) rounds up, and that activation."""
    for i in range(64):
        w = (weight.float() * (1 + i / 64)).to(torch.bfloat16)
        h = stock_of(w)
        if _scale_rounds_up(h):
            return w, h
    raise RuntimeError("no norm weight of the probe gives a global scale that rounds up")


def _check_normalized_pack(backend, device, label, x, norm_weight, modulation, stock_h) -> str | None:
    """The statistics (+ the amax of the modulated, normalized rows) of ``x``, then the normalized pack with the
    dynamic and with a static scale, against ComfyUI's quantizer of ``stock_h``."""
    rows = x.shape[0]
    norm = RmsNorm(norm_weight, EPS, torch.empty(rows, dtype=torch.float32, device=device))
    g = torch.empty(1, dtype=torch.float32, device=device)
    backend.norm_statistics(x, norm, modulation=modulation, global_scale_out=g)
    packed = backend.pack_nvfp4(x, global_scale=g, modulation=modulation, norm=norm)
    diff = compare_packed(f"{label}, dynamic scale", packed, comfy_quantized(stock_h, None))
    if diff:
        return diff
    packed = backend.pack_nvfp4(x, static_scale=static_scale(STATIC_SCALE, device), modulation=modulation, norm=norm)
    return compare_packed(f"{label}, static scale", packed, comfy_quantized(stock_h, STATIC_SCALE))


def check_pack_norm_scale(backend, device) -> str | None:
    """RMSNorm statistics and the amax of the scale-modulated rows, then the normalized pack with the scale-only
    modulation, against ComfyUI's RMSNorm module and lumina's ``modulate`` (qkv's and w1 / w3's input)."""
    m = _lumina()
    for k in WIDTHS:
        x = _tokens(device, k, seed=k)
        reason = backend.rms_norm_support(_rows2d(x), _weight(device, k, seed=k + 1))
        if reason is not None:
            return f"width {k}: {reason}"
        for label, tzi, rows, index in _cases(device, k, seed=k):
            scale = _adaln_chunks(device, rows, k, seed=k + 2)[0]
            weight, stock = _weight_rounding_up(_weight(device, k, seed=k + 1), lambda w: m.modulate(
                comfy_rms_norm(k, w, EPS)(x), scale, timestep_zero_index=tzi))
            diff = _check_normalized_pack(backend, device, f"normalized, scale-modulated pack, {label}", _rows2d(x),
                                          weight, Modulation(scale, None, index), _rows2d(stock))
            if diff:
                return diff
    return None


def check_pack_norm_unmodulated(backend, device) -> str | None:
    """The same without a modulation (the refiner blocks' qkv and w1 / w3 inputs): ComfyUI's RMSNorm module."""
    for k in WIDTHS:
        x = _tokens(device, k, seed=k + 3)
        weight, stock = _weight_rounding_up(_weight(device, k, seed=k + 4), lambda w: comfy_rms_norm(k, w, EPS)(x))
        diff = _check_normalized_pack(backend, device, f"normalized pack, width {k}", _rows2d(x), weight, None,
                                      _rows2d(stock))
        if diff:
            return diff
    return None


def _check_post_norm_residual(backend, device, gated: bool) -> str | None:
    m = _lumina()
    gen = torch.Generator(device="cpu").manual_seed(31 + gated)
    for k in WIDTHS:
        x, out = _tokens(device, k, seed=k + 5), _tokens(device, k, seed=k + 6)
        out = out * torch.randn((1, 1, k), generator=gen).to(torch.bfloat16).to(device)  # an output, not a norm input
        norm2_weight, next_weight = _weight(device, k, seed=k + 7), _weight(device, k, seed=k + 8)
        norm2 = comfy_rms_norm(k, norm2_weight, EPS)
        for label, tzi, rows, index in _cases(device, k, seed=k):
            if not gated and tzi:
                continue  # the refiner blocks have no modulation
            _, gate, scale, _ = _adaln_chunks(device, rows, k, seed=k + 9)
            if gated:
                stock = x + m.apply_gate(gate.unsqueeze(1).tanh(), norm2(out), timestep_zero_index=tzi)
                next_modulation = Modulation(scale, None, index)
                stock_h = m.modulate(comfy_rms_norm(k, next_weight, EPS)(stock), scale, timestep_zero_index=tzi)
            else:
                stock = x + norm2(out)
                next_modulation = None
                stock_h = comfy_rms_norm(k, next_weight, EPS)(stock)
            gate_table = gate.tanh() if gated else None  # ComfyUI's own op on the small [rows, k] gate
            for out_of_place in (False, True):  # in place, and a new stream read from the input (x_from)
                what = (f"{'gated' if gated else 'ungated'} post-norm residual"
                        f"{' out of place' if out_of_place else ''}, {label}")
                diff = _check_one_post_norm_residual(backend, device, what, x, out, norm2_weight, gate_table,
                                                     index if gated else None, next_weight, next_modulation, stock,
                                                     stock_h, out_of_place)
                if diff:
                    return diff
    return None


def _check_one_post_norm_residual(backend, device, what, x, out, norm2_weight, gate_table, index, next_weight,
                                  next_modulation, stock, stock_h, out_of_place: bool) -> str | None:
    """The residual alone, then with the next norm's statistics, amax and pack; ``out_of_place``: into a poisoned
    new stream from an input that must stay as it is."""
    x_rows = _rows2d(x)
    before = x_rows.clone()

    def target():
        return torch.full_like(x_rows, float("nan")) if out_of_place else x_rows.clone()

    source = {"x_from": x_rows} if out_of_place else {}
    alone = target()
    backend.post_norm_residual_(alone, _rows2d(out), norm2_weight, EPS, gate_table, index, **source)
    diff = first_difference(f"{what}, output", alone, _rows2d(stock))
    if diff:
        return diff
    fused = target()
    norm = RmsNorm(next_weight, EPS, torch.empty(fused.shape[0], dtype=torch.float32, device=device))
    g = torch.empty(1, dtype=torch.float32, device=device)
    backend.post_norm_residual_(fused, _rows2d(out), norm2_weight, EPS, gate_table, index, next_norm=norm,
                                next_modulation=next_modulation, global_scale_out=g, **source)
    diff = first_difference(f"{what} with the next norm's statistics, output", fused, _rows2d(stock))
    if diff:
        return diff
    if out_of_place:
        diff = first_difference(f"{what}, its input afterwards", x_rows, before)
        if diff:
            return diff
    packed = backend.pack_nvfp4(fused, global_scale=g, modulation=next_modulation, norm=norm)
    return compare_packed(f"{what}, the next projection's pack", packed, comfy_quantized(_rows2d(stock_h), None))


def check_post_norm_residual_gated(backend, device) -> str | None:
    """``x + apply_gate(tanh(gate), attention_norm2(out))`` (the modulated blocks' residuals), alone and with the
    next norm's statistics, scale-modulated amax and pack."""
    return _check_post_norm_residual(backend, device, gated=True)


def check_post_norm_residual(backend, device) -> str | None:
    """``x + attention_norm2(out)`` (the refiner blocks' residuals), alone and with the next norm's statistics,
    amax and pack."""
    return _check_post_norm_residual(backend, device, gated=False)


def check_pack_swiglu_pair(backend, device) -> str | None:
    """w2's input ``F.silu(x1) * x3`` from w1's and w3's separate outputs, against ComfyUI's
    ``FeedForward._forward_silu_gating``, on the hard probe activations (ties, zeros, -0.0, NaN, +-Inf,
    subnormals, huge values, a strided view), both inputs hard."""
    m = _lumina()
    for label, (x1, scale) in probe_activations(device).items():
        x3 = torch.empty_strided(x1.shape, x1.stride(), dtype=x1.dtype, device=x1.device).copy_(x1.flip(0))
        stock = m.FeedForward._forward_silu_gating(None, x1, x3)
        packed = backend.pack_nvfp4(x1, static_scale=static_scale(scale, device), swiglu=True, up=x3)
        diff = compare_packed(f"SwiGLU of two tensors, {label}", packed, comfy_quantized(stock, scale))
        if diff:
            return diff
    return None


def zimage_comfy_source() -> str:
    """Hash of the ComfyUI code the Z-Image fusions reproduce: lumina's block, attention, feed-forward, modulation and
    gate helpers, the model's forward (its adaLN rows and timestep_zero_index), ComfyUI's RMSNorm."""
    try:
        m = _lumina()
        return comfy_adapter.source_hash([
            m.JointTransformerBlock.forward, m.JointAttention.forward, m.FeedForward, m.modulate, m.apply_gate,
            m.clamp_fp16, m.invert_slices, m.NextDiT.patchify_and_embed, m.NextDiT._forward,
            comfy_adapter.mixed_precision_ops().RMSNorm])
    except Exception as exc:  # no ComfyUI Z-Image (tests of the pack alone): the hash says so
        return f"unavailable: {type(exc).__name__}"


ZIMAGE_PROBES = ProbeSet(
    name="z_image",
    probes={"pack_norm_scale": check_pack_norm_scale, "pack_norm_unmodulated": check_pack_norm_unmodulated,
            "post_norm_residual_gated": check_post_norm_residual_gated, "post_norm_residual": check_post_norm_residual,
            "pack_swiglu_pair": check_pack_swiglu_pair},
    comfy_source=zimage_comfy_source,
    shares_global_scale=("pack_norm_scale", "pack_norm_unmodulated", "post_norm_residual_gated",
                         "post_norm_residual", "pack_swiglu_pair"),
)
