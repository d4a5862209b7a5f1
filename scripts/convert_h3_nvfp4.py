"""Convert a MiniMax H3 diffusion checkpoint to ComfyUI NVFP4, optionally with calibrated static input scales.

    python scripts/convert_h3_nvfp4.py SOURCE.safetensors DEST.safetensors [--device cuda|cpu] [--layers REGEX]
        [--calibration calib.json] [--headroom 1.0] [--statistic max|p99.9|p99] [--overwrite]

SOURCE is a bf16 / fp16 / fp32 or fp8_scaled H3 checkpoint; the selected Linears (default: the four projections of
every ``blocks.N``) are quantized by ComfyUI's own NVFP4 quantizer, everything else is copied unchanged. When every
selected layer of SOURCE is NVFP4 already, ``--calibration`` only adds the input scales. ``--calibration`` reads
``{"layers": {"blocks.0.attn.qkv_proj": {"amax": 12.5, ...}, ...}}`` (the statistics file the Save Calibrated node
writes, or a hand-written one); each layer gets ``input_scale = value * headroom / 2688``, value the recorded amax
or the percentile ``--statistic`` names (default: the file's ``statistic``, else max).

Runs with ComfyUI's Python: the ComfyUI used is ``$COMFYUI_PATH``, the one this pack is installed in, or
``../shared/comfyui`` (tools/comfy_env.py). Exits 1 with a one-line error when it refuses, and when it is stopped
by SIGTERM, SIGHUP (a closed terminal) or SIGQUIT (the half-written temporary file is removed first; Ctrl-C too).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import signal
import sys
import threading

PACK_ROOT = pathlib.Path(__file__).resolve().parents[1]
BAR_WIDTH = 30
sys.path.insert(0, str(PACK_ROOT))
import report  # noqa: E402  (the pack's report.py: imports this folder as the package h3_fused_nvfp4)


def read_calibration(path: str, headroom: float, statistic: str | None) -> tuple[dict[str, float], str]:
    """(layer -> input scale, statistic used) from a calibration file (ValueError naming what is wrong)."""
    from h3_fused_nvfp4.core import calibration as calibrate

    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        layers = data["layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"calibration file {path}: cannot read its 'layers' ({exc})") from exc
    statistic = statistic or data.get("statistic") or "max"
    try:
        return calibrate.input_scales(layers, headroom, statistic), statistic
    except ValueError as exc:
        raise ValueError(f"calibration file {path}: {exc}") from exc


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
    parser.add_argument("--statistic", choices=("max", "p99.9", "p99"), default=None,
                        help="which recorded value (default: the calibration file's, else max)")
    parser.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.headroom) and args.headroom > 0):
        parser.error("--headroom must be a positive number")
    return args


def run(args) -> str:
    report.import_pack()
    from h3_fused_nvfp4.tools import comfy_env

    comfy_env.import_comfyui()
    import torch

    from h3_fused_nvfp4.models.h3 import checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layers = args.layers or checkpoint.DEFAULT_LAYERS
    scales, metadata = None, {}
    if args.calibration:
        scales, statistic = read_calibration(args.calibration, args.headroom, args.statistic)
        metadata = {"h3_fused_nvfp4.calibration": json.dumps(
            {"source": pathlib.Path(args.calibration).name, "headroom": args.headroom, "statistic": statistic})}
    info = checkpoint.inspect_checkpoint(args.source)
    selected = checkpoint.select_layers(info, layers)
    if all(info.layer_formats[layer] == checkpoint.NVFP4_FORMAT for layer in selected):
        if scales is None:
            raise ValueError(f"{args.source}: the selected layers are NVFP4 already; give --calibration to add "
                             "static input scales")
        result = checkpoint.save_with_input_scales(args.source, args.dest, scales, metadata,
                                                   progress=text_progress(), overwrite=args.overwrite)
        return (f"wrote {result['dest']}: NVFP4 source kept, {len(result['input_scales'])} input scales, "
                f"{result['bytes'] / 2**30:.2f} GiB in {result['seconds']:.1f} s")
    result = checkpoint.convert_to_nvfp4(args.source, args.dest, layers=layers, input_scales=scales, device=device,
                                         metadata=metadata, progress=text_progress(), overwrite=args.overwrite)
    formats = ", ".join(f"{n} from {fmt}" for fmt, n in result["source_formats"].items())
    return (f"wrote {result['dest']}: {len(result['converted'])} layers -> NVFP4 ({formats}) on {result['device']}, "
            f"{len(result['input_scales'])} input scales, {result['bytes'] / 2**30:.2f} GiB in "
            f"{result['seconds']:.1f} s")


class Stopped(BaseException):
    """A stop signal (STOP_SIGNALS) while running: raised where the program is, so every write's cleanup runs."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


# Signals whose default action ends the process without any cleanup: SIGTERM (a service stop, `kill`), SIGHUP (the
# terminal closed), SIGQUIT (Ctrl-\). Turned into an exception, the streaming writer removes its temporary file as
# on any failure. (Windows has SIGTERM only.)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


def main(argv=None) -> int:
    args = parse_args(argv)
    handled = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS} if handled else {}
    try:
        print(run(args))
    except (ValueError, OSError, RuntimeError) as exc:  # refusals (CheckpointRefused is a ValueError), I/O
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except (Stopped, KeyboardInterrupt) as exc:
        name = str(exc) if isinstance(exc, Stopped) else "Ctrl-C"
        print(f"error: stopped by {name}; nothing was written", file=sys.stderr)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
