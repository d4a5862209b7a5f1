"""Fused forwards for ComfyUI's MiniMax H3 ``DiTBlock``, its ``Attention`` and SwiGLU ``MLP`` (object patches).

Stock ``DiTBlock.forward`` (comfy/ldm/minimax/model.py) and what runs here instead:

    ada = adaln_proj(t_emb)                               ComfyUI's module; its silu(t_emb) is the same in every
                                                             block, so a chain of patched blocks computes it once
    h = _mod_scale_shift(norm1(x), shift, scale, segs)    -> norm statistics (one read of x) + qkv_proj's pack,
                                                             which normalizes and modulates on the fly
    x = _mod_gate(x, gate, attention(h), segs)            -> ComfyUI's Attention sequence (FusedAttention: the
                                                             RMSNorm + RoPE kernel), one gated-residual kernel that
                                                             also produces norm2's statistics and fc1's amax
    h = _mod_scale_shift(norm2(x), ...)                   -> folded into fc1's pack
    return _mod_gate(x, gate, mlp(h), segs)               -> SwiGLU folded into fc2's reduction and pack; the last
                                                             residual kernel also produces the NEXT block's norm1
                                                             statistics and qkv amax when that block is ours too

So the normalized and modulated activations, the [S, 14336] SwiGLU product and the norm outputs are never written
to memory, and every layout stays ComfyUI's. Each fused op reproduces ComfyUI's arithmetic bit for bit (the kernel
sources in kernels/ say how); the first patched block of a model checks that on the real input
(models/h3/probes.py). RMSNorm folding needs torch's CUDA ``rms_norm`` arithmetic reproduced for the running torch;
where the self-check finds it does not hold, torch's norm runs and the kernels read its output.

Fallbacks: a call the kernels cannot take runs ComfyUI's own code for that step (the block's module helpers
``_mod_scale_shift`` / ``_mod_gate``, the stock forwards), with the reason logged once. Tensors off the GPU go
through kernels/twin_ops.py, the Python twin of the kernels (tests). The decisions that do not depend on a
tensor's shape are taken once per forward (core/plan.py) and handed to the attention, the MLP and the Linears.
What is not H3's (the per-call decision, the block check, the stock arm, the shared steps, the hand-over slot) is the
block-fusion toolkit's (blocks/).
"""

from __future__ import annotations

import sys

import torch

from ...blocks.fused_block import FusedBlock
from ...blocks.state import ModelState
from ...comfy_adapter import allocation_context
from ...core.fallbacks import note_fallback
from ...core.linear import LinearSource
from ...core.plan import ForwardPlan
from ...layout import Modulation, RmsNorm, tensor_version
from .attention import FusedAttention
from .mlp import FusedSwigluMLP
from .modulation import ModulationIndexCache, bf16_table, segments_key
from .probes import H3_PROBES


class H3State(ModelState):
    """The toolkit's model state plus the modulation index of the current forward (all blocks share it)."""

    def __init__(self):
        super().__init__()
        self.index_cache = ModulationIndexCache()


class Handoff:
    """What block i's last residual computed for block i + 1: its modulation rows, norm1 statistics and, for a
    dynamic qkv_proj, the global scale; and silu(t_emb), for block i + 2's rows (None where not reused)."""

    def __init__(self, rows, norm: RmsNorm, global_scale: torch.Tensor | None, activated_t_emb: torch.Tensor | None):
        self.rows = rows
        self.norm = norm
        self.global_scale = global_scale
        self.activated_t_emb = activated_t_emb


def clip_segments(segments, rows: int) -> list:
    clipped = []
    for a, b, row in segments:
        if a >= rows:
            break
        b2 = min(b, rows)
        clipped.append((a, b2, row[: b2 - a] if isinstance(row, torch.Tensor) else row))
    return clipped


class DiTCall:
    """The arguments of one ``DiTBlock.forward`` call (blocks/fused_block.py's call object)."""

    __slots__ = ("x", "t_emb", "mod_segments", "rope_freqs", "transformer_options", "attention")

    def __init__(self, x, t_emb, mod_segments, rope_freqs, transformer_options, attention):
        self.x, self.t_emb, self.mod_segments, self.rope_freqs = x, t_emb, mod_segments, rope_freqs
        self.transformer_options, self.attention = transformer_options, attention

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    def prefix(self, rows: int) -> "DiTCall":
        """The first ``rows`` tokens, with ComfyUI's own attention (another node's override is not compared)."""
        rows = min(self.rows, rows)
        options = {k: v for k, v in (self.transformer_options or {}).items() if k != "optimized_attention_override"}
        rope = self.rope_freqs[:, :rows] if self.rope_freqs is not None else None
        return DiTCall(self.x[:rows], self.t_emb, clip_segments(self.mod_segments, rows), rope, options, None)

    def fresh(self) -> "DiTCall":
        return DiTCall(self.x.clone(), self.t_emb, self.mod_segments, self.rope_freqs,
                       dict(self.transformer_options or {}), self.attention)


