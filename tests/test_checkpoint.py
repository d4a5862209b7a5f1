"""models/h3/checkpoint.py and scripts/convert_h3_nvfp4.py against the real ComfyUI (CPU): conversion of tiny
bf16 and fp8_scaled MiniMax H3 checkpoints to NVFP4, static input scales, and every refusal leaving no file."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys

import comfy_harness as ch
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_fused_nvfp4.core import safetensors_io
from h3_fused_nvfp4.layout import GLOBAL_SCALE_DIVISOR, NVFP4_LAYOUT
from h3_fused_nvfp4.models.h3 import checkpoint
from h3_fused_nvfp4.tools import synthetic

pytestmark = ch.requires_comfyui

PREFIXED = "model.diffusion_model."
PROJECTIONS = synthetic.LINEAR_PATHS
BLOCK_LAYERS = [f"blocks.{i}.{p}" for i in range(2) for p in PROJECTIONS]
REFINER_LAYERS = [f"token_refiner.blocks.{i}.{p}" for i in range(2) for p in PROJECTIONS]
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- source checkpoints ------------------------------------------------------------------------------------

def bf16_state_dict(prefix: str = "", seed: int = 0) -> dict:
    """A tiny complete H3 checkpoint with bf16 Linears: synthetic.model_state_dict with its NVFP4 projections
    swapped for bf16 weights of the same shape."""
    sd = synthetic.model_state_dict(synthetic.H3_SMALL, num_layers=2, refiner_layers=2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in BLOCK_LAYERS + REFINER_LAYERS:
        rows, half = sd.pop(f"{layer}.weight").shape
        for suffix in ("weight_scale", "weight_scale_2", "comfy_quant"):
            del sd[f"{layer}.{suffix}"]
        sd[f"{layer}.weight"] = (torch.randn((rows, 2 * half), generator=gen) * (2 * half) ** -0.5).to(torch.bfloat16)
    return {prefix + k: v for k, v in sd.items()}


def fp8_scaled_state_dict(style: str, prefix: str = "") -> tuple[dict, dict]:
    """(tensors, metadata) of an fp8_scaled H3 checkpoint as ComfyUI stores one, every projection quantized by
    ComfyUI's ``TensorCoreFP8E4M3Layout``. ``style``: ``comfy_quant`` tags, ``quantization_metadata`` (the
    layers listed in the file's metadata) or ``scaled_fp8`` (the older marker + ``scale_weight``/``scale_input``)."""
    from comfy.quant_ops import QuantizedTensor

    sd = bf16_state_dict(seed=1)
    layers = {}
    for layer in BLOCK_LAYERS + REFINER_LAYERS:
        qt = QuantizedTensor.from_float(sd[f"{layer}.weight"], "TensorCoreFP8E4M3Layout", scale="recalculate")
        sd[f"{layer}.weight"] = qt._qdata
        scale = qt._params.scale.reshape(()).to(torch.float32)
        if style == "scaled_fp8":
            sd[f"{layer}.scale_weight"] = scale
            sd[f"{layer}.scale_input"] = torch.tensor(0.02, dtype=torch.float32)
        else:
            sd[f"{layer}.weight_scale"] = scale
            sd[f"{layer}.input_scale"] = torch.tensor(0.02, dtype=torch.float32)
            layers[layer] = {"format": "float8_e4m3fn"}
            if style == "comfy_quant":
                sd[f"{layer}.comfy_quant"] = tag("float8_e4m3fn")
    metadata = {"origin": "fp8 test file"}
    if style == "scaled_fp8":
        sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    elif style == "quantization_metadata":
        metadata[checkpoint.QUANT_METADATA_KEY] = json.dumps({"format_version": "1.0", "layers": layers})
    return {prefix + k: v for k, v in sd.items()}, metadata


def nvfp4_state_dict(prefix: str = "") -> dict:
    sd = synthetic.model_state_dict(synthetic.H3_SMALL, num_layers=2, refiner_layers=2, seed=2,
                                    static_layers=("mlp.fc2",))
    return {prefix + k: v for k, v in sd.items()}


def tag(fmt: str, **extra) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt, **extra}).encode()), dtype=torch.uint8)


def write(path, sd, metadata=None):
    save_file(sd, str(path), metadata=metadata)
    return str(path)


# ---- reading results ---------------------------------------------------------------------------------------

