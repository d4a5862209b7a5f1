"""What a static input_scale costs in accuracy: per NVFP4 layer of real ComfyUI H3 blocks, the relative error of the
layer's output against the bf16 product (the same NVFP4 weight, the activation not quantized), with ComfyUI's
dynamic scale and with a static scale calibrated on other inputs.

    python benchmarks/calibration_trade.py [--out FILE] [--headroom 1.0 --headroom 1.25]

The blocks have random weights and the inputs are random: the figures are indicative of the mechanism (held-out
inputs, saturation above the calibrated amax), not of MiniMax H3's real activations; run the same measurement on a
real model's recorded activations before relying on a calibrated checkpoint. GPU at full H3 width, else a small CPU run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import report  # noqa: E402  (the repository's report.py: imports this folder as the package h3_fused_nvfp4)

report.import_pack()

from h3_fused_nvfp4.core import calibration as calibrate  # noqa: E402
from h3_fused_nvfp4.tools import comfy_env  # noqa: E402
from h3_fused_nvfp4.tools import synthetic as syn
from h3_fused_nvfp4.tools.report import device_info  # noqa: E402


def run_blocks(blocks, inputs, layer_forward) -> None:
    """Run ``blocks`` on ``inputs`` with every NVFP4 layer's forward replaced by ``layer_forward(name, layer)``."""
    layers = [(f"blocks.{i}.{p}", b.get_submodule(p)) for i, b in enumerate(blocks) for p in syn.LINEAR_PATHS]
    for name, layer in layers:
        layer.forward = layer_forward(name, layer)
    try:
        x, t_emb, segments, rope = inputs
        h = x.clone()
        with torch.inference_mode():
            for i, b in enumerate(blocks):
                h = b(h, t_emb, segments, rope, transformer_options={"block_index": i})
    finally:
        for _, layer in layers:
            del layer.__dict__["forward"]


def capture_inputs(blocks, inputs) -> dict[str, torch.Tensor]:
    """Every NVFP4 layer's input on ComfyUI's path (the held-out run)."""
    seen: dict[str, torch.Tensor] = {}

    def capturing(name, layer):
        stock = type(layer).forward.__get__(layer)

        def forward(x, *args, **kwargs):
            seen.setdefault(name, x.detach().clone())
            return stock(x, *args, **kwargs)
        return forward

    run_blocks(blocks, inputs, capturing)
    return seen


def relative_error(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--headroom", type=float, action="append")
    args = parser.parse_args()
    headrooms = args.headroom or [1.0, 1.25]
    comfy_env.import_comfyui()
    import logging

    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dims, tokens = (syn.H3_FULL, syn.FULL_TOKENS) if cuda else (syn.H3_SMALL, (19, 46, 245))
    blocks = [syn.make_dit_block(dims, seed=100 + i, device=device) for i in range(2)]
    recorder = calibrate.CalibrationRecorder()  # what the Calibrate node records, over two inputs
    for seed in (1, 2):
        run_blocks(blocks, syn.make_block_inputs(dims, tokens, seed=seed, device=device),
                   lambda name, layer: calibrate.RecordingForward(layer, name, recorder))
    stats = recorder.statistics()
    scales = {h: calibrate.input_scales(stats, h) for h in headrooms}  # what Save Calibrated writes
    held_out = capture_inputs(blocks, syn.make_block_inputs(dims, tokens, seed=3, device=device))
    results = {}
    for name, x in held_out.items():
        layer = blocks[int(name.split(".")[1])].get_submodule(name.split(".", 2)[2])
        amax = stats[name]["amax"]
        with torch.inference_mode():
            ref = torch.nn.functional.linear(x, layer.weight.dequantize().to(x.dtype))
            entry = {"held_out_amax": float(x.abs().amax()), "calibrated_amax": amax,
                     "dynamic": relative_error(layer(x), ref)}
            for headroom in headrooms:
                layer.input_scale = torch.nn.Parameter(
                    torch.tensor(scales[headroom][name], dtype=torch.float32, device=device), requires_grad=False)
                try:
                    entry[f"static_headroom_{headroom}"] = relative_error(layer(x), ref)
                finally:
                    del layer.input_scale
        results[name] = entry
    out = {"benchmark": "relative error of NVFP4 linear outputs vs the bf16 product, dynamic vs static input scale",
           "command": shlex.join(["python", "benchmarks/calibration_trade.py", *sys.argv[1:]]),
           "device": device_info(torch.device(device)),
           "inputs": "random activations through random-weight real ComfyUI DiTBlocks; static scales calibrated on "
                     "two inputs, measured on a third (held out): indicative only",
           "dims": dims.label, "tokens": sum(tokens), "layers": results}
    path = pathlib.Path(args.out or f"calibration-trade-{device}.json")
    path.write_text(json.dumps(out, indent=1))
    print(f"{'layer':28s} {'dynamic':>9s} " + " ".join(f"{'static x' + str(h):>12s}" for h in headrooms))
    for name, e in results.items():
        print(f"{name:28s} {e['dynamic']:9.5f} " + " ".join(f"{e[f'static_headroom_{h}']:12.5f}" for h in headrooms))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
