"""The self-check's probes of the MiniMax H3 fused ops, and the block check.

The probes compare each H3 fusion with ComfyUI's own op sequence on probe tensors (core/probes.py has the tensors
and the byte comparison): the modulated pack against ``_mod_scale_shift`` and ComfyUI's quantizer, the normalized
pack and the residual's statistics against ComfyUI's RMSNorm module, the SwiGLU pack against ComfyUI's eager SwiGLU,
the gated residual against ``_mod_gate``, the RMSNorm + RoPE kernel against comfy-kitchen's op.

The block check (:func:`check_block`, at the first forward of a patched model): the first patched block runs
ComfyUI's stock block and the fused block on (a prefix of) that call's real input and compares the outputs; that
call returns the stock result. One host sync, on that call only, never during CUDA-graph capture. An input that
proves nothing (ComfyUI's output not all finite, or all zeros: :func:`proves_nothing`) leaves the check pending for
the next call; nothing is stored then.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ... import comfy_adapter
from ...core import verdicts
from ...core.probes import comfy_quantized, compare_packed, first_difference, probe_activations, static_scale
from ...core.verdicts import NotApplicable, ProbeSet
from ...layout import Modulation, RmsNorm

log = logging.getLogger("h3_fused_nvfp4")


def _h3():
    return comfy_adapter.h3_model_module()


def _modulation_probe(device, rows: int, k: int, seed: int):
    """Modulation tables, ComfyUI-style segments (with a per-token row tensor) and the matching int32 index."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    table_rows = 6
    scale = (torch.randn((table_rows, k), generator=gen) * 0.5).to(torch.bfloat16).to(device)
    shift = (torch.randn((table_rows, k), generator=gen) * 0.5).to(torch.bfloat16).to(device)
    a, b = rows // 4, rows // 2
    per_token = torch.randint(0, table_rows, (rows - b,), generator=gen).to(device)
    segments = [(0, a, 1), (a, b, 4), (b, rows, per_token)]
    index = torch.empty(rows, dtype=torch.int32)
    index[:a], index[a:b] = 1, 4
    index[b:] = per_token.cpu().to(torch.int32)
    return Modulation(scale, shift, index.to(device)), segments, scale, shift


def _comfy_rms_norm(k: int, weight: torch.Tensor, eps: float):
    """ComfyUI's RMSNorm module of an NVFP4 checkpoint (mixed-precision ops), holding ``weight``."""
    ops = comfy_adapter.mixed_precision_ops(torch.bfloat16, disabled=[])
    norm = ops.RMSNorm(k, eps=eps, dtype=torch.bfloat16, device=weight.device)
    norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return norm