def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def read_all(path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def assert_aligned(path):
    """Every tensor starts at a multiple of its element size (ComfyUI's mmap loader views the bytes in place)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        assert f.tell() % 8 == 0
    for name, entry in header.items():
        if name != "__metadata__":
            itemsize = safetensors_io.ITEMSIZE[entry["dtype"]]
            assert entry["data_offsets"][0] % itemsize == 0, name


def load_in_comfyui(path):
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(str(path))
    assert patcher.model.model_config.unet_config["image_model"] == "minimax_h3"
    return patcher.model.diffusion_model


def module(dm, layer: str):
    return dm.get_submodule(layer)


def comfy_bf16_weight(dm, layer: str) -> torch.Tensor:
    """The bf16 weight ComfyUI computes with for ``layer`` of a model loaded under ``force_nvfp4_compute`` (bf16
    compute dtype: an fp8 weight dequantizes to bf16 on the CPU)."""
    from comfy.quant_ops import QuantizedTensor

    weight = module(dm, layer).weight
    weight = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
    assert weight.dtype == torch.bfloat16
    return weight.detach()


def assert_converted(src_path, out_path, report, prefix: str, converted: list[str], kept_fp8: list[str]):
    import comfy.utils
    from comfy.quant_ops import QuantizedTensor

    src, _ = read_all(src_path)
    out, _ = read_all(out_path)
    loaded, _ = comfy.utils.load_torch_file(str(out_path), return_metadata=True)
    assert loaded.keys() == out.keys()
    assert_aligned(out_path)
    assert sorted(report["converted"]) == sorted(converted)

    source_model = load_in_comfyui(src_path)
    result_model = load_in_comfyui(out_path)
    new_keys = set()
    for layer in converted:
        expected = QuantizedTensor.from_float(comfy_bf16_weight(source_model, layer), NVFP4_LAYOUT)
        key = prefix + layer
        assert torch.equal(raw(out[f"{key}.weight"]), raw(expected._qdata)), layer
        assert torch.equal(raw(out[f"{key}.weight_scale"]), raw(expected._params.block_scale)), layer
        assert out[f"{key}.weight_scale_2"].dtype == torch.float32 and out[f"{key}.weight_scale_2"].shape == ()
        assert torch.equal(out[f"{key}.weight_scale_2"], expected._params.scale.reshape(()).float()), layer
        assert json.loads(out[f"{key}.comfy_quant"].numpy().tobytes()) == {"format": "nvfp4"}
        linear = module(result_model, layer)
        assert linear.quant_format == "nvfp4" and isinstance(linear.weight, QuantizedTensor)
        assert torch.equal(linear.weight._qdata, expected._qdata)
        new_keys |= {f"{key}.{s}" for s in ("weight", "weight_scale", "weight_scale_2", "comfy_quant")}
        new_keys |= {f"{key}.input_scale"} & out.keys()
    for layer in kept_fp8:
        assert module(result_model, layer).quant_format == "float8_e4m3fn", layer
    dropped = set(report["dropped"])
    assert out.keys() == (src.keys() - dropped) | new_keys
    for key in src.keys() - dropped - new_keys:  # untouched: same dtype, shape and bytes
        assert out[key].dtype == src[key].dtype and out[key].shape == src[key].shape, key
        assert torch.equal(raw(out[key]), raw(src[key])), key
    return out


# ---- conversion round trips --------------------------------------------------------------------------------

def test_bf16_checkpoint_converts_to_comfyui_nvfp4(tmp_path, force_nvfp4_compute, clean_models):
    src = write(tmp_path / "h3_bf16.safetensors", bf16_state_dict(), {"origin": "bf16 test file"})
    calls = []
    report = checkpoint.convert_to_nvfp4(src, tmp_path / "h3_nvfp4.safetensors",
                                         progress=lambda *args: calls.append(args))
    assert report["source_formats"] == {"unquantized BF16": len(BLOCK_LAYERS)}
    out = assert_converted(src, tmp_path / "h3_nvfp4.safetensors", report, "", BLOCK_LAYERS, [])
    assert all(out[f"{layer}.weight"].dtype == torch.bfloat16 for layer in REFINER_LAYERS)

    assert len(calls) == report["tensors"]
    done = [c[0] for c in calls]
    assert done == sorted(done) and calls[-1][0] == calls[-1][1] == sum(raw(t).numel() for t in out.values())
    assert read_all(tmp_path / "h3_nvfp4.safetensors")[1] == {"origin": "bf16 test file"}
    assert sorted(os.listdir(tmp_path)) == ["h3_bf16.safetensors", "h3_nvfp4.safetensors"]


@pytest.mark.parametrize("style, prefix, layers", [
    ("comfy_quant", "", checkpoint.DEFAULT_LAYERS),
    ("quantization_metadata", PREFIXED, checkpoint.DEFAULT_LAYERS),
    ("scaled_fp8", "", checkpoint.DEFAULT_LAYERS),
    ("scaled_fp8", PREFIXED, list(PROJECTIONS)),  # every fp8 layer: the marker goes too
])
def test_fp8_scaled_checkpoint_converts_to_comfyui_nvfp4(tmp_path, force_nvfp4_compute, clean_models, style, prefix,
                                                        layers):
    sd, metadata = fp8_scaled_state_dict(style, prefix)
    src = write(tmp_path / "h3_fp8.safetensors", sd, metadata)
    dest = tmp_path / "h3_nvfp4.safetensors"
    scales = {"blocks.1.mlp.fc1": 3.0 / GLOBAL_SCALE_DIVISOR}
    report = checkpoint.convert_to_nvfp4(src, dest, layers=layers, input_scales=scales)
    converted = BLOCK_LAYERS if layers == checkpoint.DEFAULT_LAYERS else sorted(BLOCK_LAYERS + REFINER_LAYERS)
    kept = [layer for layer in REFINER_LAYERS if layer not in converted]
    out = assert_converted(src, dest, report, prefix, converted, kept)

    assert report["source_formats"] == {"float8_e4m3fn": len(converted)}
    assert report["input_scales"] == scales
    for layer in converted:  # the fp8 activation scale does not carry over to NVFP4
        expected = torch.tensor(scales[layer], dtype=torch.float32) if layer in scales else None
        got = out.get(f"{prefix}{layer}.input_scale")
        assert (got is None) if expected is None else torch.equal(got, expected), layer
    assert (f"{prefix}scaled_fp8" in out) == (style == "scaled_fp8" and bool(kept))
    out_meta = read_all(dest)[1]
    assert out_meta["origin"] == "fp8 test file"
    if style == "quantization_metadata":
        listed = json.loads(out_meta[checkpoint.QUANT_METADATA_KEY])["layers"]
        assert {k: v["format"] for k, v in listed.items()} == {
            layer: "nvfp4" if layer in converted else "float8_e4m3fn" for layer in BLOCK_LAYERS + REFINER_LAYERS}


# ---- static input scales -----------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", PREFIXED])
def test_input_scales_land_as_the_layers_input_scale(tmp_path, force_nvfp4_compute, clean_models, prefix):
    src = write(tmp_path / "h3_nvfp4.safetensors", nvfp4_state_dict(prefix), {"origin": "community NVFP4"})
    dest = tmp_path / "h3_nvfp4_static.safetensors"
    scales = {"blocks.0.attn.qkv_proj": 12.5 / GLOBAL_SCALE_DIVISOR,
              f"{prefix}blocks.1.mlp.fc2": 0.5 / GLOBAL_SCALE_DIVISOR,  # replaces the file's own
              "token_refiner.blocks.0.mlp.fc1": 0.01}
    report = checkpoint.save_with_input_scales(src, dest, scales, {"calibration": "{\"prompts\": 4}"})
    assert report["replaced"] == ["blocks.1.mlp.fc2"]

    src_sd, _ = read_all(src)
    out, meta = read_all(dest)
    assert meta == {"origin": "community NVFP4", "calibration": "{\"prompts\": 4}"}
    expected = {f"{prefix}{name.removeprefix(prefix)}.input_scale": torch.tensor(value, dtype=torch.float32)
                for name, value in scales.items()}
    assert out.keys() == src_sd.keys() | expected.keys()
    for key, value in expected.items():
        assert out[key].dtype == torch.float32 and out[key].shape == () and torch.equal(out[key], value), key
    for key in src_sd.keys() - expected.keys():
        assert torch.equal(raw(out[key]), raw(src_sd[key])), key

    dm = load_in_comfyui(dest)
    for key, value in expected.items():
        layer = key[len(prefix):-len(".input_scale")]
        assert torch.equal(module(dm, layer).input_scale.detach(), value), layer
    assert torch.equal(module(dm, "blocks.0.mlp.fc2").input_scale.detach(),
                       torch.tensor(synthetic.STATIC_INPUT_SCALE["mlp.fc2"], dtype=torch.float32))


def test_overwrite_replaces_the_destination(tmp_path):
    src = write(tmp_path / "h3_nvfp4.safetensors", nvfp4_state_dict())
    dest = tmp_path / "out.safetensors"
    dest.write_bytes(b"old")
    checkpoint.save_with_input_scales(src, dest, {"blocks.0.mlp.fc1": 0.01}, {}, overwrite=True)
    assert torch.equal(read_all(dest)[0]["blocks.0.mlp.fc1.input_scale"], torch.tensor(0.01))
    assert sorted(os.listdir(tmp_path)) == ["h3_nvfp4.safetensors", "out.safetensors"]


# ---- refusals ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory, comfyui):
    folder = tmp_path_factory.mktemp("sources")
    convrot = bf16_state_dict()
    for layer in BLOCK_LAYERS:
        convrot[f"{layer}.weight"] = torch.zeros(convrot[f"{layer}.weight"].shape, dtype=torch.int8)
        convrot[f"{layer}.weight_scale"] = torch.ones(convrot[f"{layer}.weight"].shape[0], dtype=torch.float32)
        convrot[f"{layer}.comfy_quant"] = tag("int8_tensorwise", convrot=True)
    return {
        "bf16": write(folder / "bf16.safetensors", bf16_state_dict()),
        "nvfp4": write(folder / "nvfp4.safetensors", nvfp4_state_dict()),
        "convrot": write(folder / "convrot.safetensors", convrot),
        "not_h3": write(folder / "flux.safetensors", {"double_blocks.0.img_attn.qkv.weight": torch.zeros(48, 16)}),
    }


def _fail_on_third_write(monkeypatch):
    real = safetensors_io._write_bytes
    calls = []

    def write_bytes(handle, data):
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(handle, data)

    monkeypatch.setattr(safetensors_io, "_write_bytes", write_bytes)


def _no_free_space(monkeypatch):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4096))


REFUSALS = {
    "target exists": (None, lambda s, d: checkpoint.convert_to_nvfp4(s["bf16"], d / "existing.safetensors"),
                      checkpoint.CheckpointRefused, "already exists"),
    "not an H3 checkpoint": (None, lambda s, d: checkpoint.convert_to_nvfp4(s["not_h3"], d / "x.safetensors"),
                             checkpoint.CheckpointRefused, "not a MiniMax H3"),
    "scale for a bf16 layer": (None, lambda s, d: checkpoint.save_with_input_scales(
        s["bf16"], d / "x.safetensors", {"blocks.0.attn.qkv_proj": 0.01}, {}),
        checkpoint.CheckpointRefused, "not NVFP4 in the result"),
    "scale for a layer left bf16": (None, lambda s, d: checkpoint.convert_to_nvfp4(
        s["bf16"], d / "x.safetensors", input_scales={"token_refiner.blocks.0.mlp.fc1": 0.01}),
        checkpoint.CheckpointRefused, "not NVFP4 in the result"),
    "scale for an unknown layer": (None, lambda s, d: checkpoint.save_with_input_scales(
        s["nvfp4"], d / "x.safetensors", {"blocks.7.attn.qkv_proj": 0.01}, {}),
        checkpoint.CheckpointRefused, "no such Linear layer"),
    "scale not positive": (None, lambda s, d: checkpoint.save_with_input_scales(
        s["nvfp4"], d / "x.safetensors", {"blocks.0.attn.qkv_proj": math.nan}, {}),
        checkpoint.CheckpointRefused, "positive finite"),
    "scale inf as fp32": (None, lambda s, d: checkpoint.save_with_input_scales(
        s["nvfp4"], d / "x.safetensors", {"blocks.0.attn.qkv_proj": 1e300}, {}),
        checkpoint.CheckpointRefused, "positive finite number as the fp32"),
    "scale 0 as fp32": (None, lambda s, d: checkpoint.save_with_input_scales(
        s["nvfp4"], d / "x.safetensors", {"blocks.0.attn.qkv_proj": 1e-300}, {}),
        checkpoint.CheckpointRefused, "positive finite number as the fp32"),
    "scale inf as fp32 converting": (None, lambda s, d: checkpoint.convert_to_nvfp4(
        s["bf16"], d / "x.safetensors", input_scales={"blocks.0.mlp.fc2": 3.5e38}),
        checkpoint.CheckpointRefused, "positive finite number as the fp32"),
    "selected layer missing": (None, lambda s, d: checkpoint.convert_to_nvfp4(
        s["bf16"], d / "x.safetensors", layers=["blocks.0.mlp.fc1", "blocks.9.mlp.fc1"]),
        checkpoint.CheckpointRefused, "'blocks.9.mlp.fc1' is not a Linear layer"),
    "pattern matches nothing": (None, lambda s, d: checkpoint.convert_to_nvfp4(
        s["bf16"], d / "x.safetensors", layers=r"single_blocks\.\d+\.linear1"),
        checkpoint.CheckpointRefused, "no Linear layer"),
    "int8 convrot source": (None, lambda s, d: checkpoint.convert_to_nvfp4(s["convrot"], d / "x.safetensors"),
                            checkpoint.CheckpointRefused, "stored as int8_tensorwise.*not supported"),
    "already NVFP4": (None, lambda s, d: checkpoint.convert_to_nvfp4(s["nvfp4"], d / "x.safetensors"),
                      checkpoint.CheckpointRefused, "already NVFP4"),
    "disk full mid-file": (_fail_on_third_write, lambda s, d: checkpoint.convert_to_nvfp4(
        s["bf16"], d / "x.safetensors"), OSError, "No space left"),
    "disk full adding scales": (_fail_on_third_write, lambda s, d: checkpoint.save_with_input_scales(
        s["nvfp4"], d / "x.safetensors", {"blocks.0.mlp.fc1": 0.01}, {}), OSError, "No space left"),
    "not enough free space": (_no_free_space, lambda s, d: checkpoint.convert_to_nvfp4(s["bf16"], d / "x.safetensors"),
                              checkpoint.CheckpointRefused, "not enough free disk space"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_leave_no_file(tmp_path, sources, monkeypatch, case):
    setup, call, error, message = REFUSALS[case]
    (tmp_path / "existing.safetensors").write_bytes(b"keep me")
    if setup is not None:
        setup(monkeypatch)
    with pytest.raises(error, match=message):
        call(sources, tmp_path)
    assert os.listdir(tmp_path) == ["existing.safetensors"]
    assert (tmp_path / "existing.safetensors").read_bytes() == b"keep me"


def with_fc2_weight(tmp_path, name: str, make) -> str:
    """The bf16 source with blocks.1.mlp.fc2's weight replaced by ``make(weight)``."""
    sd = bf16_state_dict()
    sd["blocks.1.mlp.fc2.weight"] = make(sd["blocks.1.mlp.fc2.weight"])
    return write(tmp_path / name, sd)


def _poke(value):
    def make(weight):
        weight = weight.clone()
        weight[3, 5] = value
        return weight
    return make


BAD_WEIGHTS = {
    # ComfyUI's quantizer gives weight_scale_2 = 0 and every output of the layer NaN
    "all zeros": (torch.zeros_like, "blocks.1.mlp.fc2: its weight is all zeros"),
    "a NaN": (_poke(float("nan")), "blocks.1.mlp.fc2: its weight has 1 NaN"),
    "an inf": (_poke(float("inf")), "blocks.1.mlp.fc2: its weight has 1 infinite"),
    "no rows": (lambda w: w[:0], "blocks.1.mlp.fc2 has a weight of shape \\[0, "),
}


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_a_weight_nvfp4_cannot_hold_is_refused_and_nothing_is_left(tmp_path, case):
    make, message = BAD_WEIGHTS[case]
    sources_dir = tmp_path / "sources"
    sources_dir.mkdir()
    source = with_fc2_weight(sources_dir, "bad.safetensors", make)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(checkpoint.CheckpointRefused, match=message) as refused:
        checkpoint.convert_to_nvfp4(source, out / "x.safetensors")
    assert "--layers" in str(refused.value) or case == "no rows"
    assert os.listdir(out) == []


def test_a_destination_that_is_a_folder_is_refused_before_writing(tmp_path, sources, monkeypatch):
    (tmp_path / "x.safetensors").mkdir()
    written = []
    real = safetensors_io._write_bytes
    monkeypatch.setattr(safetensors_io, "_write_bytes", lambda handle, data: (written.append(1), real(handle, data)))
    with pytest.raises(checkpoint.CheckpointRefused, match="is a folder"):
        checkpoint.convert_to_nvfp4(sources["bf16"], tmp_path / "x.safetensors", overwrite=True)
    assert written == [] and os.listdir(tmp_path) == ["x.safetensors"]


# ---- the command line --------------------------------------------------------------------------------------

def run_script(*args):
    env = dict(os.environ, COMFYUI_PATH=str(ch.comfy().root), H3_FUSED_NVFP4_SELFCHECK="skip")
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "convert_h3_nvfp4.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_script_converts_with_calibrated_scales(tmp_path, sources):
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps({"layers": {"blocks.0.attn.qkv_proj": {"amax": 12.5, "samples": 3},
                                                  "blocks.1.mlp.fc2": {"amax": 3.0}}}))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dest = out_dir / "h3_nvfp4.safetensors"
    done = run_script(sources["bf16"], dest, "--device", "cpu", "--calibration", calibration, "--headroom", "1.25")
    assert done.returncode == 0, done.stderr
    assert "8 layers -> NVFP4" in done.stdout and "2 input scales" in done.stdout
    assert "100%" in done.stderr
    out, metadata = read_all(dest)
    assert json.loads(metadata["h3_fused_nvfp4.calibration"]) == {"source": "calib.json", "headroom": 1.25,
                                                                  "statistic": "max"}
    assert torch.equal(out["blocks.0.attn.qkv_proj.input_scale"],
                       torch.tensor(12.5 * 1.25 / GLOBAL_SCALE_DIVISOR, dtype=torch.float32))
    assert torch.equal(out["blocks.1.mlp.fc2.input_scale"],
                       torch.tensor(3.0 * 1.25 / GLOBAL_SCALE_DIVISOR, dtype=torch.float32))
    assert json.loads(out["blocks.1.attn.out_proj.comfy_quant"].numpy().tobytes()) == {"format": "nvfp4"}

    assert os.listdir(out_dir) == ["h3_nvfp4.safetensors"]


