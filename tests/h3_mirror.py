"""Test-only mirror of ComfyUI's MiniMax H3 transformer block and its NVFP4 Linear.

The fused kernels in this pack must reproduce what ComfyUI computes, bit for bit where that is possible. The tests
therefore need a reference that behaves like ComfyUI's code without importing ComfyUI (GPL, and not installed
here). This module re-implements, from reading ComfyUI's source, the semantics of:

* ``comfy.ops.mixed_precision_ops(...).Linear`` for an NVFP4 layer (``MirrorNVFP4Linear``) and for a plain
  bf16 layer (``MirrorLinear``), and ``comfy.ops`` RMSNorm (``MirrorRMSNorm``);
* ``comfy/ldm/minimax/model.py``: ``Attention``, ``MLP``, ``AdalnProj``, ``DiTBlock``, ``RefinerBlock``,
  ``TokenRefiner`` and the block loop of ``MiniMaxH3Model._forward`` (``MirrorH3Model.run_blocks``).

Attribute names and module structure match ComfyUI's, so code that walks a real H3 model (``model.blocks[i]
.attn.qkv_proj`` ...) can be tested on a mirror. The arithmetic is ComfyUI's op for op: same ops, same order,
same dtypes, same in-place updates, and comfy_kitchen (``ck``) is called exactly as ComfyUI calls it.

Deliberate differences, all outside the arithmetic:
* q/k/v reach the attention function as plain ``[1, H, S, D]`` views, not ``AttentionTensorContainer`` boxes.
* ComfyUI's pytorch attention backend is the default (``sdpa_attention``). ``MirrorAttention.comfy_attention.function``
  swaps it, and ``transformer_options["optimized_attention_override"]`` is honoured as ComfyUI does.
* On CPU, ck's eager ``scaled_mm_nvfp4`` raises ``ValueError`` ("CPU does not support swizzle"). ck's linear
  handler only catches RuntimeError/TypeError, so ``MirrorNVFP4Linear`` catches ValueError itself and runs the
  handler's own fallback (dequantize both operands, then ``F.linear``). On sm_90 the handler falls back by itself.
* Every forward runs under ``torch.inference_mode()``, as ComfyUI's sampling does. Under inference mode
  ``F.linear`` reaches ck's ``aten.linear`` handler without being decomposed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

import comfy_kitchen as ck
from comfy_kitchen.tensor import QuantizedTensor, TensorCoreNVFP4Layout

NVFP4_LAYOUT = "TensorCoreNVFP4Layout"
NVFP4_QUANT_FORMAT = "nvfp4"
COMPUTE_DTYPE = torch.bfloat16

# ComfyUI's H3 defaults (MiniMaxH3Model.__init__).
H3_HIDDEN = 5376
H3_HEADS = 56
H3_HEAD_DIM = 128
H3_FFN = 14336
H3_T_DIM = 2688
H3_NORM_EPS = 1e-5
H3_QK_NORM_EPS = 1e-5

# Modality tags in mod-row indices (row = timestep_index * 3 + tag), from MiniMaxH3Model._forward.
TAG_VIDEO = 0
TAG_TEXT = 1
TAG_AUDIO = 2


def _gen(seed: int, device) -> torch.Generator:
    # One generator on the target device, so full-width weights are drawn on the GPU quickly.
    # The same seed therefore gives different numbers on CPU and on CUDA.
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def _randn(shape, gen: torch.Generator, device, std: float = 1.0, mean: float = 0.0,
           dtype=COMPUTE_DTYPE) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return (t * std + mean).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# comfy.ops layers
# ----------------------------------------------------------------------------------------------------------


class MirrorLinear(nn.Module):
    """A MixedPrecisionOps.Linear whose checkpoint entry is not quantized: plain bf16 weight.

    Like ComfyUI's, it is an ``nn.Module`` rather than an ``nn.Linear``. Its forward casts weight and bias to the
    input dtype (a no-op for bf16) and calls ``F.linear``.
    """

    quant_format = None
    layout_type = None
    comfy_cast_weights = False
    _full_precision_mm = False

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.weight_function = []
        self.bias_function = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            w = self.weight.to(device=x.device, dtype=x.dtype)
            b = None if self.bias is None else self.bias.to(device=x.device, dtype=x.dtype)
            return F.linear(x, w, b)


def nvfp4_weight_from_checkpoint(qdata: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                                 out_features: int, in_features: int,
                                 orig_dtype=COMPUTE_DTYPE) -> QuantizedTensor:
    """Build the weight the way ComfyUI's loader does from ``weight``, ``weight_scale`` and ``weight_scale_2``.

    ``weight_scale`` (swizzled fp8 block scales) is reinterpreted as float8_e4m3fn and ``weight_scale_2`` becomes
    the fp32 per-tensor scale. The padded uint8 qdata is kept as stored.
    """
    params = TensorCoreNVFP4Layout.Params(
        scale=weight_scale_2,
        orig_dtype=orig_dtype,
        orig_shape=(out_features, in_features),
        block_scale=weight_scale.view(torch.float8_e4m3fn),
    )
    return QuantizedTensor(qdata.to(torch.uint8), NVFP4_LAYOUT, params)


class MirrorNVFP4Linear(nn.Module):
    """MixedPrecisionOps.Linear for a layer whose checkpoint marks it ``{"format": "nvfp4"}``.

    ``weight`` is an ``nn.Parameter`` holding a comfy_kitchen ``QuantizedTensor`` (NVFP4 layout). ``input_scale``
    is the optional static activation scale; without it the activation's global scale is computed dynamically as
    ``amax(|x|) / 2688`` over the whole flattened input.
    """

    quant_format = NVFP4_QUANT_FORMAT
    layout_type = NVFP4_LAYOUT
    comfy_cast_weights = False

    def __init__(self, in_features: int, out_features: int, weight: QuantizedTensor,
                 bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self._orig_shape = (out_features, in_features)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(COMPUTE_DTYPE), requires_grad=False)
        if input_scale is not None:
            self.input_scale = nn.Parameter(input_scale.to(torch.float32), requires_grad=False)
        else:
            self.input_scale = None
        self.pre_quant_scale = None
        # False means the activation is quantized and the quantized matmul is used (ComfyUI on SM >= 10).
        # True mirrors ComfyUI below SM 10 / full_precision_matrix_mult: dequantized weight, bf16 activation.
        self._full_precision_mm = False
        self._full_precision_mm_config = False
        self.weight_function = []
        self.bias_function = []

    def _use_quantized(self, x: torch.Tensor) -> bool:
        return (self.layout_type is not None and not isinstance(x, QuantizedTensor)
                and not self._full_precision_mm and not getattr(self, "comfy_force_cast_weights", False)
                and len(self.weight_function) == 0 and len(self.bias_function) == 0)

    def quantize_input(self, x2: torch.Tensor) -> QuantizedTensor:
        """The activation quantization step of forward, on an already flattened 2-D input."""
        scale = self.input_scale
        if scale is not None:
            scale = scale.to(x2.device)
        return QuantizedTensor.from_float(x2, NVFP4_LAYOUT, scale=scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            if self.pre_quant_scale is not None:
                x = x * self.pre_quant_scale.to(device=x.device, dtype=x.dtype)
            input_shape = x.shape
            reshaped_nd = False
            if self._use_quantized(x):
                x2 = x.reshape(-1, input_shape[-1]) if x.ndim >= 3 else x
                if x2.ndim == 2:
                    reshaped_nd = x.ndim >= 3
                    x = self.quantize_input(x2)
            # The bias is cast to the activation's original dtype (bf16), as cast_bias_weight does.
            act_dtype = x.params.orig_dtype if isinstance(x, QuantizedTensor) else x.dtype
            bias = None if self.bias is None else self.bias.to(device=x.device, dtype=act_dtype)
            weight = self.weight.dequantize() if self._full_precision_mm else self.weight
            try:
                out = F.linear(x, weight, bias)
            except (ValueError, NotImplementedError):
                # ck's eager scaled_mm raises on CPU (ValueError, or NotImplementedError for torch's CPU-less
                # _scaled_mm_v2 in some torch releases), which its handler does not catch; do what the handler
                # does for RuntimeError/TypeError: dequantize both operands and run F.linear.
                if not (isinstance(x, QuantizedTensor) and isinstance(weight, QuantizedTensor)):
                    raise
                out = F.linear(x.dequantize(), weight.dequantize(), bias)
            if reshaped_nd:
                out = out.reshape((*input_shape[:-1], self.weight.shape[0]))
            return out


class MirrorRMSNorm(nn.RMSNorm):
    """comfy.ops RMSNorm: an ``nn.RMSNorm`` whose forward is ``F.rms_norm`` with the weight cast to the input."""

    comfy_cast_weights = True

    def __init__(self, normalized_shape: int, eps: float, weight: torch.Tensor):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True,
                         device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
        self.weight.requires_grad_(False)
        self.bias = None
        self.weight_function = []
        self.bias_function = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            w = self.weight.to(device=x.device, dtype=x.dtype)
            return F.rms_norm(x, self.normalized_shape, w, self.eps)


# ----------------------------------------------------------------------------------------------------------
# Attention backend (ComfyUI's pytorch backend with skip_reshape=True)
# ----------------------------------------------------------------------------------------------------------


def sdpa_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                   skip_output_reshape=False, **kwargs):
    """ComfyUI's ``attention_pytorch`` for batch 1: SDPA on [B,H,S,D], output [B,S,H*D] (a copy)."""
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, inner = q.shape
        dim_head = inner // heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    sdpa_kwargs = {}
    if kwargs.get("scale") is not None:
        sdpa_kwargs["scale"] = kwargs["scale"]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, **sdpa_kwargs)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def sage_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kwargs):
    """ComfyUI's ``attention_sage`` (``--use-sage-attention``): head-major views with ``skip_reshape=True`` run
    SageAttention's HND path and copy the output back to token-major; token-major input runs its NHD path."""
    from sageattention import sageattn

    if skip_reshape:
        b, _, _, dim_head = q.shape
        tensor_layout = "HND"
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head) for t in (q, k, v))
        tensor_layout = "NHD"
    if SAGE_PROFILE_MARKERS:
        torch.cuda._sleep(1)  # marker kernel: benchmarks/profile_block.py files what follows as attention internals
    out = sageattn(q, k, v, attn_mask=mask, is_causal=False, tensor_layout=tensor_layout)
    if SAGE_PROFILE_MARKERS:
        torch.cuda._sleep(1)
    if tensor_layout == "HND":
        return out if skip_output_reshape else out.transpose(1, 2).reshape(b, -1, heads * dim_head)
    return out.transpose(1, 2) if skip_output_reshape else out.reshape(b, -1, heads * dim_head)


