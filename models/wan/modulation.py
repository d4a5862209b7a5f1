"""Wan's modulation rows as the kernels read them: ComfyUI's ``e = cast(block.modulation) + e`` as six ``[rows, D]``
tables (views of ComfyUI's own sum), and the table row of every token, ComfyUI's ``repeat_e`` applied to row numbers
(one row per batch item, or per batch item and latent frame when Wan 2.2 5B gets a timestep per frame), built once per
forward as the toolkit's row index (blocks/row_index.py).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import comfy_adapter
from ...blocks.row_index import RowIndexCache
from ...layout import AddcmulModulation


@dataclasses.dataclass
class Tables:
    """One block's modulation: ``chunks[i]`` is ComfyUI's ``e[i]`` (``[B, 1, D]`` or ``[B, F, D]``), ``rows[i]`` the
    same values as a ``[B F, D]`` table; ``index``: int32 [B L], the table row of every token."""

    chunks: list[torch.Tensor]
    rows: list[torch.Tensor]
    index: torch.Tensor

    def modulation(self, shift: int, scale: int) -> AddcmulModulation:
        """ComfyUI's ``addcmul(e[shift], n, 1 + e[scale])`` applied on the fly."""
        return AddcmulModulation(self.rows[scale], self.rows[shift], self.index)


def modulation_tables(block, e: torch.Tensor, x: torch.Tensor, index: torch.Tensor) -> Tables:
    """ComfyUI's ``cast_to(block.modulation, x.dtype, x.device) + e`` (``e``: [B, 6, D] or [B, F, 6, D]), its six
    chunks as ComfyUI's block takes them, and the same values as tables."""
    modulation = comfy_adapter.cast_to(block.modulation, x.device, x.dtype)
    if e.ndim < 4:
        chunks = list((modulation + e).chunk(6, dim=1))
    else:
        chunks = list((modulation.unsqueeze(0) + e).unbind(2))
    return Tables(chunks, [c.reshape(-1, c.shape[-1]) for c in chunks], index)


def frames_of(e: torch.Tensor) -> int:
    return e.shape[1] if e.ndim == 4 else 1


def token_rows(repeat_e, batch: int, frames: int, tokens: int) -> torch.Tensor:
    """int32 [batch tokens] (CPU): the modulation row (b frames + f) of every token, as ``repeat_e`` (ComfyUI's, from
    the block's module) spreads ``e`` over the tokens. Raises ValueError where it does not give every token one row
    (ComfyUI's block would not broadcast either)."""
    rows = torch.arange(batch * frames, dtype=torch.int32).view(batch, frames, 1)
    repeated = repeat_e(rows, torch.empty((batch, tokens, 0)))  # repeat_e reads the token count only
    if tuple(repeated.shape) not in ((batch, 1, 1), (batch, tokens, 1)):
        raise ValueError(f"repeat_e spreads {frames} modulation rows over {tokens} tokens as {tuple(repeated.shape)}")
    return repeated.expand(batch, tokens, 1).reshape(-1).to(torch.int32).contiguous()


class TokenRowCache(RowIndexCache):
    """The row index of the current forward (every block shares it), rebuilt when its shape changes."""

    def index(self, repeat_e, e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, frames = x.shape[0], x.shape[1], frames_of(e)
        key = (repeat_e, batch, frames, tokens, str(x.device))
        return self.get(key, x.device, lambda: (token_rows(repeat_e, batch, frames, tokens), ()))