class _ActivationApplied:
    """An ``AdalnProj`` seen with its input activation already applied: its own ``forward`` then runs on silu(t_emb)
    computed once for all blocks (every other attribute is the module's)."""

    apply_silu = False

    def __init__(self, adaln):
        self._adaln = adaln

    def __getattr__(self, name):
        return getattr(self._adaln, name)


def silu_reusable(adaln) -> bool:
    """Whether ``adaln``'s rows may be computed from a silu(t_emb) shared with other blocks: its forward applies
    silu (not the curve form), and no hook on the module must see the call."""
    return getattr(adaln, "apply_silu", None) is True and not (adaln._forward_hooks or adaln._forward_pre_hooks)


def adaln_rows(adaln, t_emb: torch.Tensor, activated: torch.Tensor | None):
    """``adaln(t_emb)``, or with ``activated`` = silu(t_emb) ComfyUI's own ``forward`` on it, its silu switched off."""
    if activated is None:
        return adaln(t_emb)
    return type(adaln).forward(_ActivationApplied(adaln), activated)


class FusedDiTBlock(FusedBlock):
    """``DiTBlock.forward`` with modulation, RMSNorm, SwiGLU and the gated residuals fused (module docstring)."""

    probe_set = H3_PROBES.name

    def __init__(self, block, name: str, index: int, attention: FusedAttention, mlp: FusedSwigluMLP,
                 state: H3State):
        super().__init__(block, name, index, state)
        self.attention = attention
        self.mlp = mlp
        module = sys.modules.get(type(block).__module__)
        self.mod_scale_shift = getattr(module, "_mod_scale_shift")
        self.mod_gate = getattr(module, "_mod_gate")

    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        return self.run(DiTCall(x, t_emb, mod_segments, rope_freqs, transformer_options, attention))

    def stock_call(self, call: DiTCall):
        return self.stock_forward(call.x, call.t_emb, call.mod_segments, call.rope_freqs,
                                  transformer_options=call.transformer_options, attention=call.attention)

    def handoff_modules(self) -> dict:
        return {"adaln_proj": self.block.adaln_proj, "norm1": self.block.norm1}

    def input_refusal(self, call: DiTCall) -> str | None:
        x = call.x
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            return f"input {tuple(x.shape)} {x.dtype} is not a 2-D bfloat16 token matrix"
        return None

    @staticmethod
    def _handoff_key(call: DiTCall):
        # The residual stream tensor block i returned (same object and storage), the same t_emb and segments. Each
        # block call takes (clears) the hand-over, so only the call right after block i's can consume it.
        x, t_emb = call.x, call.t_emb
        return (id(x), x.data_ptr(), tuple(x.shape), id(t_emb), t_emb.data_ptr(), tensor_version(x),
                segments_key(call.mod_segments, x.shape[0], x.device))

    def handoff_refusal(self, call: DiTCall) -> str | None:
        reason = super().handoff_refusal(call)
        if reason is not None:
            return reason
        options = call.transformer_options or {}
        if call.attention is not None or options.get("optimized_attention_override") is not None:
            return "another node replaces the attention"
        replace = (options.get("patches_replace") or {}).get("dit", {})
        if ("double_block", self.index) in replace or ("double_block", self.next.index) in replace:
            return "a block-replace patch is installed on this or the next block"
        return None

    def fused_forward(self, call: DiTCall, *, plan: ForwardPlan, handoff: bool = True):
        block = self.block
        x, t_emb, mod_segments = call.x, call.t_emb, call.mod_segments
        incoming = self.state.take_handoff(self.index, self._handoff_key(call))
        self.counts["fused"] += 1
        self.counts["handoff_in"] += incoming is not None
        # Outside ComfyUI's allocation graph (dynamic VRAM records each block's allocations): the token index and
        # silu(t_emb) outlive this block, and every block allocates alike, whether it was handed its rows or not.
        with allocation_context():
            index = self.state.index_cache.index(mod_segments, x.shape[0], x.device)
            if incoming is not None:
                rows, activated = incoming.rows, incoming.activated_t_emb
            else:
                activated = torch.nn.functional.silu(t_emb) if silu_reusable(block.adaln_proj) else None
                rows = adaln_rows(block.adaln_proj, t_emb, activated)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = rows
        mod_msa = Modulation(bf16_table(scale_msa), bf16_table(shift_msa), index)
        mod_mlp = Modulation(bf16_table(scale_mlp), bf16_table(shift_mlp), index)

        # ---- attention half
        if call.attention is None:
            h, source = self.norm_source(plan, x, block.norm1, mod_msa, "norm1", self.attention.qkv, incoming,
                                         lambda n: self.mod_scale_shift(n, shift_msa, scale_msa, mod_segments))
            out = self.attention(h, rope_freqs=call.rope_freqs, transformer_options=call.transformer_options,
                                 qkv_source=source, plan=plan)
        else:  # another node replaced the attention (e.g. sparse attention): it needs the modulated tensor
            h = self.mod_scale_shift(block.norm1(x), shift_msa, scale_msa, mod_segments)
            out = call.attention(h, rope_freqs=call.rope_freqs, transformer_options=call.transformer_options)

        # ---- residual 1, with norm2's statistics and fc1's amax when norm2 folds
        fold2 = self.fold_refusal(x, block.norm2, plan)
        next_norm = None
        if fold2 is None:
            rstd, scalars = self.buffers(x, "norm2")
            next_norm = RmsNorm(self.norm_weight(block.norm2, x, "norm2"), float(block.norm2.eps), rstd)
            fc1_dynamic = self.mlp.fc1 is not None and self.mlp.fc1.dynamic_scale()
            done = self._residual(plan, x, gate_msa, out, mod_segments, index, next_norm, mod_mlp,
                                  scalars[0:1] if fc1_dynamic else None)
            if done:
                self.counts["norm2"] += 1
            else:
                next_norm = None
            g_fc1 = scalars[0:1] if (next_norm is not None and fc1_dynamic) else None
        else:
            note_fallback(f"{self.name}.norm2", f"torch's RMSNorm runs: {fold2}")
            self._residual(plan, x, gate_msa, out, mod_segments, index, None, None, None)
            g_fc1 = None

        # ---- MLP half
        if next_norm is not None:
            fc1_source = LinearSource(lambda: self.mod_scale_shift(block.norm2(x), shift_mlp, scale_mlp, mod_segments),
                                      modulation=mod_mlp, norm=next_norm, global_scale=g_fc1)
            mlp_input = x
        else:
            n2 = block.norm2(x)
            fc1_source = LinearSource(lambda: self.mod_scale_shift(n2, shift_mlp, scale_mlp, mod_segments),
                                      modulation=mod_mlp)
            mlp_input = n2
        out = self.mlp(mlp_input, fc1_source=fc1_source, plan=plan)

        # ---- residual 2, with the next block's norm1 statistics and qkv amax where that block is ours
        if handoff:
            reason = self.handoff_refusal(call)
            if reason is None:
                reason = self.next.fold_refusal(x, self.next.block.norm1, plan)
            if reason is None:
                return self._residual_with_handoff(plan, call, gate_mlp, out, index, activated)
            note_fallback(f"{self.name} -> next block hand-over", reason)
        self._residual(plan, x, gate_mlp, out, mod_segments, index, None, None, None)
        return x

    def _residual(self, plan: ForwardPlan, x, gate, other, mod_segments, index, next_norm, next_modulation,
                  global_scale_out) -> bool:
        return self.residual(plan, x, bf16_table(gate), other, index, next_norm, next_modulation, global_scale_out,
                             lambda: self.mod_gate(x, gate, other, mod_segments))

    def _residual_with_handoff(self, plan: ForwardPlan, call: DiTCall, gate, out, index, activated):
        nxt, x, t_emb = self.next, call.x, call.t_emb
        reusable = silu_reusable(nxt.block.adaln_proj)
        with allocation_context():
            if activated is None and reusable:
                activated = torch.nn.functional.silu(t_emb)
            # t_emb only: block i + 1 uses these rows; silu(t_emb) is passed on even where this module cannot use it
            rows = adaln_rows(nxt.block.adaln_proj, t_emb, activated if reusable else None)
        mod = Modulation(bf16_table(rows[1]), bf16_table(rows[0]), index)
        rstd, scalars = nxt.buffers(x, "norm1")
        qkv_dynamic = nxt.attention.qkv is not None and nxt.attention.qkv.dynamic_scale()
        norm = RmsNorm(nxt.norm_weight(nxt.block.norm1, x, "norm1"), float(nxt.block.norm1.eps), rstd)
        done = self._residual(plan, x, gate, out, call.mod_segments, index, norm, mod,
                              scalars[0:1] if qkv_dynamic else None)
        if done:
            self.counts["handoff_out"] += 1
            self.state.offer_handoff(nxt.index, self._handoff_key(call),
                                     Handoff(rows, norm, scalars[0:1] if qkv_dynamic else None, activated))
        return x
