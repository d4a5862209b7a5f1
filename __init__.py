"""H3 Fused NVFP4: exact fused NVFP4 kernels for MiniMax H3 in ComfyUI.

ComfyUI calls :func:`comfy_entrypoint` (V3 node API). Everything ComfyUI-specific is imported lazily so
that the kernels and references can be used and tested without ComfyUI.
"""

from .version import __version__

__all__ = ["__version__", "comfy_entrypoint"]


async def comfy_entrypoint():
    from .nodes import H3FusedNVFP4Extension

    return H3FusedNVFP4Extension()

# ComfyUI serves this folder to its frontend (web/h3_fused_nvfp4.js shows each node's decision text on the node).
WEB_DIRECTORY = "./web"