def _norm_probe(device, k: int, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = 37
    x = torch.randn((rows, k), generator=gen)
    x[1] *= torch.exp(2 * torch.randn(k, generator=gen))        # heavy-tailed row
    x[2, ::97] = 3.0e3                                          # outliers
    x[3] = 0.0                                                  # all-zero row: rstd = rsqrt(eps)
    x[4] *= 1e-3
    x = x.to(torch.bfloat16).to(device)
    weight = (1.0 + torch.randn(k, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    return x, weight


def check_pack_modulate(backend, device) -> str | None:
    m = _h3()
    for label, (x, scale) in list(probe_activations(device).items())[:4]:
        modulation, segments, sc, sh = _modulation_probe(device, x.shape[0], x.shape[1], seed=11)
        h = m._mod_scale_shift(x.clone(), sh, sc, segments)
        packed = backend.pack_nvfp4(x, static_scale=static_scale(scale, device), modulation=modulation)
        diff = compare_packed(f"modulated {label}", packed, comfy_quantized(h, scale))
        if diff:
            return diff
    return None


def check_rms_norm(backend, device) -> str | None:
    """RMSNorm statistics (+ the next projection's amax) against ComfyUI's RMSNorm, modulation and quantizer;
    also the gated residual pass that produces them. At H3's width and another one (the reduction depends on K)."""
    m = _h3()
    for k in (5376, 1040):
        x, weight = _norm_probe(device, k, seed=k)
        comfy_norm = _comfy_rms_norm(k, weight, 1e-5)
        reason = backend.rms_norm_support(x, weight)
        if reason is not None:
            return f"width {k}: {reason}"
        modulation, segments, sc, sh = _modulation_probe(device, x.shape[0], k, seed=13)
        # statistics + amax, then the normalized, modulated pack (dynamic scale)
        norm = RmsNorm(weight, 1e-5, torch.empty(x.shape[0], dtype=torch.float32, device=device))
        g = torch.empty(1, dtype=torch.float32, device=device)
        backend.norm_statistics(x, norm, modulation=modulation, global_scale_out=g)
        packed = backend.pack_nvfp4(x, global_scale=g, modulation=modulation, norm=norm)
        h = m._mod_scale_shift(comfy_norm(x), sh, sc, segments)
        diff = compare_packed(f"normalized and modulated, width {k}", packed, comfy_quantized(h, None))
        if diff:
            return diff
        # the gated residual producing the statistics, static-scale pack after it
        gen = torch.Generator(device="cpu").manual_seed(k + 1)
        other = torch.randn(x.shape, generator=gen).to(torch.bfloat16).to(device)
        gate_table = (torch.randn((6, k), generator=gen) * 0.3).to(torch.bfloat16).to(device)
        x_fused, x_comfy = x.clone(), x.clone()
        backend.gated_residual_(x_fused, other, gate_table, modulation.mod_index, next_norm=norm,
                                next_modulation=modulation, global_scale_out=g)
        m._mod_gate(x_comfy, gate_table, other, segments)
        diff = first_difference(f"gated residual with statistics, width {k}", x_fused, x_comfy)
        if diff:
            return diff
        packed = backend.pack_nvfp4(x_fused, global_scale=g, modulation=modulation, norm=norm)
        h = m._mod_scale_shift(comfy_norm(x_comfy), sh, sc, segments)
        diff = compare_packed(f"pack after the residual's statistics, width {k}", packed, comfy_quantized(h, None))
        if diff:
            return diff
    return None


def check_pack_swiglu(backend, device) -> str | None:
    swiglu = comfy_adapter.swiglu_reference()
    for label, (y, scale) in probe_activations(device).items():
        half = y.shape[1] // 2
        h = swiglu(y.clone()) if swiglu else torch.nn.functional.silu(y[:, :half]).mul_(y[:, half:])
        packed = backend.pack_nvfp4(y, static_scale=static_scale(scale, device), swiglu=True)
        diff = compare_packed(f"SwiGLU {label}", packed, comfy_quantized(h, scale))
        if diff:
            return diff
    return None


def check_gated_residual(backend, device) -> str | None:
    m = _h3()
    x, _ = probe_activations(device)["random rows, dynamic scale"]
    gen = torch.Generator(device="cpu").manual_seed(17)
    other = torch.randn(x.shape, generator=gen).to(torch.bfloat16).to(device)
    modulation, segments, gate, _ = _modulation_probe(device, x.shape[0], x.shape[1], seed=19)
    fused, comfy = x.clone(), x.clone()
    backend.gated_residual_(fused, other, gate, modulation.mod_index)
    m._mod_gate(comfy, gate, other, segments)
    return first_difference("gated residual", fused, comfy)


def check_rms_rope(backend, device) -> str | None:
    gen = torch.Generator(device="cpu").manual_seed(23)
    s, heads, dim = 37, 4, 128
    qkv = (torch.randn((s, 3 * heads * dim), generator=gen) * 2).to(torch.bfloat16).to(device)
    angles = torch.rand((s, 48), generator=gen) * 40
    freqs = _h3().rope_rotation_table(torch.cat((angles, angles), -1), torch.bfloat16).to(device)
    qw = (1 + torch.randn(dim, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    kw = (1 + torch.randn(dim, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    fused, comfy = qkv.clone(), qkv.clone()
    views = []
    for buf in (fused, comfy):
        q, k, _ = buf.split(heads * dim, dim=-1)
        views.append((q.view(1, s, heads, dim), k.view(1, s, heads, dim)))
    reason = backend.rms_rope_support(*views[0], freqs, qw, kw, 96)
    if reason is not None:
        raise NotApplicable(reason)  # the block uses comfy-kitchen's op for such tensors
    backend.rms_rope_split_half_(*views[0], freqs, qw, kw, 1e-5, 96)
    comfy_adapter.rms_rope_split_half_(*views[1], freqs, qw, kw, 1e-5, 96)
    return first_difference("q/k after RMSNorm + RoPE", fused, comfy)


def h3_comfy_source() -> str:
    """Hash of the ComfyUI code the H3 fusions reproduce or replace: the H3 forwards and helpers, ComfyUI's SwiGLU
    and RMSNorm."""
    try:
        m = _h3()
        ops = comfy_adapter.comfy_ops()
        return comfy_adapter.source_hash([
            m.DiTBlock.forward, m.Attention.forward, m.MLP.forward, m.AdalnProj.forward, m._mod_scale_shift,
            m._mod_gate, m._mod_row, getattr(ops, "linear_input_act", None), getattr(ops, "_eager_input_act", None),
            getattr(ops, "_swiglu_eager", None), comfy_adapter.mixed_precision_ops().RMSNorm])
    except Exception as exc:  # no ComfyUI H3 (tests of the pack alone): the hash says so
        return f"unavailable: {type(exc).__name__}"


H3_PROBES = ProbeSet(
    name="minimax_h3",
    probes={"pack_modulate": check_pack_modulate, "rms_norm": check_rms_norm, "pack_swiglu": check_pack_swiglu,
            "gated_residual": check_gated_residual, "rms_rope": check_rms_rope},
    comfy_source=h3_comfy_source,
    shares_global_scale=("pack_modulate", "pack_norm", "pack_swiglu", "rms_norm"),
    aliases={"pack_norm": "rms_norm"},  # the normalized pack is the pack half of rms_norm's probe
)


# ---- the block check ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class BlockVerdict:
    ok: bool | None  # None: inconclusive, the input proved nothing (:func:`proves_nothing`); a later call checks
    detail: str
    compared: bool = True  # False: the check could not run (e.g. out of memory) or was inconclusive; nothing cached


def clip_segments(segments, rows: int) -> list:
    clipped = []
    for a, b, row in segments:
        if a >= rows:
            break
        b2 = min(b, rows)
        clipped.append((a, b2, row[: b2 - a] if isinstance(row, torch.Tensor) else row))
    return clipped


def proves_nothing(stock: torch.Tensor) -> str | None:
    """Why equal outputs of the stock and the fused block would prove nothing about the fused arithmetic (None: a
    meaningful comparison). Meaningful means every element of ComfyUI's output is a finite number and not all of
    them are zero: a NaN or inf (a non-finite input, an overflow) reaches every later op of both blocks (the row's
    RMSNorm, attention over all rows), so both outputs are NaN / inf whatever the fused roundings do, and an output
    of zeros only exercises no rounding."""
    finite = torch.isfinite(stock)
    if not bool(finite.all()):
        return f"ComfyUI's block output has {int((~finite).sum())} non-finite elements of {stock.numel()}"
    if not bool(stock.any()):
        return "ComfyUI's block output is all zeros"
    return None


def check_block(fused_block, x, t_emb, mod_segments, rope_freqs, options: dict, max_rows: int,
                plan=None) -> BlockVerdict:
    """ComfyUI's stock block against the fused block on the first ``max_rows`` rows of this call's input;
    inconclusive (``ok`` None) when that input proves nothing (:func:`proves_nothing`)."""
    rows = min(x.shape[0], max_rows)
    segments = clip_segments(mod_segments, rows)
    rope = rope_freqs[:, :rows] if rope_freqs is not None else None
    xs = x[:rows]
    detail = None
    for attempt in range(2):  # a first call can differ inside ComfyUI's emulated GEMM path: compare a second time
        with fused_block.unpatched():
            stock = fused_block.stock_forward(xs.clone(), t_emb, segments, rope, transformer_options=dict(options))
        reason = proves_nothing(stock)
        if reason is not None:
            return BlockVerdict(None, f"{fused_block.name}: not compared on this input ({reason}); the check runs "
                                      "again on the next call", compared=False)
        fused = fused_block.fused_forward(xs.clone(), t_emb, segments, rope, dict(options), None, handoff=False,
                                          plan=plan)
        detail = first_difference(f"{fused_block.name} output ({rows} rows)", fused, stock)
        if detail is None:
            return BlockVerdict(True, f"{fused_block.name}: {rows} rows bit-identical"
                                + (" on the second comparison" if attempt else ""))
    return BlockVerdict(False, detail)


def record_block_verdict(state, device: torch.device, verdict: BlockVerdict) -> None:
    """Keep the outcome with the model's state and the device's verdicts; show it on the node that patched the
    model. An inconclusive check changes nothing: the check stays pending."""
    if verdict.ok is None:
        log.info("H3 fused NVFP4: block self-check %s; this call runs ComfyUI's block", verdict.detail)
        return
    state.block_check = "passed" if verdict.ok else "failed"
    state.block_check_detail = verdict.detail
    verdicts.record_block_verdict(device, verdict.ok, verdict.detail, verdict.compared)
    text = (("block self-check passed: " if verdict.ok else "block self-check FAILED, ComfyUI's path runs: ")
            + verdict.detail)
    comfy_adapter.send_progress_text(state.node_id, f"H3 fused NVFP4: {text}")
