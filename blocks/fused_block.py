"""The base of every family's fused block (an object patch on the block's ``forward``).

A family subclass supplies its route through the block and a *call* object describing one call's arguments:

    class FusedFooBlock(FusedBlock):
        probe_set = "foo"                                   # the family's probe set (core/verdicts.py)
        def __call__(self, x, ..., transformer_options={}):  # the stock forward's signature
            return self.run(FooCall(x, ..., transformer_options))
        def stock_call(self, call): ...                      # ComfyUI's forward of the block on ``call``
        def fused_forward(self, call, *, plan, handoff=True): ...
        def input_refusal(self, call): ...                   # what the route cannot take (shapes, dtypes)

The call object has ``x`` (the residual stream, updated in place by the fused route where ComfyUI's block does),
``transformer_options``, ``prefix(rows)`` (the same call on the first ``rows`` tokens, for the block check) and
``fresh()`` (a copy whose ``x`` may be written).

:meth:`FusedBlock.run` decides per call: the first call of a patched model runs the block check (blocks/check.py)
and returns ComfyUI's result; a call the route cannot take (or after a failed check, inside torch.compile, while
ComfyUI trains) runs ComfyUI's block, with the reason logged once; every other call runs the fused route with the
forward's plan (core/plan.py). The shared steps of a route are methods here: :meth:`FusedBlock.norm_source` folds a
norm into the next projection's pack, :meth:`FusedBlock.residual` runs the residual kernel that also produces the
next norm's statistics, and the hand-over between consecutive blocks goes through the model's state (blocks/state.py).
"""

from __future__ import annotations

import collections
import contextlib

import torch

from .. import comfy_adapter
from ..comfy_adapter import allocation_context
from ..core.calibration import RecordingForward, recording_paused
from ..core.fallbacks import note_fallback
from ..core.linear import FusedNVFP4Linear, LinearSource, PackPatch, checked_op
from ..core.plan import ForwardPlan, block_op, plan_for
from ..kernels.backend import KernelBuildError
from ..layout import LayerNorm, RmsNorm, source_refusal
from .check import BlockVerdict, compare_block, record_block_verdict
from .state import ModelState

# Rows of the real input the block check compares ComfyUI's and the fused block on: bounded extra memory, and the
# start of every token kind of the usual packed sequences (text, then image or video) is still present.
BLOCK_CHECK_ROWS = 4096


def capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def is_layer_norm(norm) -> bool:
    """A LayerNorm module (ComfyUI's LayerNorm op is torch's), with or without affine parameters; else an RMSNorm."""
    return isinstance(norm, torch.nn.LayerNorm)


