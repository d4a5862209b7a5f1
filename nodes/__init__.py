"""ComfyUI nodes of the H3 Fused NVFP4 pack (V3 API). Thin: each ``execute`` calls integration/patch.py.

Node ids are stable (workflows depend on them):
    H3FusedNVFP4Loader  load a diffusion model like UNETLoader and patch its H3 blocks
    H3FusedNVFP4Patch   patch a MODEL from any other loader (e.g. after a LoRA loader)
    H3FusedNVFP4Toggle  choose the fused path or ComfyUI's own path on a clone (A/B in one graph)
"""

from __future__ import annotations

import inspect
import logging
import os

from comfy_api.latest import ComfyExtension, io, ui

from ..integration import patch

log = logging.getLogger("h3_fused_nvfp4")

CATEGORY = "model/h3 fused nvfp4"
WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]  # as ComfyUI's UNETLoader
PATHS = ["fused", "comfy"]
# Off the GPU the fused path runs the exact Python reference instead of the kernels: only useful for tests.
REFERENCE_ON_CPU = os.environ.get("H3_FUSED_NVFP4_REFERENCE_ON_CPU") == "1"

SCOPE_TOOLTIP = (
    "block: fuse adaLN modulation, SwiGLU and the gated residuals into the NVFP4 pack kernels (fastest). "
    "linears: only replace each NVFP4 Linear's activation pack. Both are bit-identical to ComfyUI."
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
    return io.NodeOutput(model, ui=ui.PreviewText(summary))


def _diffusion_model_options(weight_dtype: str) -> dict:
    import torch

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
    import comfy.sd
    import folder_paths

    path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
    model = comfy.sd.load_diffusion_model(path, model_options=_diffusion_model_options(weight_dtype))
    return patch.apply_fused(model, scope, allow_reference_backend=REFERENCE_ON_CPU)


class H3FusedNVFP4Loader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import folder_paths

        return io.Schema(
            node_id="H3FusedNVFP4Loader",
            display_name="Load H3 Diffusion Model (Fused NVFP4)",
            category=CATEGORY,
            description=(
                "Loads a diffusion model like 'Load Diffusion Model' and, for a MiniMax H3 checkpoint with NVFP4 "
                "layers, replaces ComfyUI's activation packing and the elementwise ops around it with fused CUDA "
                "kernels. Output is bit-identical to ComfyUI's; other models load unchanged."
            ),
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="Diffusion model file from models/diffusion_models (an NVFP4 H3 checkpoint)."),
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
            display_name="Patch H3 Model (Fused NVFP4)",
            category=CATEGORY,
            description=(
                "Applies the fused NVFP4 path to a MiniMax H3 model from any loader (for example after a LoRA "
                "loader). Works on a clone; the input model is untouched. Non-H3 or non-NVFP4 models pass through."
            ),
            inputs=[io.Model.Input("model", tooltip="A MiniMax H3 model with NVFP4 layers."), _scope_input()],
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
            display_name="H3 Fused NVFP4 Toggle",
            category=CATEGORY,
            description=(
                "Chooses, per model clone, between the fused kernels and ComfyUI's own NVFP4 path. Both give the "
                "same bits; use it to A/B speed or to rule the pack out when debugging."
            ),
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 model (patched or not); the output is a clone."),
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


NODES = [H3FusedNVFP4Loader, H3FusedNVFP4Patch, H3FusedNVFP4Toggle]


class H3FusedNVFP4Extension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES
