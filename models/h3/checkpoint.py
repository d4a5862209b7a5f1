"""Write MiniMax H3 diffusion checkpoints for ComfyUI: conversion to NVFP4 and calibrated static input scales.

* :func:`convert_to_nvfp4` - a bf16 / fp16 / fp32 or fp8_scaled H3 checkpoint -> ComfyUI NVFP4: the selected
  Linears (default: the four projections of every ``blocks.N``) quantized by ComfyUI's own
  ``QuantizedTensor.from_float(w_bf16, "TensorCoreNVFP4Layout")``, every other tensor copied byte for byte;
* :func:`save_with_input_scales` - an H3 checkpoint unchanged plus an fp32 ``{layer}.input_scale`` (the static
  activation scale ComfyUI's NVFP4 Linear quantizes its input with) for chosen NVFP4 layers;
* :func:`inspect_checkpoint` / :func:`select_layers` - what the file holds, read from its header and tags only;
* :func:`save_calibrated` - Save Calibrated's pair: the checkpoint with input scales and its statistics file.

Memory and safety: the source is read one tensor at a time (``safetensors.safe_open``), the destination is written
tensor by tensor after a header planned from names, dtypes and shapes, into a hidden temporary file beside it that
is fsynced and moved over the destination only once complete (core/safetensors_io.py: the destination's name
always holds a complete file, and the leftovers of a killed writer are removed by the next write into the folder).
Any failure (a refusal, an exception, a full disk, an interrupt) removes the temporary file: no partial checkpoint
is ever left where ComfyUI would list it.

How ComfyUI reads the layers, which this module follows by calling ComfyUI rather than re-implementing it:

* a Linear's format is its ``{layer}.comfy_quant`` JSON tag, overridden by the ``_quantization_metadata`` entry of
  the file's metadata, or (older fp8 files) every layer with a ``.scale_weight`` is ``float8_e4m3fn`` when the file
  has a ``scaled_fp8`` marker key (``comfy.utils.convert_old_quants``); untagged weights are unquantized;
* ``comfy.sd.load_diffusion_model`` strips the prefix ``comfy.model_detection.unet_prefix_from_state_dict`` names
  (e.g. ``model.diffusion_model.``) and detects H3 by ``video_patch_proj.weight`` + ``audio_patch_proj.weight``;
* an fp8_scaled weight computes as ``QuantizedTensor(weight_fp8, layout, Params(scale=weight_scale,
  orig_dtype=compute dtype)).dequantize()`` (``comfy.ops._load_quantized_module``; comfy-kitchen's
  ``dequantize_per_tensor_fp8``). The converter runs exactly that with H3's compute dtype bf16 on the conversion
  device, so it quantizes the bf16 weight ComfyUI computes on that device. The arithmetic is the device's:
  comfy-kitchen's CUDA kernel rounds an fp32 product to bf16, its CPU backend multiplies in bf16 (the scale rounded
  to bf16 first), so an fp8 source converted on the CPU differs in the last bit of some weights from one converted
  on CUDA; convert fp8 sources on CUDA to quantize the weight of a GPU ComfyUI.

ComfyUI must be importable: inside ComfyUI it is; standalone call ``tools/comfy_env.py import_comfyui()`` first.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import time
from typing import Iterable, Mapping, Sequence

import torch
from safetensors import safe_open

from ... import comfy_adapter
from ...core import calibration
from ...core.nvfp4_weights import comfy_quant_tag, nvfp4_checkpoint_entries
from ...core.safetensors_io import (
    ITEMSIZE,
    CheckpointRefused,
    PlannedTensor,
    Progress,
    StagedWrite,
    check_destination,
    check_metadata,
    file_order,
    write_safetensors,
)
from ...layout import NVFP4_LAYOUT, packed_shapes
from .structure import LINEAR_PATHS

NVFP4_FORMAT = "nvfp4"
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")  # fp8_scaled: fp8 weight, per-tensor fp32 weight_scale
LEGACY_FP8_MARKER = "scaled_fp8"
QUANT_METADATA_KEY = "_quantization_metadata"
DEFAULT_LAYERS = r"blocks\.\d+\.(" + "|".join(map(re.escape, LINEAR_PATHS)) + ")"
# A converted Linear's old storage; its bias is copied as it is.
_REPLACED_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "comfy_quant", "scale_weight",
                      "scale_input")
_PLAIN_WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")  # ComfyUI casts these to compute dtype

# ---- what a checkpoint holds -------------------------------------------------------------------------------

def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: str
    prefix: str  # the H3 model's key prefix in the file, as ComfyUI strips it ("" or "model.diffusion_model." ...)
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)
    metadata: dict[str, str]
    layer_formats: dict[str, str | None]  # every Linear of the H3 model (as named in the file) -> format or None
    legacy_marker: str | None  # the ``scaled_fp8`` marker key ComfyUI honours, if any

    def relative(self, layer: str) -> str:
        return layer[len(self.prefix):]

    def resolve(self, name: str) -> str | None:
        """The Linear ``name`` means, given as in the file or relative to the H3 model."""
        for candidate in (name, self.prefix + name):
            if candidate in self.layer_formats:
                return candidate
        return None

    def describe(self, layer: str) -> str:
        fmt = self.layer_formats[layer]
        return fmt if fmt is not None else f"unquantized {self.tensors[layer + '.weight'][0]}"


def _open(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # the library's errors carry no common type
        raise CheckpointRefused(f"cannot read {path} as a safetensors file: {exc}") from exc


def _h3_prefix(path: str, names: Sequence[str]) -> str:
    prefix = comfy_adapter.model_detection().unet_prefix_from_state_dict(names)
    if not any(name.startswith(prefix) for name in names):  # load_diffusion_model then keeps the keys as they are
        prefix = ""
    if f"{prefix}video_patch_proj.weight" not in names or f"{prefix}audio_patch_proj.weight" not in names:
        raise CheckpointRefused(f"{path} is not a MiniMax H3 diffusion model checkpoint: ComfyUI detects H3 by "
                                f"{prefix}video_patch_proj.weight and {prefix}audio_patch_proj.weight")
    return prefix


def _quant_metadata_layers(path: str, metadata: Mapping[str, str]) -> dict | None:
    if QUANT_METADATA_KEY not in metadata:
        return None
    try:
        layers = json.loads(metadata[QUANT_METADATA_KEY])["layers"]
        if not isinstance(layers, dict):
            raise TypeError("'layers' is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointRefused(f"{path}: unreadable {QUANT_METADATA_KEY} metadata ({exc})") from exc
    return layers


def _read_tag(handle, key: str, path: str) -> dict:
    try:
        conf = json.loads(handle.get_tensor(key).numpy().tobytes())
        if not isinstance(conf, dict):
            raise TypeError("not an object")
    except (ValueError, TypeError) as exc:
        raise CheckpointRefused(f"{path}: unreadable quantization tag {key} ({exc})") from exc
    return conf


def _inspect(handle, path: str) -> CheckpointInfo:
    names = list(handle.keys())
    tensors = {}
    for name in names:
        piece = handle.get_slice(name)
        dtype = piece.get_dtype()
        if dtype not in ITEMSIZE:
            raise CheckpointRefused(f"{path}: tensor {name} has dtype {dtype}, which this writer does not handle")
        tensors[name] = (dtype, tuple(piece.get_shape()))
    metadata = dict(handle.metadata() or {})
    prefix = _h3_prefix(path, names)
    quant_layers = _quant_metadata_layers(path, metadata)
    marker = None
    if quant_layers is None:  # ComfyUI ignores the marker when the metadata describes the layers
        marker = next((k for k in (LEGACY_FP8_MARKER, prefix + LEGACY_FP8_MARKER) if k in tensors), None)
    layers = sorted((name[:-len(".weight")] for name, (_, shape) in tensors.items()
                     if name.startswith(prefix) and name.endswith(".weight") and len(shape) == 2), key=_natural_key)
    formats: dict[str, str | None] = {}
    for layer in layers:
        conf = None
        if quant_layers is not None:  # ComfyUI applies it both before and after stripping the prefix
            conf = quant_layers.get(layer, quant_layers.get(layer[len(prefix):]))
        if conf is None and f"{layer}.comfy_quant" in tensors:
            conf = _read_tag(handle, f"{layer}.comfy_quant", path)
        if conf is not None and not isinstance(conf, dict):
            raise CheckpointRefused(f"{path}: the {QUANT_METADATA_KEY} entry of {layer} is not an object")
        if conf is None and marker is not None and f"{layer}.scale_weight" in tensors:
            conf = {"format": "float8_e4m3fn"}
        formats[layer] = None if conf is None else str(conf.get("format"))
    return CheckpointInfo(path, prefix, tensors, metadata, formats, marker)


def inspect_checkpoint(path) -> CheckpointInfo:
    """The tensors, metadata and per-Linear formats of an H3 checkpoint (refuses any other file)."""
    path = os.path.abspath(os.fspath(path))
    with _open(path) as handle:
        return _inspect(handle, path)


def select_layers(info: CheckpointInfo, layers: str | Iterable[str] = DEFAULT_LAYERS) -> list[str]:
    """Linears (file names) chosen by a regex over names relative to the model (full match), or by a list of
    names / suffixes (``"blocks.3.mlp.fc1"``, ``"attn.qkv_proj"``), each of which must match."""
    if isinstance(layers, str):
        try:
            pattern = re.compile(layers)
        except re.error as exc:
            raise CheckpointRefused(f"layer pattern {layers!r} is not a regular expression: {exc}") from exc
        chosen = [layer for layer in info.layer_formats if pattern.fullmatch(info.relative(layer))]
        if not chosen:
            raise CheckpointRefused(f"no Linear layer of {info.path} matches {layers!r}")
        return chosen
    wanted = list(layers)
    chosen_set = set()
    for entry in wanted:
        matches = [layer for layer in info.layer_formats
                   if entry in (layer, info.relative(layer)) or info.relative(layer).endswith("." + entry)]
        if not matches:
            raise CheckpointRefused(f"{entry!r} is not a Linear layer of {info.path}")
        chosen_set.update(matches)
    if not chosen_set:
        raise CheckpointRefused("no layers given")
    return [layer for layer in info.layer_formats if layer in chosen_set]


def _resolve_input_scales(info: CheckpointInfo, input_scales: Mapping[str, float],
                          nvfp4_layers: Iterable[str]) -> dict[str, float]:
    nvfp4_layers = set(nvfp4_layers)
    resolved: dict[str, float] = {}
    for name, value in input_scales.items():
        layer = info.resolve(name)
        if layer is None:
            raise CheckpointRefused(f"input scale for {name!r}: no such Linear layer in {info.path}")
        if layer not in nvfp4_layers:
            raise CheckpointRefused(f"input scale for {name!r}: the layer is not NVFP4 in the result (it is "
                                    f"{info.describe(layer)}); a static input scale applies to NVFP4 layers only")
        if calibration.stored_input_scale(value) is None:
            raise CheckpointRefused(f"input scale for {name!r} is {value!r}; it must be a positive finite number "
                                    "as the fp32 a checkpoint stores (inf or 0 there gives NaN or zero outputs)")
        scale = float(value)
        if layer in resolved:
            raise CheckpointRefused(f"input scale for {layer} is given twice")
        resolved[layer] = scale
    return resolved


def _copied(handle, info: CheckpointInfo, name: str) -> PlannedTensor:
    dtype, shape = info.tensors[name]
    return PlannedTensor(name, dtype, shape, lambda: handle.get_tensor(name))


def _scalar(name: str, value: float) -> PlannedTensor:
    return PlannedTensor(name, "F32", (), lambda: torch.tensor(value, dtype=torch.float32))


# ---- input scales ------------------------------------------------------------------------------------------

def save_with_input_scales(source_path, dest_path, input_scales: Mapping[str, float],
                           metadata: Mapping[str, str] | None = None, *, progress: Progress | None = None,
                           overwrite: bool = False) -> dict:
    """Copy an H3 checkpoint with an fp32 scalar ``{layer}.input_scale`` for each NVFP4 layer of ``input_scales``
    (layer names as in the file or relative to the model; an existing input scale of the layer is replaced).
    The file's metadata is kept, ``metadata`` merged into it. Returns a report."""
    dest = os.path.abspath(os.fspath(dest_path))
    _refuse_same_file(os.path.abspath(os.fspath(source_path)), dest)
    with StagedWrite(check_destination(dest, overwrite)) as staged:
        report = _stage_with_input_scales(staged, source_path, dest, input_scales, metadata, progress, overwrite)
        staged.commit(overwrite)
    return report


