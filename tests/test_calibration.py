"""Calibration round trip on a tiny real MiniMax H3 model, headless in the real ComfyUI: Calibrate records every
NVFP4 layer's input amax while the model runs (fused and stock path alike), SaveCalibrated writes a new checkpoint
with static input scales, ComfyUI's loader loads it, and on it the fused path takes the static single-pass pack with
the stock bits. Refusals leave nothing behind."""

from __future__ import annotations

import json

import comfy_harness as ch
import pytest
import torch
from comfy_harness import NUM_LAYERS, REFINER_LAYERS, UNET_NAME
from parity import assert_bit_identical

from h3_fused_nvfp4.core import calibration as calibrate
from h3_fused_nvfp4.layout import GLOBAL_SCALE_DIVISOR

pytestmark = pytest.mark.usefixtures("selfcheck_forced")

LAYERS = 4 * (NUM_LAYERS + REFINER_LAYERS)


def calibrate_graph(path: str, filename: str, forward: bool = True) -> dict:
    prompt = {
        "1": {"class_type": "H3FusedNVFP4Loader", "inputs": {"unet_name": UNET_NAME, "weight_dtype": "default",
                                                           "scope": "block"}},
        "2": {"class_type": "H3FusedNVFP4Toggle", "inputs": {"model": ["1", 0], "path": path, "scope": "as patched"}},
        "3": {"class_type": "H3FusedNVFP4Calibrate", "inputs": {"model": ["2", 0]}},
        "5": {"class_type": "H3FusedNVFP4SaveCalibrated",
              "inputs": {"model": ["3", 0], "unet_name": UNET_NAME, "filename": filename, "headroom": 1.25,
                         "statistic": "max", "overwrite": False}},
    }
    if forward:  # the "sampler": the model runs once, its output orders the save node after it
        prompt["4"] = ch.forward_node(["3", 0], f"calibrate {path}", seed=11)
        prompt["5"]["inputs"]["samples"] = ["4", 0]
    return prompt


def _run_save(prompt):
    return ch.run_prompt(prompt, outputs=["5"])


def test_recorded_amax_is_the_same_on_both_paths(pack, model_file, clean_models):
    recorded = {}
    for path in ("fused", "comfy"):
        prompt = calibrate_graph(path, f"unused-{path}.safetensors")
        run = ch.run_prompt({k: v for k, v in prompt.items() if k != "5"}, outputs=["4"])
        run.raise_for_status()
        recorder = pack.submodule("core.calibration").recorder_of(run.output("3"))  # the nodes' module copy
        assert recorder is not None and len(recorder.layers) == LAYERS
        recorded[path] = recorder.statistics()
        clean_models.unload_all_models()
    for name, entry in recorded["comfy"].items():
        fused_entry = recorded["fused"][name]
        assert entry["calls"] == fused_entry["calls"] >= 1, name
        assert fused_entry["amax"] == entry["amax"] and fused_entry["amax"] > 0, name


def test_calibrate_save_load_round_trip(pack, model_file, clean_models):
    run = _run_save(calibrate_graph("fused", "tiny_calibrated.safetensors"))
    run.raise_for_status()
    saved = model_file.parent / "tiny_calibrated.safetensors"
    stats = json.loads((model_file.parent / "tiny_calibrated.calibration.json").read_text())
    assert (saved.is_file() and len(stats["layers"]) == LAYERS
            and "wrote tiny_calibrated.safetensors" in run.ui_text("5"))
    from safetensors import safe_open

    with safe_open(str(saved), framework="pt") as f, safe_open(str(model_file), framework="pt") as src:
        for key in src.keys():  # every source tensor unchanged
            if not key.endswith("input_scale"):
                assert torch.equal(f.get_tensor(key).view(-1).view(torch.uint8),
                                   src.get_tensor(key).view(-1).view(torch.uint8)), key
        for name, entry in stats["layers"].items():
            scale = f.get_tensor(f"{name}.input_scale")
            assert scale.dtype == torch.float32
            assert torch.equal(scale, torch.tensor(entry["amax"] * 1.25 / GLOBAL_SCALE_DIVISOR, dtype=torch.float32))
        assert "h3_fused_nvfp4.calibration" in f.metadata()
    clean_models.unload_all_models()

    # The calibrated file through ComfyUI's loader: every NVFP4 layer static, fused == stock bytes, single-pass pack.
    prompt = {"1": {"class_type": "H3FusedNVFP4Loader",
                    "inputs": {"unet_name": "tiny_calibrated.safetensors", "weight_dtype": "default",
                               "scope": "block"}},
              "2": {"class_type": "H3FusedNVFP4Toggle", "inputs": {"model": ["1", 0], "path": "comfy",
                                                                  "scope": "as patched"}},
              "f1": ch.forward_node(["2", 0], "calibrated comfy", seed=12),
              "f2": ch.forward_node(["1", 0], "calibrated fused", seed=12)}
    run = ch.run_prompt(prompt)
    run.raise_for_status()
    assert f"{LAYERS} static input_scale" in run.ui_text("1")
    for a, b in ch.forward_pairs("calibrated fused", "calibrated comfy"):
        assert_bit_identical(a, b, "calibrated checkpoint")
    linears = [v for v in run.output("1").object_patches.values() if type(v).__name__ == "FusedNVFP4Linear"]
    assert all(not v.dynamic_scale() for v in linears)
    assert all(v.calls_fused > 0 for v in linears if v.name.startswith("blocks."))


