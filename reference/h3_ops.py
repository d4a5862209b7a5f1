"""ComfyUI's stock MiniMax H3 elementwise ops around the NVFP4 Linears, op for op.

These are the definitions the fused kernels must reproduce bit for bit (kernels/nvfp4_pack.cu states the same
arithmetic in fp32 with explicit bf16 roundings), and the exact fallback whenever a fused kernel cannot take a
call. They mirror comfy/ldm/minimax/model.py (``_mod_scale_shift``, ``_mod_gate``) and comfy/ops.py
(``linear_input_act(..., "swiglu")``): same ops, same order, same dtypes.

``mod_segments`` is ComfyUI's list of ``(start, stop, row)``: ``row`` is a modulation-row index or a per-token
LongTensor of row indices (denoise masks).
"""

from __future__ import annotations

import torch


def mod_row(table: torch.Tensor, row, dtype: torch.dtype) -> torch.Tensor:
    return table[row].to(dtype)


def modulate_(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment: ``h.mul_(1 + scale[row]).add_(shift[row])`` -- three bf16 roundings."""
    for a, b, row in segments:
        h[a:b].mul_(1.0 + mod_row(scale, row, h.dtype)).add_(mod_row(shift, row, h.dtype))
    return h


def gated_residual_(x: torch.Tensor, gate: torch.Tensor, other: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment: ``x.addcmul_(other, gate[row])`` (torch: one fp32 fma, one bf16 rounding)."""
    for a, b, row in segments:
        x[a:b].addcmul_(other[a:b], mod_row(gate, row, x.dtype))
    return x


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with gate the first half of the last dim; silu and the product each round to bf16."""
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


def modulation_index(segments, rows: int) -> torch.Tensor:
    """int32 [rows] modulation row of every token (CPU tensor), from ComfyUI's segment list."""
    index = torch.empty(rows, dtype=torch.int32)
    covered = 0
    for a, b, row in segments:
        if a != covered:
            raise ValueError(f"modulation segments must cover the sequence contiguously; gap at row {covered}")
        index[a:b] = row.to(torch.int32).cpu() if isinstance(row, torch.Tensor) else int(row)
        covered = b
    if covered != rows:
        raise ValueError(f"modulation segments cover {covered} of {rows} rows")
    return index
