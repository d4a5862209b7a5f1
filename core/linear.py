"""The fused NVFP4 Linear path: fused pack -> comfy-kitchen GEMM, with ComfyUI's weights and semantics.

``FusedNVFP4Linear`` replaces ``layer.forward`` of one ComfyUI NVFP4 Linear through a ModelPatcher object patch.
Per call it decides whether the fused path applies; if not, it runs the layer's own (stock) forward and logs
the reason once. The fused path is bit-identical to the stock one:

    stock: g = dtype(amax|x| / 2688) -> ck.quantize_nvfp4 -> F.linear(QT, QT) -> ck.scaled_mm_nvfp4 -> [:M, :N]
    fused: reduction (g on the device) -> pack (codes, scales, alpha) -> ck.scaled_mm_nvfp4(alpha=...) -> [:M, :N]

Activations in bf16 or fp16 (models that compute in fp16, Wan by default): ComfyUI rounds its global scale and the
``pre_quant_scale`` product in the activation dtype, and the fp16 kernels do the same; the self-check probes the fp16
ops separately (``pack_f16``, ``pack_prescale_f16``, ``global_scale_f16``, ``linear_f16``), so a failure there
turns off only fp16 calls. The fused sources of an RMSNorm block (RMSNorm, modulation, SwiGLU) take bf16 only,
those of a LayerNorm block (LayerNorm, addcmul modulation, GELU) bf16 and fp16.

The reduction is skipped where the layer has a static ``input_scale`` or the caller already reduced this input
(``LinearSource.global_scale``: the block's residual kernels do that for the next projection).

A layer with a ``pre_quant_scale`` (AWQ smoothing: ComfyUI multiplies the input by it, cast to the input dtype, before
quantizing) packs through the prescale source: the reduction and the pack read ``x * pre_quant_scale`` without
writing it. The table is cast to the activation dtype per call, as ComfyUI casts it (``FusedNVFP4Linear.prescale``),
and the pack writes the GEMM alpha per call from the scales as they are now: nothing the Linear hands its kernels is
cached from an earlier call.

Inputs as ComfyUI takes them: 2-D rows, N-D inputs reshaped to rows (a view where ComfyUI's reshape is one, read
in place when the rows are 16-byte aligned with unit column stride; other layouts, which ComfyUI's CUDA packer
refuses, are packed from a contiguous copy of the same values) and the output reshaped back. A 1-D input (ComfyUI
runs it unquantized) and an empty one stay on ComfyUI's path.

On compute capability < 10 there is no NVFP4 GEMM; ComfyUI itself then keeps these layers in full precision
(``_full_precision_mm``) and so does this path. When NVFP4 compute is forced on such a GPU (tests, benchmarks),
the GEMM is *emulated* exactly as comfy-kitchen's dispatch does after the FP4 GEMM fails: dequantize both
operands and run ``F.linear`` in the activation's dtype (bf16, or fp16 for a model computing in fp16). Logs and
benchmark JSON call it emulation.
"""

from __future__ import annotations

import collections
import contextlib
import logging

import torch

from .. import comfy_adapter
from ..comfy_adapter import allocation_context, layer_weights
from ..kernels.backend import KernelBuildError
from ..layout import (
    NVFP4_LAYOUT,
    AddcmulModulation,
    LayerNorm,
    Modulation,
    PackedActivation,
    RmsNorm,
    rows_readable_in_place,
)
from .fallbacks import note_fallback
from .plan import ForwardPlan, plan_for


def is_nvfp4_weight(weight) -> bool:
    return getattr(weight, "_layout_cls", None) == NVFP4_LAYOUT  # comfy-kitchen QuantizedTensor layout name


def is_nvfp4_linear(module) -> bool:
    """A ComfyUI NVFP4-quantized Linear (MixedPrecisionOps.Linear with an NVFP4 QuantizedTensor weight)."""
    weight = getattr(module, "weight", None)
    return weight is not None and is_nvfp4_weight(weight) and hasattr(module, "in_features")


