"""The block check: at the first fused call of a patched model, ComfyUI's block and the fused block run on (a prefix
of) that call's real input and their outputs are compared byte for byte; that call returns ComfyUI's result.

What counts: the comparison vouches for the fused block only when every element of ComfyUI's output on the checked
rows is a finite number and not all of them are zero (:func:`proves_nothing`). A NaN or an infinity (a non-finite
input, an overflow) reaches every later op of both blocks (the row's norm, attention over all rows), so both outputs
are NaN / inf whatever the fused roundings do, and an output of zeros exercises no rounding. Such a call is not a
verdict: the model stays on ComfyUI's path for that call, nothing is stored, and the check runs again on the next.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import comfy_adapter
from ..core import verdicts
from ..core.probes import first_difference


@dataclasses.dataclass
class BlockVerdict:
    ok: bool
    detail: str
    compared: bool = True  # False: the check could not run (out of memory, say): nothing is cached
    meaningful: bool = True  # False: the checked rows proved nothing (non-finite stock output): check again later


def proves_nothing(stock: torch.Tensor) -> str | None:
    """Why equal outputs of ComfyUI's and the fused block would prove nothing about the fused arithmetic (None: a
    meaningful comparison; module docstring)."""
    finite = torch.isfinite(stock)
    if not bool(finite.all()):
        return f"ComfyUI's block output has {int((~finite).sum())} non-finite elements of {stock.numel()}"
    if not bool(stock.any()):
        return "ComfyUI's block output is all zeros"
    return None


def compare_block(fused_block, call, rows: int, plan) -> BlockVerdict:
    """ComfyUI's block against the fused route on the first ``rows`` rows of ``call`` (the family's call object:
    ``prefix(rows)``, ``fresh()``, ``x``). Two attempts: ComfyUI's first emulated GEMM call of a process can differ
    from its later ones."""
    sub = call.prefix(rows)
    detail = None
    for attempt in range(2):
        with fused_block.unpatched():
            stock = fused_block.stock_call(sub.fresh())
        reason = proves_nothing(stock)
        if reason is not None:
            return BlockVerdict(False, f"{fused_block.name}: not compared on this input ({reason}); the check runs "
                                "again on the next call", compared=False, meaningful=False)
        fused = fused_block.fused_forward(sub.fresh(), plan=plan, handoff=False)
        detail = first_difference(f"{fused_block.name} output ({sub.rows} rows)", fused, stock)
        if detail is None:
            return BlockVerdict(True, f"{fused_block.name}: {sub.rows} rows bit-identical"
                                + (" on the second comparison" if attempt else ""))
    return BlockVerdict(False, detail)


def record_block_verdict(state, device: torch.device, probe_set: str, verdict: BlockVerdict) -> None:
    """Keep the outcome with the model's state and the device's verdicts of ``probe_set`` (the family's); show it on
    the node that patched the model. A check that proved nothing leaves the model's check pending."""
    if not verdict.meaningful:
        return
    state.block_check = "passed" if verdict.ok else "failed"
    state.block_check_detail = verdict.detail
    verdicts.record_block_verdict(device, probe_set, verdict.ok, verdict.detail, verdict.compared)
    text = (("block self-check passed: " if verdict.ok else "block self-check FAILED, ComfyUI's path runs: ")
            + verdict.detail)
    comfy_adapter.send_progress_text(state.node_id, f"H3 fused NVFP4: {text}")
