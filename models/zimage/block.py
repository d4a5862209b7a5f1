"""Fused forward of ComfyUI's Z-Image ``JointTransformerBlock`` (comfy/ldm/lumina/model.py; an object patch).

Stock ``JointTransformerBlock.forward`` and what runs here instead (tests/zimage_block.py is the executable
specification; the modulated blocks of ``layers`` and ``noise_refiner``; the refiner blocks of ``context_refiner``
have no adaLN tables and no gates), per block with x the ``[B, S, D]`` residual stream as ``[B*S, D]`` rows:

    scale_msa, gate_msa, scale_mlp, gate_mlp = adaLN_modulation(adaln_input).chunk(4)
                                                        ComfyUI's module (the rows of the next block are made by
                                                           the block before it, for the hand-over)
    h = modulate(attention_norm1(x), scale_msa)         -> folded into qkv's pack (the norm's statistics handed over
                                                           by the previous block's last residual, or one pass)
    q, k, v = qkv(h); q, k = ck.rms_rope(q, k, ...)     comfy-kitchen's op, as ComfyUI calls it
    a = attention(q, k, v)                              ComfyUI's attention function, k and v as views (ComfyUI's
                                                           repeat with n_rep = 1 copies the same values); another
                                                           node's attention override gets ComfyUI's very call
    x = x + apply_gate(tanh(gate_msa), attention_norm2(out(a)))
                                                        -> one post-norm residual kernel (out's own plain pack
                                                           before it) that also makes ffn_norm1's statistics and
                                                           w1 / w3's global scale
    h = modulate(ffn_norm1(x), scale_mlp)               -> folded into one pack that w1 and w3 both read
    y = w2(silu(w1(h)) * w3(h))                         -> SwiGLU of the two outputs folded into w2's pack
    x = x + apply_gate(tanh(gate_mlp), ffn_norm2(y))    -> one post-norm residual kernel that also makes the NEXT
                                                           block's attention_norm1 statistics and qkv amax

tanh of a gate is ComfyUI's op on the small [rows, D] adaLN table; ``clamp_fp16`` is the identity in bf16, the one
compute dtype the block's kernels take (a model computing in fp16 runs ComfyUI's block, its NVFP4 Linears keep their
fp16 packs). ``timestep_zero_index`` (omni / reference images) selects each token's adaLN row through the row index
(modulation.py). ComfyUI's block returns a new tensor and leaves its input as it is (a caller may keep either: a
cache of a block's output, say): the first residual kernel reads the block's input and writes the new stream (out
of place), the second updates that stream in place.

Every step that cannot run its kernel runs ComfyUI's own op with the reason logged once; the toolkit (blocks/) makes
the per-call decision, the block check at first use and the hand-over slot.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from ... import comfy_adapter
from ...blocks.fused_block import FusedBlock
from ...blocks.row_index import RowIndexCache
from ...blocks.state import ModelState
from ...comfy_adapter import allocation_context
from ...core.fallbacks import note_fallback
from ...core.linear import FusedNVFP4Linear, LinearSource, SharedInput
from ...core.plan import ForwardPlan
from ...layout import Modulation, RmsNorm, rows_readable_in_place
from .modulation import adaln_row_index
from .probes import ZIMAGE_PROBES
from .structure import submodule


def slices_key(timestep_zero_index) -> tuple | None:
    return None if timestep_zero_index is None else tuple((int(a), int(b)) for a, b in timestep_zero_index)


class ChainIndex(RowIndexCache):
    """The adaLN row index of one block list's calls (each list keeps its own: the noise refiner's and the layers'
    tokens of one forward differ), rebuilt only when the batch, the tokens, the table rows or the slices change."""

    def index(self, batch: int, tokens: int, table_rows: int, timestep_zero_index, device) -> torch.Tensor:
        key = (batch, tokens, table_rows, slices_key(timestep_zero_index), str(device))
        return self.get(key, device, lambda: (adaln_row_index(batch, tokens, table_rows, timestep_zero_index), ()))


@dataclasses.dataclass
class Tables:
    """A modulated block's adaLN rows: ComfyUI's four chunks of its projection (scale_msa, gate_msa, scale_mlp,
    gate_mlp: ``[rows, D]`` views), the scale-only modulations and tanh'd gates the kernels read, the row index of
    the tokens. Empty in a refiner block."""

    chunks: tuple = ()
    attention: Modulation | None = None
    ffn: Modulation | None = None
    gate_attention: torch.Tensor | None = None
    gate_ffn: torch.Tensor | None = None
    index: torch.Tensor | None = None

    def chunk(self, i: int) -> torch.Tensor | None:
        return self.chunks[i] if self.chunks else None


class Handoff:
    """What block i's last residual computed for block i + 1: its adaLN tables, attention_norm1 statistics and, for
    a dynamic qkv, the global scale; and the stream block i returned (kept so its identity keys the hand-over)."""

    def __init__(self, tables: Tables, norm: RmsNorm, global_scale: torch.Tensor | None, stream: torch.Tensor):
        self.tables = tables
        self.norm = norm
        self.global_scale = global_scale
        self.stream = stream


class JointCall:
    """The arguments of one ``JointTransformerBlock.forward`` call (blocks/fused_block.py's call object)."""

    __slots__ = ("x", "x_mask", "freqs_cis", "adaln_input", "timestep_zero_index", "transformer_options")

    def __init__(self, x, x_mask, freqs_cis, adaln_input, timestep_zero_index, transformer_options):
        self.x, self.x_mask, self.freqs_cis, self.adaln_input = x, x_mask, freqs_cis, adaln_input
        self.timestep_zero_index, self.transformer_options = timestep_zero_index, transformer_options

    @property
    def rows(self) -> int:
        return self.x.shape[0] * self.x.shape[1]

    def prefix(self, rows: int) -> "JointCall":
        """The first tokens of every batch entry, ``rows`` rows in all, with ComfyUI's own attention (another node's
        override is not compared). The slices of ``timestep_zero_index`` stay as they are: Python's slicing clips
        them at the shorter sequence in ComfyUI's block as the row index clips them."""
        tokens = max(1, min(self.x.shape[1], rows // max(1, self.x.shape[0])))
        options = {k: v for k, v in (self.transformer_options or {}).items() if k != "optimized_attention_override"}
        freqs = self.freqs_cis[:, :tokens] if self.freqs_cis is not None else None
        return JointCall(self.x[:, :tokens], self.x_mask, freqs, self.adaln_input, self.timestep_zero_index, options)

    def fresh(self) -> "JointCall":
        return JointCall(self.x.clone(), self.x_mask, self.freqs_cis, self.adaln_input, self.timestep_zero_index,
                         dict(self.transformer_options or {}))


class FusedJointBlock(FusedBlock):
    """``JointTransformerBlock.forward`` with its norms, modulation, SwiGLU and post-norm residuals fused (module
    docstring). ``linears``: the block's fused NVFP4 Linears by path (structure.py LINEAR_PATHS); ``chain_index``:
    its block list's row index; ``patch_key``: the key of ComfyUI's post-block patches of its list."""

    probe_set = ZIMAGE_PROBES.name

    def __init__(self, block, name: str, index: int, state: ModelState, *, linears: dict[str, FusedNVFP4Linear],
                 modulated: bool, chain_index: ChainIndex, patch_key: str | None):
        super().__init__(block, name, index, state)
        self.linears = linears
        self.modulated = modulated
        self.chain_index = chain_index
        self.patch_key = patch_key
        w1, w3 = linears.get("feed_forward.w1"), linears.get("feed_forward.w3")
        self.w1_w3 = SharedInput((w1, w3), f"{name}.feed_forward.w1/w3") if w1 is not None and w3 is not None else None
        module = sys.modules.get(type(block).__module__)
        self.modulate = getattr(module, "modulate")
        self.apply_gate = getattr(module, "apply_gate")
        self.attention_function = getattr(module, "optimized_attention_masked")

    def __call__(self, x, x_mask, freqs_cis, adaln_input=None, timestep_zero_index=None, transformer_options={}):
        return self.run(JointCall(x, x_mask, freqs_cis, adaln_input, timestep_zero_index, transformer_options))

    def stock_call(self, call: JointCall):
        return self.stock_forward(call.x, call.x_mask, call.freqs_cis, call.adaln_input,
                                  timestep_zero_index=call.timestep_zero_index,
                                  transformer_options=call.transformer_options)

    def handoff_modules(self) -> dict:
        modules = {"attention_norm1": self.block.attention_norm1}
        if self.modulated:
            modules["adaLN_modulation"] = self.block.adaLN_modulation
        return modules

    # ---- what the route takes ------------------------------------------------------------------------------

    def row_index(self, call: JointCall) -> torch.Tensor:
        batch, tokens = call.x.shape[:2]
        return self.chain_index.index(batch, tokens, call.adaln_input.shape[0], call.timestep_zero_index,
                                      call.x.device)

    def input_refusal(self, call: JointCall) -> str | None:
        x = call.x
        if x.dtype != torch.bfloat16:
            return (f"the block computes in {x.dtype}: its fused kernels take bfloat16 (ComfyUI's block runs; its "
                    "NVFP4 Linears keep the fused pack)")
        if x.dim() != 3:
            return f"input {tuple(x.shape)} is not a [batch, tokens, width] stream"
        if call.x_mask is not None:
            return "an attention mask is passed (ComfyUI's Z-Image passes none)"
        adaln = call.adaln_input
        if (adaln is not None) != self.modulated or (adaln is not None and adaln.dim() != 2):
            return "the adaLN input does not fit the block's modulation (ComfyUI's block decides)"
        if self.modulated:
            try:
                with allocation_context():  # the index outlives the block (every block of the list reads it)
                    self.row_index(call)
            except ValueError as exc:
                return str(exc)
        return None

    def tables(self, call: JointCall) -> Tables:
        """This block's adaLN tables for ``call`` (ComfyUI's module on the adaLN input; none in a refiner)."""
        if not self.modulated:
            return Tables()
        chunks = self.block.adaLN_modulation(call.adaln_input).chunk(4, dim=1)
        index = self.row_index(call)
        return Tables(chunks, Modulation(chunks[0], None, index), Modulation(chunks[2], None, index),
                      chunks[1].tanh(), chunks[3].tanh(), index)

    # ---- the hand-over to the next block -------------------------------------------------------------------

    @staticmethod
    def _handoff_key(call: JointCall, stream: torch.Tensor | None = None):
        # The stream tensor block i returned (the same object and storage), the same adaLN input and slices.
        x = call.x if stream is None else stream
        adaln = call.adaln_input
        return (id(x), x.data_ptr(), tuple(x.shape), None if adaln is None else (id(adaln), adaln.data_ptr()),
                slices_key(call.timestep_zero_index))

    def handoff_refusal(self, call: JointCall) -> str | None:
        reason = super().handoff_refusal(call)
        if reason is not None:
            return reason
        options = call.transformer_options or {}
        if self.patch_key is not None:
            if self.patch_key in (options.get("patches") or {}):
                return f"ComfyUI's post-block patches ({self.patch_key}) change x between the blocks"
            replace = (options.get("patches_replace") or {}).get("dit", {})
            if (self.patch_key, self.index) in replace or (self.patch_key, self.next.index) in replace:
                return "a block-replace patch is installed on this or the next block"
        return None

    # ---- the fused route -----------------------------------------------------------------------------------

    def fused_forward(self, call: JointCall, *, plan: ForwardPlan, handoff: bool = True):
        block = self.block
        batch, tokens, dim = call.x.shape
        incoming = self.state.take_handoff(self.index, self._handoff_key(call))
        self.counts["fused"] += 1
        self.counts["handoff_in"] += incoming is not None
        with allocation_context():  # every block allocates alike, handed its tables or not
            tables = incoming.tables if incoming is not None else self.tables(call)
        # ComfyUI's block leaves its input as it is and returns a new tensor (a caller may hold either: a cache of a
        # block's output, say): the first residual reads the input and writes the new stream, the second updates it
        x_in = call.x.reshape(batch * tokens, dim)
        if x_in.stride() != (dim, 1) or not rows_readable_in_place(x_in):
            x_in = x_in.clone(memory_format=torch.contiguous_format)
        x = torch.empty_like(x_in, memory_format=torch.contiguous_format)
        x3 = x.view(batch, tokens, dim)
        tzi = call.timestep_zero_index

        def modulated(n, scale):
            """ComfyUI's qkv / w1 / w3 input from a norm output: lumina's ``modulate`` (a refiner: the norm output)."""
            n = n.view(batch, tokens, dim)
            return n if scale is None else self.modulate(n, scale, timestep_zero_index=tzi)

        # ---- attention half
        h, source = self.norm_source(plan, x_in, block.attention_norm1, tables.attention, "attention_norm1",
                                     self.linears.get("attention.qkv"), incoming,
                                     lambda n: modulated(n, tables.chunk(0)))
        qkv = self._project("attention.qkv", h, source, plan)
        a = self._attention(qkv.view(batch, tokens, -1), call)
        o = self._project("attention.out", a, None, plan).reshape(batch * tokens, dim)

        # ---- residual 1, with ffn_norm1's statistics and w1 / w3's global scale where ffn_norm1 folds
        ffn_norm, g_ffn = None, None
        reason = self.fold_refusal(x, block.ffn_norm1, plan)
        if reason is None:
            rstd, scalars = self.buffers(x, "ffn_norm1")
            ffn_norm = RmsNorm(self.norm_weight(block.ffn_norm1, x, "ffn_norm1"), float(block.ffn_norm1.eps), rstd)
            if any(f is not None and f.dynamic_scale() for f in self._ffn_up_linears()):
                g_ffn = scalars[0:1]
        else:
            note_fallback(f"{self.name}.ffn_norm1", f"torch's RMSNorm runs: {reason}")
        folded = self._residual(plan, call, x, o, "attention_norm2", tables, 1, ffn_norm, tables.ffn, g_ffn,
                                x_from=x_in)
        self.counts["ffn_norm1"] += folded

        # ---- feed-forward: w1 and w3 read one pack, SwiGLU folded into w2's
        if folded:
            source = LinearSource(lambda: modulated(block.ffn_norm1(x), tables.chunk(2)), modulation=tables.ffn,
                                  norm=ffn_norm, global_scale=g_ffn)
            ffn_input = x
        else:
            ffn_input, source = modulated(block.ffn_norm1(x3), tables.chunk(2)).view(batch * tokens, dim), None
        x1, x3_up = (t.reshape(batch * tokens, -1) for t in self._ffn_up(ffn_input, source, plan))
        y = self._ffn_down(x1, x3_up, plan).reshape(batch * tokens, dim)

        # ---- residual 2, with the next block's attention_norm1 statistics and qkv amax where that block is ours
        if handoff and self.next is not None:  # the last block of a list has none to hand over to
            reason = self.handoff_refusal(call)
            if reason is None:
                reason = self.next.fold_refusal(x, self.next.block.attention_norm1, plan)
            if reason is None:
                return self._residual_with_handoff(plan, call, x, y, tables)
            note_fallback(f"{self.name} -> next block hand-over", reason)
        self._residual(plan, call, x, y, "ffn_norm2", tables, 3, None, None, None)
        return x3

    def _project(self, path: str, h: torch.Tensor, source: LinearSource | None, plan: ForwardPlan):
        """Linear ``path`` of the block on ``h`` read through ``source``: its fused Linear, or (not NVFP4) ComfyUI's
        module on the input ComfyUI builds."""
        linear = self.linears.get(path)
        if linear is not None:
            return linear(h, source=source, plan=plan)
        return submodule(self.block, path)(source.stock() if source is not None else h)

    def _ffn_up_linears(self):
        return self.linears.get("feed_forward.w1"), self.linears.get("feed_forward.w3")

    def _ffn_up(self, h: torch.Tensor, source: LinearSource | None, plan: ForwardPlan):
        if self.w1_w3 is not None:
            return self.w1_w3(h, source=source, plan=plan)
        return [self._project(path, h, source, plan) for path in ("feed_forward.w1", "feed_forward.w3")]

    def _ffn_down(self, x1: torch.Tensor, x3: torch.Tensor, plan: ForwardPlan):
        """w2 of ComfyUI's SwiGLU gating of w1's and w3's outputs, the gating folded into w2's pack."""
        ffn = self.block.feed_forward
        w2 = self.linears.get("feed_forward.w2")

        def gating():
            return ffn._forward_silu_gating(x1, x3)

        if w2 is None:
            return ffn.w2(gating())
        return w2(x1, swiglu=True, up=x3, stock=gating, plan=plan)

    def _attention(self, qkv: torch.Tensor, call: JointCall) -> torch.Tensor:
        """ComfyUI's joint attention after its qkv projection, on ``qkv`` ``[B, S, 3 * inner]``: comfy-kitchen's q / k
        RMSNorm + RoPE, the attention function of the block's module; returns ``[B, S, inner]``."""
        attn = self.block.attention
        batch, tokens = qkv.shape[:2]
        heads, head_dim = attn.n_local_heads, attn.head_dim
        q, k, v = (t.view(batch, tokens, heads, head_dim) for t in qkv.split(heads * head_dim, dim=-1))
        q, k = comfy_adapter.qk_rms_rope(attn.q_norm, attn.k_norm, q, k, call.freqs_cis)
        options = call.transformer_options
        if (options or {}).get("optimized_attention_override") is not None:
            # another node's override gets ComfyUI's very call: k and v as the contiguous copies ComfyUI's repeat
            # (one kv head per head) makes of them
            k, v = k.contiguous(), v.contiguous()
        return self.attention_function(q.movedim(1, 2), k.movedim(1, 2), v.movedim(1, 2), heads, call.x_mask,
                                       skip_reshape=True, transformer_options=options)

    def _residual(self, plan: ForwardPlan, call: JointCall, x, other, norm_name: str, tables: Tables, gate: int,
                  next_norm, next_modulation, global_scale_out, x_from=None) -> bool:
        """The post-norm residual ``x += apply_gate(tanh(gate_chunk), norm(other))`` (a refiner: ``x +=
        norm(other)``; ``x = x_from + ...`` with ``x_from``) through the toolkit's kernel step, ComfyUI's ops where
        it cannot run; ``gate``: the index of the gate among the adaLN chunks. Returns whether the next norm's
        statistics were produced."""
        norm = getattr(self.block, norm_name)
        gate_chunk = tables.chunk(gate)
        batch, tokens, dim = call.x.shape

        def stock():
            n = norm(other.view(batch, tokens, dim))
            if gate_chunk is not None:
                n = self.apply_gate(gate_chunk.unsqueeze(1).tanh(), n, timestep_zero_index=call.timestep_zero_index)
            x.view(batch, tokens, dim).add_(n)

        gate_table = tables.gate_attention if gate == 1 else tables.gate_ffn
        return self.post_norm_residual(plan, x, other, norm, norm_name, gate_table, tables.index, next_norm,
                                       next_modulation, global_scale_out, stock, x_from=x_from)

    def _residual_with_handoff(self, plan: ForwardPlan, call: JointCall, x, y, tables: Tables):
        nxt = self.next
        with allocation_context():  # block i + 1 reads these
            next_tables = nxt.tables(call)
        rstd, scalars = nxt.buffers(x, "attention_norm1")
        qkv = nxt.linears.get("attention.qkv")
        g_qkv = scalars[0:1] if qkv is not None and qkv.dynamic_scale() else None
        norm1 = nxt.block.attention_norm1
        norm = RmsNorm(nxt.norm_weight(norm1, x, "attention_norm1"), float(norm1.eps), rstd)
        done = self._residual(plan, call, x, y, "ffn_norm2", tables, 3, norm, next_tables.attention, g_qkv)
        stream = x.view(call.x.shape)
        if done:
            self.counts["handoff_out"] += 1
            self.state.offer_handoff(nxt.index, self._handoff_key(call, stream),
                                     Handoff(next_tables, norm, g_qkv, stream))
        return stream
