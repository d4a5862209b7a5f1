"""Z-Image Turbo's block, fused: the executable specification of what the fused JointTransformerBlock runs.

``fused_blocks`` composes the fused ops (kernels/cuda_ops.py on the GPU, kernels/twin_ops.py, their Python twin,
elsewhere) with ComfyUI's own GEMM, comfy-kitchen's q/k RMSNorm + RoPE and ComfyUI's attention into the forward of
a chain of ComfyUI's real ``JointTransformerBlock``s (comfy/ldm/lumina/model.py). The tests require its output to
equal ComfyUI's stock blocks bit for bit; the family's fused block (models/zimage/) must run exactly this sequence.
Per block, with rows r = (batch b, token s) of the [B, S, D] residual stream x, m = adaLN row of r (lumina's
``modulate`` / ``apply_gate`` rows, with ``timestep_zero_index`` the second half for tokens in its slices:
models/zimage/modulation.py), every bf16() one rounding where ComfyUI's ops round:

  attention half   n1 = attention_norm1(x) = bf16(w * (rstd(x) * x))              statistics from the previous
                   h1 = bf16(n1 * bf16(1 + scale_msa[m]))   (refiner: h1 = n1)     block's residual (or one pass)
                   qkv = GEMM(pack(h1))                      one pack kernel, normalizing and modulating on the fly
                   q, k = ck.rms_rope(q, k, ...)             comfy-kitchen's op, as ComfyUI calls it (at its floor)
                   a = attention(q, k, v)                    ComfyUI's attention, on k and v as they are (ComfyUI's
                                                             repeat with n_rep = 1 is a copy of the same values)
                   o = GEMM(pack(a))                         plain pack, its own global-scale reduction
  residual 1       x = bf16(x + bf16(tanh(gate_msa)[m] * attention_norm2(o)))   (refiner: x = bf16(x + norm2(o)))
                   one pass: rstd(o), the new x, ffn_norm1's rstd(x) and the amax of w1 / w3's input
  FFN              h2 = bf16(ffn_norm1(x) * bf16(1 + scale_mlp[m]))            (refiner: h2 = ffn_norm1(x))
                   x1, x3 = GEMM_w1(p), GEMM_w3(p), p = pack(h2)    one pack for both where their scales agree
                   y = GEMM_w2(pack(bf16(bf16(silu(x1)) * x3)))     SwiGLU inside w2's reduction and pack
  residual 2       x = bf16(x + bf16(tanh(gate_mlp)[m] * ffn_norm2(y)))        (refiner: x = bf16(x + norm2(y)))
                   with the next block's attention_norm1 statistics and qkv amax in the same pass

tanh(gate) is ComfyUI's own op on the small [rows, D] adaLN output; clamp_fp16 is the identity in bf16 (the fused
ops take bf16 only: fp16 compute runs ComfyUI's block).
"""

from __future__ import annotations

import dataclasses

import torch

from h3_fused_nvfp4 import comfy_adapter
from h3_fused_nvfp4.core.linear import nvfp4_gemm
from h3_fused_nvfp4.layout import Modulation, RmsNorm
from h3_fused_nvfp4.models.zimage.modulation import adaln_row_index
from h3_fused_nvfp4.tools import synthetic as syn

BF16 = torch.bfloat16
LINEARS = ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
STATIC_INPUT_SCALE = {"attention.qkv": 4.0 / 2688, "attention.out": 2.0 / 2688, "feed_forward.w1": 4.0 / 2688,
                      "feed_forward.w3": 4.0 / 2688, "feed_forward.w2": 1.0 / 2688}
ADALN_WIDTH = 256  # z_image_modulation: the adaLN Linear reads a 256-wide embedding
NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Dims:
    dim: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


FULL = Dims(3840, 30)  # Z-Image Turbo: 30 heads x 128, FFN 10240
TINY = Dims(256, 2)  # heads of 128 (the RoPE axes fix it), FFN 768


def _lumina():
    return comfy_adapter.lumina_model_module()


