"""The decisions of a forward, resolved once: which implementation of the fused ops runs on this device, and which
ops the self-check turned off there.

A fused block builds one :class:`ForwardPlan` at the start of its forward and hands it to its attention, MLP and
Linears; a Linear called on its own asks :func:`plan_for` (a dict lookup after the first call). Plans are rebuilt
when a verdict changes (core/verdicts.py ``generation``), never per op.

The plan answers for the Linear's ops (:data:`OPS`) and for every op a model family declares in its probe set
(models/<family>/probes.py), including the family's block check, :func:`block_op`.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from ..kernels.backend import FusedOps, KernelBuildError, backend_for
from . import verdicts

# The Linear's ops (core/probes.py): its kernels and the Linear path. The fp16 Linear path has its own ops (``*_f16``:
# fp16 activations, core/linear.py checked_op). The ops of a family's block come from its probe set.
OPS = ("global_scale", "pack", "pack_prescale", "linear", "global_scale_f16", "pack_f16", "pack_prescale_f16",
       "linear_f16")


def block_op(probe_set: str) -> str:
    """The plan op of the block check of the family whose probe set is ``probe_set``."""
    return verdicts.block_op(probe_set)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    device: torch.device
    backend: FusedOps | None  # None: the kernels could not be built (``unavailable`` says why)
    unavailable: str | None
    refusals: dict[str, str]  # op -> why the self-check turned it off

    def refusal(self, *ops: str) -> str | None:
        """Why the first of ``ops`` that may not run here is refused (None: all may)."""
        if self.unavailable is not None:
            return self.unavailable
        for op in ops:
            reason = self.refusals.get(op)
            if reason is not None:
                return reason
        return None


_plans: dict[str, tuple[int, ForwardPlan]] = {}
_lock = threading.Lock()


def plan_for(device: torch.device) -> ForwardPlan:
    """The plan for ``device`` under the current verdicts (built now if they changed since the last one)."""
    key, generation = str(device), verdicts.generation()
    cached = _plans.get(key)
    if cached is not None and cached[0] == generation:
        return cached[1]
    device = torch.device(device)
    try:
        backend, unavailable = backend_for(device), None
    except KernelBuildError as exc:
        backend, unavailable = None, f"kernels unavailable: {exc}"
    refusals = {}
    for op in OPS + verdicts.declared_ops(device):
        reason = verdicts.op_refusal(device, op)
        if reason is not None:
            refusals[op] = reason
    plan = ForwardPlan(device, backend, unavailable, refusals)
    with _lock:
        _plans[key] = (generation, plan)
    return plan


def forget_plans() -> None:
    with _lock:
        _plans.clear()