def full_precision_cause(layer) -> str:
    """Why ComfyUI runs an NVFP4 Linear in full precision (its weight dequantized, its input never quantized), in
    the order ComfyUI's loader sets the flag: the checkpoint asks for it, the device has no NVFP4 compute, or the
    model's ops were built that way (ComfyUI builds every text encoder's quantized Linears so)."""
    if getattr(layer, "_full_precision_mm_config", False):
        return "the checkpoint marks it full_precision_matrix_mult"
    if getattr(layer, "quant_format", None) in getattr(layer, "_disabled_formats", ()):
        return "no NVFP4 compute on this device"
    return ("the model's ops run quantized Linears in full precision, as ComfyUI builds text encoders: weights "
            "dequantized, inputs never quantized")


# Activation dtypes the fused ops take, and the suffix of the self-check ops that cover each (core/plan.py OPS): an
# op's fp16 form is an op of its own, with its own probe (a bf16 probe says nothing of fp16 arithmetic).
FUSED_DTYPES = {torch.bfloat16: "", torch.float16: "_f16"}


def checked_op(op: str, dtype: torch.dtype) -> str:
    """The self-check op that covers ``op`` for activations of ``dtype`` (``pack`` -> ``pack_f16`` for fp16; a dtype
    the fused ops do not take keeps the name: their support checks refuse it)."""
    return op + FUSED_DTYPES.get(dtype, "")


def gemm_mode(device: torch.device) -> str:
    """``"nvfp4"`` (cuBLASLt FP4 GEMM, compute capability >= 10) or ``"emulated"`` (dequantize + a matmul in the
    activation's dtype)."""
    if device.type != "cuda":
        return "emulated"
    return "nvfp4" if torch.cuda.get_device_capability(device)[0] >= 10 else "emulated"