def _stage_with_input_scales(staged: StagedWrite, source_path, dest: str, input_scales, metadata, progress,
                             overwrite, every_nvfp4_layer: bool = False) -> dict:
    """:func:`save_with_input_scales` up to the move into place: the complete file staged in ``staged``.
    ``every_nvfp4_layer``: refuse unless ``input_scales`` names exactly the source's NVFP4 layers (scales recorded
    on the model loaded from that file: any other set is another model's)."""
    started = time.monotonic()
    source = os.path.abspath(os.fspath(source_path))
    _refuse_same_file(source, dest)
    metadata = dict(metadata or {})
    check_metadata(metadata)
    if not input_scales:
        raise CheckpointRefused("no input scales given")
    with _open(source) as handle:
        info = _inspect(handle, source)
        nvfp4 = [layer for layer, fmt in info.layer_formats.items() if fmt == NVFP4_FORMAT]
        if every_nvfp4_layer:
            _refuse_other_layers(info, input_scales, nvfp4)
        scales = _resolve_input_scales(info, input_scales, nvfp4)
        replaced = {f"{layer}.input_scale" for layer in scales} & info.tensors.keys()
        planned = [_copied(handle, info, name) for name in info.tensors if name not in replaced]
        planned += [_scalar(f"{layer}.input_scale", scale) for layer, scale in scales.items()]
        size = staged.stage_safetensors(dest, file_order(planned, []), {**info.metadata, **metadata},
                                        progress=progress, overwrite=overwrite)
    return {"dest": dest, "input_scales": {info.relative(layer): scale for layer, scale in scales.items()},
            "replaced": sorted(info.relative(name[:-len(".input_scale")]) for name in replaced),
            "tensors": len(planned), "bytes": size, "seconds": time.monotonic() - started}