SAGE_PROFILE_MARKERS = False
# The global backend ComfyUI picks at start-up (pytorch by default, sage with --use-sage-attention).
GLOBAL_ATTENTION = {"function": sdpa_attention}


def global_attention():
    return GLOBAL_ATTENTION["function"]


class MirrorComfyAttention:
    """ComfyUI's ``ComfyAttention``: ``function`` is a per-layer backend chosen by the checkpoint (None = global)."""

    def __init__(self, function=None):
        self.function = function


def optimized_attention(q, k, v, heads, mask=None, skip_reshape=False, transformer_options={},
                        preferred_attention=None, **kwargs):
    """ComfyUI's ``optimized_attention`` as H3 imports it: an override in transformer_options gets the
    undecorated backend first; otherwise the layer's preferred backend, otherwise the global one (SDPA here)."""
    fn = global_attention()
    override = transformer_options.get("optimized_attention_override") if transformer_options else None
    if override is not None:
        return override(fn, q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                        transformer_options=transformer_options, **kwargs)
    if preferred_attention is not None and preferred_attention.function is not None:
        fn = preferred_attention.function
    return fn(q, k, v, heads, mask=mask, skip_reshape=skip_reshape, transformer_options=transformer_options, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# comfy/ldm/minimax/model.py modules
# ----------------------------------------------------------------------------------------------------------


def rope_rotation_table(angles: torch.Tensor, dtype) -> torch.Tensor:
    """[S, rot] pair angles (two equal halves) -> [1, S, 1, rot/2, 2, 2] rotation matrices [[c, -s], [s, c]]."""
    half = angles.shape[-1] // 2
    ang = angles[:, :half]
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([c, -s, s, c], dim=-1).reshape(1, angles.shape[0], 1, half, 2, 2).to(dtype)


def rope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """MiniMaxH3Model.rope_freqs: [S, 3] positions x [n] inverse frequencies -> [S, 6n] fp32 angles."""
    pos = position_ids.to(torch.float32).to(inv_freq.device)
    per_axis = pos.unsqueeze(-1) * inv_freq.view(1, 1, -1)
    t_f, h_f, w_f = per_axis.unbind(dim=1)
    half = torch.cat((t_f, h_f, w_f), dim=-1)
    return torch.cat((half, half), dim=-1)


class MirrorAttention(nn.Module):
    """H3 ``Attention``: fused qkv projection, per-head RMSNorm (+ partial split-half rope), attention, out_proj."""

    def __init__(self, hidden: int, heads: int, head_dim: int, qkv_proj: nn.Module, q_norm: MirrorRMSNorm,
                 k_norm: MirrorRMSNorm, out_proj: nn.Module, attention_fn=None):
        super().__init__()
        # attention_fn plays the role of a checkpoint-selected backend (ComfyAttention.function).
        self.comfy_attention = MirrorComfyAttention(attention_fn)
        self.heads = heads
        self.head_dim = head_dim
        self.hidden = hidden
        self.qkv_proj = qkv_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.out_proj = out_proj
        self.to_gate_compress = None

    def forward(self, x: torch.Tensor, rope_freqs: torch.Tensor | None = None, transformer_options={}):
        with torch.inference_mode():
            s = x.shape[0]
            q, k, v = self.qkv_proj(x).split(self.heads * self.head_dim, dim=-1)
            v = v.view(s, self.heads, self.head_dim)
            if rope_freqs is not None:
                # RMSNorm + partial split-half rope, in place on the q/k views of the fused qkv buffer.
                q = q.view(1, s, self.heads, self.head_dim)
                k = k.view(1, s, self.heads, self.head_dim)
                qw = self.q_norm.weight.to(x.device)
                kw = self.k_norm.weight.to(x.device)
                rot = rope_freqs.shape[-3] * 2
                ck.rms_rope_split_half_(q, k, rope_freqs, qw, kw, epsilon=self.q_norm.eps, rot_dim=rot)
                q = q[0]
                k = k[0]
            else:
                q = self.q_norm(q.view(s, self.heads, self.head_dim))
                k = self.k_norm(k.view(s, self.heads, self.head_dim))
            q = q.transpose(0, 1).unsqueeze(0)
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            out = optimized_attention(q, k, v, self.heads, preferred_attention=self.comfy_attention, mask=None,
                                      skip_reshape=True, transformer_options=transformer_options)
            return self.out_proj(out.squeeze(0))


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """comfy.ops ``_swiglu_eager``: first half is the gate, second half the up projection, all in y's dtype."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class MirrorMLP(nn.Module):
    """H3 ``MLP``: ``linear_input_act(fc2, fc1(x), "swiglu")``, which for an NVFP4 fc2 is ``fc2(swiglu(y))``."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.fc1 = fc1
        self.fc2 = fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.fc2(swiglu(self.fc1(x)))


class MirrorAdalnProj(nn.Module):
    """H3 ``AdalnProj``: [M, t_dim] -> ``expand`` tensors of [M*modalities, hidden] (non-contiguous chunks)."""

    def __init__(self, linear: nn.Module, hidden: int, expand: int = 6, modalities: int = 3, apply_silu=True):
        super().__init__()
        self.expand = expand
        self.modalities = modalities
        self.hidden = hidden
        self.apply_silu = apply_silu
        self.linear = linear

    def forward(self, t_emb: torch.Tensor):
        with torch.inference_mode():
            x = self.linear(F.silu(t_emb) if self.apply_silu else t_emb)
            x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
            return x.chunk(self.expand, dim=-1)


def mod_row(vecs: torch.Tensor, row, dtype) -> torch.Tensor:
    """``vecs[row]`` cast to dtype; row is an int or a per-token LongTensor of mod-row indices."""
    return vecs[row].to(dtype)


def mod_scale_shift(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment: ``h = h * (1 + scale_row) + shift_row`` (two bf16 roundings, as in ComfyUI)."""
    for a, b, row in segments:
        h[a:b].mul_(1.0 + mod_row(scale, row, h.dtype)).add_(mod_row(shift, row, h.dtype))
    return h


def mod_gate(x: torch.Tensor, gate: torch.Tensor, other: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment: ``x += other * gate_row`` as one ``addcmul_``."""
    for a, b, row in segments:
        x[a:b].addcmul_(other[a:b], mod_row(gate, row, x.dtype))
    return x


class MirrorDiTBlock(nn.Module):
    """H3 ``DiTBlock``; forward updates ``x`` in place and returns it."""

    def __init__(self, norm1, norm2, attn: MirrorAttention, mlp: MirrorMLP, adaln_proj: MirrorAdalnProj):
        super().__init__()
        self.norm1 = norm1
        self.norm2 = norm2
        self.attn = attn
        self.mlp = mlp
        self.adaln_proj = adaln_proj

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        with torch.inference_mode():
            # `attention` replaces the whole attn module (ComfyUI's sparse-attention patches use it).
            attention = self.attn if attention is None else attention
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
            h = mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)
            x = mod_gate(x, gate_msa, attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options),
                         mod_segments)
            h = mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, mod_segments)
            return mod_gate(x, gate_mlp, self.mlp(h), mod_segments)