def test_save_refusals_leave_nothing_behind(pack, model_file, clean_models):
    (model_file.parent / "existing.safetensors").write_bytes(b"someone's file")
    before = sorted(p.name for p in model_file.parent.iterdir())
    # no calibration data: the save node without a calibrating model run
    run = _run_save(calibrate_graph("fused", "never.safetensors", forward=False))
    assert not run.success and "no calibration data" in run.error["exception_message"]
    # target exists, target is the source
    run = _run_save(calibrate_graph("fused", "existing.safetensors"))
    assert not run.success and "exists" in run.error["exception_message"]
    run = _run_save(calibrate_graph("fused", UNET_NAME))
    assert not run.success and "is the source file" in run.error["exception_message"]
    assert sorted(p.name for p in model_file.parent.iterdir()) == before
    assert (model_file.parent / "existing.safetensors").read_bytes() == b"someone's file"


@pytest.mark.parametrize("other", ["same layers, other weights", "one block deeper"])
def test_save_refuses_a_checkpoint_the_model_was_not_loaded_from(pack, model_file, clean_models, other):
    """The model was loaded from one file, unet_name names another: the input scales of the one must not go into
    a copy of the other (a deeper file would also leave its extra layers unscaled)."""
    import folder_paths
    from safetensors.torch import save_file

    from h3_fused_nvfp4.tools import synthetic as syn

    layers = NUM_LAYERS + (other == "one block deeper")
    save_file(syn.model_state_dict(num_layers=layers, refiner_layers=REFINER_LAYERS, seed=5),
              str(model_file.parent / "other.safetensors"))
    folder_paths.filename_list_cache.pop("diffusion_models", None)
    before = sorted(p.name for p in model_file.parent.iterdir())
    prompt = calibrate_graph("fused", "mixed.safetensors")
    prompt["5"]["inputs"]["unet_name"] = "other.safetensors"
    run = _run_save(prompt)
    assert not run.success, run.ui_text("5")
    message = run.error["exception_message"]
    assert f"loaded from {UNET_NAME}" in message and "other.safetensors" in message, message
    assert sorted(p.name for p in model_file.parent.iterdir()) == before


def test_input_scales_refuse_bad_statistics():
    with pytest.raises(ValueError, match="never called"):
        calibrate.input_scales({"blocks.0.mlp.fc1": {"amax": 1.0, "calls": 0}})
    with pytest.raises(ValueError, match="has no positive amax"):
        calibrate.input_scales({"blocks.0.mlp.fc1": {"amax": float("nan"), "calls": 3}})
    with pytest.raises(ValueError, match="headroom"):
        calibrate.input_scales({"blocks.0.mlp.fc1": {"amax": 1.0, "calls": 3}}, headroom=0)
    with pytest.raises(ValueError, match="has no positive p99"):
        calibrate.input_scales({"blocks.0.mlp.fc1": {"amax": 1.0}}, statistic="p99")
    assert calibrate.input_scales({"a": {"amax": 2688.0, "calls": 1}}, headroom=2.0) == {"a": 2.0}
    assert calibrate.input_scales({"a": {"amax": 9.0, "p99": 2688.0}}, statistic="p99") == {"a": 1.0}


def test_recorder_propagates_nan_and_keeps_the_last_samples():
    recorder = calibrate.CalibrationRecorder(samples=2)
    for values in ([1.0, -3.0], [0.5, -0.0], [float("nan"), 2.0], [-7.0, 1.0]):
        recorder.record("layer", torch.tensor(values, dtype=torch.bfloat16))
    entry = recorder.statistics()["layer"]
    assert entry["calls"] == 4 and entry["amax"] != entry["amax"]  # NaN: as ComfyUI's dynamic scale would be
    assert entry["samples"][1] == 7.0 and entry["samples"][0] != entry["samples"][0]  # ring of the last two calls
    with calibrate.recording_paused([recorder]):
        recorder.record("layer", torch.ones(4))
    assert recorder.statistics()["layer"]["calls"] == 4