def _refuse_other_layers(info: CheckpointInfo, recorded: Mapping[str, float], nvfp4: Sequence[str]) -> None:
    in_file = {info.relative(layer) for layer in nvfp4}
    unrecorded = sorted(in_file - set(recorded), key=_natural_key)
    foreign = sorted(set(recorded) - in_file, key=_natural_key)
    if unrecorded or foreign:
        what = (f"{len(unrecorded)} of its NVFP4 layers were not recorded (e.g. {unrecorded[0]})" if unrecorded else
                f"{len(foreign)} recorded layers are not in it (e.g. {foreign[0]})")
        raise CheckpointRefused(f"{os.path.basename(info.path)} is not the checkpoint the calibrated model was loaded "
                                f"from: {what}; choose the model's own file as unet_name")


def _refuse_same_file(source: str, dest: str) -> None:
    if os.path.exists(dest) and os.path.samefile(source, dest):
        raise CheckpointRefused(f"{dest} is the source file; write the result to a new file")


# ---- conversion to NVFP4 -----------------------------------------------------------------------------------

class _NVFP4Layer:
    """One Linear to convert: quantized when the first of its tensors is written, each result handed out once."""

    def __init__(self, handle, info: CheckpointInfo, layer: str, device: torch.device, input_scale: float | None):
        self.handle, self.info, self.layer, self.device, self.input_scale = handle, info, layer, device, input_scale
        self.format = info.layer_formats[layer]
        self._entries: dict[str, torch.Tensor] | None = None

    def planned(self) -> list[PlannedTensor]:
        rows, cols = self.info.tensors[f"{self.layer}.weight"][1]
        rows16, cols16 = comfy_adapter.quant_ops().get_layout_class(NVFP4_LAYOUT).get_padded_shape((rows, cols))
        shapes = [("weight_scale_2", "F32", ())]
        if self.input_scale is not None:
            shapes.append(("input_scale", "F32", ()))
        weight_shape, scale_shape = packed_shapes(rows16, cols16)
        shapes += [("weight", "U8", weight_shape), ("weight_scale", "F8_E4M3", scale_shape)]
        return [PlannedTensor(f"{self.layer}.{suffix}", dtype, shape, lambda s=suffix: self._take(s))
                for suffix, dtype, shape in shapes]

    def _take(self, suffix: str) -> torch.Tensor:
        if self._entries is None:
            weight = self._bf16_weight()
            _refuse_unrepresentable(self.info.relative(self.layer), weight)
            entries = nvfp4_checkpoint_entries(self.layer, weight, self.input_scale)
            del entries[f"{self.layer}.comfy_quant"]  # written with the other 1-byte tensors
            self._entries = {k: v.to("cpu") for k, v in entries.items()}
        return self._entries.pop(f"{self.layer}.{suffix}")  # dropped once written

    def _bf16_weight(self) -> torch.Tensor:
        weight = self.handle.get_tensor(f"{self.layer}.weight")
        if self.format is None:  # ComfyUI casts an unquantized weight to its compute dtype
            return weight.to(device=self.device, dtype=torch.bfloat16)
        quant_ops = comfy_adapter.quant_ops()
        algo = quant_ops.QUANT_ALGOS[self.format]
        layout = algo["comfy_tensor_layout"]
        scale = self.handle.get_tensor(_fp8_scale_key(self.info, self.layer)).to(self.device)
        params = quant_ops.get_layout_class(layout).Params(scale=scale, orig_dtype=torch.bfloat16,
                                                 orig_shape=tuple(weight.shape))
        quantized = quant_ops.QuantizedTensor(weight.to(device=self.device, dtype=algo["storage_t"]), layout, params)
        return quantized.dequantize()  # the device's arithmetic (module docstring)


