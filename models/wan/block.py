"""The fused forward of ComfyUI's Wan ``WanAttentionBlock`` (comfy/ldm/wan/model.py), an object patch built on the
block-fusion toolkit (blocks/).

Stock ``WanAttentionBlock.forward`` and what runs here instead (fp16, ComfyUI's compute dtype for Wan on NVIDIA GPUs,
or bf16; ``e`` the six modulation rows ``cast(modulation) + e``, each token's row ComfyUI's ``repeat_e``):

    y = self_attn(addcmul(e0, norm1(x), 1 + e1))   -> norm1's statistics handed over by the previous block's last
                                                      residual (or one statistics pass) and ONE pack of the
                                                      normalized, modulated rows shared by q, k and v (SharedInput,
                                                      where their scales agree); q / k RMSNorm over the full width
                                                      and RoPE in place (one kernel); ComfyUI's attention, called as
                                                      its self-attention calls it; o's pack
    x = addcmul(x, y, e2)                          -> one residual kernel into the block's new output, with norm3's
                                                      statistics and the cross-attention q pack's global scale
    x = x + cross_attn(norm3(x), context)          -> q packed from norm3(x) on the fly, its RMSNorm in place; k / v
                                                      of the context (and I2V's image k / v and image attention) are
                                                      ComfyUI's modules and calls; o's pack; the residual add with
                                                      norm2's statistics and ffn.0's global scale, in place
    y = ffn(addcmul(e3, norm2(x), 1 + e4))         -> ffn.0 packed from the normalized, modulated rows; GELU (tanh)
                                                      of its output folded into ffn.2's pack
    x = addcmul(x, y, e5)                          -> one residual kernel, in place, with the NEXT block's norm1
                                                      statistics and q / k / v global scale (the hand-over)

So the norm and modulation outputs, the GELU output and the repeated modulation rows are never written to memory.
The sequence is the executable specification tests/wan_block_spec.py checks against ComfyUI's real blocks. Like
ComfyUI's block, the fused block never writes its input: its first residual writes a new tensor, its output.

Other nodes' patches keep working: ``attn1_patch`` and ``attn2_patch`` run where ComfyUI runs them, on the same
tensors (after an ``attn2_patch`` norm2's statistics take a pass of their own); an attention override is called by
ComfyUI's attention function, which the block calls as ComfyUI's block does; a ``double_block`` patch or a
block-replace patch on this block or the next stops the hand-over. Every fused step has ComfyUI's op as its fallback,
with the reason logged once: torch's LayerNorm, ComfyUI's RMSNorm module and ``apply_rope1``, ``torch.addcmul`` /
``x + y`` with ComfyUI's ``repeat_e``, the Linear's own forward on ComfyUI's input (a LoRA-patched layer, a refused
source), ComfyUI's feed-forward where its Linears are not both NVFP4. The decisions that do not depend on a tensor's
shape are the forward's plan (core/plan.py); the per-call decision, the block check, the stock arm, the norm sources,
the residual kernels and the hand-over slot are the toolkit's.
"""

from __future__ import annotations

import collections
import inspect

import torch

from ... import comfy_adapter
from ...blocks.fused_block import FusedBlock, is_layer_norm
from ...blocks.state import ModelState
from ...comfy_adapter import allocation_context
from ...core.fallbacks import note_fallback
from ...core.linear import FusedNVFP4Linear, LinearSource, SharedInput, checked_op
from ...core.plan import ForwardPlan
from ...kernels.backend import KernelBuildError
from ...layout import tensor_version
from .modulation import Tables, TokenRowCache, modulation_tables
from .probes import WAN_PROBES
from .structure import QKV_PATHS, block_module, submodule

# What block i's last residual computed for block i + 1: its modulation tables, norm1's statistics and the q / k / v
# global scale (None: all static).
Handoff = collections.namedtuple("Handoff", "tables norm global_scale")
# A norm's statistics made by the residual before it: what the toolkit's norm_source takes from a neighbour.
Statistics = collections.namedtuple("Statistics", "norm global_scale")
UNSET = object()  # an argument the caller left out (ComfyUI's own default applies)


class WanState(ModelState):
    """The toolkit's model state plus the row index of the current forward (all blocks share it)."""

    def __init__(self):
        super().__init__()
        self.rows = TokenRowCache()