def make_block(dims: Dims, *, modulated: bool, seed: int, device="cpu", static_layers: tuple[str, ...] = (),
               input_scales: dict[str, float] = STATIC_INPUT_SCALE):
    """One ComfyUI ``JointTransformerBlock`` as Z-Image builds it (noise refiner / layers: ``modulated``; context
    refiner: not), random weights, NVFP4 Linears made by ComfyUI's quantizer, loaded through its state dict."""
    settings = {"operations": syn.h3_ops(), "device": device, "dtype": BF16}
    block = _lumina().JointTransformerBlock(0, dims.dim, dims.heads, dims.heads, 256, 8.0 / 3.0, NORM_EPS, True,
                                            modulation=modulated, z_image_modulation=True,
                                            operation_settings=settings)
    sd = syn.module_state_dict(block, seed=seed, device=device, quantized=LINEARS, static_layers=static_layers,
                               input_scales=input_scales)
    missing, unexpected = block.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"JointTransformerBlock state dict mismatch: missing {missing}, unexpected {unexpected}")
    return block.requires_grad_(False)


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # [B, S, D] bf16
    freqs_cis: torch.Tensor  # [1, S, 1, head_dim / 2, 2, 2] fp32, as NextDiT's rope_embedder(ids).movedim(1, 2)
    adaln_input: torch.Tensor | None  # [B or 2B, 256] bf16 (None: the context refiner)
    timestep_zero_index: list | None


