"""Everything the pack uses of ComfyUI and comfy-kitchen, in one module.

The pack's shipped code (core/, kernels/, models/, nodes/) reaches ComfyUI and comfy-kitchen only through the
functions here (`lint-imports` enforces it), so what the pack depends on in ComfyUI is visible in one file and a
ComfyUI change that breaks it shows up in one place. Imports are lazy: the kernels, their Python twin and the
tests of the pack alone import this module without a ComfyUI; each function raises ImportError (or returns the
documented fallback) when the ComfyUI piece it names is missing.

The one exception is ``comfy_api`` in nodes/: the node classes subclass ComfyUI's V3 node API at import time.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys

import torch

NVFP4_LAYOUT = "TensorCoreNVFP4Layout"  # ComfyUI's / comfy-kitchen's name of the NVFP4 QuantizedTensor layout


# ---- comfy-kitchen -----------------------------------------------------------------------------------------

def kitchen():
    """The comfy_kitchen module (its NVFP4 quantize, GEMM, dequantize and RMSNorm + RoPE ops)."""
    import comfy_kitchen

    return comfy_kitchen


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, pad_16x: bool):
    return kitchen().quantize_nvfp4(x, global_scale, pad_16x=pad_16x)


def scaled_mm_nvfp4(a, b, **kwargs):
    return kitchen().scaled_mm_nvfp4(a, b, **kwargs)


def dequantize_nvfp4(qdata, global_scale, block_scales, out_dtype):
    return kitchen().dequantize_nvfp4(qdata, global_scale, block_scales, out_dtype)


def rms_rope_split_half_(q, k, freqs, q_weight, k_weight, epsilon: float, rot_dim: int) -> None:
    kitchen().rms_rope_split_half_(q, k, freqs, q_weight, k_weight, epsilon=epsilon, rot_dim=rot_dim)


# ---- comfy.ops and comfy.quant_ops: layers, weights, the NVFP4 tensor -------------------------------------

def comfy_ops():
    """``comfy.ops``, or None outside ComfyUI."""
    try:
        import comfy.ops

        return comfy.ops
    except ImportError:
        return None


def quant_ops():
    import comfy.quant_ops

    return comfy.quant_ops


def mixed_precision_ops(compute_dtype=torch.bfloat16, disabled=None):
    """ComfyUI's op set of a quantized checkpoint (``disabled=[]``: NVFP4 compute forced on)."""
    import comfy.ops

    if disabled is None:
        return comfy.ops.mixed_precision_ops({}, compute_dtype=compute_dtype)
    return comfy.ops.mixed_precision_ops({}, compute_dtype=compute_dtype, disabled=disabled)


def quantize_like_comfy(h: torch.Tensor, scale: torch.Tensor | None = None):
    """``QuantizedTensor.from_float(h, "TensorCoreNVFP4Layout", scale=...)``: ComfyUI's NVFP4 activation quantizer."""
    return quant_ops().QuantizedTensor.from_float(h, NVFP4_LAYOUT, scale=scale)


def eager_swiglu(y: torch.Tensor) -> torch.Tensor:
    """fc2's input from fc1's output the way ComfyUI's eager activation computes it (a new tensor)."""
    ops = comfy_ops()
    if ops is not None and hasattr(ops, "_eager_input_act"):
        return ops._eager_input_act(y, "swiglu")
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


def eager_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """A down-projection's input the way ComfyUI's eager activation computes GELU (tanh) of it (a new tensor)."""
    ops = comfy_ops()
    if ops is not None and hasattr(ops, "_eager_input_act"):
        return ops._eager_input_act(x, "gelu_tanh")
    return torch.nn.functional.gelu(x, approximate="tanh")


def apply_rope1(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ComfyUI's interleaved RoPE of one tensor (``comfy.ldm.flux.math.apply_rope1``: comfy-kitchen's op outside
    training); ``x`` ``[B, S, H, D]``, ``freqs`` ``[1, S, 1, D / 2, 2, 2]``."""
    import comfy.ldm.flux.math

    return comfy.ldm.flux.math.apply_rope1(x, freqs)


def swiglu_reference():
    """ComfyUI's in-place SwiGLU helper, or None where this ComfyUI has none."""
    ops = comfy_ops()
    return getattr(ops, "_swiglu_eager", None) if ops is not None else None


def allocation_context():
    """Allocations made inside stay outside ComfyUI's recorded allocation graph, like comfy-kitchen's own."""
    try:
        import comfy.model_prefetch

        return comfy.model_prefetch.pause_malloc_graph()
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