def nvfp4_gemm(packed: PackedActivation, weight, bias: torch.Tensor | None, out_features: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """GEMM of a packed activation with an NVFP4 QuantizedTensor weight, sliced to [M, N] like the stock path
    (whose output dtype is the activation's)."""
    params = weight._params
    if gemm_mode(packed.qdata.device) == "nvfp4":
        try:
            out = comfy_adapter.scaled_mm_nvfp4(
                packed.qdata, weight._qdata, tensor_scale_a=packed.global_scale, tensor_scale_b=params.scale,
                block_scale_a=packed.block_scales, block_scale_b=params.block_scale, bias=bias,
                out_dtype=out_dtype, alpha=packed.alpha,
            )
            return out[: packed.rows, :out_features]
        except (RuntimeError, TypeError) as exc:  # comfy-kitchen's dispatch falls back the same way
            note_fallback("NVFP4 GEMM", f"cuBLASLt failed ({exc}); dequantizing like comfy-kitchen does",
                          logging.WARNING)
    activation = comfy_adapter.dequantize_nvfp4(packed.qdata, packed.global_scale, packed.block_scales, out_dtype)
    activation = activation[: packed.rows, : packed.cols]
    return torch.nn.functional.linear(activation, weight.dequantize(), bias)


def quantized_input(layer, x: torch.Tensor) -> torch.Tensor:
    """What ComfyUI's NVFP4 Linear quantizes for input ``x``: ``x`` itself, or with a ``pre_quant_scale`` the input
    times the table cast to its dtype (calibration records the amax of this)."""
    pqs = getattr(layer, "pre_quant_scale", None)
    return x if pqs is None else x * comfy_adapter.cast_to_device(pqs, x.device, x.dtype)


# ---- the per-layer replacement forward ---------------------------------------------------------------------

class LinearSource:
    """What an NVFP4 Linear's pack reads its input through, as a fused block describes it: the raw tensor the caller
    passes, normalized (``norm``: the norm's statistics already computed on the stream, an RMSNorm or a LayerNorm)
    and/or modulated (``modulation``: the adaLN scale-and-shift of an RMSNorm block, ComfyUI's addcmul of a LayerNorm
    block), or its GELU (``gelu``), with the global scale already reduced on the device (``global_scale``) or not.
    ``stock()`` rebuilds the layer input with ComfyUI's own code when the fused path refuses."""

    def __init__(self, stock, *, modulation: Modulation | AddcmulModulation | None = None,
                 norm: RmsNorm | LayerNorm | None = None, global_scale: torch.Tensor | None = None,
                 gelu: bool = False):
        self.stock = stock
        self.modulation = modulation
        self.norm = norm
        self.global_scale = global_scale
        self.gelu = gelu

    @property
    def layer_norm_form(self) -> bool:
        """The source of a LayerNorm block (its norm, its addcmul modulation or its GELU)."""
        return self.gelu or isinstance(self.norm, LayerNorm) or isinstance(self.modulation, AddcmulModulation)

    def pack_arguments(self) -> dict:
        """The source as the fused ops' ``pack_support`` / ``pack_nvfp4`` take it."""
        if self.layer_norm_form:
            return {"layer_norm": self.norm, "addcmul_modulation": self.modulation, "gelu": self.gelu}
        return {"modulation": self.modulation, "norm": self.norm}

    @property
    def op(self) -> str:
        """The self-check op of a pack that reads this source (for bf16 activations; core/linear.py checked_op)."""
        if self.gelu:
            return "pack_gelu"
        if isinstance(self.norm, LayerNorm):
            return "pack_layer_norm_affine" if self.modulation is None else "pack_layer_norm_modulate"
        if self.norm is not None:  # an RMSNorm with the adaLN scale-and-shift, the scale alone, or no modulation
            if self.modulation is None:
                return "pack_norm_unmodulated"
            return "pack_norm" if self.modulation.shift is not None else "pack_norm_scale"
        return "pack_modulate" if self.modulation is not None else "pack"


class PackPatch:
    """Base of every callable this pack installs as an object patch: how a clone's patches are told from other
    nodes' patches (core/patching.py removes exactly these)."""


class FusedNVFP4Linear(PackPatch):
    """Callable installed as ``layer.forward`` (object patch). Holds no tensors of its own except the buffer a
    ``pre_quant_scale`` is cast into, so patching and unpatching are cheap.

    ``stock_forward`` is the layer class's own forward; every refusal goes there with an explicit reason.
    """

    def __init__(self, layer, name: str):
        self.layer = layer
        self.name = name
        self.stock_forward = type(layer).forward.__get__(layer)
        self._prescale: dict[tuple, torch.Tensor] = {}  # (device, dtype, shape) -> the buffer the table is cast into
        self.calls_fused = 0
        self.stock_reasons: collections.Counter = collections.Counter()  # calls on ComfyUI's path, by reason
        self.recorder = None  # core/calibration.py: records this layer's input amax while calibrating

    @property
    def calls_stock(self) -> int:
        return sum(self.stock_reasons.values())

    def dynamic_scale(self) -> bool:
        """True when ComfyUI computes this layer's activation scale per call (no static ``input_scale``)."""
        return getattr(self.layer, "input_scale", None) is None

    def static_refusal(self) -> str | None:
        """Why no call of this layer can take the fused path as the layer stands (None: calls may)."""
        layer = self.layer
        if getattr(layer, "_full_precision_mm", False):
            return f"ComfyUI keeps this layer in full precision ({full_precision_cause(layer)})"
        if getattr(layer, "comfy_force_cast_weights", False):
            return "ComfyUI forces weight casting for this layer"
        if getattr(layer, "weight_function", None) or getattr(layer, "bias_function", None):
            return "weight patches (LoRA) are applied on the fly; ComfyUI's path handles them"
        pqs = getattr(layer, "pre_quant_scale", None)
        if pqs is not None and (tuple(pqs.shape) != (layer.in_features,) or not pqs.is_floating_point()):
            return f"the pre_quant_scale is {pqs.dtype} {tuple(pqs.shape)}, not a float [in_features] table"
        if not is_nvfp4_weight(layer.weight):
            return "the weight is not an NVFP4 QuantizedTensor"
        return None

    def refusal(self, x: torch.Tensor, width: int) -> str | None:
        """Why the fused path cannot take this call (None: it can)."""
        if torch.compiler.is_compiling():
            return "inside torch.compile (stock path is traced instead)"
        if x.dim() < 2:  # ComfyUI quantizes 2-D inputs and reshapes N-D ones; a 1-D input it runs unquantized
            return "a 1-D input: ComfyUI runs it unquantized"
        if x.numel() == 0:
            return "an empty input (no rows): ComfyUI's own path handles it"
        if x.dtype not in FUSED_DTYPES:
            return f"the activation is {x.dtype}, not bfloat16 or float16"
        if x.requires_grad and torch.is_grad_enabled():
            return "autograd is recording (training path)"
        reason = self.static_refusal()
        if reason is not None:
            return reason
        if width != self.layer.in_features:
            return f"input width {width} != in_features {self.layer.in_features}"
        return None

    def static_scale(self, device: torch.device) -> torch.Tensor | None:
        """The layer's static ``input_scale`` as the fp32 one-element tensor the pack reads (None: dynamic), read as
        it is now: the pack also writes the GEMM alpha from it and the weight's scale on the device, per call as
        ComfyUI's GEMM computes it, so no product is cached that an in-place change could leave stale."""
        scale = getattr(self.layer, "input_scale", None)
        if scale is None:
            return None
        return scale.detach().to(device=device, dtype=torch.float32).reshape(1)

    def prescale(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The layer's ``pre_quant_scale`` as ComfyUI's forward casts it for an input of ``dtype`` on ``device``
        (None: the layer has none), from the table's values now. A table already in that dtype, on that device and
        16-byte aligned is read as it is (ComfyUI's cast returns it unchanged); any other is cast per call into one
        persistent buffer with the copy ComfyUI's cast makes (one small launch, no allocation). Nothing is keyed on
        the table's address or version: inference tensors, which ComfyUI loads, keep no version."""
        pqs = getattr(self.layer, "pre_quant_scale", None)
        if pqs is None:
            return None
        pqs = pqs.detach()
        if pqs.device == device and pqs.dtype == dtype and pqs.is_contiguous() and pqs.data_ptr() % 16 == 0:
            return pqs  # the kernels read 16-byte aligned rows
        key = (str(device), dtype, tuple(pqs.shape))
        buffer = self._prescale.get(key)
        if buffer is None:  # a normal tensor: updated in place under inference mode and outside it alike
            with allocation_context(), torch.inference_mode(False):
                buffer = self._prescale[key] = torch.empty(pqs.shape, dtype=dtype, device=device)
        return buffer.copy_(pqs, non_blocking=pqs.device != device)

    def __call__(self, x: torch.Tensor, *, source: LinearSource | None = None, swiglu: bool = False,
                 up: torch.Tensor | None = None, stock=None, plan: ForwardPlan | None = None):
        """Forward of the layer. ``source`` or ``swiglu`` make the pack read the layer input through that op (``x`` is
        then the op's *input*: with ``swiglu`` the gate half and up half of one row, or the gates and, in ``up``, the
        up values as a second tensor of the same shape); ``stock`` / ``source.stock()`` rebuild the layer input with
        ComfyUI's own code when the fused path refuses. ``plan``: the forward's decisions (core/plan.py), resolved by
        the caller once per forward; looked up here when not given."""
        if source is not None:
            stock = source.stock
        stock = self.record_input(x, stock)
        up = up.reshape(-1, up.shape[-1]) if up is not None and up.dim() > 2 else up  # rows, as x's
        reason, x2, prescale, plan = self.prepare(x, source, swiglu, plan, up=up)
        if reason is not None:
            return self._stock(reason, x, stock)
        out = None
        with layer_weights(self.layer, x2) as (weight, bias):
            reason = self.weight_refusal(weight, x)
            if reason is None:
                try:
                    with allocation_context():
                        packed = self.pack(plan.backend, x2, weight, source, swiglu, prescale, up=up)
                        out = nvfp4_gemm(packed, weight, bias, self.layer.out_features, x.dtype)
                except (KernelBuildError, ValueError) as exc:  # refused or failed: no output written
                    reason = f"kernel launch failed: {exc}"
        if out is None:
            return self._stock(reason, x, stock)
        self.calls_fused += 1
        return self.shaped(out, x)

    # ---- the steps of a fused call (shared with SharedInput) -------------------------------------------------

    def record_input(self, x: torch.Tensor, stock):
        """While calibrating, record the input ComfyUI would quantize; returns ``stock`` (built once if it was used,
        so a fallback reuses it)."""
        if self.recorder is not None and self.recorder.active():
            if stock is not None:
                built = stock()
                stock = lambda: built  # noqa: E731
            self._record(stock() if stock is not None else x)
        return stock

    def prepare(self, x: torch.Tensor, source: LinearSource | None, swiglu: bool, plan: ForwardPlan | None, *,
                up: torch.Tensor | None = None):
        """``(reason, rows, prescale, plan)``: why the fused path cannot take this call (None: it can), the input as
        ``[M, K]`` rows the kernels read, the layer's cast ``pre_quant_scale`` table, and the forward's plan. ``up``:
        a SwiGLU source's up values as ``[M, K]`` rows beside the gates ``x``."""
        reason = self.refusal(x, x.shape[-1] // 2 if swiglu and up is None else x.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x  # ComfyUI's reshape: a view where it can be one
        if reason is None and source is None and not swiglu and not rows_readable_in_place(x2):
            # Rows the kernels cannot read in place (a column stride, a misaligned view): ComfyUI's CUDA packer
            # refuses them too (it asserts contiguity); pack the values from a contiguous copy, the bytes any
            # ComfyUI quantizer gives for them.
            with allocation_context():
                x2 = x2.clone(memory_format=torch.contiguous_format)
        prescale = None
        if reason is None and getattr(self.layer, "pre_quant_scale", None) is not None:
            if swiglu or source is not None:  # the pack reads one source: ComfyUI's ops build this input
                reason = ("the layer's pre_quant_scale cannot be folded into a pack that already reads a fused "
                          "SwiGLU / norm / modulation / GELU source")
            else:
                prescale = self.prescale(x.device, x.dtype)
        if reason is None:
            plan = plan if plan is not None else plan_for(x.device)
            op = ("pack_swiglu_pair" if swiglu and up is not None else "pack_swiglu" if swiglu else
                  source.op if source is not None else "pack_prescale" if prescale is not None else "pack")
            reason = (plan.refusal(checked_op(op, x.dtype), checked_op("linear", x.dtype))
                      or plan.backend.pack_support(x2, swiglu=swiglu, prescale=prescale, up=up,
                                                   **(source.pack_arguments() if source is not None else {})))
        return reason, x2, prescale, plan

    @staticmethod
    def weight_refusal(weight, x: torch.Tensor) -> str | None:
        """Why the weight ComfyUI's cast handed out cannot take the fused GEMM (None: it can)."""
        # ComfyUI's cast sets the weight's compute dtype (the stored QuantizedTensor may carry none)
        if not is_nvfp4_weight(weight):
            return "ComfyUI's weight cast returned a non-NVFP4 weight"  # handled after the cast is undone
        if weight.dtype != x.dtype:
            return f"the weight computes in {weight.dtype}, the activation is {x.dtype}"
        return None

    def pack(self, backend, x2: torch.Tensor, weight, source: LinearSource | None, swiglu: bool,
             prescale: torch.Tensor | None, *, up: torch.Tensor | None = None) -> PackedActivation:
        """The fused pack of this layer's input, with the GEMM alpha for ``weight`` (the scale_2 of the weight ComfyUI's
        cast hands out: under dynamic VRAM a LoRA requantizes it with one of its own)."""
        static = self.static_scale(x2.device)
        reduced = source.global_scale if (source is not None and static is None) else None
        return backend.pack_nvfp4(
            x2, static_scale=static, global_scale=reduced, weight_scale_2=weight._params.scale.reshape(1),
            swiglu=swiglu, prescale=prescale, up=up, **(source.pack_arguments() if source is not None else {}),
        )

    def shaped(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out.reshape(*x.shape[:-1], self.layer.out_features) if x.dim() >= 3 else out

    def _record(self, h: torch.Tensor) -> None:
        self.recorder.record(self.name, quantized_input(self.layer, h))

    def _stock(self, reason: str, x: torch.Tensor, stock):
        note_fallback(self.name, reason)
        self.stock_reasons[reason] += 1
        return self.stock_forward(stock() if stock is not None else x)


class SharedInput:
    """NVFP4 Linears that read one tensor (Z-Image's w1 and w3, Wan's q, k and v): where their packs would be identical
    the tensor is packed once and every GEMM reads that copy, with its own weight and GEMM alpha.

    Identical packs: the same input read through the same source, and the same global scale - every layer's scale
    dynamic (ComfyUI reduces the same tensor for each), or one static ``input_scale`` value for all (compared once,
    when the group is built; a layer whose ``input_scale`` tensor is replaced afterwards stops sharing). Which Linears
    read one tensor is decided by the fused block that produced it, never guessed from addresses at run time (ComfyUI
    samples under inference mode, where tensors carry no version counter, so an address can be reused for new values).
    A layer that cannot take the fused path on a call runs ComfyUI's forward for that call, as on its own.
    """

    def __init__(self, linears, name: str):
        self.linears = tuple(linears)
        self.name = name
        self._scales = tuple(getattr(f.layer, "input_scale", None) for f in self.linears)
        self.sharing_refusal = self._sharing_refusal()
        self._alphas: dict[tuple, torch.Tensor] = {}
        self.shared_packs = 0  # calls on which two or more of the Linears read one pack (tests read it)

    def _sharing_refusal(self) -> str | None:
        if len(self.linears) < 2:
            return "a single Linear"
        if len({f.layer.in_features for f in self.linears}) != 1:
            return "the Linears differ in width"
        if any(getattr(f.layer, "pre_quant_scale", None) is not None for f in self.linears):
            return "a Linear has a pre_quant_scale (each packs its own scaled input)"
        static = [s for s in self._scales if s is not None]
        if static and (len(static) != len(self._scales) or not all(
                torch.equal(s.detach().float().cpu(), static[0].detach().float().cpu()) for s in static[1:])):
            return "the Linears' activation scales differ (dynamic and static, or different static values)"
        return None

    def _alpha(self, index: int, device: torch.device) -> torch.Tensor:
        key = (index, device)
        buf = self._alphas.get(key)
        if buf is None:
            with allocation_context():
                buf = self._alphas.setdefault(key, torch.empty(1, dtype=torch.float32, device=device))
        return buf

    def __call__(self, x: torch.Tensor, *, source: LinearSource | None = None,
                 plan: ForwardPlan | None = None) -> list[torch.Tensor]:
        """Every Linear's output for input ``x`` (read through ``source``), in order."""
        stock = source.stock if source is not None else None
        if stock is not None and any(f.recorder is not None and f.recorder.active() for f in self.linears):
            built = stock()  # once for every layer that records or falls back
            stock = lambda: built  # noqa: E731
        if self.sharing_refusal is not None or any(
                getattr(f.layer, "input_scale", None) is not s for f, s in zip(self.linears, self._scales)):
            return [f(x, source=source, plan=plan) for f in self.linears]
        results: list[torch.Tensor | None] = [None] * len(self.linears)
        taking, rows = [], None
        for i, f in enumerate(self.linears):
            f.record_input(x, stock)
            reason, x2, _, plan = f.prepare(x, source, False, plan)
            if reason is None:
                taking.append(i)
                rows = rows if rows is not None else x2
            else:
                results[i] = f._stock(reason, x, stock)
        if taking:
            self._shared(x, rows, source, plan, taking, results, stock)
        return results

    def _shared(self, x, x2, source, plan, taking, results, stock) -> None:
        with contextlib.ExitStack() as weights:
            cast = [weights.enter_context(layer_weights(self.linears[i].layer, x2)) for i in taking]
            reasons = [FusedNVFP4Linear.weight_refusal(weight, x) for weight, _ in cast]
            ready = [(i, w, b) for i, (w, b), r in zip(taking, cast, reasons) if r is None]
            outs, failure = {}, None
            if ready:
                try:
                    with allocation_context():
                        first, weight, _ = ready[0]
                        packed = self.linears[first].pack(plan.backend, x2, weight, source, False, None)
                        for i, weight, bias in ready:
                            if i != first:  # the same fp32 product the pack forms for the first layer
                                packed.alpha = torch.mul(packed.global_scale, weight._params.scale.reshape(1),
                                                         out=self._alpha(i, x.device))
                            layer = self.linears[i]
                            outs[i] = nvfp4_gemm(packed, weight, bias, layer.layer.out_features, x.dtype)
                    self.shared_packs += len(ready) > 1
                except (KernelBuildError, ValueError) as exc:  # refused or failed: the layers run ComfyUI's path
                    outs, failure = {}, f"kernel launch failed: {exc}"
        for i, reason in zip(taking, reasons):
            layer = self.linears[i]
            if i in outs:
                layer.calls_fused += 1
                results[i] = layer.shaped(outs[i], x)
            else:
                results[i] = layer._stock(reason or failure, x, stock)