class WanCall:
    """The arguments of one ``WanAttentionBlock.forward`` call (blocks/fused_block.py's call object)."""

    __slots__ = ("x", "e", "freqs", "context", "context_img_len", "transformer_options")

    def __init__(self, x, e, freqs, context, context_img_len, transformer_options):
        self.x, self.e, self.freqs, self.context = x, e, freqs, context
        self.context_img_len, self.transformer_options = context_img_len, transformer_options

    @property
    def rows(self) -> int:
        return self.x.shape[0] * self.x.shape[1] if self.x.dim() == 3 else self.x.shape[0]

    def prefix(self, rows: int) -> "WanCall":
        """The first tokens of every batch item (``rows`` in all), with ComfyUI's own attention (another node's
        override is not compared)."""
        tokens = max(1, min(self.x.shape[1], rows // max(1, self.x.shape[0])))
        options = {k: v for k, v in (self.transformer_options or {}).items() if k != "optimized_attention_override"}
        freqs = self.freqs[:, :tokens] if self.freqs is not None else None
        return WanCall(self.x[:, :tokens], self.e, freqs, self.context, self.context_img_len, options)

    def fresh(self) -> "WanCall":
        return WanCall(self.x.clone(), self.e, self.freqs, self.context, self.context_img_len,
                       dict(self.transformer_options or {}))


class FusedWanBlock(FusedBlock):
    """``WanAttentionBlock.forward`` with its norms, modulation, GELU, q / k norms + RoPE and residuals fused (module
    docstring). ``linears``: the block's fused NVFP4 Linears by path (models/wan/structure.py LINEAR_PATHS);
    ``handoff_stop``: why this block never hands over to the next (the model changes x between them), or None."""

    probe_set = WAN_PROBES.name

    def __init__(self, block, name: str, index: int, linears: dict[str, FusedNVFP4Linear], state: WanState,
                 handoff_stop: str | None = None):
        super().__init__(block, name, index, state)
        self.linears = linears
        self.handoff_stop = handoff_stop
        self.module = block_module(block)
        qkv = [linears[p] for p in QKV_PATHS if p in linears]
        self.qkv = SharedInput(qkv, f"{name}.self_attn.qkv") if qkv else None
        self.qkv_scale_layer = next((f for f in qkv if f.dynamic_scale()), None)  # reduced in the residual if any
        self.image_cross_attention = type(block.cross_attn).forward is self.module.WanI2VCrossAttention.forward
        parameter = inspect.signature(self.stock_forward).parameters.get("context_img_len")
        self.context_img_len_default = None if parameter is None else parameter.default

    def __call__(self, x, e, freqs, context, context_img_len=UNSET, transformer_options={}, **kwargs):
        if context_img_len is UNSET:
            context_img_len = self.context_img_len_default
        if kwargs:  # arguments this route does not know (a newer caller): ComfyUI's block takes them
            note_fallback(self.name, f"unknown arguments {sorted(kwargs)}")
            self.state.drop_handoff()
            return self.stock_forward(x, e, freqs, context, context_img_len=context_img_len,
                                      transformer_options=transformer_options, **kwargs)
        return self.run(WanCall(x, e, freqs, context, context_img_len, transformer_options))

    def stock_call(self, call: WanCall):
        return self.stock_forward(call.x, e=call.e, freqs=call.freqs, context=call.context,
                                  context_img_len=call.context_img_len, transformer_options=call.transformer_options)

    def handoff_modules(self) -> dict:
        return {"norm1": self.block.norm1}

    def input_refusal(self, call: WanCall) -> str | None:
        x, e, freqs = call.x, call.e, call.freqs
        if x.dim() != 3 or x.dtype not in (torch.float16, torch.bfloat16) or x.shape[-1] != self.block.dim:
            return f"input {tuple(x.shape)} {x.dtype} is not [batch, tokens, {self.block.dim}] fp16 or bf16"
        if e.dtype != x.dtype or e.ndim not in (3, 4) or e.shape[0] != x.shape[0] or tuple(e.shape[-2:]) != (
                6, x.shape[-1]):
            return (f"the time embedding {tuple(e.shape)} {e.dtype} is not [batch, (frames,) 6, {x.shape[-1]}] in the "
                    "activation dtype")
        if freqs is None or freqs.dtype != torch.float32 or freqs.dim() != 6 or freqs.shape[0] != 1 \
                or freqs.shape[1] != x.shape[1] or freqs.shape[2] != 1:
            return "the rope table is not fp32 [1, tokens, 1, head_dim / 2, 2, 2]"
        try:
            with allocation_context():  # the forward's row index, kept for its blocks
                self.state.rows.index(self.module.repeat_e, e, x)
        except ValueError as exc:
            return str(exc)
        return None

    @staticmethod
    def _handoff_key(call: WanCall):
        # The x block i returned (the same object and storage) and the same e. Each block call takes (clears) the
        # hand-over, so only the call right after block i's can consume it.
        x, e = call.x, call.e
        return (id(x), x.data_ptr(), tuple(x.shape), id(e), e.data_ptr(), tuple(e.shape), tensor_version(x))

    def handoff_refusal(self, call: WanCall) -> str | None:
        if self.handoff_stop is not None:
            return self.handoff_stop
        reason = super().handoff_refusal(call)
        if reason is not None:
            return reason
        options = call.transformer_options or {}
        if (options.get("patches") or {}).get("double_block"):
            return "a double_block patch changes x between the blocks"
        replace = (options.get("patches_replace") or {}).get("dit", {})
        if ("double_block", self.index) in replace or ("double_block", self.next.index) in replace:
            return "a block-replace patch is installed on this or the next block"
        return None

    # ---- ComfyUI's ops, for the fallbacks (on the [B, L, D] views ComfyUI's block computes on) ------------------

    def modulate(self, tables: Tables, shift: int, scale: int, n: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
        """``torch.addcmul(repeat_e(e[shift], x), n, 1 + repeat_e(e[scale], x))`` as ComfyUI's block computes it."""
        repeat_e = self.module.repeat_e
        return torch.addcmul(repeat_e(tables.chunks[shift], x3), n.view(x3.shape),
                             1 + repeat_e(tables.chunks[scale], x3))

    def _weight(self, norm, x: torch.Tensor, name: str) -> torch.Tensor:
        """An RMSNorm module's weight as its forward casts it for ``x``, valid for this forward (no dtype conversion:
        a weight torch would mix with the activation's dtype is refused by the kernel)."""
        with comfy_adapter.norm_weight(norm, x) as w:
            return self.kept(w, getattr(norm, "weight", None), ("norm weight", name))

    def _project(self, path: str, h: torch.Tensor, source: LinearSource | None, plan: ForwardPlan, rows: int):
        """The output of Linear ``path`` (``[rows, N]``): the fused Linear reading ``h`` through ``source``, or the
        module's own forward on ComfyUI's input where it is not NVFP4."""
        fused = self.linears.get(path)
        if fused is None:
            out = submodule(self.block, path)(source.stock() if source is not None else h)
        else:
            out = fused(h, source=source, plan=plan)
        return out.reshape(rows, out.shape[-1])

    def _qkv(self, h, source: LinearSource, plan: ForwardPlan, rows: int):
        """q, k, v ``[rows, D]``: one pack for the NVFP4 ones (SharedInput), ComfyUI's module on ComfyUI's input (made
        once) for any other."""
        shared = iter(self.qkv(h, source=source, plan=plan) if self.qkv is not None else ())
        stock, out = [], []
        for path in QKV_PATHS:
            if path in self.linears:
                value = next(shared)
            else:
                stock = stock or [source.stock()]
                value = submodule(self.block, path)(stock[0])
            out.append(value.reshape(rows, value.shape[-1]))
        return out

    def _rms_norm_rope(self, plan: ForwardPlan, q, k, attn, name: str, freqs, shape):
        """q (and k) of attention module ``attn`` (``name``) after their RMSNorm over the full width and, with
        ``freqs``, ComfyUI's interleaved RoPE: in place (one kernel), or ComfyUI's RMSNorm modules and
        ``apply_rope1`` (new tensors). ``shape``: (B, L, D)."""
        batch, tokens, dim = shape
        norm_q, norm_k, heads = attn.norm_q, attn.norm_k, attn.num_heads
        step = "rms_norm_rope" if freqs is not None else "rms_norm"
        table = freqs[0, :, 0] if freqs is not None else None  # [L, head_dim / 2, 2, 2]: a view
        qw = self._weight(norm_q, q, f"{name}.norm_q")
        kw = self._weight(norm_k, k, f"{name}.norm_k") if k is not None else None
        reason = plan.refusal(checked_op("rms_norm_rope", q.dtype)) or plan.backend.rms_norm_rope_support(
            q, k, qw, kw, freqs=table, positions=tokens if freqs is not None else None)
        if reason is None:
            try:
                plan.backend.rms_norm_rope_(q, k, qw, kw, float(norm_q.eps), freqs=table,
                                            positions=tokens if freqs is not None else None)
                self.counts[step] += 1
                return q, k
            except (KernelBuildError, ValueError) as exc:
                reason = f"kernel failed: {exc}"
        note_fallback(f"{self.name} {step}", reason)
        out = []
        for t, norm in ((q, norm_q), (k, norm_k)):
            if t is None:
                out.append(None)
                continue
            n = norm(t.view(shape))
            if freqs is not None:
                n = self.module.apply_rope1(n.view(batch, tokens, heads, dim // heads), freqs)
            out.append(n.reshape(batch * tokens, dim))
        return out

    # ---- the fused route -----------------------------------------------------------------------------------

    def fused_forward(self, call: WanCall, *, plan: ForwardPlan, handoff: bool = True):
        block, module = self.block, self.module
        x3 = call.x.contiguous()  # ComfyUI's block does the same (a copy only where its input is not contiguous)
        batch, tokens, dim = x3.shape
        rows = batch * tokens
        x = x3.view(rows, dim)
        options = call.transformer_options or {}
        patches = options.get("patches") or {}
        attention = module.optimized_attention
        sa, ca = block.self_attn, block.cross_attn
        incoming = self.state.take_handoff(self.index, self._handoff_key(call))
        self.counts["fused"] += 1
        self.counts["handoff_in"] += incoming is not None
        # Outside ComfyUI's allocation graph (dynamic VRAM records each block's allocations): the row index outlives
        # this block, and every block allocates alike, whether it was handed its tables or not.
        with allocation_context():
            index = self.state.rows.index(module.repeat_e, call.e, x3)
            tables = incoming.tables if incoming is not None else modulation_tables(block, call.e, x3, index)

        # ---- self-attention: one pack of the normalized, modulated rows for q, k and v
        handed = Statistics(incoming.norm, incoming.global_scale) if incoming is not None else None
        h, source = self.norm_source(plan, x, block.norm1, tables.modulation(0, 1), "norm1", self.qkv_scale_layer,
                                     handed, lambda n: self.modulate(tables, 0, 1, n, x3))
        q, k, v = self._qkv(h, source, plan, rows)
        q, k = self._rms_norm_rope(plan, q, k, sa, "self_attn", call.freqs, x3.shape)
        y = attention(q.view(x3.shape), k.view(x3.shape), v.view(x3.shape), heads=sa.num_heads,
                      transformer_options=options)
        for patch in patches.get("attn1_patch", ()):  # as ComfyUI's self-attention runs them, on the same tensors
            y = patch({"x": y, "q": q.view(batch, tokens, sa.num_heads, sa.head_dim),
                       "k": k.view(batch, tokens, sa.num_heads, sa.head_dim), "transformer_options": options})
        y = self._project("self_attn.o", y, None, plan, rows)

        # ---- x + y * e2 into the block's output, with norm3's statistics (and the cross-attention q's scale)
        out = torch.empty_like(x)
        out3 = out.view(x3.shape)
        norm3, cross_q = block.norm3, self.linears.get("cross_attn.q")
        stats3 = g3 = None
        fold3 = self.fold_refusal(x, norm3, plan) if is_layer_norm(norm3) else None
        if is_layer_norm(norm3) and fold3 is None:
            stats3, slot = self.statistics(norm3, x, "norm3")
            g3 = slot if cross_q is not None and cross_q.dynamic_scale() else None
        if not self.layer_norm_residual(
                plan, x, y, stats3, lambda: torch.addcmul(x3, y.view(x3.shape), module.repeat_e(tables.chunks[2], x3),
                                                          out=out3),
                gate=tables.rows[2], index=index, out=out, global_scale_out=g3):
            stats3 = None
        if fold3 is not None:
            note_fallback(f"{self.name}.norm3", f"torch's LayerNorm runs: {fold3}")

        # ---- cross-attention
        if stats3 is not None:
            self.counts["norm3"] += 1
            cq_source, cq_input = LinearSource(lambda: norm3(out3), norm=stats3, global_scale=g3), out
        else:
            cq_source, cq_input = None, norm3(out3)  # an Identity where cross_attn_norm is off
        cq = self._project("cross_attn.q", cq_input, cq_source, plan, rows)
        cq, _ = self._rms_norm_rope(plan, cq, None, ca, "cross_attn", None, x3.shape)
        cq3 = cq.view(x3.shape)
        context = call.context
        if self.image_cross_attention:  # WanI2VCrossAttention: the image tokens first
            context_img, context = context[:, :call.context_img_len], context[:, call.context_img_len:]
        ck, cv = ca.norm_k(ca.k(context)), ca.v(context)
        if self.image_cross_attention:
            k_img, v_img = ca.norm_k_img(ca.k_img(context_img)), ca.v_img(context_img)
            img_x = attention(cq3, k_img, v_img, heads=ca.num_heads, transformer_options=options,
                              low_precision_attention=False)
        y = attention(cq3, ck, cv, heads=ca.num_heads, transformer_options=options)
        if self.image_cross_attention:
            y = y + img_x
        y = self._project("cross_attn.o", y, None, plan, rows)

        # ---- x + y, in place, with norm2's statistics (and ffn.0's scale of the modulated rows)
        mod2, ffn0 = tables.modulation(3, 4), self.linears.get("ffn.0")
        attn2 = patches.get("attn2_patch", ())
        fold2 = self.fold_refusal(out, block.norm2, plan) if not attn2 else "an attn2_patch changes x after the add"
        handed2 = None
        if fold2 is None:
            stats2, slot = self.statistics(block.norm2, out, "norm2")
            g2 = slot if ffn0 is not None and ffn0.dynamic_scale() else None
            if self.layer_norm_residual(plan, out, y, stats2, lambda: torch.add(out3, y.view(x3.shape), out=out3),
                                        next_modulation=mod2 if g2 is not None else None, global_scale_out=g2):
                handed2 = Statistics(stats2, g2)
        else:
            self.layer_norm_residual(plan, out, y, None, lambda: torch.add(out3, y.view(x3.shape), out=out3))
        current3, owned = out3, True
        for patch in attn2:  # as ComfyUI's block runs them, on its x
            current3, owned = patch({"x": current3, "transformer_options": options}), False
        if not owned:
            current3 = current3.contiguous()
        current = current3.view(rows, dim)

        # ---- feed-forward: ffn.0 from the normalized, modulated rows, GELU in ffn.2's pack
        h, source = self.norm_source(plan, current, block.norm2, mod2, "norm2", ffn0, handed2,
                                     lambda n: self.modulate(tables, 3, 4, n, current3))
        ffn2 = self.linears.get("ffn.2")
        if ffn0 is None or ffn2 is None:  # ComfyUI's feed-forward (its NVFP4 Linear takes the fused pack)
            y = block.ffn(source.stock()).reshape(rows, dim)
        else:
            f = self._project("ffn.0", h, source, plan, rows)
            y = ffn2(f, source=LinearSource(lambda: comfy_adapter.eager_gelu_tanh(f), gelu=True), plan=plan)

        # ---- x + y * e5 (in place where the block owns x), with the next block's norm1 statistics where it is ours
        target = current if owned else torch.empty_like(current)
        result = target.view(x3.shape)

        def stock_residual():
            torch.addcmul(current3, y.view(x3.shape), module.repeat_e(tables.chunks[5], current3), out=result)

        if handoff:
            reason = self.handoff_refusal(call)
            if reason is None:
                reason = self.next.fold_refusal(current, self.next.block.norm1, plan)
            if reason is None:
                self._residual_with_handoff(plan, call, current, y, target, tables, index, result, stock_residual)
                return result
            note_fallback(f"{self.name} -> next block hand-over", reason)
        self.layer_norm_residual(plan, current, y, None, stock_residual, gate=tables.rows[5], index=index,
                                 out=None if owned else target)
        return result

    def _residual_with_handoff(self, plan: ForwardPlan, call: WanCall, x, y, target, tables: Tables, index, result,
                               stock_residual) -> None:
        nxt = self.next
        with allocation_context():  # block i + 1 uses these tables
            next_tables = modulation_tables(nxt.block, call.e, result, index)
        stats, slot = nxt.statistics(nxt.block.norm1, x, "norm1")
        g = slot if nxt.qkv_scale_layer is not None else None
        done = self.layer_norm_residual(plan, x, y, stats, stock_residual, gate=tables.rows[5], index=index,
                                        out=None if target is x else target,
                                        next_modulation=next_tables.modulation(0, 1) if g is not None else None,
                                        global_scale_out=g)
        if done:
            self.counts["handoff_out"] += 1
            self.state.offer_handoff(nxt.index, self._handoff_key(WanCall(result, call.e, None, None, None, None)),
                                     Handoff(next_tables, stats, g))

