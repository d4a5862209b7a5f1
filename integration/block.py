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
to memory, and every layout stays ComfyUI's. Each fused op reproduces ComfyUI's arithmetic bit for bit (kernels/
nvfp4_pack.cu says how); the first patched block of a model checks that on the real input (integration/
selfcheck.py). RMSNorm folding needs torch's CUDA ``rms_norm`` arithmetic reproduced for the running torch;
where the self-check finds it does not hold, torch's norm runs and the kernels read its output.

Fallbacks: a call the kernels cannot take runs ComfyUI's own code for that step (the block's module helpers
``_mod_scale_shift`` / ``_mod_gate``, the stock forwards), with the reason logged once. Tensors off the GPU go
through reference/fused_ops.py, the Python twin of the kernels (tests).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading

import torch

from ..kernels import runtime
from ..layout import Modulation, RmsNorm
from .calibrate import RecordingForward, recording_paused
from .linear import FusedNVFP4Linear, allocation_context, backend_for, note_fallback
from . import selfcheck

# Rows of the real input the first patched block compares stock vs fused on (bounded extra memory, every
# segment kind of the packed sequence still present: text, audio and the start of the video).
BLOCK_CHECK_ROWS = 4096


def modulation_index(segments, rows: int) -> torch.Tensor:
    """int32 [rows] modulation row of every token (CPU tensor; per-token row tensors are filled in later)."""
    index = torch.empty(rows, dtype=torch.int32)
    covered = 0
    for a, b, row in segments:
        if a != covered:
            raise ValueError(f"modulation segments must cover the sequence contiguously; gap at row {covered}")
        index[a:b] = 0 if isinstance(row, torch.Tensor) else int(row)
        covered = b
    if covered != rows:
        raise ValueError(f"modulation segments cover {covered} of {rows} rows")
    return index