def make_inputs(dims: Dims, batch: int, tokens: int, *, seed: int, device="cpu", modulated: bool = True,
                timestep_zero_index=None) -> Inputs:
    """The block inputs NextDiT builds: the token stream, Z-Image's 3-axis RoPE table of a (caption, image) token
    layout, the adaLN input (2B rows with timestep_zero_index)."""
    from comfy.ldm.flux.layers import EmbedND

    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn((batch, tokens, dims.dim), generator=gen) * 2).to(BF16)
    ids = torch.zeros((1, tokens, 3))
    caption = tokens // 4
    ids[0, :caption, 0] = torch.arange(caption) + 1.0
    side = max(1, int((tokens - caption) ** 0.5))
    image = torch.arange(tokens - caption)
    ids[0, caption:, 0] = caption + 1.0
    ids[0, caption:, 1], ids[0, caption:, 2] = (image // side).float(), (image % side).float()
    freqs = EmbedND(dim=dims.head_dim, theta=256.0, axes_dim=[32, 48, 48])(ids).movedim(1, 2)
    rows = batch * (2 if timestep_zero_index else 1)
    adaln = (torch.randn((rows, ADALN_WIDTH), generator=gen)).to(BF16) if modulated else None
    return Inputs(x.to(device), freqs.to(device), None if adaln is None else adaln.to(device), timestep_zero_index)


def stock_blocks(blocks, inputs: Inputs) -> torch.Tensor:
    """ComfyUI's own forward of the chain (NextDiT's loop)."""
    x = inputs.x
    with torch.inference_mode():
        for block in blocks:
            adaln = inputs.adaln_input if block.modulation else None
            tzi = inputs.timestep_zero_index if block.modulation else None
            x = block(x, None, inputs.freqs_cis, adaln, timestep_zero_index=tzi)
    return x


# ---- the fused sequence ---------------------------------------------------------------------------------------

def _static_scale(layer) -> torch.Tensor | None:
    scale = getattr(layer, "input_scale", None)
    return None if scale is None else scale.detach().to(torch.float32).reshape(1)


def _gemm(layer, packed, like: torch.Tensor) -> torch.Tensor:
    """The layer's NVFP4 GEMM on a packed input (its weights as ComfyUI's Linear fetches them)."""
    with comfy_adapter.layer_weights(layer, like) as (weight, bias):
        return nvfp4_gemm(packed, weight, bias, layer.out_features, like.dtype)


def _pack(ops, layer, h: torch.Tensor, *, global_scale=None, **source):
    """The layer's pack of ``source(h)``: its static scale, else the global scale reduced earlier (a normalized
    source) or here (the others), with the GEMM alpha of its weight."""
    static = _static_scale(layer)
    with comfy_adapter.layer_weights(layer, h) as (weight, _):
        w2 = weight._params.scale.reshape(1)
    return ops.pack_nvfp4(h, static_scale=static, global_scale=global_scale if static is None else None,
                          weight_scale_2=None if static is not None else w2, **source)


@dataclasses.dataclass
class _Tables:
    """A block's adaLN tables as the fused ops read them (None in a refiner block)."""
    attention: Modulation | None = None
    ffn: Modulation | None = None
    gate_attention: torch.Tensor | None = None
    gate_ffn: torch.Tensor | None = None
    index: torch.Tensor | None = None


def _tables(block, inputs: Inputs, index: torch.Tensor | None) -> _Tables:
    if not block.modulation:
        return _Tables()
    scale_msa, gate_msa, scale_mlp, gate_mlp = block.adaLN_modulation(inputs.adaln_input).chunk(4, dim=1)
    return _Tables(Modulation(scale_msa, None, index), Modulation(scale_mlp, None, index), gate_msa.tanh(),
                   gate_mlp.tanh(), index)


def _attention(block, qkv: torch.Tensor, inputs: Inputs, batch: int, tokens: int) -> torch.Tensor:
    """ComfyUI's JointAttention after its qkv Linear: comfy-kitchen's rms_rope on the q / k views, ComfyUI's attention
    on q, k, v as they are."""
    attn = block.attention
    q, k, v = torch.split(qkv.view(batch, tokens, -1), [attn.n_local_heads * attn.head_dim] * 3, dim=-1)
    q, k, v = (t.view(batch, tokens, attn.n_local_heads, attn.head_dim) for t in (q, k, v))
    eps = attn.q_norm.eps if attn.q_norm.eps is not None else torch.finfo(torch.float32).eps
    q, k = comfy_adapter.quant_ops().ck.rms_rope(q, k, inputs.freqs_cis, attn.q_norm.weight, attn.k_norm.weight, eps)
    out = _lumina().optimized_attention_masked(q.movedim(1, 2), k.movedim(1, 2), v.movedim(1, 2),
                                               attn.n_local_heads, None, skip_reshape=True)
    return out.reshape(batch * tokens, -1)


def fused_blocks(blocks, inputs: Inputs, ops) -> torch.Tensor:
    """The chain of blocks through the fused ops ``ops`` (module docstring); returns the new [B, S, D] stream."""
    batch, tokens, dim = inputs.x.shape
    x = inputs.x.reshape(batch * tokens, dim).clone()  # the residual stream, updated in place
    device = x.device

    def norm_of(module) -> RmsNorm:
        return RmsNorm(module.weight, float(module.eps), torch.empty(x.shape[0], dtype=torch.float32, device=device))

    def scalar():
        return torch.empty(1, dtype=torch.float32, device=device)

    # one row index for the forward: every block's adaLN rows follow the same token layout
    index = None
    if inputs.adaln_input is not None:
        index = adaln_row_index(batch, tokens, inputs.adaln_input.shape[0], inputs.timestep_zero_index).to(device)
    with torch.inference_mode():
        tables = _tables(blocks[0], inputs, index)
        norm1, g_qkv = norm_of(blocks[0].attention_norm1), scalar()
        qkv_dynamic = _static_scale(blocks[0].attention.qkv) is None
        ops.norm_statistics(x, norm1, modulation=tables.attention, global_scale_out=g_qkv if qkv_dynamic else None)
        for i, block in enumerate(blocks):
            attn, ffn = block.attention, block.feed_forward
            qkv = _gemm(attn.qkv, _pack(ops, attn.qkv, x, global_scale=g_qkv, modulation=tables.attention,
                                        norm=norm1), x)
            a = _attention(block, qkv, inputs, batch, tokens)
            o = _gemm(attn.out, _pack(ops, attn.out, a), a)

            ffn_norm1, g_ffn = norm_of(block.ffn_norm1), scalar()
            s1, s3 = _static_scale(ffn.w1), _static_scale(ffn.w3)
            ops.post_norm_residual_(x, o, block.attention_norm2.weight, float(block.attention_norm2.eps),
                                    tables.gate_attention, tables.index, next_norm=ffn_norm1,
                                    next_modulation=tables.ffn,
                                    global_scale_out=g_ffn if s1 is None or s3 is None else None)
            source = dict(modulation=tables.ffn, norm=ffn_norm1)
            p1 = _pack(ops, ffn.w1, x, global_scale=g_ffn, **source)
            x1 = _gemm(ffn.w1, p1, x)
            if (s1 is None and s3 is None) or (s1 is not None and s3 is not None and torch.equal(s1, s3)):
                # one pack for both (the same codes); the w3 GEMM computes its own alpha
                x3 = _gemm(ffn.w3, dataclasses.replace(p1, alpha=None), x)
            else:
                x3 = _gemm(ffn.w3, _pack(ops, ffn.w3, x, global_scale=g_ffn, **source), x)
            y = _gemm(ffn.w2, _pack(ops, ffn.w2, x1, swiglu=True, up=x3), x1)

            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            next_tables = _tables(nxt, inputs, index) if nxt is not None else _Tables()
            next_norm = norm_of(nxt.attention_norm1) if nxt is not None else None
            g_next = scalar() if nxt is not None and _static_scale(nxt.attention.qkv) is None else None
            ops.post_norm_residual_(x, y, block.ffn_norm2.weight, float(block.ffn_norm2.eps), tables.gate_ffn,
                                    tables.index, next_norm=next_norm, next_modulation=next_tables.attention,
                                    global_scale_out=g_next)
            tables, norm1, g_qkv = next_tables, next_norm, g_next
    return x.view(batch, tokens, dim)