def _refuse_unrepresentable(name: str, weight: torch.Tensor) -> None:
    """A weight ComfyUI's NVFP4 quantizer turns into a layer that computes NaN for every output: all zeros (its
    weight_scale_2 is 0), or a NaN or inf anywhere (the layer's one scale becomes NaN or inf). Refused, naming the
    layer; the write stops and leaves nothing."""
    nan, inf = int(torch.isnan(weight).sum()), int(torch.isinf(weight).sum())
    if nan or inf:
        what = f"{nan} NaN" if nan else f"{inf} infinite"
        problem = f"its weight has {what} value{'s' if max(nan, inf) > 1 else ''} (of {weight.numel()})"
    elif not bool(weight.any()):
        problem = "its weight is all zeros"
    else:
        return
    scale = "NaN" if nan else "inf" if inf else "0"
    raise CheckpointRefused(f"{name}: {problem}: ComfyUI's NVFP4 quantizer would store a global scale of {scale} and "
                            "the layer would compute NaN for every output. Leave it out of the conversion (--layers "
                            "with a pattern that does not match it) or fix the source")


def _fp8_scale_key(info: CheckpointInfo, layer: str) -> str:
    key = f"{layer}.weight_scale"
    return key if key in info.tensors else f"{layer}.scale_weight"