class MirrorRefinerBlock(nn.Module):
    """H3 ``RefinerBlock`` (text token refiner): no modulation, no rope, plain residuals."""

    def __init__(self, norm1, norm2, attn: MirrorAttention, mlp: MirrorMLP):
        super().__init__()
        self.norm1 = norm1
        self.norm2 = norm2
        self.attn = attn
        self.mlp = mlp

    def forward(self, x, transformer_options={}):
        with torch.inference_mode():
            x = self.attn(self.norm1(x), transformer_options=transformer_options).add_(x)
            return self.mlp(self.norm2(x)).add_(x)


class MirrorTokenRefiner(nn.Module):
    def __init__(self, blocks: Iterable[MirrorRefinerBlock], final_norm: MirrorRMSNorm):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm

    def forward(self, x, transformer_options={}):
        with torch.inference_mode():
            for block in self.blocks:
                x = block(x, transformer_options=transformer_options)
            return self.final_norm(x)


class MirrorH3Model(nn.Module):
    """Enough of ``MiniMaxH3Model`` for structural matching: ``.blocks`` and ``.token_refiner.blocks``."""

    def __init__(self, blocks: Iterable[MirrorDiTBlock], token_refiner: MirrorTokenRefiner, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.dtype = COMPUTE_DTYPE
        self.token_refiner = token_refiner
        self.blocks = nn.ModuleList(blocks)

    def run_blocks(self, h, t_emb, mod_segments, rope_freqs, transformer_options=None):
        """The block loop of ``_forward``, including ``patches_replace["dit"][("double_block", i)]``."""
        transformer_options = {} if transformer_options is None else transformer_options
        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        with torch.inference_mode():
            for i, block in enumerate(self.blocks):
                transformer_options["block_index"] = i
                if ("double_block", i) in blocks_replace:
                    def block_wrap(args, block=block):
                        return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                             transformer_options=args["transformer_options"],
                                             attention=args.get("attention"))}
                    h = blocks_replace[("double_block", i)](
                        {"img": h, "t_emb": t_emb, "mod_segments": mod_segments, "rope_freqs": rope_freqs,
                         "layout": None, "transformer_options": transformer_options},
                        {"original_block": block_wrap})["img"]
                else:
                    h = block(h, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options)
            return h


