"""Convert a MiniMax H3 diffusion checkpoint to ComfyUI NVFP4, optionally with calibrated static input scales.

    python scripts/convert_h3_nvfp4.py SOURCE.safetensors DEST.safetensors [--device cuda|cpu] [--layers REGEX]
        [--calibration calib.json] [--headroom 1.0] [--overwrite]

SOURCE is a bf16 / fp16 / fp32 or fp8_scaled H3 checkpoint; the selected Linears (default: the four projections of
every ``blocks.N``) are quantized by ComfyUI's own NVFP4 quantizer, everything else is copied unchanged. When every
selected layer of SOURCE is NVFP4 already, ``--calibration`` only adds the input scales. ``--calibration`` reads
``{"layers": {"blocks.0.attn.qkv_proj": {"amax": 12.5, ...}, ...}}`` (recorded activation amax per layer); each
layer gets ``input_scale = amax * headroom / 2688``.

Runs with ComfyUI's Python: the ComfyUI used is ``$COMFYUI_PATH``, the one this pack is installed in, or
``../shared/comfyui`` (integration/comfy_env.py). Exits 1 with a one-line error when it refuses.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys

PACK_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_NAME = "h3_fused_nvfp4"
BAR_WIDTH = 30


def import_pack():
    """The pack under a fixed name: an installed pack's folder name is arbitrary (it may contain dashes)."""
    if PACKAGE_NAME in sys.modules:
        return sys.modules[PACKAGE_NAME]
    spec = importlib.util.spec_from_file_location(PACKAGE_NAME, PACK_ROOT / "__init__.py",
                                                  submodule_search_locations=[str(PACK_ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE_NAME] = module
    spec.loader.exec_module(module)
    return module


def read_calibration(path: str, headroom: float, divisor: float) -> dict[str, float]:
    """Layer -> input scale from a calibration file (ValueError naming what is wrong)."""
    try:
        with open(path, encoding="utf-8") as handle:
            layers = json.load(handle)["layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"calibration file {path}: cannot read its 'layers' ({exc})") from exc
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"calibration file {path}: 'layers' is not a non-empty object")
    scales = {}
    for name, record in layers.items():
        amax = record.get("amax") if isinstance(record, dict) else None
        if not isinstance(amax, (int, float)) or not math.isfinite(amax) or amax <= 0:
            raise ValueError(f"calibration file {path}: layer {name} has no positive amax ({amax!r})")
        scales[name] = amax * headroom / divisor
    return scales


def text_progress(stream=None):
    stream = stream or sys.stderr

    def show(done: int, total: int, name: str) -> None:
        fraction = done / total if total else 1.0
        filled = int(fraction * BAR_WIDTH)
        line = (f"\r[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {fraction:4.0%} "
                f"{done / 2**30:.2f}/{total / 2**30:.2f} GiB  {name[-48:]:<48}")
        stream.write(line + ("\n" if done >= total else ""))
        stream.flush()
    return show


def parse_args(argv):
    summary, _usage, details = __doc__.split("\n\n", 2)
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="H3 diffusion checkpoint (.safetensors): bf16/fp16/fp32 or fp8_scaled")
    parser.add_argument("dest", help="NVFP4 checkpoint to write (.safetensors)")
    parser.add_argument("--device", default=None, choices=("cuda", "cpu"),
                        help="where to quantize (default: cuda if available); the bytes are ComfyUI's own "
                             "quantization on that device")
    parser.add_argument("--layers", default=None,
                        help="regex over layer names relative to the model, full match (default: the four "
                             "projections of every blocks.N)")
    parser.add_argument("--calibration", help="JSON file of recorded activation amax per layer")
    parser.add_argument("--headroom", type=float, default=1.0,
                        help="input_scale = amax * headroom / 2688 (default 1.0)")
    parser.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.headroom) and args.headroom > 0):
        parser.error("--headroom must be a positive number")
    return args


def run(args) -> str:
    import_pack()
    from h3_fused_nvfp4.integration import comfy_env

    comfy_env.import_comfyui()
    import torch

    from h3_fused_nvfp4.integration import checkpoint
    from h3_fused_nvfp4.layout import GLOBAL_SCALE_DIVISOR

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layers = args.layers or checkpoint.DEFAULT_LAYERS
    scales = read_calibration(args.calibration, args.headroom, GLOBAL_SCALE_DIVISOR) if args.calibration else None
    metadata = ({"h3_fused_nvfp4.input_scales": json.dumps({"calibration": pathlib.Path(args.calibration).name,
                                                             "headroom": args.headroom})}
                if args.calibration else {})
    info = checkpoint.inspect_checkpoint(args.source)
    selected = checkpoint.select_layers(info, layers)
    if all(info.layer_formats[layer] == checkpoint.NVFP4_FORMAT for layer in selected):
        if scales is None:
            raise ValueError(f"{args.source}: the selected layers are NVFP4 already; give --calibration to add "
                             "static input scales")
        report = checkpoint.save_with_input_scales(args.source, args.dest, scales, metadata,
                                                   progress=text_progress(), overwrite=args.overwrite)
        return (f"wrote {report['dest']}: NVFP4 source kept, {len(report['input_scales'])} input scales, "
                f"{report['bytes'] / 2**30:.2f} GiB in {report['seconds']:.1f} s")
    report = checkpoint.convert_to_nvfp4(args.source, args.dest, layers=layers, input_scales=scales, device=device,
                                         metadata=metadata, progress=text_progress(), overwrite=args.overwrite)
    formats = ", ".join(f"{n} from {fmt}" for fmt, n in report["source_formats"].items())
    return (f"wrote {report['dest']}: {len(report['converted'])} layers -> NVFP4 ({formats}) on {report['device']}, "
            f"{len(report['input_scales'])} input scales, {report['bytes'] / 2**30:.2f} GiB in "
            f"{report['seconds']:.1f} s")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        print(run(args))
    except (ValueError, OSError, RuntimeError) as exc:  # refusals (CheckpointRefused is a ValueError), I/O
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