class FusedBlock(PackPatch):
    """A family's fused ``forward`` of one block (module docstring)."""

    probe_set: str = ""  # the family's probe set; its block check is the plan op block_op(probe_set)

    def __init__(self, block, name: str, index: int, state: ModelState):
        self.block = block
        self.name = name
        self.index = index
        self.state = state
        self.next: FusedBlock | None = None  # the fused block of index + 1, set by the family's patch
        self.stock_forward = type(block).forward.__get__(block)
        self._workspace: dict = {}
        # Calls by path (tests and the report read them): "fused" forwards, folded norms by name, "residual" kernels,
        # "handoff_out" / "handoff_in" statistics handed to / taken from a neighbour.
        self.counts = collections.Counter()

    # ---- what a family supplies ----------------------------------------------------------------------------

    def stock_call(self, call):
        raise NotImplementedError

    def fused_forward(self, call, *, plan: ForwardPlan, handoff: bool = True):
        raise NotImplementedError

    def input_refusal(self, call) -> str | None:
        return None

    def handoff_modules(self) -> dict:
        """name -> module of this block whose weights the previous block reads when it hands over to this one (the
        next norm's weight, the modules that make its modulation rows)."""
        return {}

    # ---- the stock arm -------------------------------------------------------------------------------------

    def _patched_submodules(self):
        """(module, this pack's forward patch) of every submodule of the block (attention, MLP, Linears...)."""
        for module in self.block.modules():
            if module is self.block:
                continue
            forward = module.__dict__.get("forward")
            if isinstance(forward, PackPatch):
                yield module, forward

    def recorders(self) -> set:
        """The calibration recorders of this block's fused Linears (empty unless calibrating)."""
        return {f.recorder for _, f in self._patched_submodules()
                if isinstance(f, FusedNVFP4Linear) and f.recorder is not None}

    @contextlib.contextmanager
    def unpatched(self, keep_recording: bool = False):
        """ComfyUI's own forwards on this block's submodules for the duration (this pack's object patches lifted):
        the stock arm of the block check. ``keep_recording``: a calibrating Linear records on the stock forward (the
        call the user gets)."""
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

    # ---- the per-call decision -----------------------------------------------------------------------------

    def refusal(self, call, plan: ForwardPlan) -> str | None:
        reason = self.input_refusal(call)
        if reason is not None:
            return reason
        if torch.compiler.is_compiling():
            return "inside torch.compile (the stock block is traced instead)"
        if comfy_adapter.in_training():
            return "ComfyUI is training"
        if self.state.block_check == "failed":
            return f"the block self-check failed: {self.state.block_check_detail}"
        return plan.refusal(block_op(self.probe_set))

    def run(self, call):
        """One call of the block: fused route, ComfyUI's block, or the block check (module docstring)."""
        plan = plan_for(call.x.device)  # every decision of this forward that does not depend on a tensor's shape
        reason = self.refusal(call, plan)
        if reason is None and self.state.block_check == "pending":
            if capturing(call.x):
                reason = "the block self-check waits for a call outside CUDA-graph capture"
            else:
                return self._block_check(call, plan)
        if reason is not None:
            note_fallback(self.name, reason)
            self.state.drop_handoff()
            return self.stock_call(call)
        return self.fused_forward(call, plan=plan)

    def _block_check(self, call, plan: ForwardPlan):
        """Run ComfyUI's and the fused block on (a prefix of) this call's real input, compare the bytes, record the
        verdict; return ComfyUI's result of the full call. One host sync, on this call only."""
        try:
            with allocation_context(), recording_paused(self.recorders()):  # the check's forwards do not count
                verdict = compare_block(self, call, BLOCK_CHECK_ROWS, plan)
        except Exception as exc:  # the check itself must never break the user's graph
            verdict = BlockVerdict(False, f"the block self-check could not run: {type(exc).__name__}: {exc}",
                                   compared=False)
        if not verdict.meaningful:
            note_fallback(self.name, verdict.detail)
        record_block_verdict(self.state, call.x.device, self.probe_set, verdict)
        self.state.drop_handoff()
        with self.unpatched(keep_recording=True):
            return self.stock_call(call)

    # ---- the hand-over to the next block -------------------------------------------------------------------

    def handoff_refusal(self, call) -> str | None:
        """Why this block may not compute the next block's norm statistics in its last residual (None: it may).
        Families add their own conditions (a patch that changes x between the blocks, say)."""
        nxt = self.next
        if nxt is None:
            return "the next block is not patched"
        options = call.transformer_options or {}
        if options.get("prefetch_dynamic_vbars", False):
            # Dynamic VRAM: ComfyUI prefetches block i + 1's weights when that block starts. What the hand-over
            # reads of them, taken here through ComfyUI's own cast, is the same either way; a layer not kept in VRAM
            # would be copied once more, so the hand-over waits until it is.
            streamed = [name for name, module in nxt.handoff_modules().items()
                        if not comfy_adapter.weights_in_vram(module)]
            if streamed:
                return (f"dynamic VRAM has not kept the next block's {' and '.join(streamed)} weights in VRAM "
                        "(ComfyUI's prefetch brings them with that block)")
        if options.get("block_index", self.index) != self.index:
            return "the block is not called from the model's block loop"
        return None

    # ---- workspaces and weights ----------------------------------------------------------------------------

    def buffers(self, x: torch.Tensor, name: str):
        """Reused per-block device buffers of one norm: fp32 rstd [rows] and a 2-float scalar slot (global scale,
        spare). Reallocated only when the row count changes."""
        rows = x.shape[0]
        key = (name, rows, x.device)
        buf = self._workspace.get(key)
        if buf is None:
            with allocation_context():
                buf = (torch.empty(rows, dtype=torch.float32, device=x.device),
                       torch.empty(2, dtype=torch.float32, device=x.device))
            self._workspace = {k: v for k, v in self._workspace.items() if k[0] != name}  # the old row count
            self._workspace[key] = buf
        return buf

    def kept(self, w: torch.Tensor, own: torch.Tensor | None, key) -> torch.Tensor:
        """``w``, a weight as ComfyUI's cast handed it out, valid for the rest of this forward: the resident parameter
        ``own`` itself, or a copy (same dtype) in a persistent buffer when the cast handed out a temporary."""
        if own is not None and w.data_ptr() == own.data_ptr():
            return w
        key = (*key, tuple(w.shape), w.device, w.dtype)
        buf = self._workspace.get(key)
        if buf is None:
            with allocation_context():
                buf = self._workspace.setdefault(key, torch.empty(w.shape, dtype=w.dtype, device=w.device))
        return buf.copy_(w)

    def layer_norm_params(self, norm, x: torch.Tensor, name: str):
        """``(weight, bias)`` of LayerNorm module ``norm`` as its forward casts them for ``x`` (None without affine
        parameters), valid for the rest of this forward (:meth:`kept`); the dtype as cast: a weight torch would
        combine with the activation in another dtype is refused by the kernels, not converted here."""
        with comfy_adapter.layer_norm_weights(norm, x) as (w, b):
            if w is None:
                return None, None
            weight = self.kept(w, getattr(norm, "weight", None), ("norm weight", name))
            bias = self.kept(b, getattr(norm, "bias", None), ("norm bias", name)) if b is not None else None
            return weight, bias

    def statistics(self, norm, x: torch.Tensor, name: str):
        """``(statistics, global-scale slot)``: norm module ``norm``'s statistics over the rows of ``x`` as the kernels
        take them (an RmsNorm, or a LayerNorm with or without its affine parameters), in this block's persistent
        buffers ``name``, to be written by a statistics or residual kernel; the slot (fp32 [1]) takes the next
        projection's global scale."""
        rstd, scalars = self.buffers(x, name)
        if not is_layer_norm(norm):
            return RmsNorm(self.norm_weight(norm, x, name), float(norm.eps), rstd), scalars[0:1]
        mean, _ = self.buffers(x, f"{name} mean")
        weight, bias = self.layer_norm_params(norm, x, name)
        return LayerNorm(weight, bias, float(norm.eps), mean, rstd), scalars[0:1]

    def norm_weight(self, norm, x: torch.Tensor, name: str) -> torch.Tensor:
        """The norm's weight in the activation dtype, valid for the rest of this forward: the resident parameter
        itself, or a copy in a persistent buffer when ComfyUI's cast hands out a temporary (offloaded weights)."""
        with comfy_adapter.norm_weight(norm, x) as w:
            own = getattr(norm, "weight", None)
            if own is not None and w.data_ptr() == own.data_ptr() and w.dtype == x.dtype:
                return w
            key = ("weight", name, w.shape[0], x.device, x.dtype)
            buf = self._workspace.get(key)
            if buf is None:
                with allocation_context():
                    buf = self._workspace.setdefault(key, torch.empty(w.shape[0], dtype=x.dtype, device=x.device))
            return buf.copy_(w)

    # ---- shared steps of a fused route ---------------------------------------------------------------------

    def fold_refusal(self, x: torch.Tensor, norm, plan: ForwardPlan) -> str | None:
        """None if norm module ``norm`` (an RMSNorm with its weight, or a LayerNorm with or without affine parameters)
        can be folded into the kernels for this input, else why not."""
        if is_layer_norm(norm):
            if tuple(norm.normalized_shape) != (x.shape[-1],):
                return "the norm does not normalize over the hidden size"
        elif getattr(norm, "weight", None) is None or tuple(getattr(norm, "normalized_shape", ())) != (x.shape[-1],):
            return "the norm has no weight over the hidden size"
        if getattr(norm, "weight_function", None) or getattr(norm, "bias_function", None):
            return "the norm weight is patched on the fly"
        if is_layer_norm(norm):
            return plan.refusal(checked_op("layer_norm", x.dtype))
        return plan.refusal("rms_norm") or plan.backend.rms_norm_support(x, norm.weight)

    def norm_statistics(self, plan: ForwardPlan, x: torch.Tensor, stats, modulation,
                        global_scale_out: torch.Tensor | None) -> str | None:
        """Write ``stats`` (:meth:`statistics`) of the rows of ``x`` in one pass, with ``global_scale_out`` also the
        next projection's global scale (the norm modulated by ``modulation``, or a LayerNorm with its affine
        parameters). None when done, else why not (nothing was written)."""
        try:
            if isinstance(stats, LayerNorm):
                reason = plan.refusal(checked_op("layer_norm", x.dtype))
                if reason is None:
                    plan.backend.layer_norm_statistics(x, stats, global_scale_out=global_scale_out,
                                                       modulation=modulation if global_scale_out is not None else None)
                return reason
            plan.backend.norm_statistics(x, stats, modulation=modulation, global_scale_out=global_scale_out)
            return None
        except (KernelBuildError, ValueError) as exc:
            return f"norm statistics kernel failed: {exc}"

    def norm_source(self, plan: ForwardPlan, x: torch.Tensor, norm, modulation, name: str, layer, incoming,
                    modulate):
        """``(input, source)`` of the projection after norm module ``norm`` (an RMSNorm with a scale-and-shift
        ``Modulation``, or a LayerNorm with an ``AddcmulModulation`` or its affine parameters and ``modulation``
        None): ``x`` normalized (and modulated) on the fly inside the projection's pack, with the statistics handed
        over by the previous block (``incoming``: its ``norm`` and ``global_scale``) or made here in one statistics
        pass; or, where the norm cannot fold, torch's norm output with the modulation on the fly (or applied by
        ComfyUI's op where the pack reads that modulation only with its norm). ``modulate(n)`` is ComfyUI's
        modulation of a norm output (the stock input when the projection refuses); ``layer``: the projection's
        fused Linear (None: not NVFP4; the scale is reduced here when ``layer.dynamic_scale()``)."""
        reason = self.fold_refusal(x, norm, plan)
        if reason is None and incoming is not None:
            self.counts[name] += 1
            return x, LinearSource(lambda: modulate(norm(x)), modulation=modulation, norm=incoming.norm,
                                   global_scale=incoming.global_scale)
        if reason is None:
            dynamic = layer is not None and layer.dynamic_scale()
            stats, slot = self.statistics(norm, x, name)
            reason = self.norm_statistics(plan, x, stats, modulation, slot if dynamic else None)
            if reason is None:
                self.counts[name] += 1
                return x, LinearSource(lambda: modulate(norm(x)), modulation=modulation, norm=stats,
                                       global_scale=slot if dynamic else None)
        kind = "LayerNorm" if is_layer_norm(norm) else "RMSNorm"
        note_fallback(f"{self.name}.{name}", f"torch's {kind} runs: {reason}")
        n = norm(x)
        if modulation is not None and source_refusal(
                n, **LinearSource(None, modulation=modulation).pack_arguments()) is not None:
            h = modulate(n)  # the pack reads this modulation only with its norm folded: ComfyUI's op applies it
            return h, LinearSource(lambda: h)
        return n, LinearSource(lambda: modulate(n), modulation=modulation)

    def post_norm_residual(self, plan: ForwardPlan, x, other, other_norm, name: str, gate, index, next_norm,
                           next_modulation, global_scale_out, stock_residual, x_from=None):
        """In place ``x += gate[index[r]] * other_norm(other)`` (the post-norm, or sandwich-norm, residual; ``x +=
        other_norm(other)`` without a gate), ``other_norm`` an RMSNorm module (``name``) reduced in the same pass; with
        ``x_from`` out of place, ``x = x_from + ...`` (``x_from`` left as it is); with ``next_norm`` also that norm's
        statistics of the new x (and the next projection's global scale into ``global_scale_out``).
        ``stock_residual()`` is ComfyUI's op on ``x``, run (after ``x_from`` is copied to ``x``) where the kernel
        cannot. Returns whether the statistics were produced."""
        op = "post_norm_residual_gated" if gate is not None else "post_norm_residual"
        reason = self.fold_refusal(other, other_norm, plan) or plan.refusal(op)
        if reason is None:
            weight = self.norm_weight(other_norm, other, name)
            reason = plan.backend.post_norm_residual_support(x, other, weight, gate, next_norm=next_norm,
                                                             next_modulation=next_modulation, x_from=x_from)

        def stock():
            if x_from is not None:
                x.copy_(x_from)
            stock_residual()

        return self._residual_kernel_or_stock(
            plan, reason, lambda: plan.backend.post_norm_residual_(
                x, other, weight, float(other_norm.eps), gate, index, next_norm=next_norm,
                next_modulation=next_modulation, global_scale_out=global_scale_out, x_from=x_from),
            f"{self.name} post-norm residual ({name})", stock, x, next_norm, next_modulation, global_scale_out)

    def _residual_kernel_or_stock(self, plan: ForwardPlan, reason, launch, where: str, stock, x, next_norm,
                                  next_modulation, global_scale_out) -> bool:
        """A residual step: ``launch()`` (the kernel that also makes the next norm's statistics) where ``reason`` is
        None, else, or where it fails, ComfyUI's op ``stock()`` with the reason logged and then the statistics in
        their own pass (they still save the norm's write and read). Returns whether the statistics were produced."""
        if reason is None:
            try:
                launch()
                self.counts["residual"] += 1
                return next_norm is not None
            except (KernelBuildError, ValueError) as exc:
                reason = f"kernel failed: {exc}"
        note_fallback(where, reason)
        stock()
        return next_norm is not None and self.norm_statistics(plan, x, next_norm, next_modulation,
                                                              global_scale_out) is None

    def residual(self, plan: ForwardPlan, x, gate, other, index, next_norm, next_modulation, global_scale_out,
                 stock_gate):
        """In place ``x += other * gate[index[r]]``; with ``next_norm`` also that norm's statistics of the new x (and
        the next projection's global scale into ``global_scale_out``). ``stock_gate()`` is ComfyUI's op, run where
        the kernel cannot. Returns whether the statistics were produced."""
        reason = plan.refusal("gated_residual") or plan.backend.residual_support(x, other, gate, next_norm=next_norm)
        return self._residual_kernel_or_stock(
            plan, reason, lambda: plan.backend.gated_residual_(
                x, other, gate, index, next_norm=next_norm, next_modulation=next_modulation,
                global_scale_out=global_scale_out),
            f"{self.name} gated residual", stock_gate, x, next_norm, next_modulation, global_scale_out)

    def layer_norm_residual(self, plan: ForwardPlan, x: torch.Tensor, other: torch.Tensor, next_norm: LayerNorm | None,
                            stock_residual, *, gate: torch.Tensor | None = None, index: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, next_modulation=None,
                            global_scale_out: torch.Tensor | None = None) -> bool:
        """The residual of a LayerNorm block: ``out = addcmul(x, other, gate[index[r]])`` (``x + other`` without a
        gate) in the activation dtype, ``out`` defaulting to ``x`` (in place), and in the same pass LayerNorm
        ``next_norm``'s statistics of the new rows (:meth:`statistics`; with ``global_scale_out`` also the next
        projection's global scale: the norm followed by ``next_modulation``, or with its affine parameters).
        ``next_norm`` None: no norm follows (the statistics go to a scratch buffer). ``stock_residual()`` writes
        ComfyUI's op into ``out`` where the kernel cannot. Returns whether the statistics were produced."""
        stats = next_norm
        if stats is None:  # the kernels always write statistics; nothing reads these (any eps will do)
            rstd, _ = self.buffers(x, "scratch")
            mean, _ = self.buffers(x, "scratch mean")
            stats = LayerNorm(None, None, 1e-6, mean, rstd)
        reason = plan.refusal(checked_op("residual_layer_norm", x.dtype)) or plan.backend.residual_layer_norm_support(
            x, other, stats, gate=gate, mod_index=index, out=out, next_modulation=next_modulation,
            global_scale_out=global_scale_out)
        return self._residual_kernel_or_stock(
            plan, reason, lambda: plan.backend.residual_layer_norm_(
                x, other, stats, gate=gate, mod_index=index, out=out, next_modulation=next_modulation,
                global_scale_out=global_scale_out),
            f"{self.name} residual", stock_residual, x if out is None else out, next_norm, next_modulation,
            global_scale_out)

