"""The exact specification of a fused Wan block: ComfyUI's ``WanAttentionBlock.forward`` (comfy/ldm/wan/model.py)
written as the sequence of fused ops a fused block runs, for a chain of consecutive blocks.

Every op is one of kernels/backend.py ``FusedOps`` (the CUDA kernels on a GPU, their Python twin elsewhere) or the
ComfyUI code the fused path keeps (attention, the text-side k / v, the GEMM of each NVFP4 Linear). Per block, with
``e`` the modulation rows ``block.modulation + e0`` (ComfyUI's own sum, six tables, one row per batch item and frame)
and ``mod_index`` the row of each token (ComfyUI's ``repeat_e``):

1. norm1 statistics (+ the q / k / v global scale), handed over by the previous block's last residual;
2. ONE pack of ``addcmul(e0, norm1(x), 1 + e1)`` for q, k and v (their inputs are the same tensor; one scale when all
   three are dynamic or share a static one), three GEMMs;
3. q and k: RMSNorm over the full width + interleaved RoPE, in place; attention; o (plain pack);
4. ``x = addcmul(x, o, e2)`` with norm3's statistics (+ the cross-attention q scale, norm3 with affine parameters);
5. cross-attention q packed from norm3(x), its RMSNorm over the full width (no RoPE); k / v from the text (ComfyUI's
   modules; I2V also its image k / v and the image attention); attention; o;
6. ``x = x + o`` with norm2's statistics (+ ffn.0's scale of ``addcmul(e3, norm2(x), 1 + e4)``); ffn.0 packed from
   that; ffn.2 packed from ``gelu_tanh(ffn.0 output)``;
7. ``x = addcmul(x, ffn, e5)`` with the next block's norm1 statistics and q / k / v scale (the last block: the
   statistics only).

tests/test_wan_block_cpu.py (the twin, fp16 and bf16, T2V and I2V) and tests/test_gpu_wan_kernels.py (the kernels,
Wan 2.2 14B's widths) require the outputs to be bit-identical to ComfyUI's real blocks: the fused Wan block must meet
this.
"""

from __future__ import annotations

import dataclasses

import torch

from h3_fused_nvfp4 import comfy_adapter
from h3_fused_nvfp4.core.linear import nvfp4_gemm
from h3_fused_nvfp4.layout import AddcmulModulation, LayerNorm

F32 = torch.float32


@dataclasses.dataclass
class BlockTables:
    """One block's modulation: ``e[i]`` as ``[rows, D]`` tables (views of ComfyUI's sum), the row of each token."""

    e: list[torch.Tensor]
    mod_index: torch.Tensor

    def modulation(self, shift: int, scale: int) -> AddcmulModulation:
        return AddcmulModulation(self.e[scale], self.e[shift], self.mod_index)


