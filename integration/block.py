"""Fused forwards for ComfyUI's MiniMax H3 ``DiTBlock`` and its SwiGLU ``MLP``, installed as object patches.

Stock ``DiTBlock.forward`` (comfy/ldm/minimax/model.py) and what changes here:

    ada = adaln_proj(t_emb)                          unchanged
    h = norm1(x)                                     unchanged (torch's F.rms_norm; see "RMSNorm" below)
    h = h * (1 + scale_msa) + shift_msa   per seg    -> folded into qkv_proj's reduction and pack kernels
    x += attn(h) * gate_msa               per seg    -> ComfyUI's own Attention.forward runs on the norm output;
                                                        its qkv_proj call reads the modulation on the fly;
                                                        the gated residual is one in-place kernel
    h = norm2(x); h = modulate(h, mlp rows)          -> folded into fc1's kernels
    x += fc2(silu(gate) * up) * gate_mlp  per seg    -> SwiGLU folded into fc2's kernels; one residual kernel

So the modulated activations and the [S, 14336] SwiGLU product are never written to memory, and every layout
stays as ComfyUI has it: q/k/v remain views of qkv_proj's output, RMSNorm + RoPE runs in place on them
(``FusedAttention``: a bit-identical kernel instead of comfy-kitchen's, one pass instead of two), attention is
ComfyUI's ``optimized_attention`` (the user's backend, overrides and sparse attention included), and out_proj's
pack reads whatever layout attention returned. No layout copy is made here. Attention gets token-major
``[1, S, H*D]`` views (``skip_reshape=False``) unless another node installed an attention override (then the
stock head-major call): PyTorch attention sees the same views as stock and copies nothing; SageAttention runs its
NHD path, whose output is out_proj's input as is (stock H3 takes the HND path: ComfyUI then copies the output back
to token-major, and SageAttention quantizes from head-major views).

Synchronization of the global scale: each NVFP4 input's amax is produced by the reduction kernel of that
layer (last CTA writes g and alpha to device memory) and consumed by the pack kernel and the GEMM that follow on
the same stream, so stream order is the only synchronization; the host never waits.

RMSNorm is not folded: torch's fused rms_norm reduction order is an implementation detail of each torch release,
so a re-implementation could not promise equal bits. The kernels read the norm output instead.

Fallbacks keep exactness: a call the kernels cannot take (LoRA patches, a custom ``attention`` callable from
another node, torch.compile tracing, ...) runs the stock op sequence (reference/h3_ops.py) for that step.
Tensors off the GPU go through reference/fused_ops.py, the Python twin of the kernels (tests).
"""

from __future__ import annotations

import sys
import threading

import torch

from ..kernels import ops, runtime
from ..reference import h3_ops
from .linear import FusedNVFP4Linear, backend_for


class ModulationIndexCache:
    """int32 per-token modulation rows on the device, built once per forward (the segment list is shared by
    all blocks of a forward) from ComfyUI's ``mod_segments``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key = None
        self._value = None

    @staticmethod
    def _key_of(segments, rows, device):
        parts = []
        for a, b, row in segments:
            if isinstance(row, torch.Tensor):
                parts.append((a, b, id(row), row.data_ptr(), row._version))
            else:
                parts.append((a, b, int(row)))
        return (rows, str(device), tuple(parts))

    def get(self, segments, rows: int, device: torch.device) -> torch.Tensor:
        key = self._key_of(segments, rows, device)
        with self._lock:
            if self._key != key:
                # Integer rows are filled on the host and copied without blocking; per-token row tensors (denoise
                # masks) are copied device to device, so building the index never waits for the GPU.
                host_segments = [(a, b, 0 if isinstance(r, torch.Tensor) else r) for a, b, r in segments]
                index = h3_ops.modulation_index(host_segments, rows)
                if device.type == "cuda":
                    index = index.pin_memory().to(device, non_blocking=True)
                for a, b, r in segments:
                    if isinstance(r, torch.Tensor):
                        index[a:b].copy_(r.to(device=device, dtype=torch.int32, non_blocking=True))
                # Keep the segment tensors referenced so their ids cannot be reused by new tensors.
                self._key, self._value = key, (index, [r for _, _, r in segments if isinstance(r, torch.Tensor)])
            return self._value[0]


def _bf16_table(table: torch.Tensor) -> torch.Tensor:
    # Stock code converts each gathered row with .to(x.dtype); converting the whole table is the same rounding.
    return table if table.dtype == torch.bfloat16 else table.to(torch.bfloat16)


def _fused_backend(x: torch.Tensor):
    """The fused-op backend for this block call, or None when the stock forward must run."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or torch.compiler.is_compiling():
        return None
    try:
        return backend_for(x)
    except runtime.KernelBuildError:
        return None  # FusedNVFP4Linear logs the build failure once per layer