def _check_convertible(info: CheckpointInfo, layer: str) -> None:
    fmt = info.layer_formats[layer]
    name = info.relative(layer)
    if fmt == NVFP4_FORMAT:
        raise CheckpointRefused(f"{name} is already NVFP4 (add static input scales with save_with_input_scales)")
    shape = info.tensors[f"{layer}.weight"][1]
    if 0 in shape:
        raise CheckpointRefused(f"{name} has a weight of shape {list(shape)}: an empty Linear has nothing to quantize; "
                                "leave it out of the conversion (--layers)")
    if fmt is None:
        dtype = info.tensors[f"{layer}.weight"][0]
        if dtype not in _PLAIN_WEIGHT_DTYPES:
            raise CheckpointRefused(f"{name} has an unquantized {dtype} weight; only floating-point weights convert")
        return
    if fmt not in FP8_FORMATS:
        raise CheckpointRefused(f"{name} is stored as {fmt}: only bf16 / fp16 / fp32 and fp8_scaled "
                                f"({', '.join(FP8_FORMATS)}) checkpoints convert to NVFP4 (int8 convrot and w6a8 "
                                "checkpoints are not supported)")
    if _fp8_scale_key(info, layer) not in info.tensors:
        raise CheckpointRefused(f"{name} is {fmt} but has no weight_scale")


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointRefused("device cuda was asked for, but CUDA is not available")
    return device


def _quant_metadata_after(info: CheckpointInfo, converted: Sequence[str]) -> dict[str, str]:
    """The file's metadata with converted layers marked nvfp4 in ``_quantization_metadata`` (ComfyUI lets it
    override the layers' tags)."""
    metadata = dict(info.metadata)
    quant_layers = _quant_metadata_layers(info.path, metadata)
    if quant_layers is None:
        return metadata
    for layer in converted:
        for name in (layer, info.relative(layer)):
            if name in quant_layers:
                quant_layers[name] = {"format": NVFP4_FORMAT}
    document = json.loads(metadata[QUANT_METADATA_KEY])
    document["layers"] = quant_layers
    metadata[QUANT_METADATA_KEY] = json.dumps(document)
    return metadata


