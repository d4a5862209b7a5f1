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
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading

import torch

from ... import comfy_adapter
from ...comfy_adapter import allocation_context
from ...core.calibration import RecordingForward, recording_paused
from ...core.fallbacks import note_fallback
from ...core.linear import FusedNVFP4Linear, PackPatch
from ...core.plan import ForwardPlan, plan_for
from ...kernels.backend import KernelBuildError
from ...layout import Modulation, RmsNorm, tensor_version
from .attention import FusedAttention
from .mlp import FusedSwigluMLP
from .modulation import ModulationIndexCache, bf16_table
from .probes import BlockVerdict, check_block, record_block_verdict
from .sources import LinearSource

# Rows of the real input the first patched block compares stock vs fused on (bounded extra memory, every
# segment kind of the packed sequence still present: text, audio and the start of the video).
BLOCK_CHECK_ROWS = 4096


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class ModelState:
    """State shared by the patches of one patched model clone: the modulation index of the current forward, the
    block self-check's verdict, and the hand-over of norm statistics from one block to the next."""

    def __init__(self):
        self.index_cache = ModulationIndexCache()
        self.block_check = "pending"  # "pending" | "passed" | "failed" | "off"
        self.block_check_detail = ""
        self.node_id = None  # the graph node that patched the model: the block check's verdict is shown there
        self.handoff = None  # (block index, key, Handoff) written by block i for block i + 1
        self.lock = threading.Lock()


class Handoff:
    """What block i's last residual computed for block i + 1: its modulation rows, norm1 statistics and, for a
    dynamic qkv_proj, the global scale; and silu(t_emb), for block i + 2's rows (None where not reused)."""

    def __init__(self, rows, norm: RmsNorm, global_scale: torch.Tensor | None, activated_t_emb: torch.Tensor | None):
        self.rows = rows
        self.norm = norm
        self.global_scale = global_scale
        self.activated_t_emb = activated_t_emb


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


