"""Where each token's adaLN modulation row comes from in MiniMax H3: ComfyUI's ``mod_segments`` (``(a, b, row)`` per
segment, ``row`` an int or a per-token row tensor) as the int32 row index of blocks/row_index.py, built once per
forward (every block of a forward shares the segment list).
"""

from __future__ import annotations

import torch

from ...blocks.row_index import RowIndexCache
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


def segments_key(segments, rows: int, device) -> tuple:
    parts = []
    for a, b, row in segments:
        if isinstance(row, torch.Tensor):
            parts.append((a, b, id(row), row.data_ptr(), tensor_version(row)))
        else:
            parts.append((a, b, int(row)))
    return (rows, str(device), tuple(parts))


class ModulationIndexCache(RowIndexCache):
    """The row index of ComfyUI's ``mod_segments``, rebuilt only when the segments change."""

    def index(self, segments, rows: int, device: torch.device) -> torch.Tensor:
        return self.get(segments_key(segments, rows, device), device, lambda: (
            modulation_index(segments, rows), [(a, b, r) for a, b, r in segments if isinstance(r, torch.Tensor)]))


def bf16_table(table: torch.Tensor) -> torch.Tensor:
    # ComfyUI converts each gathered modulation row with .to(x.dtype); converting the whole table rounds the same.
    return table if table.dtype == torch.bfloat16 else table.to(torch.bfloat16)
