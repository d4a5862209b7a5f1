"""``MLP.forward`` of ComfyUI's MiniMax H3 blocks with SwiGLU folded into fc2's pack (object patch)."""

from __future__ import annotations

import torch

from ... import comfy_adapter
from ...core.linear import FusedNVFP4Linear, LinearSource, PackPatch
from ...core.plan import ForwardPlan


class FusedSwigluMLP(PackPatch):
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
        return comfy_adapter.eager_swiglu(y)

    def __call__(self, x: torch.Tensor, *, fc1_source: LinearSource | None = None, plan: ForwardPlan | None = None):
        if self.fc1 is not None:
            y = self.fc1(x, source=fc1_source, plan=plan)
        else:
            y = self.mlp.fc1(fc1_source.stock() if fc1_source is not None else x)
        if self.fc2 is None:
            return self.mlp.fc2(self.stock_swiglu(y))
        return self.fc2(y, swiglu=True, stock=lambda: self.stock_swiglu(y), plan=plan)