def convert_to_nvfp4(source_path, dest_path, *, layers: str | Iterable[str] = DEFAULT_LAYERS,
                     input_scales: Mapping[str, float] | None = None, device="cpu",
                     metadata: Mapping[str, str] | None = None, progress: Progress | None = None,
                     overwrite: bool = False) -> dict:
    """Convert the ``layers`` (see :func:`select_layers`) of a bf16 / fp16 / fp32 or fp8_scaled H3 checkpoint to
    ComfyUI NVFP4, quantized on ``device`` by ComfyUI's own ``QuantizedTensor.from_float``; fp8 weights are
    dequantized as ComfyUI does first. Their old scales / tags are dropped (the ``scaled_fp8`` marker too once no
    layer needs it), ``input_scales`` become fp32 ``input_scale`` tensors of NVFP4 layers, everything else is
    copied as it is. Returns a report."""
    started = time.monotonic()
    source = os.path.abspath(os.fspath(source_path))
    dest = os.path.abspath(os.fspath(dest_path))
    _refuse_same_file(source, dest)
    check_metadata(metadata or {})
    device = _device(device)
    with _open(source) as handle:
        info = _inspect(handle, source)
        chosen = select_layers(info, layers)
        for layer in chosen:
            _check_convertible(info, layer)
        nvfp4_after = set(chosen) | {layer for layer, fmt in info.layer_formats.items() if fmt == NVFP4_FORMAT}
        scales = _resolve_input_scales(info, input_scales or {}, nvfp4_after)

        dropped = {f"{layer}.{suffix}" for layer in chosen for suffix in _REPLACED_SUFFIXES} & info.tensors.keys()
        dropped |= {f"{layer}.input_scale" for layer in scales if layer not in chosen} & info.tensors.keys()
        remaining_legacy = [name for name in info.tensors if name.endswith(".scale_weight") and name not in dropped]
        if info.legacy_marker is not None and not remaining_legacy:
            dropped.add(info.legacy_marker)

        tag = comfy_quant_tag(NVFP4_FORMAT)
        single = [_copied(handle, info, name) for name in info.tensors if name not in dropped]
        single += [PlannedTensor(f"{layer}.comfy_quant", "U8", tuple(tag.shape), lambda: tag) for layer in chosen]
        single += [_scalar(f"{layer}.input_scale", scale) for layer, scale in scales.items() if layer not in chosen]
        groups = [_NVFP4Layer(handle, info, layer, device, scales.get(layer)).planned() for layer in chosen]
        planned = file_order(single, groups)
        size = write_safetensors(dest, planned, {**_quant_metadata_after(info, chosen), **(metadata or {})},
                                 progress=progress, overwrite=overwrite)
    source_formats = dict(collections.Counter(info.describe(layer) for layer in chosen))
    return {"dest": dest, "prefix": info.prefix, "converted": [info.relative(layer) for layer in chosen],
            "source_formats": source_formats,
            "input_scales": {info.relative(layer): scale for layer, scale in scales.items()},
            "dropped": sorted(dropped), "tensors": len(planned), "bytes": size,
            "seconds": time.monotonic() - started, "device": str(device)}


# ---- the Save Calibrated node's files ----------------------------------------------------------------------