@contextlib.contextmanager
def layer_weights(layer, x: torch.Tensor):
    """Yield (weight, bias) the way ComfyUI's NVFP4 Linear obtains them (offload, LoRA, dynamic VRAM)."""
    ops = comfy_ops()
    if ops is None or not isinstance(layer, getattr(ops, "CastWeightBiasOp", ())):
        yield layer.weight, layer.bias  # not a ComfyUI op: its weights are used as they are
    elif hasattr(ops, "CastBiasWeightContext"):
        with ops.CastBiasWeightContext(layer, x, offloadable=True, compute_dtype=x.dtype, want_requant=True) as wb:
            yield wb
    else:
        weight, bias, state = ops.cast_bias_weight(layer, x, offloadable=True)
        try:
            yield weight, bias
        finally:
            ops.uncast_bias_weight(layer, weight, bias, state)


@contextlib.contextmanager
def norm_weight(norm, x: torch.Tensor):
    """The weight of a ComfyUI RMSNorm the way its forward obtains it (offloaded or dynamic-VRAM weights)."""
    ops = comfy_ops()
    context = getattr(ops, "CastBiasWeightContext", None) if getattr(norm, "comfy_cast_weights", False) else None
    if context is None:
        yield norm.weight.to(device=x.device)
    else:
        with context(norm, x, offloadable=True) as (weight, _):
            yield weight


def weights_in_vram(module) -> bool:
    """Whether every ComfyUI layer of ``module`` has its weights on the device without a transfer.

    Under dynamic VRAM (``ModelPatcherDynamic`` with comfy-aimdo) a layer with a VRAM allocation (``_v``) keeps its
    weights in system memory and ComfyUI casts them per call (comfy/ops.py ``cast_modules_with_vbar``: staged
    copies, LoRA patches applied on the fly). ``_v_signature`` is the allocation's signature from the last cast
    that placed the weights there; it is None before the first one and when the last one could not (no VRAM left:
    the weights then come through a cast buffer, copied per call). Casting a layer outside ComfyUI's prefetch of
    its block gives the same weights either way; on the device it copies nothing. Layers without ``_v`` (classic
    memory mode, small layers dynamic VRAM loads to the device) always have their weights on the device."""
    return all(getattr(m, "_v_signature", None) is not None for m in module.modules() if hasattr(m, "_v"))


@contextlib.contextmanager
def layer_norm_weights(norm, x: torch.Tensor):
    """(weight, bias) of a ComfyUI LayerNorm the way its forward obtains them: None for a norm without affine
    parameters, else cast to the input's device and dtype (offloaded or dynamic-VRAM weights included)."""
    if getattr(norm, "weight", None) is None:
        yield None, None
        return
    ops = comfy_ops()
    context = getattr(ops, "CastBiasWeightContext", None) if getattr(norm, "comfy_cast_weights", False) else None
    if context is None:
        yield norm.weight.to(device=x.device), (norm.bias.to(device=x.device) if norm.bias is not None else None)
    else:
        with context(norm, x, offloadable=True) as (weight, bias):
            yield weight, bias


def qk_rms_rope(q_norm, k_norm, q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor):
    """comfy-kitchen's per-head RMSNorm + RoPE of ``q`` and ``k`` (``ck.rms_rope``, new tensors) with the weights of
    RMSNorm modules ``q_norm`` / ``k_norm`` as ComfyUI's ``cast_bias_weight`` hands them out for these inputs and
    takes them back after (offloaded or dynamic-VRAM weights), and the norm's eps (float32's where it has none):
    what ComfyUI's joint attention runs between its qkv projection and the attention."""
    import comfy.ops

    q_weight, _, q_stream = comfy.ops.cast_bias_weight(q_norm, q, offloadable=True)
    k_weight, _, k_stream = comfy.ops.cast_bias_weight(k_norm, k, offloadable=True)
    eps = q_norm.eps if q_norm.eps is not None else torch.finfo(torch.float32).eps
    try:
        return quant_ops().ck.rms_rope(q, k, freqs, q_weight, k_weight, eps)
    finally:
        comfy.ops.uncast_bias_weight(q_norm, q_weight, None, q_stream)
        comfy.ops.uncast_bias_weight(k_norm, k_weight, None, k_stream)


