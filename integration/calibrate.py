"""Calibration: record the activation amax of every NVFP4 Linear of the H3 blocks during normal sampling, then turn
it into static ``input_scale`` values (integration/checkpoint.py writes them into a new checkpoint).

With an ``input_scale`` ComfyUI quantizes a layer's input with that fixed global scale: no reduction pass before
the pack (one launch instead of two in the fused path, two instead of eight in stock), and fc2 reads the large fc1
output once instead of twice. The trade: values above ``input_scale * 2688`` saturate the E4M3 block scales.

Recording is device-side and needs no host sync per call: each layer keeps a small fp32 buffer on its GPU, the
running max in slot 0 and a ring of the last ``SAMPLES`` per-call maxima after it (for a clipped choice). It works
on the fused and on the stock path alike: a fused Linear records the amax of the input ComfyUI would have built
(its normalized / modulated / SwiGLU source computed by ComfyUI's own ops), a stock one the amax of its input.
"""

from __future__ import annotations

import itertools
import math
import threading

import torch

from ..layout import GLOBAL_SCALE_DIVISOR

STATE_KEY = "h3_fused_nvfp4_calibration"  # transformer_options entry: the recorder id of a calibrating clone
SAMPLES = 256
STATISTICS = ("max", "p99.9", "p99")


class CalibrationRecorder:
    """Per-layer device buffers: ``[running amax, last SAMPLES per-call amax values...]`` and a host call count."""

    def __init__(self, samples: int = SAMPLES):
        self.samples = samples
        self.layers: dict[str, dict] = {}
        self.lock = threading.Lock()

    def record(self, name: str, x: torch.Tensor) -> None:
        """Record ``amax|x|`` (NaN propagates, as ComfyUI's dynamic scale) for layer ``name``; no host sync."""
        amax = torch.amax(x.detach().abs()).float().reshape(1)
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

    def statistics(self) -> dict[str, dict]:
        """Host copies (one sync, at save time): amax, calls, percentiles of the sampled per-call maxima."""
        out = {}
        for name, slot in sorted(self.layers.items()):
            data = slot["buffer"].cpu()
            samples = data[1:1 + min(slot["calls"], self.samples)]
            entry = {"amax": float(data[0]), "calls": slot["calls"], "samples": [float(v) for v in samples]}
            if samples.numel():
                finite = samples[torch.isfinite(samples)]
                for stat, q in (("p99.9", 0.999), ("p99", 0.99)):
                    entry[stat] = float(torch.quantile(finite, q)) if finite.numel() else float("nan")
            out[name] = entry
        return out


_recorders: dict[str, CalibrationRecorder] = {}
_ids = itertools.count()


def new_recorder() -> tuple[str, CalibrationRecorder]:
    key = f"calibration-{next(_ids)}"
    _recorders[key] = CalibrationRecorder()
    return key, _recorders[key]


def recorder_of(model_patcher) -> CalibrationRecorder | None:
    key = model_patcher.model_options.get("transformer_options", {}).get(STATE_KEY)
    return _recorders.get(key) if key else None


class RecordingForward:
    """Object patch for a Linear on ComfyUI's own path: record its input's amax, then run ComfyUI's forward."""

    def __init__(self, layer, name: str, recorder: CalibrationRecorder):
        self.layer = layer
        self.name = name
        self.recorder = recorder
        self.stock_forward = type(layer).forward.__get__(layer)

    def __call__(self, x, *args, **kwargs):
        self.recorder.record(self.name, x)
        return self.stock_forward(x, *args, **kwargs)


def apply_calibration(model_patcher, allow_reference_backend: bool = False):
    """``(clone, summary)``: a clone of ``model_patcher`` that records every H3 NVFP4 Linear's input amax. A fused
    model stays fused (its patches are rebuilt for the clone, with recording); a stock one stays stock."""
    from . import patch
    from .linear import FusedNVFP4Linear, is_nvfp4_linear

    fused = patch.patch_state(model_patcher).get("mode") == "fused"
    if fused:
        clone, report = patch.apply_fused(model_patcher, patch.patched_scope(model_patcher),
                                          allow_reference_backend=allow_reference_backend)
        fused = report.applied
    else:
        clone = model_patcher.clone()
    key, recorder = new_recorder()
    diffusion_model = clone.get_model_object("diffusion_model")
    layers = 0
    for blk in patch.find_h3_blocks(diffusion_model):
        for path in patch.LINEAR_PATHS:
            layer = patch._get(blk.module, path)
            if not is_nvfp4_linear(layer):
                continue
            name = f"{blk.prefix}.{path}"
            current = clone.object_patches.get(f"diffusion_model.{name}.forward")
            if isinstance(current, FusedNVFP4Linear):
                current.recorder = recorder
            else:
                clone.add_object_patch(f"diffusion_model.{name}.forward", RecordingForward(layer, name, recorder))
            layers += 1
    clone.model_options.setdefault("transformer_options", {})[STATE_KEY] = key
    if not layers:
        return clone, "H3 fused NVFP4 calibration: no NVFP4 Linear in MiniMax H3 blocks to record"
    return clone, (f"H3 fused NVFP4 calibration: recording the input amax of {layers} NVFP4 layers on the "
                   f"{'fused' if fused else 'stock'} path; run sampling, then save with 'Save Calibrated H3 NVFP4'")


def input_scales(statistics: dict[str, dict], headroom: float = 1.0, statistic: str = "max") -> dict[str, float]:
    """``input_scale = amax x headroom / 2688`` per recorded layer (``statistic``: max or a sampled percentile)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}")
    if not (headroom > 0 and math.isfinite(headroom)):
        raise ValueError(f"headroom must be a positive number, got {headroom}")
    scales = {}
    for name, entry in statistics.items():
        value = entry["amax"] if statistic == "max" else entry.get(statistic, float("nan"))
        if not entry["calls"]:
            raise ValueError(f"{name} was never called while recording")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: recorded {statistic} {value} is not a positive finite amax (NaN/inf inputs?)")
        scales[name] = value * headroom / GLOBAL_SCALE_DIVISOR
    return scales
