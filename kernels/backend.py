"""The interface both implementations of the fused ops declare, and the choice between them.

``FusedOps`` is what the core and the model fusions call: the CUDA kernels (kernels/cuda_ops.py) on a CUDA device,
their Python twin (kernels/twin_ops.py) elsewhere. Every op reproduces ComfyUI's stock ops bit for bit; each
``*_support`` returns None when the implementation takes these tensors, else the reason the caller logs before
running ComfyUI's own op. :func:`backend_for` picks the implementation once per device (core/plan.py resolves it
once per forward).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..layout import AddcmulModulation, LayerNorm, Modulation, PackedActivation, RmsNorm
from . import cuda_ops, runtime, twin_ops


class FusedOps(Protocol):
    def pack_support(self, x: torch.Tensor, *, swiglu: bool = False, modulation: Modulation | None = None,
                     norm: RmsNorm | None = None, prescale: torch.Tensor | None = None,
                     up: torch.Tensor | None = None, layer_norm: LayerNorm | None = None,
                     addcmul_modulation: AddcmulModulation | None = None, gelu: bool = False) -> str | None: ...

    def pack_nvfp4(self, x: torch.Tensor, *, static_scale: torch.Tensor | None = None,
                   global_scale: torch.Tensor | None = None, weight_scale_2: torch.Tensor | None = None,
                   swiglu: bool = False, modulation: Modulation | None = None, norm: RmsNorm | None = None,
                   prescale: torch.Tensor | None = None, up: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, layer_norm: LayerNorm | None = None,
                   addcmul_modulation: AddcmulModulation | None = None, gelu: bool = False) -> PackedActivation: ...

    def rms_norm_support(self, x: torch.Tensor, weight: torch.Tensor) -> str | None: ...

    def norm_statistics(self, x: torch.Tensor, norm: RmsNorm, *, modulation: Modulation | None = None,
                        global_scale_out: torch.Tensor | None = None) -> None: ...

    def residual_support(self, x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor, *,
                         next_norm: RmsNorm | None = None) -> str | None: ...

    def gated_residual_(self, x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor, mod_index: torch.Tensor, *,
                        next_norm: RmsNorm | None = None, next_modulation: Modulation | None = None,
                        global_scale_out: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def post_norm_residual_support(self, x: torch.Tensor, other: torch.Tensor, other_weight: torch.Tensor,
                                   gate: torch.Tensor | None = None, *, next_norm: RmsNorm | None = None,
                                   next_modulation: Modulation | None = None,
                                   x_from: torch.Tensor | None = None) -> str | None: ...

    def post_norm_residual_(self, x: torch.Tensor, other: torch.Tensor, other_weight: torch.Tensor, other_eps: float,
                            gate: torch.Tensor | None, mod_index: torch.Tensor | None, *,
                            next_norm: RmsNorm | None = None, next_modulation: Modulation | None = None,
                            global_scale_out: torch.Tensor | None = None,
                            x_from: torch.Tensor | None = None) -> torch.Tensor: ...

    def rms_rope_support(self, q, k, freqs, q_weight, k_weight, rot_dim) -> str | None: ...

    def rms_rope_split_half_(self, q, k, freqs, q_weight, k_weight, epsilon: float, rot_dim: int) -> None: ...

    # the row ops of a LayerNorm block (Wan), bf16 and fp16
    def layer_norm_support(self, x: torch.Tensor, norm: LayerNorm, *, modulation: AddcmulModulation | None = None,
                           global_scale_out: torch.Tensor | None = None) -> str | None: ...

    def layer_norm_statistics(self, x: torch.Tensor, norm: LayerNorm, *,
                              modulation: AddcmulModulation | None = None,
                              global_scale_out: torch.Tensor | None = None) -> None: ...

    def residual_layer_norm_support(self, x: torch.Tensor, other: torch.Tensor, next_norm: LayerNorm, *,
                                    gate: torch.Tensor | None = None, mod_index: torch.Tensor | None = None,
                                    out: torch.Tensor | None = None,
                                    next_modulation: AddcmulModulation | None = None,
                                    global_scale_out: torch.Tensor | None = None) -> str | None: ...

    def residual_layer_norm_(self, x: torch.Tensor, other: torch.Tensor, next_norm: LayerNorm, *,
                             gate: torch.Tensor | None = None, mod_index: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, next_modulation: AddcmulModulation | None = None,
                             global_scale_out: torch.Tensor | None = None) -> torch.Tensor: ...

    def rms_norm_rope_support(self, q: torch.Tensor, k: torch.Tensor | None, q_weight: torch.Tensor,
                              k_weight: torch.Tensor | None, *, freqs: torch.Tensor | None = None,
                              positions: int | None = None) -> str | None: ...

    def rms_norm_rope_(self, q: torch.Tensor, k: torch.Tensor | None, q_weight: torch.Tensor,
                       k_weight: torch.Tensor | None, eps: float, *, freqs: torch.Tensor | None = None,
                       positions: int | None = None): ...


KernelBuildError = runtime.KernelBuildError


def backend_for(device: torch.device) -> FusedOps:
    """The CUDA kernels for a CUDA device (built or loaded from the cache now), the Python twin elsewhere.

    Raises :class:`KernelBuildError` when the kernels cannot be built for this GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        cuda_ops.module_for(device)
        return cuda_ops
    return twin_ops
