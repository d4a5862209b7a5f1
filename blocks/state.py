"""What the fused blocks of one patched model share: the block check's status and the hand-over between blocks."""

from __future__ import annotations

import threading

from .. import comfy_adapter
from ..core.verdicts import Verdict

BLOCK_CHECK_STATES = ("pending", "passed", "failed", "off")


class ModelState:
    """State shared by the block patches of one patched model clone.

    ``block_check``: ``pending`` (the first fused call compares with ComfyUI's block), ``passed``, ``failed`` (the
    model runs ComfyUI's blocks), ``off``. ``node_id``: the graph node that patched the model (the block check's
    verdict is shown there). The hand-over slot holds what block i computed for block i + 1 in its last residual
    (the next norm's statistics, say); only block i + 1's very next call, with the same key, can take it."""

    def __init__(self):
        self.block_check = "pending"
        self.block_check_detail = ""
        self.node_id = None
        self._handoff = None  # (receiving block index, key, payload)
        self.lock = threading.Lock()

    def offer_handoff(self, index: int, key, payload) -> None:
        self._handoff = (index, key, payload)

    def take_handoff(self, index: int, key):
        """The payload offered to block ``index`` under ``key`` (None otherwise); the slot is emptied either way, so
        a hand-over is never taken by any call but the one right after the block that offered it."""
        handoff, self._handoff = self._handoff, None
        if handoff is None or handoff[0] != index or handoff[1] != key:
            return None
        return handoff[2]

    def drop_handoff(self) -> None:
        self._handoff = None

    @property
    def handoff_pending(self) -> bool:
        return self._handoff is not None


def block_check_preparer(states, scope: str):
    """A family's ``FamilyPatches.prepare`` (core/patching.py) for the model states its fused blocks share: a failed
    block check on this device refuses the patch; otherwise each state's block check starts passed (the device's
    verdict already holds one) or pending, and its verdict is shown on the node that patched the model."""

    def prepare(verdict: Verdict) -> str | None:
        if verdict.block == "failed":
            return verdict.summary()
        if scope == "block":
            for state in states:
                state.block_check = "passed" if verdict.block == "passed" else "pending"
                state.node_id = comfy_adapter.executing_node_id()
        return None

    return prepare
