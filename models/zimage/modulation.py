"""Which adaLN row ComfyUI's lumina ``modulate`` / ``apply_gate`` apply to each token of a Z-Image block, as the
int32 row index the fused kernels read (one row per token, no per-slice launches)."""

from __future__ import annotations

import torch


def adaln_row_index(batch: int, tokens: int, table_rows: int, timestep_zero_index=None) -> torch.Tensor:
    """int32 ``[batch * tokens]`` (row-major tokens of a ``[batch, tokens, D]`` activation): the row of the
    ``[table_rows, D]`` adaLN table (scale, or tanh of a gate) that ComfyUI multiplies token ``(b, s)`` with.

    Without ``timestep_zero_index`` ComfyUI broadcasts ``table.unsqueeze(1)`` over the tokens: row ``b`` (one row per
    batch entry) or row 0 (a single row). With it (omni / reference images) the table holds ``2 n`` rows; tokens inside
    one of its ``(start, end)`` slices are multiplied in place by rows ``n..2n-1`` and every other token by rows
    ``0..n-1`` (``invert_slices``), again per batch entry or broadcast from one row.

    Raises ValueError where ComfyUI's sequence is not one row per token: slices that overlap (their tokens are
    multiplied twice) or that Python slicing would read from the end (negative or reversed bounds), and tables that
    do not broadcast over the batch.
    """
    if timestep_zero_index is None:
        if table_rows not in (1, batch):
            raise ValueError(f"{table_rows} adaLN rows do not broadcast over a batch of {batch}")
        rows = torch.arange(batch, dtype=torch.int32) if table_rows == batch else torch.zeros(batch, dtype=torch.int32)
        return rows.repeat_interleave(tokens)
    half = table_rows // 2
    if table_rows % 2 or half not in (1, batch):
        raise ValueError(f"timestep_zero_index needs 2 x {batch} (or 2) adaLN rows, got {table_rows}")
    inside = torch.zeros(tokens, dtype=torch.bool)
    covered_to = 0
    for start, end in sorted((int(a), int(b)) for a, b in timestep_zero_index):
        if not 0 <= start <= end:
            raise ValueError(f"timestep_zero_index slice ({start}, {end}) is not a forward range from 0")
        start, end = min(start, tokens), min(end, tokens)
        if start == end:
            continue
        if start < covered_to:
            raise ValueError(f"timestep_zero_index slices overlap at token {start}: ComfyUI multiplies those twice")
        inside[start:end] = True
        covered_to = end
    per_batch = torch.arange(batch, dtype=torch.int32) if half == batch else torch.zeros(batch, dtype=torch.int32)
    return (per_batch[:, None] + half * inside.to(torch.int32)[None, :]).reshape(-1)