# ----------------------------------------------------------------------------------------------------------
# Factories
# ----------------------------------------------------------------------------------------------------------


def make_nvfp4_linear(in_f: int, out_f: int, *, bias: bool = False, static_input_scale: float | None = None,
                      seed: int, device) -> MirrorNVFP4Linear:
    """An NVFP4 layer with a random weight (std 1/sqrt(in_f)), stored as a ComfyUI checkpoint would store it."""
    device = torch.device(device)
    gen = _gen(seed, device)
    w = _randn((out_f, in_f), gen, device, std=1.0 / math.sqrt(in_f))
    b = _randn((out_f,), gen, device, std=0.05) if bias else None
    # Quantize with ck (as the checkpoint converter did), then rebuild from the three stored tensors.
    sd = QuantizedTensor.from_float(w, NVFP4_LAYOUT).state_dict("weight")
    weight = nvfp4_weight_from_checkpoint(sd["weight"], sd["weight_scale"], sd["weight_scale_2"], out_f, in_f)
    input_scale = None
    if static_input_scale is not None:
        input_scale = torch.tensor(float(static_input_scale), dtype=torch.float32, device=device)
    return MirrorNVFP4Linear(in_f, out_f, weight, b, input_scale)


def make_linear(in_f: int, out_f: int, *, bias: bool = True, std: float | None = None, seed: int,
                device) -> MirrorLinear:
    device = torch.device(device)
    gen = _gen(seed, device)
    w = _randn((out_f, in_f), gen, device, std=(1.0 / math.sqrt(in_f)) if std is None else std)
    b = _randn((out_f,), gen, device, std=0.05) if bias else None
    return MirrorLinear(in_f, out_f, w, b)


