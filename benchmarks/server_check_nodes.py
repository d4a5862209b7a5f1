"""Nodes for benchmarks/real_server.py: the step copies this file into the ComfyUI it starts, as the custom node
``custom_nodes/h3_server_check/__init__.py`` beside the pack. It changes nothing of the pack.

* **NVFP4 compute on a GPU without an FP4 GEMM.** ComfyUI runs NVFP4 activations only with an FP4 GEMM (compute
  capability 10 or 12); on the H200 (sm_90) or a CPU it keeps NVFP4 layers in full precision, so neither arm would
  run the path under test. There this node calls the pack's ``tools/comfy_env.force_nvfp4_compute("auto")`` at
  startup, as the benchmarks do in-process: ComfyUI then runs its NVFP4 path with the GEMM emulated by
  comfy-kitchen (dequantize + bf16 matmul), in both arms. On Blackwell it changes nothing.
* ``H3ServerCheck_Conditioning``: a fixed random text conditioning of a given width (no text encoder file).
* ``H3ServerCheck_Calls`` (output node, after the sampler): what the pack's patches of the sampled model counted
  since the last report: NVFP4 Linear calls fused and on ComfyUI's path with their reasons, the H3 blocks' fused
  calls and hand-overs; and the model's NVFP4 Linears, those with a fused patch and those without, and the compute
  dtype ComfyUI chose.
* ``H3ServerCheck_MarkBlock`` (``real_server.py --dram``): a profiler window (``cudaProfilerStart`` / ``Stop``, a
  spin-kernel marker first) around one call of one H3 block, for Nsight Compute.
* ``GET /h3_server_check/pid``: the server's process id (to stop it with SIGINT under ncu).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import pathlib
import sys
import weakref

import comfy.model_management
import torch

log = logging.getLogger("h3_server_check")
NVFP4_LAYOUT = "TensorCoreNVFP4Layout"
PACK = pathlib.Path(os.environ.get("H3_SERVER_CHECK_PACK", pathlib.Path(__file__).resolve().parents[1] /
                                   "h3-fused-nvfp4"))


def _force_nvfp4_compute() -> None:
    device = comfy.model_management.get_torch_device()
    if comfy.model_management.supports_nvfp4_compute(device):
        return
    spec = importlib.util.spec_from_file_location("h3_server_check_comfy_env", PACK / "tools" / "comfy_env.py")
    comfy_env = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = comfy_env  # its dataclasses look their module up
    spec.loader.exec_module(comfy_env)
    comfy_env.force_nvfp4_compute("auto")
    log.info("H3 server check: %s has no FP4 GEMM: NVFP4 compute forced on, the GEMM emulated in both arms", device)


_force_nvfp4_compute()


class H3ServerCheck_Conditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": ("INT", {"default": 64, "min": 1, "max": 65536}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 4096}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing/h3 server check"

    def make(self, width, tokens, seed):
        gen = torch.Generator().manual_seed(seed)
        return ([[torch.randn((1, tokens, width), generator=gen), {}]],)


_seen = weakref.WeakKeyDictionary()  # patch -> its counters at the last report


def _delta(patch, now: dict) -> dict:
    before = _seen.get(patch, {})
    _seen[patch] = now
    out = {}
    for key, value in now.items():
        if isinstance(value, collections.Counter):
            out[key] = value - before.get(key, collections.Counter())
        else:
            out[key] = value - before.get(key, 0)
    return out


class H3ServerCheck_Calls:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "samples": ("LATENT",)}}

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "testing/h3 server check"

    def report(self, model, samples):
        diffusion_model = model.get_model_object("diffusion_model")
        nvfp4 = sorted(name for name, m in diffusion_model.named_modules()
                       if getattr(getattr(m, "weight", None), "_layout_cls", None) == NVFP4_LAYOUT
                       and hasattr(m, "in_features"))
        linears, blocks = {}, {}
        for key, patch in model.object_patches.items():
            name = key.removeprefix("diffusion_model.").removesuffix(".forward")
            if hasattr(patch, "calls_fused") and hasattr(patch, "stock_reasons"):
                linears[name] = _delta(patch, {"fused": patch.calls_fused,
                                               "stock": collections.Counter(patch.stock_reasons)})
            elif hasattr(patch, "counts") and hasattr(patch, "next"):
                blocks[name] = _delta(patch, {"counts": collections.Counter(patch.counts)})["counts"]
        reasons = collections.Counter()
        for value in linears.values():
            reasons.update(value["stock"])
        state = model.model_options.get("transformer_options", {}).get("h3_fused_nvfp4", {})
        result = {
            "nvfp4_linears": len(nvfp4),
            "fused_patches": len(linears),
            "nvfp4_linears_without_fused_patch": [n for n in nvfp4 if n not in linears],
            "calls_fused": sum(v["fused"] for v in linears.values()),
            "calls_stock": sum(reasons.values()),
            "stock_reasons": dict(reasons),
            "linears_not_called": sorted(n for n, v in linears.items() if v["fused"] + sum(v["stock"].values()) == 0),
            "blocks": dict(sum((collections.Counter(v) for v in blocks.values()), collections.Counter())),
            "block_calls": {name: dict(v) for name, v in sorted(blocks.items())},
            "pack_state": {k: state.get(k) for k in ("mode", "scope")},
            "compute_dtype": str(model.model.get_dtype_inference()).removeprefix("torch."),
        }
        return {"ui": {"text": [json.dumps(result)]}}


class H3ServerCheck_MarkBlock:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "block": ("INT", {"default": 1, "min": 0, "max": 1000}),
                             "call": ("INT", {"default": 2, "min": 1, "max": 1000})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "mark"
    CATEGORY = "testing/h3 server check"

    def mark(self, model, block, call):
        if not torch.cuda.is_available():  # no profiler to mark for
            return (model,)
        module = model.get_model_object("diffusion_model").blocks[block]
        seen = {"calls": 0}
        handles = []

        def before(mod, args):
            seen["calls"] += 1
            if seen["calls"] == call:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                torch.cuda._sleep(1000)

        def after(mod, args, out):
            if seen["calls"] == call:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                for handle in handles:
                    handle.remove()
                log.info("H3 server check: profiler window closed after call %d of block %d", call, block)

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        return (model,)


def _routes():
    from aiohttp import web
    from server import PromptServer

    @PromptServer.instance.routes.get("/h3_server_check/pid")
    async def pid(request):
        return web.json_response({"pid": os.getpid()})


_routes()

NODE_CLASS_MAPPINGS = {"H3ServerCheck_Conditioning": H3ServerCheck_Conditioning,
                       "H3ServerCheck_Calls": H3ServerCheck_Calls,
                       "H3ServerCheck_MarkBlock": H3ServerCheck_MarkBlock}
