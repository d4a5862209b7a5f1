"""Where each token's adaLN modulation row comes from: ComfyUI's ``mod_segments`` turned into an int32 row index on
the device, built once per forward (every block of a forward shares the segment list) without waiting for the GPU.
"""

from __future__ import annotations

import threading

import torch

from ...layout import tensor_version


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


def bf16_table(table: torch.Tensor) -> torch.Tensor:
    # ComfyUI converts each gathered modulation row with .to(x.dtype); converting the whole table rounds the same.
    return table if table.dtype == torch.bfloat16 else table.to(torch.bfloat16)