def cast_to(weight: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """ComfyUI's ``cast_to`` (how its blocks take a parameter such as a modulation table onto the device)."""
    try:
        import comfy.model_management

        return comfy.model_management.cast_to(weight, dtype=dtype, device=device)
    except ImportError:
        return weight.to(device=device, dtype=dtype)


def cast_to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ComfyUI's ``cast_to_device`` (how its NVFP4 Linear casts ``pre_quant_scale`` to the input per call)."""
    try:
        import comfy.model_management

        return comfy.model_management.cast_to_device(tensor, device, dtype)
    except ImportError:
        return tensor.to(device=device, dtype=dtype)


def in_training() -> bool:
    try:
        import comfy.model_management

        return bool(getattr(comfy.model_management, "in_training", False))
    except ImportError:
        return False


# ---- models, files and the server --------------------------------------------------------------------------

def h3_model_module():
    """``comfy.ldm.minimax.model``: ComfyUI's MiniMax H3 (blocks, modulation helpers, rotation tables)."""
    import comfy.ldm.minimax.model

    return comfy.ldm.minimax.model


def lumina_model_module():
    """``comfy.ldm.lumina.model``: ComfyUI's Lumina 2 / Z-Image (NextDiT, JointTransformerBlock, modulate,
    apply_gate)."""
    import comfy.ldm.lumina.model

    return comfy.ldm.lumina.model


def wan_model_module():
    """``comfy.ldm.wan.model``: ComfyUI's Wan (its blocks, ``repeat_e``, the rope embedder)."""
    import comfy.ldm.wan.model

    return comfy.ldm.wan.model


def model_detection():
    import comfy.model_detection

    return comfy.model_detection


def diffusion_model_names() -> list[str]:
    import folder_paths

    return folder_paths.get_filename_list("diffusion_models")


def diffusion_model_path(name: str) -> str:
    import folder_paths

    return folder_paths.get_full_path_or_raise("diffusion_models", name)


def load_diffusion_model(path: str, model_options: dict):
    """ComfyUI's *Load Diffusion Model* (``comfy.sd.load_diffusion_model``)."""
    import comfy.sd

    return comfy.sd.load_diffusion_model(path, model_options=model_options)


def model_compute_dtype(model_patcher) -> torch.dtype | None:
    """The dtype ComfyUI runs the diffusion model in (``BaseModel.get_dtype_inference``: its manual-cast dtype, else
    its weights' dtype; ``apply_model`` casts the input to it), a ``manual_cast_dtype`` object patch on the clone
    included; None for a model that does not say."""
    patched = getattr(model_patcher, "object_patches", {}).get("manual_cast_dtype")
    if patched is not None:
        return patched
    dtype_inference = getattr(getattr(model_patcher, "model", None), "get_dtype_inference", None)
    return dtype_inference() if callable(dtype_inference) else None


def diffusion_model_source(model_patcher) -> str | None:
    """The file a model was loaded from by ComfyUI's ``load_diffusion_model`` (its *Load Diffusion Model* and this
    pack's Loader), as ComfyUI records it for reloading the model (``cached_patcher_init``; clones keep it), or None
    where ComfyUI does not say (another loader, an older ComfyUI)."""
    init = getattr(model_patcher, "cached_patcher_init", None)
    try:
        import comfy.sd

        if init and init[0] is comfy.sd.load_diffusion_model and isinstance(init[1][0], str):
            return init[1][0]
    except (ImportError, AttributeError, IndexError, TypeError):
        pass
    return None


def progress_bar(total: int):
    import comfy.utils

    return comfy.utils.ProgressBar(total)


def executing_node_id():
    """The id of the graph node ComfyUI is executing, or None (older ComfyUI, or outside a graph)."""
    try:
        from comfy_execution.utils import get_executing_context

        return getattr(get_executing_context(), "node_id", None)
    except Exception:
        return None


def send_progress_text(node_id, text: str) -> None:
    """Show ``text`` on graph node ``node_id`` (ComfyUI's progress text) where a server runs; the log has it too."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if node_id is None or instance is None or not hasattr(instance, "send_progress_text"):
        return
    try:
        instance.send_progress_text(text, node_id)
    except Exception:  # the UI is a courtesy
        pass


def comfyui_version() -> str:
    """The running ComfyUI's ``comfyui_version.__version__``, or "unknown"."""
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except (ImportError, AttributeError):
        return "unknown"


def source_hash(objects) -> str:
    """Hash of the source of ComfyUI functions and classes (a class with every ComfyUI class it inherits from: a
    subclass alone may be two lines). A change of that code re-runs the self-check."""
    parts = []
    for obj in objects:
        if obj is None:
            continue
        if inspect.isclass(obj):
            parts += [inspect.getsource(c) for c in obj.__mro__ if c.__module__.startswith("comfy")]
        else:
            parts.append(inspect.getsource(obj))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