def make_rms_norm(dim: int, eps: float, *, seed: int, device) -> MirrorRMSNorm:
    # weights near 1, as trained norms are, but not exactly 1 so that the weight matters
    gen = _gen(seed, device)
    return MirrorRMSNorm(dim, eps, _randn((dim,), gen, torch.device(device), std=0.1, mean=1.0))


# Default static activation scale: lets |x| up to 0.02 * 2688 ~ 54 through without saturating.
DEFAULT_STATIC_SCALE = 0.02


def _static_scale_for(name: str, static_scale_layers) -> float | None:
    if isinstance(static_scale_layers, Mapping):
        v = static_scale_layers.get(name)
        return None if v is None else float(v)
    return DEFAULT_STATIC_SCALE if name in tuple(static_scale_layers) else None


def _make_attention(hidden, heads, head_dim, eps, seed, device, static_scale_layers, prefix="attn."):
    inner = heads * head_dim
    return MirrorAttention(
        hidden, heads, head_dim,
        qkv_proj=make_nvfp4_linear(hidden, 3 * inner, seed=seed + 1, device=device,
                                   static_input_scale=_static_scale_for(prefix + "qkv_proj", static_scale_layers)),
        q_norm=make_rms_norm(head_dim, eps, seed=seed + 2, device=device),
        k_norm=make_rms_norm(head_dim, eps, seed=seed + 3, device=device),
        out_proj=make_nvfp4_linear(inner, hidden, seed=seed + 4, device=device,
                                   static_input_scale=_static_scale_for(prefix + "out_proj", static_scale_layers)),
    )