def modulation_index(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The modulation row of every token of ``x`` [B, L, D] (int32 [B L]): ComfyUI's ``repeat_e`` applied to the row
    numbers of ``e`` ([B, F, 6, D]: row b F + f; [B, 6, D]: row b)."""
    m = comfy_adapter.wan_model_module()
    batch, frames = x.shape[0], (e.shape[1] if e.ndim == 4 else 1)
    rows = torch.arange(batch * frames, device=x.device, dtype=torch.int32).view(batch, frames, 1)
    repeated = m.repeat_e(rows, x)  # [B, L, 1], or [B, 1, 1] that ComfyUI's ops broadcast over the tokens
    return repeated.expand(batch, x.shape[1], 1).reshape(-1).to(torch.int32).contiguous()


def block_tables(block, e: torch.Tensor, x: torch.Tensor, mod_index: torch.Tensor) -> BlockTables:
    """ComfyUI's ``e = cast(block.modulation) + e`` (its six chunks) as ``[rows, D]`` tables."""
    import comfy.model_management

    modulation = comfy.model_management.cast_to(block.modulation, dtype=x.dtype, device=x.device)
    if e.ndim < 4:  # [B, 6, D]: one row per batch item
        sums = modulation + e
        tables = [sums[:, i] for i in range(6)]
    else:  # [B, F, 6, D]: one row per batch item and frame
        sums = modulation.unsqueeze(0) + e
        tables = [sums[:, :, i].reshape(-1, sums.shape[-1]) for i in range(6)]
    assert sums.dtype == x.dtype, f"modulation rows in {sums.dtype}, activations in {x.dtype}"
    return BlockTables(tables, mod_index)


def _stats(x2: torch.Tensor, eps: float, weight=None, bias=None) -> LayerNorm:
    rows = x2.shape[0]
    return LayerNorm(weight, bias, eps, torch.empty(rows, dtype=F32, device=x2.device),
                     torch.empty(rows, dtype=F32, device=x2.device))


def _scale(dynamic: bool, device) -> torch.Tensor | None:
    return torch.empty(1, dtype=F32, device=device) if dynamic else None


def _static(layer, device):
    scale = getattr(layer, "input_scale", None)
    return None if scale is None else scale.detach().to(device=device, dtype=F32).reshape(1)


def pack(backend, layer, x2: torch.Tensor, *, global_scale=None, **source):
    """The fused pack of ``source(x2)`` for ``layer``: its static ``input_scale``, else the dynamic ``global_scale``
    (None: the pack reduces it)."""
    static = _static(layer, x2.device)
    return backend.pack_nvfp4(x2, static_scale=static, global_scale=None if static is not None else global_scale,
                              **source)


def gemm(layer, packed, x2: torch.Tensor) -> torch.Tensor:
    """ComfyUI's GEMM call of an NVFP4 Linear on a packed input, the layer's weights as its forward casts them."""
    with comfy_adapter.layer_weights(layer, x2) as (weight, bias):
        alpha = packed.global_scale * weight._params.scale.reshape(1).to(F32)  # this layer's GEMM alpha
        return nvfp4_gemm(dataclasses.replace(packed, alpha=alpha), weight, bias, layer.out_features, x2.dtype)


def linear(backend, layer, x2: torch.Tensor, *, global_scale=None, **source) -> torch.Tensor:
    return gemm(layer, pack(backend, layer, x2, global_scale=global_scale, **source), x2)


def shared_pack_groups(layers) -> list[list]:
    """Linears reading one input that can share one pack: those with the same scale (all dynamic, or one static
    ``input_scale`` value)."""
    groups: dict = {}
    for layer in layers:
        scale = getattr(layer, "input_scale", None)
        groups.setdefault(None if scale is None else float(scale), []).append(layer)
    return list(groups.values())


def _rms_weight(norm, x2):
    with comfy_adapter.norm_weight(norm, x2) as weight:
        return weight


def _freq_table(freqs: torch.Tensor, positions: int) -> torch.Tensor:
    """ComfyUI's rope table [1, S, 1, D / 2, 2, 2] (fp32) as the kernel reads it: [S, D / 2, 2, 2]."""
    assert freqs.shape[0] == 1 and freqs.shape[2] == 1 and freqs.shape[1] >= positions, tuple(freqs.shape)
    return freqs[0, :, 0].contiguous()


def run_blocks(blocks, x: torch.Tensor, e: torch.Tensor, freqs: torch.Tensor, context: torch.Tensor,
               context_img_len, transformer_options: dict, backend) -> list[torch.Tensor]:
    """The outputs of ``blocks`` run one after another on ``x`` [B, L, D] (each block's input the previous output),
    computed with the fused ops of ``backend``; ``e``, ``freqs``, ``context``, ``context_img_len`` and
    ``transformer_options`` as ComfyUI's WanModel passes them to every block."""
    m = comfy_adapter.wan_model_module()
    batch, positions, dim = x.shape
    x2 = x.contiguous().reshape(batch * positions, dim).clone()  # the residual stream, updated in place from here
    mod_index = modulation_index(e, x)  # one for every block: the gates and the next block's modulation share it
    tables = [block_tables(block, e, x, mod_index) for block in blocks]
    freq_table = _freq_table(freqs, positions)

    def norm1_of(i: int):
        block = blocks[i]
        dynamic = any(getattr(lin, "input_scale", None) is None for lin in
                      (block.self_attn.q, block.self_attn.k, block.self_attn.v))
        return _stats(x2, block.norm1.eps), tables[i].modulation(0, 1), _scale(dynamic, x2.device)

    norm1, mod1, g1 = norm1_of(0)
    backend.layer_norm_statistics(x2, norm1, modulation=mod1 if g1 is not None else None, global_scale_out=g1)
    outputs = []
    for i, block in enumerate(blocks):
        t = tables[i]
        sa, ca = block.self_attn, block.cross_attn
        heads = sa.num_heads
        # self-attention: one pack of the modulated norm1 for q, k and v
        qkv = {}
        for group in shared_pack_groups((sa.q, sa.k, sa.v)):
            packed = pack(backend, group[0], x2, global_scale=g1, layer_norm=norm1, addcmul_modulation=mod1)
            qkv.update({layer: gemm(layer, packed, x2) for layer in group})
        q, k, v = qkv[sa.q], qkv[sa.k], qkv[sa.v]
        backend.rms_norm_rope_(q, k, _rms_weight(sa.norm_q, q), _rms_weight(sa.norm_k, k), sa.norm_q.eps,
                               freqs=freq_table, positions=positions)
        y = m.optimized_attention(q.view(batch, positions, dim), k.view(batch, positions, dim),
                                  v.view(batch, positions, dim), heads=heads, transformer_options=transformer_options)
        y = linear(backend, sa.o, y.reshape(-1, dim))
        # x = addcmul(x, y, e2), with norm3's statistics (+ the cross-attention q scale)
        with comfy_adapter.layer_norm_weights(block.norm3, x2) as (w3, b3):
            affine = w3 is not None
            norm3 = _stats(x2, block.norm3.eps, w3, b3) if affine else _stats(x2, block.norm1.eps)
            g3 = _scale(affine and getattr(ca.q, "input_scale", None) is None, x2.device)
            backend.residual_layer_norm_(x2, y, norm3, gate=t.e[2], mod_index=t.mod_index, global_scale_out=g3)
            # cross-attention (norm3 is an Identity where cross_attn_norm is off: q then reads x itself)
            cq = linear(backend, ca.q, x2, global_scale=g3, layer_norm=norm3) if affine else linear(backend, ca.q, x2)
        backend.rms_norm_rope_(cq, None, _rms_weight(ca.norm_q, cq), None, ca.norm_q.eps)
        cq = cq.view(batch, positions, dim)
        text = context
        if context_img_len is not None and hasattr(ca, "k_img"):  # I2V: the image tokens come first
            image, text = context[:, :context_img_len], context[:, context_img_len:]
            k_img, v_img = ca.norm_k_img(ca.k_img(image)), ca.v_img(image)
            img_x = m.optimized_attention(cq, k_img, v_img, heads=heads, transformer_options=transformer_options,
                                          low_precision_attention=False)
        y = m.optimized_attention(cq, ca.norm_k(ca.k(text)), ca.v(text), heads=heads,
                                  transformer_options=transformer_options)
        if context_img_len is not None and hasattr(ca, "k_img"):
            y = y + img_x
        y = linear(backend, ca.o, y.reshape(-1, dim))
        # x = x + y, with norm2's statistics (+ ffn.0's scale)
        norm2, mod2 = _stats(x2, block.norm2.eps), t.modulation(3, 4)
        g2 = _scale(getattr(block.ffn[0], "input_scale", None) is None, x2.device)
        backend.residual_layer_norm_(x2, y, norm2, next_modulation=mod2 if g2 is not None else None,
                                     global_scale_out=g2)
        f = linear(backend, block.ffn[0], x2, global_scale=g2, layer_norm=norm2, addcmul_modulation=mod2)
        y = linear(backend, block.ffn[2], f, gelu=True)
        # x = addcmul(x, y, e5), with the next block's norm1 statistics (+ its q / k / v scale)
        if i + 1 < len(blocks):
            norm1, mod1, g1 = norm1_of(i + 1)
        else:
            norm1, mod1, g1 = _stats(x2, block.norm1.eps), None, None
        backend.residual_layer_norm_(x2, y, norm1, gate=t.e[5], mod_index=t.mod_index,
                                     next_modulation=mod1 if g1 is not None else None, global_scale_out=g1)
        outputs.append(x2.view(batch, positions, dim).clone())
    return outputs


# ---- ComfyUI's real blocks with random NVFP4 weights, and their inputs (the tests of this specification) ---------

def make_blocks(dtype: torch.dtype, *, dim: int, ffn: int, heads: int, count: int, cross: str = "t2v_cross_attn",
                cross_attn_norm: bool = True, seed: int = 0, device="cpu") -> list:
    """``count`` ComfyUI ``WanAttentionBlock``s built with ComfyUI's ops for a quantized checkpoint computing in
    ``dtype`` (NVFP4 compute forced on), every Linear NVFP4 from ComfyUI's own quantizer, loaded by the blocks' own
    state-dict loaders; norms near 1, random biases and modulation."""
    from h3_fused_nvfp4.core.nvfp4_weights import nvfp4_checkpoint_entries, random_weight

    m = comfy_adapter.wan_model_module()
    ops = comfy_adapter.mixed_precision_ops(dtype, disabled=[])
    settings = {"operations": ops, "device": device, "dtype": dtype}
    blocks = []
    for i in range(count):
        block = m.WanAttentionBlock(cross, dim, ffn, heads, qk_norm=True, cross_attn_norm=cross_attn_norm, eps=1e-6,
                                    operation_settings=settings)
        gen = torch.Generator(device=device).manual_seed(seed + 1000 * i)
        sd = {"modulation": random_weight((1, 6, dim), gen, device, dim ** -0.5, dtype=dtype)}
        for name, module in block.named_modules():
            if hasattr(module, "in_features"):  # ComfyUI's NVFP4 Linear
                weight = random_weight((module.out_features, module.in_features), gen, device,
                                       module.in_features ** -0.5)
                sd.update(nvfp4_checkpoint_entries(name, weight))
                sd[f"{name}.bias"] = random_weight((module.out_features,), gen, device, 0.02, dtype=dtype)
            elif getattr(module, "weight", None) is not None:  # RMSNorm / LayerNorm with affine parameters
                sd[f"{name}.weight"] = random_weight((dim,), gen, device, 0.1, dtype=dtype, mean=1.0)
                if getattr(module, "bias", None) is not None:
                    sd[f"{name}.bias"] = random_weight((dim,), gen, device, 0.05, dtype=dtype)
        missing, unexpected = block.load_state_dict(sd, strict=False)
        assert not unexpected, unexpected
        blocks.append(block.requires_grad_(False))
    return blocks


@dataclasses.dataclass
class BlockInputs:
    x: torch.Tensor
    e: torch.Tensor
    freqs: torch.Tensor
    context: torch.Tensor
    context_img_len: int | None

    def kwargs(self) -> dict:
        return dict(e=self.e, freqs=self.freqs, context=self.context, context_img_len=self.context_img_len,
                    transformer_options={})


def block_inputs(dtype: torch.dtype, *, dim: int, heads: int, grid=(3, 5, 7), batch: int = 2, frames_e: int = 1,
                 text: int = 24, image: int | None = None, seed: int = 0, device="cpu") -> BlockInputs:
    """Inputs of a WanAttentionBlock as ComfyUI's WanModel makes them: x [B, L, D] (L = t h w tokens of the latent
    grid), e0 [B, frames_e, 6, D] (frames_e > 1: a timestep per frame, as Wan 2.2 5B with a denoise mask), the rope
    table of the grid (ComfyUI's EmbedND with Wan's axes; fp32 [1, L, 1, head_dim / 2, 2, 2]) and the text (and image)
    context [B, text (+ image), D]."""
    import comfy.ldm.flux.layers

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    t, h, w = grid
    tokens = t * h * w
    x = torch.randn((batch, tokens, dim), generator=gen).to(dtype)
    e = (torch.randn((batch, frames_e, 6, dim), generator=gen) * 0.2).to(dtype)
    context = torch.randn((batch, text + (image or 0), dim), generator=gen).to(dtype)
    d = dim // heads
    embed = comfy.ldm.flux.layers.EmbedND(dim=d, theta=10000.0, axes_dim=[d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
    ids = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    freqs = embed(ids.reshape(1, -1, 3).to(dtype)).movedim(1, 2)
    return BlockInputs(*(v.to(device) for v in (x, e, freqs, context)), image)


def stock_outputs(blocks, inputs: BlockInputs) -> list[torch.Tensor]:
    """ComfyUI's blocks run one after another, as its WanModel runs them."""
    x, outputs = inputs.x, []
    for block in blocks:
        x = block(x, **inputs.kwargs())
        outputs.append(x)
    return outputs


def spec_outputs(blocks, inputs: BlockInputs, backend) -> list[torch.Tensor]:
    return run_blocks(blocks, inputs.x, inputs.e, inputs.freqs, inputs.context, inputs.context_img_len, {}, backend)