def load_script():
    spec = importlib.util.spec_from_file_location("convert_h3_nvfp4", REPO_ROOT / "scripts" / "convert_h3_nvfp4.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_script_adds_calibrated_scales_to_an_nvfp4_checkpoint(tmp_path, sources, capsys):
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps({"layers": {"blocks.1.attn.out_proj": {"amax": 2.0}}}))
    dest = tmp_path / "static.safetensors"
    assert load_script().main([sources["nvfp4"], str(dest), "--calibration", str(calibration)]) == 0
    assert "NVFP4 source kept, 1 input scales" in capsys.readouterr().out
    assert torch.equal(read_all(dest)[0]["blocks.1.attn.out_proj.input_scale"],
                       torch.tensor(2.0 / GLOBAL_SCALE_DIVISOR, dtype=torch.float32))


@pytest.mark.parametrize("case, calibration, message", [
    ("target exists", None, "already exists"),
    ("nvfp4 source, no calibration", None, "give --calibration"),
    ("amax missing", {"layers": {"blocks.0.mlp.fc1": {"max": 1.0}}}, "blocks.0.mlp.fc1 has no positive amax"),
    ("not a calibration file", [1, 2], "cannot read its 'layers'"),
    ("layer left bf16", {"layers": {"token_refiner.blocks.0.mlp.fc1": {"amax": 1.0}}}, "not NVFP4 in the result"),
    ("amax overflows fp32", {"layers": {"blocks.0.mlp.fc1": {"amax": 1e300}}}, "is inf as an fp32 number"),
    ("amax underflows fp32", {"layers": {"blocks.0.mlp.fc1": {"amax": 1e-300}}}, "is 0 as an fp32 number"),
    ("headroom overflows fp32", {"layers": {"blocks.0.mlp.fc1": {"amax": 12.5}}, "headroom": 1e300},
     "is inf as an fp32 number"),
    ("nvfp4 source, amax overflows fp32", {"layers": {"blocks.0.mlp.fc1": {"amax": 1e300}}},
     "is inf as an fp32 number"),
])
def test_script_refuses_in_one_line(tmp_path, sources, capsys, case, calibration, message):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "existing.safetensors").write_bytes(b"keep me")
    source = sources["nvfp4"] if case.startswith("nvfp4") else sources["bf16"]
    dest = out_dir / ("existing.safetensors" if case == "target exists" else "new.safetensors")
    argv = [source, str(dest), "--device", "cpu"]
    if calibration is not None:
        if isinstance(calibration, dict) and "headroom" in calibration:
            argv += ["--headroom", str(calibration.pop("headroom"))]
        (tmp_path / "calib.json").write_text(json.dumps(calibration))
        argv += ["--calibration", str(tmp_path / "calib.json")]
    assert load_script().main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert os.listdir(out_dir) == ["existing.safetensors"]