def _make_mlp(hidden, ffn, seed, device, static_scale_layers, prefix="mlp."):
    return MirrorMLP(
        fc1=make_nvfp4_linear(hidden, 2 * ffn, seed=seed + 5, device=device,
                              static_input_scale=_static_scale_for(prefix + "fc1", static_scale_layers)),
        fc2=make_nvfp4_linear(ffn, hidden, seed=seed + 6, device=device,
                              static_input_scale=_static_scale_for(prefix + "fc2", static_scale_layers)),
    )


def make_block(hidden: int, heads: int, head_dim: int, ffn: int, t_dim: int, *, seed: int, device,
               static_scale_layers: Iterable[str] | Mapping[str, float] = (),
               eps: float = H3_NORM_EPS, qk_eps: float = H3_QK_NORM_EPS) -> MirrorDiTBlock:
    """A random DiTBlock: NVFP4 qkv_proj/out_proj/fc1/fc2, bf16 adaln linear (with bias), bf16 norms.

    ``static_scale_layers``: names relative to the block ("attn.qkv_proj", "attn.out_proj", "mlp.fc1",
    "mlp.fc2") that get a static ``input_scale`` (DEFAULT_STATIC_SCALE), or a mapping name -> scale.
    """
    device = torch.device(device)
    # adaln weights sized so that scale/shift/gate come out around 0.3, like a trained model's.
    adaln_linear = make_linear(t_dim, 6 * hidden * 3, bias=True, std=0.3 / math.sqrt(t_dim),
                               seed=seed + 7, device=device)
    return MirrorDiTBlock(
        norm1=make_rms_norm(hidden, eps, seed=seed + 8, device=device),
        norm2=make_rms_norm(hidden, eps, seed=seed + 9, device=device),
        attn=_make_attention(hidden, heads, head_dim, qk_eps, seed, device, static_scale_layers),
        mlp=_make_mlp(hidden, ffn, seed, device, static_scale_layers),
        adaln_proj=MirrorAdalnProj(adaln_linear, hidden, expand=6, modalities=3, apply_silu=True),
    )


