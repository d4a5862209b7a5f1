"""``Attention.forward`` of ComfyUI's MiniMax H3 DiTBlock with the RMSNorm + RoPE kernel (object patch)."""

from __future__ import annotations

import collections
import sys

from ... import comfy_adapter
from ...core.fallbacks import note_fallback
from ...core.linear import FusedNVFP4Linear, PackPatch
from ...core.plan import ForwardPlan, plan_for
from ...kernels.backend import KernelBuildError


class FusedAttention(PackPatch):
    """``Attention.forward`` of an H3 DiTBlock with comfy-kitchen's ``rms_rope_split_half_`` replaced by the
    bit-identical RMSNorm + RoPE kernel (kernels/cuda_ops.py ``rms_rope_split_half_``) (one read and one write of q
    and k instead of two reads).

    Everything else is ComfyUI's sequence: qkv_proj (the fused pack when patched), q/k/v views of its output, the
    attention function the block's own module imports (``optimized_attention``: the user's backend, overrides and
    sparse attention), ``AttentionTensorContainer`` boxes, out_proj. ``qkv_source`` (from ``FusedDiTBlock``) makes
    qkv_proj read the norm input and normalize / modulate on the fly.
    """

    def __init__(self, attn, name: str, qkv: FusedNVFP4Linear | None):
        self.attn = attn
        self.name = name
        self.qkv = qkv
        self.stock_forward = type(attn).forward.__get__(attn)
        module = sys.modules.get(type(attn).__module__)
        self.attention_function = getattr(module, "optimized_attention", None)
        self.container = getattr(module, "AttentionTensorContainer", None)
        self.counts = collections.Counter()  # calls by path ("rms_rope": the fused kernel ran); tests read them

    def _project_qkv(self, x, qkv_source, plan):
        if qkv_source is None:
            return self.attn.qkv_proj(x)
        if self.qkv is None:  # qkv_proj is not an NVFP4 layer: ComfyUI's modulated input, its own Linear
            return self.attn.qkv_proj(qkv_source.stock())
        return self.qkv(x, source=qkv_source, plan=plan)

    def _rope(self, q, k, rope_freqs, x, plan: ForwardPlan):
        attn = self.attn
        qw = comfy_adapter.cast_to(attn.q_norm.weight, x.device)
        kw = comfy_adapter.cast_to(attn.k_norm.weight, x.device)
        rot = rope_freqs.shape[-3] * 2
        reason = plan.refusal("rms_rope") or plan.backend.rms_rope_support(q, k, rope_freqs, qw, kw, rot)
        if reason is None:
            try:
                plan.backend.rms_rope_split_half_(q, k, rope_freqs, qw, kw, attn.q_norm.eps, rot)
                self.counts["rms_rope"] += 1
                return
            except KernelBuildError as exc:  # the kernel did not build or launch; q and k are untouched
                reason = f"kernel failed: {exc}"
        note_fallback(f"{self.name} RMSNorm+RoPE", reason)
        comfy_adapter.rms_rope_split_half_(q, k, rope_freqs, qw, kw, attn.q_norm.eps, rot)

    def __call__(self, x, rope_freqs=None, transformer_options={}, *, qkv_source=None, plan: ForwardPlan | None = None):
        attn = self.attn
        if rope_freqs is None or self.attention_function is None or comfy_adapter.in_training():
            h = qkv_source.stock() if qkv_source is not None else x
            return self.stock_forward(h, rope_freqs=rope_freqs, transformer_options=transformer_options)
        s = x.shape[0]
        heads, head_dim = attn.heads, attn.head_dim
        plan = plan if plan is not None else plan_for(x.device)
        q, k, v = self._project_qkv(x, qkv_source, plan).split(heads * head_dim, dim=-1)
        q = q.view(1, s, heads, head_dim)
        k = k.view(1, s, heads, head_dim)
        self._rope(q, k, rope_freqs, x, plan)
        boxes = self.container or (lambda t: t)
        preferred = getattr(attn, "comfy_attention", None)
        if (transformer_options or {}).get("optimized_attention_override") is None:
            # Token-major [1, S, H*D] views (ComfyUI's usual calling convention, skip_reshape=False): every backend
            # reshapes them without a copy. SageAttention then runs its NHD path and returns [1, S, H, D], out_proj's
            # input as is; PyTorch SDPA receives the same [1, H, S, D] views as stock.
            inner = heads * head_dim
            q, k, v = (boxes(t.reshape(1, s, inner)) for t in (q, k, v.view(1, s, heads, head_dim)))
            out = self.attention_function(q, k, v, heads, preferred_attention=preferred, mask=None,
                                          skip_reshape=False, transformer_options=transformer_options)
        else:  # another node's override gets exactly the stock call (head-major views, skip_reshape=True)
            q = boxes(q[0].transpose(0, 1).unsqueeze(0))
            k = boxes(k[0].transpose(0, 1).unsqueeze(0))
            v = boxes(v.view(s, heads, head_dim).transpose(0, 1).unsqueeze(0))
            out = self.attention_function(q, k, v, heads, preferred_attention=preferred, mask=None,
                                          skip_reshape=True, transformer_options=transformer_options)
        return attn.out_proj(out.squeeze(0))