# ---- Save Calibrated's two files ---------------------------------------------------------------------------

class RecordedStatistics:
    """Stands in for a CalibrationRecorder after sampling: every NVFP4 layer called, fixed amax values; the model's
    source file unknown (a loader that does not say)."""

    def __init__(self, layers=tuple(BLOCK_LAYERS + REFINER_LAYERS), amax=2.0):
        self.layers = {name: None for name in layers}
        self.amax = amax
        self.source = None

    def missing(self):
        return []

    def statistics(self):
        return {name: {"amax": self.amax + i, "calls": 3, "samples": [1.0, 2.0], "p99.9": 1.5, "p99": 1.25}
                for i, name in enumerate(self.layers)}


@pytest.fixture
def models_folder(tmp_path, sources):
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    shutil.copy(sources["nvfp4"], folder / "h3_nvfp4.safetensors")
    return folder


def save_calibrated(folder, filename, overwrite=False, amax=2.0):
    return checkpoint.save_calibrated(RecordedStatistics(amax=amax), str(folder / "h3_nvfp4.safetensors"),
                                      "h3_nvfp4.safetensors", filename, 1.0, "max", overwrite)


def folder_bytes(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("filename", ["", "   ", ".safetensors", ".sft", ". .safetensors", "sub/x.safetensors",
                                      "..\\x.safetensors", "..", " x.safetensors", ".hidden"])
def test_save_calibrated_refuses_names_comfyui_would_not_list(models_folder, filename):
    before = folder_bytes(models_folder)
    with pytest.raises(ValueError, match="file name"):
        save_calibrated(models_folder, filename)
    assert folder_bytes(models_folder) == before


def test_save_calibrated_adds_the_extension(models_folder):
    assert "wrote calibrated.safetensors" in save_calibrated(models_folder, "calibrated")
    assert sorted(os.listdir(models_folder)) == ["calibrated.calibration.json", "calibrated.safetensors",
                                                 "h3_nvfp4.safetensors"]


def _fail_writing_the_statistics(monkeypatch):
    """No file of the statistics' name can be created (a full disk, a quota): the checkpoint itself was written."""
    real = os.open

    def open_(path, flags, *args, **kwargs):
        if ".calibration.json" in os.path.basename(os.fspath(path)) and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def _fail_renaming_the_statistics(monkeypatch):
    """The statistics file is complete under its temporary name, but the rename onto its name fails."""
    real, failed = os.replace, []

    def replace(src, dst, **kwargs):
        if os.fspath(dst).endswith(".calibration.json") and not failed:  # the first one; putting back works
            failed.append(dst)
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def _fail_renaming_the_checkpoint(monkeypatch):
    """The statistics file is in place, the rename of the checkpoint onto its name fails: the statistics go back."""
    real = os.replace

    def replace(src, dst, **kwargs):
        if os.fspath(dst).endswith("calibrated.safetensors"):
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("fail", [_fail_writing_the_statistics, _fail_renaming_the_statistics,
                                  _fail_renaming_the_checkpoint])
def test_save_calibrated_overwrite_never_loses_the_old_pair(models_folder, monkeypatch, fail):
    save_calibrated(models_folder, "calibrated.safetensors", amax=2.0)
    before = folder_bytes(models_folder)
    assert set(before) == {"h3_nvfp4.safetensors", "calibrated.safetensors", "calibrated.calibration.json"}
    with monkeypatch.context() as m:
        fail(m)
        with pytest.raises(OSError):
            save_calibrated(models_folder, "calibrated.safetensors", overwrite=True, amax=5.0)
    assert folder_bytes(models_folder) == before, "the earlier pair changed or a file was left behind"
    save_calibrated(models_folder, "calibrated.safetensors", overwrite=True, amax=5.0)
    after = folder_bytes(models_folder)
    assert set(after) == set(before) and after["calibrated.safetensors"] != before["calibrated.safetensors"]
    assert json.loads(after["calibrated.calibration.json"])["layers"]["blocks.0.attn.qkv_proj"]["amax"] == 5.0


def test_save_calibrated_without_overwrite_keeps_a_lone_statistics_file(models_folder):
    (models_folder / "calibrated.calibration.json").write_text("someone's notes")
    before = folder_bytes(models_folder)
    with pytest.raises(ValueError, match="exists"):
        save_calibrated(models_folder, "calibrated.safetensors")
    assert folder_bytes(models_folder) == before


@pytest.mark.parametrize("layers, message", [(BLOCK_LAYERS + REFINER_LAYERS[:-1], "were not recorded"),
                                             (BLOCK_LAYERS + REFINER_LAYERS + ["blocks.2.mlp.fc1"], "not in")])
def test_save_calibrated_refuses_a_checkpoint_with_other_nvfp4_layers(models_folder, layers, message):
    """Where ComfyUI does not say which file the model came from, the checkpoint's NVFP4 layers must be the recorded
    ones: a deeper (or shallower) checkpoint is another model."""
    before = folder_bytes(models_folder)
    with pytest.raises(ValueError, match=message):
        checkpoint.save_calibrated(RecordedStatistics(layers), str(models_folder / "h3_nvfp4.safetensors"),
                                   "h3_nvfp4.safetensors", "calibrated.safetensors", 1.0, "max", False)
    assert folder_bytes(models_folder) == before


def test_save_calibrated_refuses_another_file_than_the_models_source(models_folder):
    shutil.copy(models_folder / "h3_nvfp4.safetensors", models_folder / "copy.safetensors")
    recorded = RecordedStatistics()
    recorded.source = str(models_folder / "copy.safetensors")
    with pytest.raises(ValueError, match="loaded from copy.safetensors"):
        checkpoint.save_calibrated(recorded, str(models_folder / "h3_nvfp4.safetensors"), "h3_nvfp4.safetensors",
                                   "calibrated.safetensors", 1.0, "max", False)
    recorded.source = str(models_folder / "h3_nvfp4.safetensors")
    assert "wrote calibrated.safetensors" in checkpoint.save_calibrated(
        recorded, str(models_folder / "h3_nvfp4.safetensors"), "h3_nvfp4.safetensors", "calibrated.safetensors", 1.0,
        "max", False)


def test_save_calibrated_never_shares_a_statistics_file_between_two_checkpoints(models_folder):
    """x.safetensors and x.sft would both have x.calibration.json: the second is refused (even with overwrite),
    the first pair kept."""
    save_calibrated(models_folder, "calibrated.safetensors", amax=2.0)
    before = folder_bytes(models_folder)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="calibrated.safetensors"):
            save_calibrated(models_folder, "calibrated.sft", overwrite=overwrite, amax=5.0)
        assert folder_bytes(models_folder) == before