def make_refiner_block(hidden: int, heads: int, head_dim: int, ffn: int, *, seed: int, device,
                       eps: float = H3_NORM_EPS, qk_eps: float = H3_QK_NORM_EPS) -> MirrorRefinerBlock:
    device = torch.device(device)
    return MirrorRefinerBlock(
        norm1=make_rms_norm(hidden, eps, seed=seed + 8, device=device),
        norm2=make_rms_norm(hidden, eps, seed=seed + 9, device=device),
        attn=_make_attention(hidden, heads, head_dim, qk_eps, seed, device, ()),
        mlp=_make_mlp(hidden, ffn, seed, device, ()),
    )


def make_model(hidden: int, heads: int, head_dim: int, ffn: int, t_dim: int, *, num_layers: int = 2,
               refiner_layers: int = 2, seed: int, device,
               static_scale_layers: Iterable[str] | Mapping[str, float] = ()) -> MirrorH3Model:
    blocks = [make_block(hidden, heads, head_dim, ffn, t_dim, seed=seed + 100 * (i + 1), device=device,
                         static_scale_layers=static_scale_layers) for i in range(num_layers)]
    refiner = MirrorTokenRefiner(
        [make_refiner_block(hidden, heads, head_dim, ffn, seed=seed + 10_000 + 100 * i, device=device)
         for i in range(refiner_layers)],
        final_norm=make_rms_norm(hidden, H3_NORM_EPS, seed=seed + 20_000, device=device),
    )
    return MirrorH3Model(blocks, refiner, hidden)


def rot_dim_for(head_dim: int) -> int:
    """H3 rotates 96 of 128 head dims (3 axes x 16 frequencies x 2); scale that to other head sizes."""
    rot = 3 * head_dim // 4
    if head_dim % 8 != 0:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 8 (rot/2 splits evenly over 3 axes)")
    return rot


