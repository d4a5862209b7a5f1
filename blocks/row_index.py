"""The table row of every token as an int32 index on the device, built once per forward without waiting for the GPU.

A block's modulation and gate tables hold one row per timestep / batch entry / token kind; the kernels read the row
of token r from ``index[r]``. Every block of a forward shares one index: :class:`RowIndexCache` rebuilds it only when
the key its family derives from the call's arguments changes.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

# A family's description of the index: the host part (int32 [rows], on the CPU) and the ranges whose rows come from
# device tensors already (a per-token row tensor of ComfyUI's), copied in on the stream.
IndexBuild = Callable[[], "tuple[torch.Tensor, Sequence[tuple[int, int, torch.Tensor]]]"]


class RowIndexCache:
    """int32 row indices on the device, one per key: the last key's index is kept (a forward's blocks share it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key = None
        self._value = None

    def get(self, key, device: torch.device, build: IndexBuild) -> torch.Tensor:
        with self._lock:
            if self._key != key:
                host, device_ranges = build()
                if device.type == "cuda":
                    host = host.pin_memory()
                    index = host.to(device, non_blocking=True)
                else:
                    index = host
                for a, b, rows in device_ranges:
                    index[a:b].copy_(rows.to(device=device, dtype=torch.int32, non_blocking=True))
                # Keep the pinned source (a CUDA graph may replay the copy) and the device row tensors (their ids can
                # be part of the key) alive with the index.
                self._key, self._value = key, (index, host, [t for _, _, t in device_ranges])
            return self._value[0]