def test_a_dangling_link_at_the_destination_is_an_existing_file(tmp_path, sources):
    """A symbolic link whose target is missing is still a name in the folder: replaced only with overwrite."""
    dest = tmp_path / "out.safetensors"
    dest.symlink_to(tmp_path / "missing.safetensors")
    with pytest.raises(checkpoint.CheckpointRefused, match="already exists"):
        checkpoint.save_with_input_scales(sources["nvfp4"], dest, {"blocks.0.mlp.fc1": 0.01}, {})
    assert dest.is_symlink() and os.listdir(tmp_path) == ["out.safetensors"]
    checkpoint.save_with_input_scales(sources["nvfp4"], dest, {"blocks.0.mlp.fc1": 0.01}, {}, overwrite=True)
    assert not dest.is_symlink() and dest.is_file()


def name_of_length(length: int, suffix: str = ".safetensors") -> str:
    return "n" * (length - len(suffix)) + suffix


@pytest.mark.parametrize("length", [237, 247, 255])
def test_long_names_the_folder_takes_are_written(tmp_path, sources, length):
    """Any name the file system takes (255 bytes) is written: the hidden temporary names are bounded."""
    dest = tmp_path / name_of_length(length)
    checkpoint.save_with_input_scales(sources["nvfp4"], dest, {"blocks.0.mlp.fc1": 0.01}, {})
    assert os.listdir(tmp_path) == [dest.name]