class ModulationIndexCache:
    """int32 per-token modulation rows on the device, built once per forward (all blocks of a forward share the
    segment list) from ComfyUI's ``mod_segments``, without waiting for the GPU."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key = None
        self._value = None

    @staticmethod
    def _key_of(segments, rows, device):
        parts = []
        for a, b, row in segments:
            if isinstance(row, torch.Tensor):
                parts.append((a, b, id(row), row.data_ptr(), tensor_version(row)))
            else:
                parts.append((a, b, int(row)))
        return (rows, str(device), tuple(parts))

    def get(self, segments, rows: int, device: torch.device) -> torch.Tensor:
        key = self._key_of(segments, rows, device)
        with self._lock:
            if self._key != key:
                host = modulation_index(segments, rows)
                if device.type == "cuda":
                    host = host.pin_memory()
                    index = host.to(device, non_blocking=True)
                else:
                    index = host
                for a, b, r in segments:
                    if isinstance(r, torch.Tensor):
                        index[a:b].copy_(r.to(device=device, dtype=torch.int32, non_blocking=True))
                # Keep the pinned source (a CUDA graph may replay the copy) and the segment tensors (their ids are
                # part of the key) alive with the index.
                self._key, self._value = key, (index, host, [r for _, _, r in segments if isinstance(r, torch.Tensor)])
            return self._value[0]


def tensor_version(t: torch.Tensor):
    """``t._version``, or None for inference tensors (which track no version; ComfyUI samples in inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _bf16_table(table: torch.Tensor) -> torch.Tensor:
    # ComfyUI converts each gathered modulation row with .to(x.dtype); converting the whole table rounds the same.
    return table if table.dtype == torch.bfloat16 else table.to(torch.bfloat16)


def _in_training() -> bool:
    try:
        import comfy.model_management

        return bool(getattr(comfy.model_management, "in_training", False))
    except ImportError:
        return False


def _cast_weight(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    try:
        import comfy.model_management

        return comfy.model_management.cast_to(weight, device=device)
    except ImportError:
        return weight.to(device)


@contextlib.contextmanager
def _cast_norm_weight(norm, x: torch.Tensor):
    """The weight of a ComfyUI RMSNorm the way its forward obtains it (offloaded or dynamic-VRAM weights)."""
    try:
        import comfy.ops

        context = comfy.ops.CastBiasWeightContext if getattr(norm, "comfy_cast_weights", False) else None
    except (ImportError, AttributeError):
        context = None
    if context is None:
        yield norm.weight.to(device=x.device)
    else:
        with context(norm, x, offloadable=True) as (weight, _):
            yield weight


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class FusedAttention:
    """``Attention.forward`` of an H3 DiTBlock with comfy-kitchen's ``rms_rope_split_half_`` replaced by the
    bit-identical kernels/h3_rms_rope.cu (one read and one write of q and k instead of two reads).

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

    def _project_qkv(self, x, qkv_source):
        if qkv_source is None:
            return self.attn.qkv_proj(x)
        if self.qkv is None:  # qkv_proj is not an NVFP4 layer: ComfyUI's modulated input, its own Linear
            return self.attn.qkv_proj(qkv_source.stock())
        return self.qkv(x, source=qkv_source)

    def _rope(self, q, k, rope_freqs, x):
        attn = self.attn
        qw = _cast_weight(attn.q_norm.weight, x.device)
        kw = _cast_weight(attn.k_norm.weight, x.device)
        rot = rope_freqs.shape[-3] * 2
        backend = backend_for(x)
        reason = selfcheck.op_refusal(x.device, "rms_rope") or backend.rms_rope_support(q, k, rope_freqs, qw, kw, rot)
        if reason is None:
            try:
                backend.rms_rope_split_half_(q, k, rope_freqs, qw, kw, attn.q_norm.eps, rot)
                self.counts["rms_rope"] += 1
                return
            except runtime.KernelBuildError as exc:  # the kernel did not build or launch; q and k are untouched
                reason = f"kernel failed: {exc}"
        note_fallback(f"{self.name} RMSNorm+RoPE", reason)
        import comfy_kitchen as ck

        ck.rms_rope_split_half_(q, k, rope_freqs, qw, kw, epsilon=attn.q_norm.eps, rot_dim=rot)

    def __call__(self, x, rope_freqs=None, transformer_options={}, *, qkv_source=None):
        attn = self.attn
        if rope_freqs is None or self.attention_function is None or _in_training():
            h = qkv_source.stock() if qkv_source is not None else x
            return self.stock_forward(h, rope_freqs=rope_freqs, transformer_options=transformer_options)
        s = x.shape[0]
        heads, head_dim = attn.heads, attn.head_dim
        q, k, v = self._project_qkv(x, qkv_source).split(heads * head_dim, dim=-1)
        q = q.view(1, s, heads, head_dim)
        k = k.view(1, s, heads, head_dim)
        self._rope(q, k, rope_freqs, x)
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


class LinearSource:
    """What an NVFP4 Linear's pack reads its input through: the raw tensor the caller passes, normalized
    (``norm``: RMSNorm statistics already computed on the stream) and/or modulated, with the global scale already
    reduced on the device (``global_scale``) or not. ``stock()`` rebuilds the layer input with ComfyUI's own code
    when the fused path refuses."""

    def __init__(self, stock, *, modulation: Modulation | None = None, norm: RmsNorm | None = None,
                 global_scale: torch.Tensor | None = None):
        self.stock = stock
        self.modulation = modulation
        self.norm = norm
        self.global_scale = global_scale


class FusedSwigluMLP:
    """``MLP.forward``: ``fc2(silu(gate) * up)`` with the SwiGLU computed inside fc2's reduction and pack.

    ``fc1_source`` lets the block hand fc1 its normalized / modulated input description."""

    def __init__(self, mlp, name: str, fc1: FusedNVFP4Linear | None, fc2: FusedNVFP4Linear | None):
        self.mlp = mlp
        self.name = name
        self.fc1 = fc1
        self.fc2 = fc2
        self.stock_forward = type(mlp).forward.__get__(mlp)

    @staticmethod
    def stock_swiglu(y):
        """fc2's input, SwiGLU of fc1's output, computed by ComfyUI's own eager activation."""
        try:
            import comfy.ops

            if hasattr(comfy.ops, "_eager_input_act"):
                return comfy.ops._eager_input_act(y, "swiglu")
        except ImportError:
            pass
        gate, up = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).mul_(up)

    def __call__(self, x: torch.Tensor, *, fc1_source: LinearSource | None = None):
        if self.fc1 is not None:
            y = self.fc1(x, source=fc1_source)
        else:
            y = self.mlp.fc1(fc1_source.stock() if fc1_source is not None else x)
        if self.fc2 is None:
            return self.mlp.fc2(self.stock_swiglu(y))
        return self.fc2(y, swiglu=True, stock=lambda: self.stock_swiglu(y))


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


class FusedDiTBlock:
    """``DiTBlock.forward`` with modulation, RMSNorm, SwiGLU and the gated residuals fused (module docstring)."""

    def __init__(self, block, name: str, index: int, attention: FusedAttention, mlp: FusedSwigluMLP,
                 state: ModelState):
        self.block = block
        self.name = name
        self.index = index
        self.attention = attention
        self.mlp = mlp
        self.state = state
        self.next: FusedDiTBlock | None = None  # set by integration/patch.py when block index + 1 is patched too
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

    def refusal(self, x) -> str | None:
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            return f"input {tuple(x.shape)} {x.dtype} is not a 2-D bfloat16 token matrix"
        if torch.compiler.is_compiling():
            return "inside torch.compile (the stock block is traced instead)"
        if _in_training():
            return "ComfyUI is training"
        try:
            backend_for(x)  # builds the kernels on first use
        except runtime.KernelBuildError as exc:
            return f"kernels unavailable: {exc}"
        if self.state.block_check == "failed":
            return f"the block self-check failed: {self.state.block_check_detail}"
        return selfcheck.op_refusal(x.device, "block")

    def _fold_norm(self, x, norm) -> str | None:
        """None if RMSNorm ``norm`` can be folded into the kernels for this input, else why not."""
        if getattr(norm, "weight", None) is None or tuple(getattr(norm, "normalized_shape", ())) != (x.shape[1],):
            return "the norm has no weight over the hidden size"
        if getattr(norm, "weight_function", None) or getattr(norm, "bias_function", None):
            return "the norm weight is patched on the fly"
        reason = selfcheck.op_refusal(x.device, "rms_norm")
        if reason is None:
            reason = backend_for(x).rms_norm_support(x, norm.weight)
        return reason

    def _norm_weight(self, norm, x, name) -> torch.Tensor:
        """bf16 norm weight valid for the rest of this forward: the resident parameter itself, or a copy in a
        persistent buffer when ComfyUI's cast hands out a temporary (offloaded weights)."""
        with _cast_norm_weight(norm, x) as w:
            own = getattr(norm, "weight", None)
            if own is not None and w.data_ptr() == own.data_ptr() and w.dtype == torch.bfloat16:
                return w
            key = ("weight", name, w.shape[0], x.device)
            buf = self._workspace.get(key)
            if buf is None:
                with allocation_context():
                    buf = self._workspace.setdefault(key, torch.empty(w.shape[0], dtype=torch.bfloat16, device=x.device))
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
        reason = self.refusal(x)
        if reason is None and self.state.block_check == "pending":
            if _capturing(x):
                reason = "the block self-check waits for a call outside CUDA-graph capture"
            else:
                return self._block_check(x, t_emb, mod_segments, rope_freqs, transformer_options, attention)
        if reason is not None:
            note_fallback(self.name, reason)
            self._drop_handoff()
            return self.stock_forward(x, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options,
                                      attention=attention)
        return self.fused_forward(x, t_emb, mod_segments, rope_freqs, transformer_options, attention)

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
            return "ComfyUI prefetches the next block's weights (dynamic VRAM)"
        if (transformer_options or {}).get("block_index", self.index) != self.index:
            return "the block is not called from the model's block loop"
        return None

    def fused_forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options, attention, *, handoff=True):
        block = self.block
        backend = backend_for(x)
        incoming = self._take_handoff(x, t_emb, mod_segments)
        self.counts["fused"] += 1
        self.counts["handoff_in"] += incoming is not None
        if incoming is not None:
            rows, activated = incoming.rows, incoming.activated_t_emb
        else:
            activated = torch.nn.functional.silu(t_emb) if silu_reusable(block.adaln_proj) else None
            rows = adaln_rows(block.adaln_proj, t_emb, activated)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = rows
        index = self.state.index_cache.get(mod_segments, x.shape[0], x.device)
        mod_msa = Modulation(_bf16_table(scale_msa), _bf16_table(shift_msa), index)
        mod_mlp = Modulation(_bf16_table(scale_mlp), _bf16_table(shift_mlp), index)

        # ---- attention half
        if attention is None:
            h, source = self._norm_source(backend, x, block.norm1, mod_msa, "norm1", self.attention.qkv, incoming,
                                          lambda n: self.mod_scale_shift(n, shift_msa, scale_msa, mod_segments))
            out = self.attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options, qkv_source=source)
        else:  # another node replaced the attention (e.g. sparse attention): it needs the modulated tensor
            h = self.mod_scale_shift(block.norm1(x), shift_msa, scale_msa, mod_segments)
            out = attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options)

        # ---- residual 1, with norm2's statistics and fc1's amax when norm2 folds
        fold2 = self._fold_norm(x, block.norm2)
        next_norm = None
        if fold2 is None:
            rstd, scalars = self._buffers(x, "norm2")
            next_norm = RmsNorm(self._norm_weight(block.norm2, x, "norm2"), float(block.norm2.eps), rstd)
            fc1_dynamic = self.mlp.fc1 is not None and self.mlp.fc1.dynamic_scale()
            done = self._residual(backend, x, gate_msa, out, mod_segments, index, next_norm, mod_mlp,
                                  scalars[0:1] if fc1_dynamic else None)
            if done:
                self.counts["norm2"] += 1
            else:
                next_norm = None
            g_fc1 = scalars[0:1] if (next_norm is not None and fc1_dynamic) else None
        else:
            note_fallback(f"{self.name}.norm2", f"torch's RMSNorm runs: {fold2}")
            self._residual(backend, x, gate_msa, out, mod_segments, index, None, None, None)
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
        out = self.mlp(mlp_input, fc1_source=fc1_source)

        # ---- residual 2, with the next block's norm1 statistics and qkv amax where that block is ours
        if handoff:
            reason = self._handoff_refusal(transformer_options, attention)
            if reason is None:
                reason = self.next._fold_norm(x, self.next.block.norm1)
            if reason is None:
                return self._residual_with_handoff(backend, x, gate_mlp, out, mod_segments, index, t_emb, activated)
            note_fallback(f"{self.name} -> next block hand-over", reason)
        self._residual(backend, x, gate_mlp, out, mod_segments, index, None, None, None)
        return x

    def _residual_with_handoff(self, backend, x, gate, out, mod_segments, index, t_emb, activated):
        nxt = self.next
        reusable = silu_reusable(nxt.block.adaln_proj)
        with allocation_context():
            if activated is None and reusable:
                activated = torch.nn.functional.silu(t_emb)
            # t_emb only: block i + 1 uses these rows; silu(t_emb) is passed on even where this module cannot use it
            rows = adaln_rows(nxt.block.adaln_proj, t_emb, activated if reusable else None)
        mod = Modulation(_bf16_table(rows[1]), _bf16_table(rows[0]), index)
        rstd, scalars = nxt._buffers(x, "norm1")
        qkv_dynamic = nxt.attention.qkv is not None and nxt.attention.qkv.dynamic_scale()
        norm = RmsNorm(nxt._norm_weight(nxt.block.norm1, x, "norm1"), float(nxt.block.norm1.eps), rstd)
        done = self._residual(backend, x, gate, out, mod_segments, index, norm, mod,
                              scalars[0:1] if qkv_dynamic else None)
        if done:
            self.counts["handoff_out"] += 1
            self.state.handoff = (nxt.index, self._handoff_key(x, t_emb, mod_segments),
                                  Handoff(rows, norm, scalars[0:1] if qkv_dynamic else None, activated))
        return x

    def _norm_source(self, backend, x, norm, modulation, name, layer, incoming, modulate):
        """Input and source of the projection after ``norm``: ``x`` normalized on the fly (statistics from the
        previous block's residual or one statistics pass here), or torch's norm output modulated on the fly.
        ``modulate(n)`` is ComfyUI's modulation of a norm output (the stock input when the projection refuses)."""
        reason = self._fold_norm(x, norm)
        if reason is None and incoming is not None:
            self.counts[name] += 1
            return x, LinearSource(lambda: modulate(norm(x)), modulation=modulation, norm=incoming.norm,
                                   global_scale=incoming.global_scale)
        if reason is None:
            rstd, scalars = self._buffers(x, name)
            dynamic = layer is not None and layer.dynamic_scale()
            rms = RmsNorm(self._norm_weight(norm, x, name), float(norm.eps), rstd)
            try:
                backend.norm_statistics(x, rms, modulation=modulation,
                                        global_scale_out=scalars[0:1] if dynamic else None)
            except (runtime.KernelBuildError, ValueError) as exc:
                reason = f"norm statistics kernel failed: {exc}"
            if reason is None:
                self.counts[name] += 1
                return x, LinearSource(lambda: modulate(norm(x)), modulation=modulation, norm=rms,
                                       global_scale=scalars[0:1] if dynamic else None)
        note_fallback(f"{self.name}.{name}", f"torch's RMSNorm runs: {reason}")
        n = norm(x)
        return n, LinearSource(lambda: modulate(n), modulation=modulation)

    def _residual(self, backend, x, gate, other, mod_segments, index, next_norm, next_modulation, global_scale_out):
        """In place ``x += other * gate[row]``; with ``next_norm`` also that norm's statistics of the new x (and the
        next projection's global scale). Returns whether the statistics were produced."""
        gate16 = _bf16_table(gate)
        reason = selfcheck.op_refusal(x.device, "gated_residual")
        if reason is None:
            reason = backend.residual_support(x, other, gate16, next_norm=next_norm)
        if reason is None:
            try:
                backend.gated_residual_(x, other, gate16, index, next_norm=next_norm,
                                        next_modulation=next_modulation, global_scale_out=global_scale_out)
                self.counts["residual"] += 1
                return next_norm is not None
            except (runtime.KernelBuildError, ValueError) as exc:
                reason = f"kernel failed: {exc}"
        note_fallback(f"{self.name} gated residual", reason)
        self.mod_gate(x, gate, other, mod_segments)
        if next_norm is None:
            return False
        try:  # the statistics still save the norm's write and read
            backend.norm_statistics(x, next_norm, modulation=next_modulation, global_scale_out=global_scale_out)
            return True
        except (runtime.KernelBuildError, ValueError):
            return False

    # ---- the block self-check ------------------------------------------------------------------------------

    def _block_check(self, x, t_emb, mod_segments, rope_freqs, transformer_options, attention):
        """Run stock and fused on (a prefix of) this call's real input, compare the bytes, record the verdict;
        return the stock result of the full call. One host sync, on this call only."""
        options = {k: v for k, v in (transformer_options or {}).items() if k != "optimized_attention_override"}
        try:
            with allocation_context(), recording_paused(self.recorders()):  # the check's forwards do not count
                verdict = selfcheck.check_block(self, x, t_emb, mod_segments, rope_freqs, options, BLOCK_CHECK_ROWS)
        except Exception as exc:  # the check itself must never break the user's graph
            verdict = selfcheck.BlockVerdict(False, f"the block self-check could not run: {type(exc).__name__}: {exc}",
                                             compared=False)
        selfcheck.record_block_verdict(self.state, x.device, verdict)
        self._drop_handoff()
        with self.unpatched(keep_recording=True):
            return self.stock_forward(x, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options,
                                      attention=attention)