def make_position_ids(s_text: int, s_audio: int, s_video: int, frame_w: int = 8) -> torch.Tensor:
    """[S, 3] float64 (t, h, w) positions shaped like PackedLayout's, without its exact video grid.

    Text counts t from 0; audio is channel-major stereo on a shared t axis, w pinned to +-extreme; video
    frames of ``frame_w``-wide patch rows whose t advances by FRAME_RESCALE spans.
    """
    text = torch.zeros(s_text, 3, dtype=torch.float64)
    text[:, 0] = torch.arange(s_text, dtype=torch.float64)
    cursor = float(s_text)
    half_w = 0.5 * frame_w
    t_audio = (s_audio + 1) // 2
    audio = torch.zeros(s_audio, 3, dtype=torch.float64)
    idx = torch.arange(s_audio)
    audio[:, 0] = cursor + (idx % t_audio).to(torch.float64)
    audio[:, 2] = torch.where(idx < t_audio, -half_w, half_w).to(torch.float64)
    frame_rows = frame_w * frame_w // 2
    vid = torch.arange(s_video)
    frame = vid // frame_rows
    spans = torch.tensor([1.0, 4.0, 4.0, 4.0, 4.0], dtype=torch.float64) * (5.0 / 3.0)
    t_of_frame = torch.cat([torch.zeros(1, dtype=torch.float64),
                            spans[torch.arange(int(frame.max()) + 1 if s_video else 1) % 5].cumsum(0)])
    video = torch.empty(s_video, 3, dtype=torch.float64)
    video[:, 0] = cursor + t_of_frame[frame]
    video[:, 1] = ((vid % frame_rows) // frame_w).to(torch.float64) - 0.25 * frame_w
    video[:, 2] = (vid % frame_w).to(torch.float64) - half_w
    return torch.cat([text, audio, video])


def make_rope_freqs(position_ids: torch.Tensor, head_dim: int, *, device, dtype=COMPUTE_DTYPE) -> torch.Tensor:
    rot = rot_dim_for(head_dim)
    n = rot // 6
    inv_freq = 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32, device=device) / n))
    return rope_rotation_table(rope_angles(position_ids, inv_freq), dtype)


def make_inputs(S_text: int, S_audio: int, S_video: int, *, seed: int, device, hidden: int = 256,
                head_dim: int = 64, t_dim: int = 256, n_timesteps: int = 1, per_token_video: bool = False):
    """Random block inputs in ComfyUI's packed layout [text | audio | video].

    Returns ``(x [S, hidden] bf16, t_emb [n_timesteps, t_dim] bf16, mod_segments, rope_freqs)``.
    ``mod_segments`` is ``[(a, b, row)]`` with row = timestep_index * 3 + tag (text 1, video 0, audio 2); text
    and video use timestep 0, audio its own timestep (index 1 when there are two or more). With
    ``per_token_video`` the video row is a LongTensor of per-token rows spread over all timesteps.
    """
    device = torch.device(device)
    gen = _gen(seed, device)
    S = S_text + S_audio + S_video
    x = _randn((S, hidden), gen, device, std=1.0)
    t_emb = _randn((n_timesteps, t_dim), gen, device, std=1.0)
    t_audio = min(1, n_timesteps - 1)
    a, b = S_text, S_text + S_audio
    mod_segments = [(0, a, 0 * 3 + TAG_TEXT), (a, b, t_audio * 3 + TAG_AUDIO)]
    if per_token_video:
        t_idx = torch.randint(0, n_timesteps, (S_video,), generator=gen, device=device)
        mod_segments.append((b, S, t_idx * 3 + TAG_VIDEO))
    else:
        mod_segments.append((b, S, 0 * 3 + TAG_VIDEO))
    rope_freqs = make_rope_freqs(make_position_ids(S_text, S_audio, S_video), head_dim, device=device)
    return x, t_emb, mod_segments, rope_freqs


# ----------------------------------------------------------------------------------------------------------
# ModelPatcher-style object patches on a bare module tree
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def object_patches(root, patches):
    """Apply ``patches`` (dotted path -> value) like ModelPatcher.patch_model, undo them on exit."""
    saved = []
    for key, value in patches.items():
        *path, attr = key.split(".")
        obj = root
        for part in path:
            obj = getattr(obj, part)
        had = attr in obj.__dict__
        saved.append((obj, attr, had, obj.__dict__.get(attr)))
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, had, old in reversed(saved):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