def test_a_name_the_folder_cannot_take_is_refused_before_writing(tmp_path, sources, models_folder):
    with pytest.raises(checkpoint.CheckpointRefused, match="longer than"):
        checkpoint.save_with_input_scales(sources["nvfp4"], tmp_path / name_of_length(256),
                                          {"blocks.0.mlp.fc1": 0.01}, {})
    before = folder_bytes(models_folder)
    assert "wrote" in save_calibrated(models_folder, name_of_length(247))  # statistics file: 252 bytes
    with pytest.raises(ValueError, match="longer than"):  # statistics file: 256 bytes
        save_calibrated(models_folder, name_of_length(251))
    assert len(folder_bytes(models_folder)) == len(before) + 2


# ---- interrupted writes ------------------------------------------------------------------------------------

# Runs the converter with its writes stalled after the header and one tensor (printing STALLED): a signal then
# arrives while the hidden temporary file is half written, as in a real multi-GB conversion.
STALLED_CONVERTER = """
import os, runpy, sys, time
sys.path.insert(0, {root!r})
import report
report.import_pack()
from h3_fused_nvfp4.core import safetensors_io
real, calls = safetensors_io._write_bytes, []
def stalled(handle, data):
    real(handle, data)
    calls.append(1)
    if len(calls) == 2:
        handle.flush()
        print("STALLED", flush=True)
        time.sleep(600)
safetensors_io._write_bytes = stalled
sys.argv = ["convert_h3_nvfp4.py", *sys.argv[1:]]
runpy.run_path(os.path.join({root!r}, "scripts", "convert_h3_nvfp4.py"), run_name="__main__")
"""