def _json_text(value, indent=None) -> str:
    """Strict JSON: NaN / inf (e.g. a percentile of NaN-only calls) are written as null."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(value), indent=indent, allow_nan=False)


CHECKPOINT_SUFFIXES = (".safetensors", ".sft")


def checkpoint_file_name(filename: str) -> str:
    """The file name Save Calibrated writes for ``filename`` (``.safetensors`` added unless it ends with one of
    ComfyUI's checkpoint suffixes); ValueError for a name ComfyUI would not list or that leaves the folder."""
    if not isinstance(filename, str) or not filename.strip():
        raise ValueError("file name is empty: give the new checkpoint a name, e.g. h3_nvfp4_calibrated.safetensors")
    if filename != filename.strip():
        raise ValueError(f"file name {filename!r} starts or ends with white space")
    if any(sep in filename for sep in ("/", "\\", os.sep, os.altsep or "/")) or filename in (".", ".."):
        raise ValueError(f"file name {filename!r}: a plain file name, no folders (the file goes into the source's "
                         "models/diffusion_models folder)")
    if any(ord(c) < 32 for c in filename):
        raise ValueError(f"file name {filename!r} contains a control character")
    if not filename.lower().endswith(CHECKPOINT_SUFFIXES):
        filename += ".safetensors"
    stem = filename.rsplit(".", 1)[0]
    if not stem.strip(" ."):
        raise ValueError(f"file name {filename!r} is only an extension: ComfyUI lists no such file")
    if stem.startswith("."):
        raise ValueError(f"file name {filename!r} starts with '.': a hidden file")
    return filename


def statistics_file_name(filename: str) -> str:
    """The statistics file Save Calibrated writes beside checkpoint ``filename``: its name without the extension
    + ``.calibration.json``."""
    return filename.rsplit(".", 1)[0] + ".calibration.json"


def _refuse_shared_statistics(folder: str, filename: str) -> None:
    """Another checkpoint in ``folder`` (``x.sft`` beside ``x.safetensors``) has the same statistics file name: one
    save would overwrite the other's statistics."""
    stats = statistics_file_name(filename)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for other in sorted(names):
        if other != filename and other.lower().endswith(CHECKPOINT_SUFFIXES) and statistics_file_name(other) == stats:
            raise ValueError(f"{filename}: its statistics file {stats} is also the statistics file of {other}; "
                             "choose another name")


def save_calibrated(recorder, source: str, unet_name: str, filename: str, headroom: float, statistic: str,
                    overwrite: bool, progress: Progress | None = None) -> str:
    """Write ``filename`` beside ``source`` (the checkpoint ``unet_name`` the model was loaded from): its tensors
    unchanged + the recorded input scales, and the statistics as JSON beside it. Both files or neither: both are
    written completely under temporary names first, then moved into place together (the statistics first, kept
    aside until the checkpoint is in place: core/safetensors_io.py). Returns the summary line."""
    filename = checkpoint_file_name(filename)
    if recorder is None or not recorder.layers:
        raise ValueError("no calibration data: connect the MODEL that went through 'Calibrate H3 NVFP4 Scales' "
                         "and a sampler (the sampler must run before this node)")
    never = recorder.missing()
    if never:
        raise ValueError(f"{len(never)} NVFP4 layers were never called while recording (e.g. {never[0]}); "
                         "run the whole sampling with the calibrating model first")
    known = getattr(recorder, "source", None)
    if known is not None and not _same_path(known, source):
        raise ValueError(f"the calibrated model was loaded from {os.path.basename(known)}, not {unet_name}: its input "
                         f"scales go into a copy of its own file; choose {os.path.basename(known)} as unet_name")
    stats = recorder.statistics()
    scales = calibration.input_scales(stats, headroom, statistic)
    folder = os.path.dirname(os.path.abspath(source))  # the models/diffusion_models folder the source was found in
    dest = os.path.join(folder, filename)
    stats_path = os.path.join(folder, statistics_file_name(filename))
    _refuse_same_file(os.path.abspath(source), dest)
    _refuse_shared_statistics(folder, filename)
    for path in (stats_path, dest):  # before anything is written
        check_destination(path, overwrite)
    summary = {"source": unet_name, "headroom": headroom, "statistic": statistic}
    metadata = {"h3_fused_nvfp4.calibration": _json_text(
        {**summary, "layers": {k: {key: v[key] for key in ("amax", "calls", *calibration.STATISTICS[1:])}
                               for k, v in stats.items()}})}
    with StagedWrite(folder) as staged:
        staged.stage_bytes(stats_path, _json_text({**summary, "layers": stats}, indent=1).encode(),
                           overwrite=overwrite)
        report = _stage_with_input_scales(staged, source, dest, scales, metadata, progress, overwrite,
                                          every_nvfp4_layer=True)
        staged.commit(overwrite)
    unknown = ("" if known is not None else " (ComfyUI did not say which file the model was loaded from: only its "
               "NVFP4 layer names were checked against that file)")
    return (f"H3 fused NVFP4: wrote {os.path.basename(dest)} with a static input_scale for {len(scales)} layers "
            f"({statistic} x {headroom}); statistics in {os.path.basename(stats_path)}; {report['seconds']:.1f} s"
            + unknown)


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is gone
        return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))
