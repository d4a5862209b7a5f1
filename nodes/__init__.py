"""ComfyUI nodes of the H3 Fused NVFP4 pack (V3 API). Thin: each ``execute`` calls models/.

Node ids are stable (workflows depend on them):
    H3FusedNVFP4Loader          load any diffusion model like UNETLoader and patch its NVFP4 Linears (H3: blocks too)
    H3FusedNVFP4Patch           patch any MODEL from another loader (e.g. after a LoRA loader)
    H3FusedNVFP4Toggle          choose the fused path or ComfyUI's own path on a clone (A/B in one graph)
    H3FusedNVFP4Calibrate       a clone that records every NVFP4 layer's activation amax while it samples
    H3FusedNVFP4SaveCalibrated  write a new checkpoint: the source file + a static input_scale per layer
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from comfy_api.latest import ComfyExtension, io, ui

from .. import comfy_adapter
from ..core.calibration import STATISTICS, recorder_of
from ..models import patch
from ..models.h3 import checkpoint

log = logging.getLogger("h3_fused_nvfp4")

CATEGORY = "model/h3 fused nvfp4"
WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]  # as ComfyUI's UNETLoader
PATHS = ["fused", "comfy"]
# Off the GPU the fused path runs the exact Python reference instead of the kernels: only useful for tests.
REFERENCE_ON_CPU = os.environ.get("H3_FUSED_NVFP4_REFERENCE_ON_CPU") == "1"

SCOPE_TOOLTIP = (
    "block (fastest): every NVFP4 Linear's activation pack, and on MiniMax H3 the whole block around its NVFP4 "
    "Linears: RMSNorm (norm1 / norm2) folded into the activation packs, adaLN modulation, SwiGLU folded into fc2's "
    "pack (token-refiner blocks too), the gated residuals, per-head RMSNorm + RoPE on q and k, and the hand-over of "
    "norm statistics between consecutive blocks; on Wan 2.1 / 2.2 its block the same way: LayerNorm (norm1 / norm2 / "
    "norm3) folded into the activation packs with the addcmul modulation (one pack for q, k and v), GELU folded into "
    "ffn.2's pack, the residuals, full-width RMSNorm + RoPE on q and k (other models have no block fusion: block and "
    "linears patch the same). linears: only replaces each NVFP4 Linear's activation pack (SwiGLU, GELU and "
    "everything else run ComfyUI's ops). Both are bit-identical to ComfyUI."
)


def _input(cls, *args, advanced: bool = False, **kwargs):
    """Build an input, marking it advanced where this ComfyUI supports that flag."""
    if advanced and "advanced" in inspect.signature(cls.__init__).parameters:
        kwargs["advanced"] = True
    return cls(*args, **kwargs)


def _scope_input():
    return _input(io.Combo.Input, "scope", options=list(patch.SCOPES), default="block", tooltip=SCOPE_TOOLTIP,
                  advanced=True)


KEEP_SCOPE = "as patched"


def _toggle_scope_input():
    return _input(io.Combo.Input, "scope", options=[KEEP_SCOPE, *patch.SCOPES], default=KEEP_SCOPE, advanced=True,
                  tooltip=f"{KEEP_SCOPE}: the scope the Loader / Patch node used (block if none). " + SCOPE_TOOLTIP)


def _output(model, summary: str) -> io.NodeOutput:
    """The node's MODEL and its decision text as UI output (web/h3_fused_nvfp4.js shows it on the node). The nodes
    declare ``has_intermediate_output``: when ComfyUI serves them from its execution cache (the same graph queued
    again, from any tab), it sends their cached UI output again, so the text shows for a cached run too."""
    return io.NodeOutput(model, ui=ui.PreviewText(summary))


def _diffusion_model_options(weight_dtype: str) -> dict:
    options = {}
    if weight_dtype == "fp8_e4m3fn":
        options["dtype"] = torch.float8_e4m3fn
    elif weight_dtype == "fp8_e4m3fn_fast":
        options["dtype"] = torch.float8_e4m3fn
        options["fp8_optimizations"] = True
    elif weight_dtype == "fp8_e5m2":
        options["dtype"] = torch.float8_e5m2
    return options


def load_and_patch(unet_name: str, weight_dtype: str, scope: str):
    path = comfy_adapter.diffusion_model_path(unet_name)
    model = comfy_adapter.load_diffusion_model(path, _diffusion_model_options(weight_dtype))
    return patch.apply_fused(model, scope, allow_reference_backend=REFERENCE_ON_CPU)


class H3FusedNVFP4Loader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3FusedNVFP4Loader",
            display_name="Load Diffusion Model (Fused NVFP4)",
            category=CATEGORY,
            has_intermediate_output=True,  # see _output
            description=(
                "Loads any diffusion model file exactly like 'Load Diffusion Model' and replaces the activation "
                "packing of every NVFP4 Linear with a fused CUDA kernel; on MiniMax H3 and Wan it also fuses "
                "the elementwise ops of each block around them. Output is bit-identical to ComfyUI's; models without "
                "NVFP4 layers load unchanged."
            ),
            inputs=[
                io.Combo.Input("unet_name", options=comfy_adapter.diffusion_model_names(),
                               tooltip="Diffusion model file from models/diffusion_models "
                                       "(any model; NVFP4 layers get fused)."),
                _input(io.Combo.Input, "weight_dtype", options=WEIGHT_DTYPES, default="default", advanced=True,
                       tooltip="Same as 'Load Diffusion Model': cast non-quantized weights (default keeps them)."),
                _scope_input(),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, unet_name, weight_dtype="default", scope="block") -> io.NodeOutput:
        model, report = load_and_patch(unet_name, weight_dtype, scope)
        return _output(model, report.summary())


class H3FusedNVFP4Patch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3FusedNVFP4Patch",
            display_name="Patch Model (Fused NVFP4)",
            category=CATEGORY,
            has_intermediate_output=True,  # see _output
            description=(
                "Applies the fused NVFP4 path to any MODEL from any loader (for example after a LoRA loader): "
                "every NVFP4 Linear, plus the block fusion on MiniMax H3 and Wan. Works on a clone; the input model is "
                "untouched. Models without NVFP4 layers pass through."
            ),
            inputs=[io.Model.Input("model",
                                   tooltip="Any model; its NVFP4 Linears get fused (MiniMax H3, Wan: its blocks "
                                           "too)."),
                    _scope_input()],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, scope="block") -> io.NodeOutput:
        patched, report = patch.apply_fused(model, scope, allow_reference_backend=REFERENCE_ON_CPU)
        return _output(patched, report.summary())


class H3FusedNVFP4Toggle(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3FusedNVFP4Toggle",
            display_name="Fused NVFP4 Toggle",
            category=CATEGORY,
            has_intermediate_output=True,  # see _output
            description=(
                "Chooses, on a clone of any model, between the fused kernels and ComfyUI's own NVFP4 path. "
                "Both give the "
                "same bits; use it to A/B speed or to rule the pack out when debugging."
            ),
            inputs=[
                io.Model.Input("model", tooltip="Any model (patched or not); the output is a clone."),
                io.Combo.Input("path", options=PATHS, default="fused",
                               tooltip="fused: this pack's kernels. comfy: ComfyUI's stock packer and linear path."),
                _toggle_scope_input(),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, path="fused", scope=KEEP_SCOPE) -> io.NodeOutput:
        if path == "comfy":
            clone, summary = patch.apply_comfy(model)
            return _output(clone, summary)
        if scope == KEEP_SCOPE:
            scope = patch.patched_scope(model)
        patched, report = patch.apply_fused(model, scope, allow_reference_backend=REFERENCE_ON_CPU)
        return _output(patched, report.summary())


class H3FusedNVFP4Calibrate(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3FusedNVFP4Calibrate",
            display_name="Calibrate H3 NVFP4 Scales",
            category=CATEGORY,
            has_intermediate_output=True,  # see _output
            description=(
                "Records, while the model samples, the largest activation every NVFP4 layer of the H3 blocks sees "
                "(on the GPU, no slowdown from host syncs). Sample with it as usual, then save the scales with "
                "'Save Calibrated H3 NVFP4': a checkpoint with static input_scale needs fewer passes per layer."
            ),
            inputs=[io.Model.Input("model", tooltip="A MiniMax H3 model with NVFP4 layers (fused or not).")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model) -> io.NodeOutput:
        clone, summary = patch.apply_calibration(model, allow_reference_backend=REFERENCE_ON_CPU)
        log.info(summary)
        return _output(clone, summary)


def save_calibrated(model, unet_name: str, filename: str, headroom: float, statistic: str, overwrite: bool,
                    progress=None) -> str:
    """Write models/diffusion_models/<filename>: ``unet_name`` unchanged + the recorded input scales, and the
    statistics as JSON beside it (both or neither). Returns the summary line."""
    source = comfy_adapter.diffusion_model_path(unet_name)
    return checkpoint.save_calibrated(recorder_of(model), source, unet_name, filename, headroom, statistic, overwrite,
                                      progress)


class H3FusedNVFP4SaveCalibrated(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3FusedNVFP4SaveCalibrated",
            display_name="Save Calibrated H3 NVFP4",
            category=CATEGORY,
            is_output_node=True,
            description=(
                "Writes a NEW checkpoint into models/diffusion_models: the source file's tensors unchanged plus an "
                "fp32 input_scale = amax x headroom / 2688 for every NVFP4 layer the calibrating model recorded, "
                "and the statistics as JSON beside it. Streams tensor by tensor; nothing is left behind on failure."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The calibrating MODEL, after a sampler ran with it."),
                io.Latent.Input("samples", optional=True,
                                tooltip="The sampler's output: connect it so this node runs after the sampling."),
                io.Combo.Input("unet_name", options=comfy_adapter.diffusion_model_names(),
                               tooltip="The checkpoint the model was loaded from (its tensors are copied); "
                                       "another file is refused."),
                io.String.Input("filename", default="h3_nvfp4_calibrated.safetensors",
                                tooltip="New file name in models/diffusion_models."),
                io.Float.Input("headroom", default=1.0, min=0.5, max=4.0, step=0.05,
                               tooltip="Multiplies the recorded amax: above 1 leaves room for larger activations "
                                       "than the calibration run saw (less saturation, coarser steps)."),
                _input(io.Combo.Input, "statistic", options=list(STATISTICS), default="max", advanced=True,
                       tooltip="max: the largest amax seen. p99.9 / p99: a percentile of the per-call maxima "
                               "(clips rare outlier calls)."),
                _input(io.Boolean.Input, "overwrite", default=False, advanced=True,
                       tooltip="Replace an existing file of that name."),
            ],
            outputs=[],
        )

    @classmethod
    def execute(cls, model, unet_name, filename, headroom=1.0, statistic="max", overwrite=False,
                samples=None) -> io.NodeOutput:
        bar = comfy_adapter.progress_bar(1000)

        def progress(done, total, name):
            bar.update_absolute(int(1000 * done / max(total, 1)), 1000)

        summary = save_calibrated(model, unet_name, filename, headroom, statistic, overwrite, progress)
        log.info(summary)
        return io.NodeOutput(ui=ui.PreviewText(summary))


NODES = [H3FusedNVFP4Loader, H3FusedNVFP4Patch, H3FusedNVFP4Toggle, H3FusedNVFP4Calibrate, H3FusedNVFP4SaveCalibrated]


class H3FusedNVFP4Extension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES
