"""The self-check's probes of Wan's fused ops (models/wan/probes.py) on the CPU, with the Python twin of the kernels:
every probe passes, quickly, and a planted wrong op (one per probe: the modulation rounded twice, the residual's gate
rows shifted, the rotation of the split-half layout, GELU without its tanh approximation) fails its probe with the
place of the first differing byte. (The probes on the GPU, and planted wrong CUDA kernels:
tests/test_gpu_wan_kernels.py.)"""

import dataclasses

import pytest
import torch

from h3_fused_nvfp4 import comfy_adapter
from h3_fused_nvfp4.core import verdicts
from h3_fused_nvfp4.kernels import twin_ops
from h3_fused_nvfp4.models.wan.probes import WAN_PROBES

pytestmark = pytest.mark.usefixtures("comfyui")
CPU = torch.device("cpu")


@pytest.fixture
def nvfp4_compute(comfyui, monkeypatch):
    monkeypatch.setattr(comfyui.model_management, "supports_nvfp4_compute", lambda *a, **k: True)


def test_every_probe_passes_on_the_twin(nvfp4_compute):
    results = verdicts.run_probes(twin_ops, CPU, (WAN_PROBES,))
    assert set(results) == set(WAN_PROBES.probes) | set(WAN_PROBES.aliases)
    failed = {name: r.detail for name, r in results.items() if r.ok is not True}
    assert not failed, failed
    assert not WAN_PROBES.comfy_source().startswith("unavailable")


def _twice_rounded_modulate(n, modulation):
    """The modulation as two rounded ops (n * (1 + scale), then + shift) instead of one addcmul."""
    index = modulation.mod_index.long()
    return (n * (1 + modulation.scale[index])).add_(modulation.shift[index])


def _shifted_gate_residual(x, other, next_norm, *, gate=None, mod_index=None, out=None, next_modulation=None,
                           global_scale_out=None):
    rows = mod_index.roll(1) if mod_index is not None else None
    return ORIGINAL["residual_layer_norm_"](x, other, next_norm, gate=gate, mod_index=rows, out=out,
                                            next_modulation=next_modulation, global_scale_out=global_scale_out)


def _split_half_rope(x, freqs):
    return comfy_adapter.kitchen().apply_rope_split_half1(x, freqs)


ORIGINAL = {"residual_layer_norm_": twin_ops.residual_layer_norm_}
FAULTS = {
    "layer_norm": (twin_ops, "addcmul_modulate", _twice_rounded_modulate),
    "residual_layer_norm": (twin_ops, "residual_layer_norm_", _shifted_gate_residual),
    "rms_norm_rope": (twin_ops, "apply_rope1", _split_half_rope),
    "pack_gelu": (twin_ops, "gelu", lambda x: torch.nn.functional.gelu(x)),
}


@pytest.mark.parametrize("probe", list(FAULTS))
def test_planted_wrong_op_fails_its_probe(probe, nvfp4_compute, monkeypatch):
    """The bf16 and the fp16 probe of the op (only those run: the probes of the other ops are not affected)."""
    owner, name, fault = FAULTS[probe]
    monkeypatch.setattr(owner, name, fault)
    names = (probe, probe + "_f16")
    only = dataclasses.replace(WAN_PROBES, probes={n: WAN_PROBES.probes[n] for n in names}, aliases={})
    results = verdicts.run_probes(twin_ops, CPU, (only,))
    for n in names:
        assert results[n].ok is False and "differs at index" in results[n].detail, (n, results[n].detail)


@pytest.mark.parametrize("op", ["layer_norm_support", "layer_norm_statistics", "residual_layer_norm_support",
                                "residual_layer_norm_", "rms_norm_rope_support", "rms_norm_rope_", "pack_support",
                                "pack_nvfp4"])
def test_both_implementations_take_the_protocols_arguments(op):
    """The CUDA kernels' wrappers and their twin take the arguments kernels/backend.py FusedOps declares for the ops
    of the LayerNorm block (the block calls either through that protocol)."""
    import inspect

    from h3_fused_nvfp4.kernels import backend, cuda_ops

    declared = [p for p in inspect.signature(getattr(backend.FusedOps, op)).parameters if p != "self"]
    for implementation in (cuda_ops, twin_ops):
        assert list(inspect.signature(getattr(implementation, op)).parameters) == declared, (implementation, op)