def stalled_conversion(source, dest):
    env = dict(os.environ, COMFYUI_PATH=str(ch.comfy().root), H3_FUSED_NVFP4_SELFCHECK="skip")
    proc = subprocess.Popen([sys.executable, "-c", STALLED_CONVERTER.format(root=str(REPO_ROOT)), str(source),
                             str(dest), "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()  # the child writes nothing else to stdout before it stalls
        assert line.strip() == "STALLED", line + proc.stderr.read()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def partials(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_a_stop_signal_during_a_conversion_leaves_no_partial_file(tmp_path, sources, signum):
    """SIGTERM (a service stop), SIGHUP (a closed terminal), SIGQUIT: the converter stops with one line and removes
    its half-written file."""
    out = tmp_path / "diffusion_models"
    out.mkdir()
    proc = stalled_conversion(sources["bf16"], out / "h3_nvfp4.safetensors")
    (partial,) = partials(out)
    assert (out / partial).stat().st_size > 0
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert err.strip().count("\n") == 0 and signal.Signals(signum).name in err, err
    assert os.listdir(out) == []


def test_a_live_writer_is_never_cleaned_up_whatever_its_process_id_says(tmp_path, sources, monkeypatch):
    """A writer in another container (another PID namespace) on a shared models volume: its process id means
    nothing here (no such process, or this very process: ComfyUI as PID 1 in both). A write into the folder leaves
    the live writer's file alone, which then completes."""
    out = tmp_path / "diffusion_models"
    out.mkdir()
    proc = stalled_conversion(sources["bf16"], out / "h3_nvfp4.safetensors")
    try:
        before = hidden(out)
        for seen_as in ("no such process", "this process"):
            with monkeypatch.context() as m:
                if seen_as == "no such process":
                    m.setattr(os, "kill", lambda pid, sig: (_ for _ in ()).throw(ProcessLookupError(pid)))
                else:
                    m.setattr(os, "getpid", lambda: proc.pid)
                checkpoint.save_with_input_scales(sources["nvfp4"], out / f"next-{len(seen_as)}.safetensors",
                                                  {"blocks.0.mlp.fc1": 0.01}, {})
            assert hidden(out) == before, f"a live writer's files were touched ({seen_as})"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert hidden(out) == []


# Runs Save Calibrated with overwrite=True and dies (SIGKILL: no cleanup of any kind) at the N-th rename or link
# of the commit, as a process killed mid-way would.
KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import report
report.import_pack()
from h3_fused_nvfp4.tools import comfy_env
comfy_env.import_comfyui()
from h3_fused_nvfp4.models.h3 import checkpoint
class Recorded:  # RecordedStatistics of the test module
    layers = dict.fromkeys({layers!r})
    def missing(self):
        return []
    def statistics(self):
        return {{name: {{"amax": 5.0 + i, "calls": 3, "samples": [1.0, 2.0], "p99.9": 1.5, "p99": 1.25}}
                for i, name in enumerate(self.layers)}}
calls = []
def dying(real):
    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == {n}:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return call
os.replace, os.rename, os.link = dying(os.replace), dying(os.rename), dying(os.link)
checkpoint.save_calibrated(Recorded(), {source!r}, "h3_nvfp4.safetensors", "calibrated.safetensors", 1.0, "max",
                           True)
print("COMPLETED")
"""


@pytest.mark.parametrize("n", [1, 2, 3])
def test_an_overwriting_save_killed_mid_way_never_hides_the_checkpoint(models_folder, monkeypatch, n):
    """ComfyUI killed during an overwriting Save Calibrated (its n-th rename or link), then restarted with the same
    process id (PID 1 in a container): the checkpoint's name holds a complete file all along, and the next write
    into the folder leaves the old pair or the new one, never a mix, and no leftover."""
    save_calibrated(models_folder, "calibrated.safetensors", amax=2.0)
    old = folder_bytes(models_folder)
    env = dict(os.environ, COMFYUI_PATH=str(ch.comfy().root), H3_FUSED_NVFP4_SELFCHECK="skip")
    script = KILLED_SAVE.format(root=str(REPO_ROOT), n=n, layers=BLOCK_LAYERS + REFINER_LAYERS,
                                source=str(models_folder / "h3_nvfp4.safetensors"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, out + err[-2000:]
    assert (models_folder / "calibrated.safetensors").is_file(), "the checkpoint is hidden"
    assert folder_bytes(models_folder)["calibrated.safetensors"] in (old["calibrated.safetensors"],
                                                                   checkpoint_bytes_with_amax(models_folder, 5.0))
    monkeypatch.setattr(os, "getpid", lambda: proc.pid)  # restarted as the same process id
    save_calibrated(models_folder, "other.safetensors", amax=3.0)  # the next write into the folder
    after = {k: v for k, v in folder_bytes(models_folder).items() if not k.startswith("other.")}
    assert set(after) == set(old), sorted(after)
    pair = (after["calibrated.safetensors"], after["calibrated.calibration.json"])
    stats_amax = json.loads(pair[1])["layers"]["blocks.0.attn.qkv_proj"]["amax"]
    assert pair in ((old["calibrated.safetensors"], old["calibrated.calibration.json"]),
                    (checkpoint_bytes_with_amax(models_folder, 5.0), pair[1])), stats_amax
    assert (stats_amax == 2.0) == (pair[0] == old["calibrated.safetensors"]), "a mixed pair"


@pytest.mark.parametrize("planted", ["a name outside the folder", "another user's lock file"])
def test_a_planted_move_list_makes_the_cleanup_touch_nothing_else(tmp_path, sources, planted):
    """The moves a gone writer's lock file lists are undone only for its own temporary files, names in the folder,
    and a lock file of this user's: a planted one cannot make a later write remove or replace another file."""
    out = tmp_path / "diffusion_models"
    out.mkdir()
    victim = (tmp_path if planted == "a name outside the folder" else out) / "victim.safetensors"
    victim.write_bytes(b"someone's checkpoint")
    token = "0123456789abcdef"
    moves = [[f".victim.0.{token}.partial", "../victim.safetensors" if planted.startswith("a name") else victim.name,
              None], [f".last.1.{token}.partial", "last.safetensors", None]]
    lock = out / f".h3-fused-nvfp4.{token}.lock"
    lock.write_text(json.dumps({"moves": moves}))
    (out / moves[1][0]).write_bytes(b"the last move's file, never moved")
    if planted == "another user's lock file":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the lock file to another user")
        os.chown(lock, 65534, 65534)
    checkpoint.save_with_input_scales(sources["nvfp4"], out / "next.safetensors", {"blocks.0.mlp.fc1": 0.01}, {})
    assert victim.read_bytes() == b"someone's checkpoint"
    assert sorted(os.listdir(out)) == sorted(["next.safetensors"] + (["victim.safetensors"] if victim.parent == out
                                                                      else []))


def checkpoint_bytes_with_amax(folder, amax) -> bytes:
    """The checkpoint Save Calibrated writes for recorded amax ``amax`` (written aside and read back)."""
    scratch = folder.parent / f"scratch-{amax}"
    scratch.mkdir(exist_ok=True)
    if not (scratch / "calibrated.safetensors").exists():
        shutil.copy(folder / "h3_nvfp4.safetensors", scratch / "h3_nvfp4.safetensors")
        save_calibrated(scratch, "calibrated.safetensors", amax=amax)
    return (scratch / "calibrated.safetensors").read_bytes()


def test_leftovers_of_a_killed_writer_are_removed_by_the_next_write_to_the_folder(tmp_path, sources, caplog):
    """A writer killed outright (SIGKILL) leaves its partial file and its lock file; the next write into the folder
    removes them, and leaves those of a writer that still runs."""
    out = tmp_path / "diffusion_models"
    out.mkdir()
    running = stalled_conversion(sources["bf16"], out / "other.safetensors")
    try:
        live = hidden(out)
        assert len(live) == 2, live  # its partial file and its lock file
        killed = stalled_conversion(sources["bf16"], out / "h3_nvfp4.safetensors")
        killed.kill()
        killed.communicate(timeout=60)
        left = [name for name in hidden(out) if name not in live]
        assert len(left) == 2 and any(name.endswith(".partial") for name in left), left
        caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
        checkpoint.save_with_input_scales(sources["nvfp4"], out / "next.safetensors", {"blocks.0.mlp.fc1": 0.01}, {})
        assert sorted(os.listdir(out)) == sorted([*live, "next.safetensors"])
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert all(name in messages for name in left + live if name.endswith(".partial")), messages
        assert "in use" in messages and "left by an interrupted write" in messages, messages
    finally:
        running.send_signal(signal.SIGTERM)
        running.communicate(timeout=120)
    assert os.listdir(out) == ["next.safetensors"]