def _cast_weight(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    try:
        import comfy.model_management

        return comfy.model_management.cast_to(weight, device=device)
    except ImportError:
        return weight.to(device)


def _in_training() -> bool:
    try:
        import comfy.model_management

        return bool(getattr(comfy.model_management, "in_training", False))
    except ImportError:
        return False


class FusedAttention:
    """``Attention.forward`` of an H3 DiTBlock with comfy-kitchen's rms_rope_split_half_ replaced by the
    bit-identical kernels/h3_rms_rope.cu (one read and one write of q and k instead of two reads).

    Everything else is ComfyUI's sequence: qkv_proj (fused pack when patched), q/k/v views of its output, the
    attention function the block's own module imports (``optimized_attention``: the user's backend, overrides
    and sparse attention), ``AttentionTensorContainer`` boxes where that module has them, out_proj. Anything
    the kernel does not take (training, another layout) runs the layer's stock forward or comfy-kitchen's op.
    """

    def __init__(self, attn):
        self.attn = attn
        self.stock_forward = type(attn).forward.__get__(attn)
        module = sys.modules.get(type(attn).__module__)
        self.attention_function = getattr(module, "optimized_attention", None)
        self.container = getattr(module, "AttentionTensorContainer", None)

    def __call__(self, x, rope_freqs=None, transformer_options={}):
        attn = self.attn
        if rope_freqs is None or self.attention_function is None or _in_training() or not x.is_cuda:
            return self.stock_forward(x, rope_freqs=rope_freqs, transformer_options=transformer_options)
        s = x.shape[0]
        heads, head_dim = attn.heads, attn.head_dim
        q, k, v = attn.qkv_proj(x).split(heads * head_dim, dim=-1)
        v = v.view(s, heads, head_dim)
        q = q.view(1, s, heads, head_dim)
        k = k.view(1, s, heads, head_dim)
        qw = _cast_weight(attn.q_norm.weight, x.device)
        kw = _cast_weight(attn.k_norm.weight, x.device)
        rot = rope_freqs.shape[-3] * 2
        fused = ops.rms_rope_support(q, k, rope_freqs, qw, kw, rot) is None
        if fused:
            try:
                ops.rms_rope_split_half_(q, k, rope_freqs, qw, kw, attn.q_norm.eps, rot)
            except runtime.KernelBuildError:  # the kernel did not build or launch; q and k are untouched
                fused = False
        if not fused:
            import comfy_kitchen as ck

            ck.rms_rope_split_half_(q, k, rope_freqs, qw, kw, epsilon=attn.q_norm.eps, rot_dim=rot)
        boxes = self.container or (lambda t: t)
        preferred = getattr(attn, "comfy_attention", None)
        if (transformer_options or {}).get("optimized_attention_override") is None:
            # Token-major [1, S, H*D] views (ComfyUI's usual calling convention, skip_reshape=False): every backend
            # reshapes them itself without a copy. SageAttention then runs its NHD path and returns [1, S, H, D],
            # which is out_proj's input as is; PyTorch SDPA receives the same [1, H, S, D] views as stock.
            inner = heads * head_dim
            q, k, v = (boxes(t.view(1, s, inner)) for t in (q, k, v))
            out = self.attention_function(q, k, v, heads, preferred_attention=preferred, mask=None,
                                          skip_reshape=False, transformer_options=transformer_options)
        else:  # another node's override gets exactly the stock call (head-major views, skip_reshape=True)
            q = boxes(q[0].transpose(0, 1).unsqueeze(0))
            k = boxes(k[0].transpose(0, 1).unsqueeze(0))
            v = boxes(v.transpose(0, 1).unsqueeze(0))
            out = self.attention_function(q, k, v, heads, preferred_attention=preferred, mask=None,
                                          skip_reshape=True, transformer_options=transformer_options)
        return attn.out_proj(out.squeeze(0))


class FusedSwigluMLP:
    """``MLP.forward``: ``fc2(silu(gate) * up)`` with the SwiGLU computed inside fc2's reduction and pack.

    ``fc1_modulation`` lets the block hand fc1 the adaLN modulation of this call (fc1 then reads the norm
    output and modulates on the fly).
    """

    def __init__(self, mlp, fc1: FusedNVFP4Linear | None, fc2: FusedNVFP4Linear | None):
        self.mlp = mlp
        self.fc1 = fc1
        self.fc2 = fc2
        self.stock_forward = type(mlp).forward.__get__(mlp)

    def __call__(self, x: torch.Tensor, modulation=None, stock_modulated=None):
        if self.fc1 is not None:
            y = self.fc1(x, modulation=modulation, stock_input=stock_modulated)
        else:
            y = self.mlp.fc1(stock_modulated() if stock_modulated is not None else x)
        if self.fc2 is None:
            return self.mlp.fc2(h3_ops.swiglu(y))
        return self.fc2(y, swiglu=True, stock_input=lambda: h3_ops.swiglu(y))


class FusedDiTBlock:
    """``DiTBlock.forward`` with modulation, SwiGLU and gated residuals fused (see the module docstring)."""

    def __init__(self, block, name: str, qkv: FusedNVFP4Linear | None, mlp: FusedSwigluMLP,
                 index_cache: ModulationIndexCache):
        self.block = block
        self.name = name
        self.qkv = qkv
        self.mlp = mlp
        self.index_cache = index_cache
        self.stock_forward = type(block).forward.__get__(block)

    def _residual(self, backend, x, gate, other, segments, index):
        if other.shape == x.shape and backend.pack_support(other) is None:
            try:
                return backend.gated_residual_(x, other, _bf16_table(gate), index)
            except ValueError:  # unaligned views and the like: the stock per-segment addcmul_ is exact too
                pass
        return h3_ops.gated_residual_(x, gate, other, segments)

    def _modulation(self, scale, shift, index):
        return ops.Modulation(_bf16_table(scale), _bf16_table(shift), index)

    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        block = self.block
        backend = _fused_backend(x)
        if backend is None:
            return self.stock_forward(x, t_emb, mod_segments, rope_freqs,
                                      transformer_options=transformer_options, attention=attention)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)
        index = self.index_cache.get(mod_segments, x.shape[0], x.device)

        # attention half
        n1 = block.norm1(x)
        if attention is None and self.qkv is not None:
            modulation = self._modulation(scale_msa, shift_msa, index)
            self.qkv.pending = (modulation, lambda: h3_ops.modulate_(n1, shift_msa, scale_msa, mod_segments))
            try:
                out = block.attn(n1, rope_freqs=rope_freqs, transformer_options=transformer_options)
            finally:
                self.qkv.pending = None
        else:  # another node replaced the attention (e.g. sparse attention): it needs the modulated tensor
            h = h3_ops.modulate_(n1, shift_msa, scale_msa, mod_segments)
            out = (attention or block.attn)(h, rope_freqs=rope_freqs, transformer_options=transformer_options)
        self._residual(backend, x, gate_msa, out, mod_segments, index)

        # MLP half
        n2 = block.norm2(x)
        out = self.mlp(n2, modulation=self._modulation(scale_mlp, shift_mlp, index),
                       stock_modulated=lambda: h3_ops.modulate_(n2, shift_mlp, scale_mlp, mod_segments))
        return self._residual(backend, x, gate_mlp, out, mod_segments, index)