class FusedDiTBlock(PackPatch):
    """``DiTBlock.forward`` with modulation, RMSNorm, SwiGLU and the gated residuals fused (module docstring)."""

    def __init__(self, block, name: str, index: int, attention: FusedAttention, mlp: FusedSwigluMLP,
                 state: ModelState):
        self.block = block
        self.name = name
        self.index = index
        self.attention = attention
        self.mlp = mlp
        self.state = state
        self.next: FusedDiTBlock | None = None  # set by models/h3/patch.py when block index + 1 is patched too
        self.stock_forward = type(block).forward.__get__(block)
        module = sys.modules.get(type(block).__module__)
        self.mod_scale_shift = getattr(module, "_mod_scale_shift")
        self.mod_gate = getattr(module, "_mod_gate")
        self._workspace = {}
        # Calls by path (tests and the report read them): "fused" forwards, "norm1" / "norm2" folded into the
        # kernels, "residual" kernels, "handoff_out" / "handoff_in" statistics handed to / taken from a neighbour.
        self.counts = collections.Counter()

    def _patched_submodules(self):
        """(module, this pack's forward patch) of the block's attention, MLP and Linears."""
        block = self.block
        for module in (block.attn, block.attn.qkv_proj, block.attn.out_proj, block.mlp, block.mlp.fc1, block.mlp.fc2):
            forward = module.__dict__.get("forward")
            if isinstance(forward, (FusedNVFP4Linear, FusedAttention, FusedSwigluMLP)):
                yield module, forward

    def recorders(self) -> set:
        """The calibration recorders of this block's fused Linears (empty unless calibrating)."""
        return {f.recorder for _, f in self._patched_submodules()
                if isinstance(f, FusedNVFP4Linear) and f.recorder is not None}

    @contextlib.contextmanager
    def unpatched(self, keep_recording: bool = False):
        """ComfyUI's own forwards on this block's submodules for the duration (this pack's object patches lifted):
        the stock arm of the block self-check. ``keep_recording``: a calibrating Linear records on the stock
        forward (the call the user gets)."""
        saved = list(self._patched_submodules())
        for module, forward in saved:
            del module.__dict__["forward"]
            if keep_recording and isinstance(forward, FusedNVFP4Linear) and forward.recorder is not None:
                module.__dict__["forward"] = RecordingForward(module, forward.name, forward.recorder)
        try:
            yield
        finally:
            for module, forward in saved:
                module.__dict__["forward"] = forward

    # ---- decisions -----------------------------------------------------------------------------------------

    def refusal(self, x, plan: ForwardPlan | None) -> str | None:
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            return f"input {tuple(x.shape)} {x.dtype} is not a 2-D bfloat16 token matrix"
        if torch.compiler.is_compiling():
            return "inside torch.compile (the stock block is traced instead)"
        if comfy_adapter.in_training():
            return "ComfyUI is training"
        if self.state.block_check == "failed":
            return f"the block self-check failed: {self.state.block_check_detail}"
        return plan.refusal("block")

    def _fold_norm(self, x, norm, plan: ForwardPlan) -> str | None:
        """None if RMSNorm ``norm`` can be folded into the kernels for this input, else why not."""
        if getattr(norm, "weight", None) is None or tuple(getattr(norm, "normalized_shape", ())) != (x.shape[1],):
            return "the norm has no weight over the hidden size"
        if getattr(norm, "weight_function", None) or getattr(norm, "bias_function", None):
            return "the norm weight is patched on the fly"
        return plan.refusal("rms_norm") or plan.backend.rms_norm_support(x, norm.weight)

    def _norm_weight(self, norm, x, name) -> torch.Tensor:
        """bf16 norm weight valid for the rest of this forward: the resident parameter itself, or a copy in a
        persistent buffer when ComfyUI's cast hands out a temporary (offloaded weights)."""
        with comfy_adapter.norm_weight(norm, x) as w:
            own = getattr(norm, "weight", None)
            if own is not None and w.data_ptr() == own.data_ptr() and w.dtype == torch.bfloat16:
                return w
            key = ("weight", name, w.shape[0], x.device)
            buf = self._workspace.get(key)
            if buf is None:
                with allocation_context():
                    buf = self._workspace.setdefault(key, torch.empty(w.shape[0], dtype=torch.bfloat16,
                                                                      device=x.device))
            return buf.copy_(w)

    def _buffers(self, x, name):
        """Reused per-block device buffers: fp32 rstd [M] and a 2-float scalar slot (global scale, spare)."""
        key = (name, x.shape[0], x.device)
        buf = self._workspace.get(key)
        if buf is None:
            with allocation_context():
                buf = (torch.empty(x.shape[0], dtype=torch.float32, device=x.device),
                       torch.empty(2, dtype=torch.float32, device=x.device))
            self._workspace = {k: v for k, v in self._workspace.items() if k[0] != name}  # the old row count
            self._workspace[key] = buf
        return buf

    # ---- the forward ---------------------------------------------------------------------------------------

    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        plan = plan_for(x.device)  # every decision of this forward that does not depend on a tensor's shape
        reason = self.refusal(x, plan)
        if reason is None and self.state.block_check == "pending":
            if _capturing(x):
                reason = "the block self-check waits for a call outside CUDA-graph capture"
            else:
                return self._block_check(x, t_emb, mod_segments, rope_freqs, transformer_options, attention, plan)
        if reason is not None:
            note_fallback(self.name, reason)
            self._drop_handoff()
            return self.stock_forward(x, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options,
                                      attention=attention)
        return self.fused_forward(x, t_emb, mod_segments, rope_freqs, transformer_options, attention, plan=plan)

    def _drop_handoff(self):
        self.state.handoff = None

    def _take_handoff(self, x, t_emb, mod_segments):
        handoff, self.state.handoff = self.state.handoff, None
        if handoff is None:
            return None
        index, key, value = handoff
        if index != self.index or key != self._handoff_key(x, t_emb, mod_segments):
            return None
        return value

    @staticmethod
    def _handoff_key(x, t_emb, mod_segments):
        # The residual stream tensor block i returned (same object and storage), the same t_emb and segments. Each
        # block call takes (clears) the hand-over, so only the call right after block i's can consume it.
        return (id(x), x.data_ptr(), tuple(x.shape), id(t_emb), t_emb.data_ptr(), tensor_version(x),
                ModulationIndexCache._key_of(mod_segments, x.shape[0], x.device))

    def _handoff_refusal(self, transformer_options, attention) -> str | None:
        """Why block i may not compute block i + 1's norm statistics in its last residual (None: it may)."""
        nxt = self.next
        if nxt is None:
            return "the next block is not patched"
        if attention is not None or (transformer_options or {}).get("optimized_attention_override") is not None:
            return "another node replaces the attention"
        replace = ((transformer_options or {}).get("patches_replace") or {}).get("dit", {})
        if ("double_block", self.index) in replace or ("double_block", nxt.index) in replace:
            return "a block-replace patch is installed on this or the next block"
        if (transformer_options or {}).get("prefetch_dynamic_vbars", False):
            # Dynamic VRAM: ComfyUI prefetches block i + 1's weights when that block starts. Its adaLN rows and
            # norm1 weight, taken here through ComfyUI's own cast, are the same either way; a layer not kept in
            # VRAM would be copied once more, so the hand-over waits until it is.
            streamed = [name for name, module in (("adaln_proj", nxt.block.adaln_proj), ("norm1", nxt.block.norm1))
                        if not comfy_adapter.weights_in_vram(module)]
            if streamed:
                return (f"dynamic VRAM has not kept the next block's {' and '.join(streamed)} weights in VRAM "
                        f"(ComfyUI's prefetch brings them with that block)")
        if (transformer_options or {}).get("block_index", self.index) != self.index:
            return "the block is not called from the model's block loop"
        return None

    def fused_forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options, attention, *, handoff=True,
                      plan: ForwardPlan | None = None):
        block = self.block
        plan = plan if plan is not None else plan_for(x.device)
        incoming = self._take_handoff(x, t_emb, mod_segments)
        self.counts["fused"] += 1
        self.counts["handoff_in"] += incoming is not None
        # Outside ComfyUI's allocation graph (dynamic VRAM records each block's allocations): the token index and
        # silu(t_emb) outlive this block, and every block allocates alike, whether it was handed its rows or not.
        with allocation_context():
            index = self.state.index_cache.get(mod_segments, x.shape[0], x.device)
            if incoming is not None:
                rows, activated = incoming.rows, incoming.activated_t_emb
            else:
                activated = torch.nn.functional.silu(t_emb) if silu_reusable(block.adaln_proj) else None
                rows = adaln_rows(block.adaln_proj, t_emb, activated)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = rows
        mod_msa = Modulation(bf16_table(scale_msa), bf16_table(shift_msa), index)
        mod_mlp = Modulation(bf16_table(scale_mlp), bf16_table(shift_mlp), index)

        # ---- attention half
        if attention is None:
            h, source = self._norm_source(plan, x, block.norm1, mod_msa, "norm1", self.attention.qkv, incoming,
                                          lambda n: self.mod_scale_shift(n, shift_msa, scale_msa, mod_segments))
            out = self.attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options, qkv_source=source,
                                 plan=plan)
        else:  # another node replaced the attention (e.g. sparse attention): it needs the modulated tensor
            h = self.mod_scale_shift(block.norm1(x), shift_msa, scale_msa, mod_segments)
            out = attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options)

        # ---- residual 1, with norm2's statistics and fc1's amax when norm2 folds
        fold2 = self._fold_norm(x, block.norm2, plan)
        next_norm = None
        if fold2 is None:
            rstd, scalars = self._buffers(x, "norm2")
            next_norm = RmsNorm(self._norm_weight(block.norm2, x, "norm2"), float(block.norm2.eps), rstd)
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
            reason = self._handoff_refusal(transformer_options, attention)
            if reason is None:
                reason = self.next._fold_norm(x, self.next.block.norm1, plan)
            if reason is None:
                return self._residual_with_handoff(plan, x, gate_mlp, out, mod_segments, index, t_emb, activated)
            note_fallback(f"{self.name} -> next block hand-over", reason)
        self._residual(plan, x, gate_mlp, out, mod_segments, index, None, None, None)
        return x

    def _residual_with_handoff(self, plan: ForwardPlan, x, gate, out, mod_segments, index, t_emb, activated):
        nxt = self.next
        reusable = silu_reusable(nxt.block.adaln_proj)
        with allocation_context():
            if activated is None and reusable:
                activated = torch.nn.functional.silu(t_emb)
            # t_emb only: block i + 1 uses these rows; silu(t_emb) is passed on even where this module cannot use it
            rows = adaln_rows(nxt.block.adaln_proj, t_emb, activated if reusable else None)
        mod = Modulation(bf16_table(rows[1]), bf16_table(rows[0]), index)
        rstd, scalars = nxt._buffers(x, "norm1")
        qkv_dynamic = nxt.attention.qkv is not None and nxt.attention.qkv.dynamic_scale()
        norm = RmsNorm(nxt._norm_weight(nxt.block.norm1, x, "norm1"), float(nxt.block.norm1.eps), rstd)
        done = self._residual(plan, x, gate, out, mod_segments, index, norm, mod,
                              scalars[0:1] if qkv_dynamic else None)
        if done:
            self.counts["handoff_out"] += 1
            self.state.handoff = (nxt.index, self._handoff_key(x, t_emb, mod_segments),
                                  Handoff(rows, norm, scalars[0:1] if qkv_dynamic else None, activated))
        return x

    def _norm_source(self, plan: ForwardPlan, x, norm, modulation, name, layer, incoming, modulate):
        """Input and source of the projection after ``norm``: ``x`` normalized on the fly (statistics from the
        previous block's residual or one statistics pass here), or torch's norm output modulated on the fly.
        ``modulate(n)`` is ComfyUI's modulation of a norm output (the stock input when the projection refuses)."""
        reason = self._fold_norm(x, norm, plan)
        if reason is None and incoming is not None:
            self.counts[name] += 1
            return x, LinearSource(lambda: modulate(norm(x)), modulation=modulation, norm=incoming.norm,
                                   global_scale=incoming.global_scale)
        if reason is None:
            rstd, scalars = self._buffers(x, name)
            dynamic = layer is not None and layer.dynamic_scale()
            rms = RmsNorm(self._norm_weight(norm, x, name), float(norm.eps), rstd)
            try:
                plan.backend.norm_statistics(x, rms, modulation=modulation,
                                        global_scale_out=scalars[0:1] if dynamic else None)
            except (KernelBuildError, ValueError) as exc:
                reason = f"norm statistics kernel failed: {exc}"
            if reason is None:
                self.counts[name] += 1
                return x, LinearSource(lambda: modulate(norm(x)), modulation=modulation, norm=rms,
                                       global_scale=scalars[0:1] if dynamic else None)
        note_fallback(f"{self.name}.{name}", f"torch's RMSNorm runs: {reason}")
        n = norm(x)
        return n, LinearSource(lambda: modulate(n), modulation=modulation)

    def _residual(self, plan: ForwardPlan, x, gate, other, mod_segments, index, next_norm, next_modulation,
                  global_scale_out):
        """In place ``x += other * gate[row]``; with ``next_norm`` also that norm's statistics of the new x (and the
        next projection's global scale). Returns whether the statistics were produced."""
        gate16 = bf16_table(gate)
        reason = plan.refusal("gated_residual") or plan.backend.residual_support(x, other, gate16, next_norm=next_norm)
        if reason is None:
            try:
                plan.backend.gated_residual_(x, other, gate16, index, next_norm=next_norm,
                                        next_modulation=next_modulation, global_scale_out=global_scale_out)
                self.counts["residual"] += 1
                return next_norm is not None
            except (KernelBuildError, ValueError) as exc:
                reason = f"kernel failed: {exc}"
        note_fallback(f"{self.name} gated residual", reason)
        self.mod_gate(x, gate, other, mod_segments)
        if next_norm is None:
            return False
        try:  # the statistics still save the norm's write and read
            plan.backend.norm_statistics(x, next_norm, modulation=next_modulation, global_scale_out=global_scale_out)
            return True
        except (KernelBuildError, ValueError):
            return False

    # ---- the block self-check ------------------------------------------------------------------------------

    def _block_check(self, x, t_emb, mod_segments, rope_freqs, transformer_options, attention, plan):
        """Run stock and fused on (a prefix of) this call's real input, compare the bytes, record the verdict;
        return the stock result of the full call. One host sync, on this call only."""
        options = {k: v for k, v in (transformer_options or {}).items() if k != "optimized_attention_override"}
        try:
            with allocation_context(), recording_paused(self.recorders()):  # the check's forwards do not count
                verdict = check_block(self, x, t_emb, mod_segments, rope_freqs, options, BLOCK_CHECK_ROWS, plan)
        except Exception as exc:  # the check itself must never break the user's graph
            verdict = BlockVerdict(False, f"the block self-check could not run: {type(exc).__name__}: {exc}",
                                   compared=False)
        record_block_verdict(self.state, x.device, verdict)
        self._drop_handoff()
        with self.unpatched(keep_recording=True):
            return self.stock_forward(x, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options,
                                      attention=attention)
