"""Calibration: record the activation amax of NVFP4 Linears during normal sampling, then turn it into static
``input_scale`` values (core/safetensors_io.py and models/h3/checkpoint.py write them into a new checkpoint).

With an ``input_scale`` ComfyUI quantizes a layer's input with that fixed global scale: no reduction pass before
the pack (one launch instead of two in the fused path, two instead of eight in stock), and fc2 reads the large fc1
output once instead of twice. The trade: values above ``input_scale * 2688`` saturate the E4M3 block scales.

Recording is device-side and needs no host sync per call: each layer keeps a small fp32 buffer on its GPU, the
running max in slot 0 and a ring of the last ``SAMPLES`` per-call maxima after it (for a clipped choice). It works
on the fused and on the stock path alike: a fused Linear records the amax of the input ComfyUI would have built
(its normalized / modulated / SwiGLU source computed by ComfyUI's own ops), a stock one the amax of its input.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref

import torch

from ..layout import GLOBAL_SCALE_DIVISOR
from .linear import FusedNVFP4Linear, quantized_input

STATE_KEY = "h3_fused_nvfp4_calibration"  # transformer_options entry: the recorder id of a calibrating clone
# (an id, not the object: ComfyUI may deep-copy model options)
SAMPLES = 256
STATISTICS = ("max", "p99.9", "p99")


class CalibrationRecorder:
    """Per-layer device buffers: ``[running amax, last SAMPLES per-call amax values...]`` and a host call count.
    ``expected``: the layers that must have been called before the statistics may be saved (every NVFP4 Linear of
    the model); ``source``: the file the model was loaded from, where ComfyUI says (the save writes its scales into
    a copy of that file only)."""

    def __init__(self, samples: int = SAMPLES, expected: tuple[str, ...] = (), source: str | None = None):
        self.samples = samples
        self.expected = expected
        self.source = source
        self.layers: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.paused = 0  # > 0 while a block self-check runs extra forwards that must not count

    def active(self) -> bool:
        return self.paused == 0

    def record(self, name: str, x: torch.Tensor) -> None:
        """Record ``amax|x|`` (NaN propagates, as ComfyUI's dynamic scale) for layer ``name``; no host sync and no
        temporary of x's size (the inf-norm is one reduction)."""
        if self.paused:
            return
        amax = torch.linalg.vector_norm(x.detach(), float("inf")).float().reshape(1)
        with self.lock:
            slot = self.layers.get(name)
            if slot is None:
                buffer = torch.full((1 + self.samples,), float("nan"), dtype=torch.float32, device=x.device)
                buffer[0] = 0.0
                slot = self.layers[name] = {"buffer": buffer, "calls": 0}
            buffer, calls = slot["buffer"], slot["calls"]
            slot["calls"] = calls + 1
        torch.maximum(buffer[0:1], amax, out=buffer[0:1])
        buffer[1 + calls % self.samples: 2 + calls % self.samples].copy_(amax)

    def missing(self) -> list[str]:
        """Expected layers never called while recording."""
        return [name for name in self.expected if name not in self.layers]

    def statistics(self) -> dict[str, dict]:
        """Host copies (one sync, at save time): amax, calls, and percentiles of the per-call maxima of the last
        ``samples`` calls (``max`` covers every call)."""
        names = sorted(self.layers)
        if not names:
            return {}
        data = torch.stack([self.layers[n]["buffer"].to(self.layers[names[0]]["buffer"].device) for n in names]).cpu()
        out = {}
        for name, row in zip(names, data):
            calls = self.layers[name]["calls"]
            samples = row[1:1 + min(calls, self.samples)]
            entry = {"amax": float(row[0]), "calls": calls, "samples": samples.tolist()}
            finite = samples[torch.isfinite(samples)]
            for stat, q in (("p99.9", 0.999), ("p99", 0.99)):
                entry[stat] = float(torch.quantile(finite, q)) if finite.numel() else float("nan")
            out[name] = entry
        return out


@contextlib.contextmanager
def recording_paused(recorders):
    """No recording by ``recorders`` for the duration (the block self-check's extra forwards)."""
    recorders = [r for r in recorders if r is not None]
    for r in recorders:
        r.paused += 1
    try:
        yield
    finally:
        for r in recorders:
            r.paused -= 1


# Recorders live as long as a calibrating clone's patches reference them.
_recorders: "weakref.WeakValueDictionary[str, CalibrationRecorder]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def new_recorder(expected: tuple[str, ...] = (), source: str | None = None) -> tuple[str, CalibrationRecorder]:
    key = f"calibration-{next(_ids)}"
    recorder = CalibrationRecorder(expected=expected, source=source)
    _recorders[key] = recorder
    return key, recorder


def recorder_of(model_patcher) -> CalibrationRecorder | None:
    key = model_patcher.model_options.get("transformer_options", {}).get(STATE_KEY)
    return _recorders.get(key) if key else None


class RecordingForward:
    """Object patch for a Linear on ComfyUI's own path: record its input's amax, then run the forward that was
    there (another node's patch, or ComfyUI's own)."""

    def __init__(self, layer, name: str, recorder: CalibrationRecorder, inner=None):
        self.layer = layer
        self.name = name
        self.recorder = recorder
        self.stock_forward = inner if inner is not None else type(layer).forward.__get__(layer)

    def __call__(self, x, *args, **kwargs):
        self.recorder.record(self.name, quantized_input(self.layer, x))
        return self.stock_forward(x, *args, **kwargs)


def attach_recorder(clone, layers: dict, *, prefix: str = "diffusion_model.",
                    source: str | None = None) -> CalibrationRecorder:
    """Make every Linear of ``layers`` (name below ``prefix`` -> module) of the ModelPatcher ``clone`` record its
    input amax: a fused Linear records through its own forward, any other forward (ComfyUI's, or another node's
    patch) is wrapped. ``source``: the model's file, where known. Returns the recorder; :func:`recorder_of` finds it
    from the clone."""
    key, recorder = new_recorder(tuple(layers), source)
    for name, layer in layers.items():
        patch_key = f"{prefix}{name}.forward"
        current = clone.object_patches.get(patch_key)
        if isinstance(current, FusedNVFP4Linear):
            current.recorder = recorder
        else:
            clone.add_object_patch(patch_key, RecordingForward(layer, name, recorder, inner=current))
    clone.model_options.setdefault("transformer_options", {})[STATE_KEY] = key
    return recorder


def stored_input_scale(value) -> float | None:
    """``value`` as the fp32 ``input_scale`` a checkpoint stores it, or None where that is not a positive finite
    number: a value beyond fp32's range becomes inf (ComfyUI then gives NaN for the layer), one below its smallest
    subnormal becomes 0 (all zeros)."""
    try:
        scale = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(scale):
        return None
    stored = float(torch.tensor(scale, dtype=torch.float32))
    return stored if math.isfinite(stored) and stored > 0 else None


def input_scales(statistics: dict[str, dict], headroom: float = 1.0, statistic: str = "max") -> dict[str, float]:
    """``input_scale = amax x headroom / 2688`` per recorded layer (``statistic``: max or a sampled percentile).
    ``statistics``: :meth:`CalibrationRecorder.statistics` or its JSON file (``calls`` may be left out)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}")
    if not (headroom > 0 and math.isfinite(headroom)):
        raise ValueError(f"headroom must be a positive number, got {headroom}")
    if not isinstance(statistics, dict) or not statistics:
        raise ValueError("no recorded layers")
    field = "amax" if statistic == "max" else statistic
    scales = {}
    for name, entry in statistics.items():
        value = entry.get(field) if isinstance(entry, dict) else None
        if isinstance(entry, dict) and not entry.get("calls", 1):
            raise ValueError(f"{name} was never called while recording")
        if not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} has no positive {field} ({value!r}; NaN or inf inputs while recording?)")
        scale = value * headroom / GLOBAL_SCALE_DIVISOR
        if stored_input_scale(scale) is None:
            raise ValueError(f"{name}: input_scale = {field} {value!r} x headroom {headroom!r} / "
                             f"{GLOBAL_SCALE_DIVISOR} = {scale!r} is {_as_fp32(scale)} as an fp32 number; it must be "
                             "positive and finite")
        scales[name] = scale
    return scales


def _as_fp32(value: float) -> str:
    stored = float(torch.tensor(value, dtype=torch.float32)) if math.isfinite(value) else value
    return "0" if stored == 0 else repr(stored)
