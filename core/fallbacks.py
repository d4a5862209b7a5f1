"""One log line per reason the pack leaves a call on ComfyUI's path."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("h3_fused_nvfp4")

_noted: set[tuple[str, str]] = set()
_noted_lock = threading.Lock()


def note_fallback(where: str, reason: str, level: int = logging.INFO) -> None:
    """Log once per (place, reason) that ``where`` runs ComfyUI's path, and why."""
    with _noted_lock:
        if (where, reason) in _noted:
            return
        _noted.add((where, reason))
    log.log(level, "H3 fused NVFP4: %s uses ComfyUI's path: %s", where, reason)
