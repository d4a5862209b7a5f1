"""What an NVFP4 Linear's pack reads its input through, as the H3 block describes it to the core's Linear."""

from __future__ import annotations

import torch

from ...layout import Modulation, RmsNorm


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
