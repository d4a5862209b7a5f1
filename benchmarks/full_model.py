"""The whole MiniMax H3 model, stock vs fused: ComfyUI's own loader, the pack's Patch node path, one forward each.

A random-weight NVFP4 checkpoint at full H3 size (50 DiT blocks + 2 token-refiner blocks, hidden 5376; weights
drawn and quantized by ComfyUI's own ``QuantizedTensor.from_float`` on the GPU, one tensor at a time, kept on the
CPU like a loaded file) is loaded through ``comfy.sd.load_diffusion_model_state_dict`` with NVFP4 compute forced on
(below sm_100 both arms emulate the FP4 GEMM the same way), then:

* stock: ComfyUI's model as loaded (``load_models_gpu``), one warm-up forward, then the reference forwards;
* fused: the clone the Patch node returns (``models/patch.apply_fused`` as ``H3FusedNVFP4Patch.execute`` calls
  it, self-check forced so the first forward runs the block check), its FIRST forward compared too.

Inputs follow ``MiniMaxH3Model.forward``: a video latent [1, 24, 37, 48, 84] (1344x768, 124 frames: 37,296 rows),
an audio latent [1, 32, 2, 207] (414 rows), 100 text tokens of width 5120 with vision-pad tag runs (37,810 packed
rows), ``timestep`` = sigma * 1000; each forward has two timesteps (video and audio run on their own schedules). Two
sigmas are compared. Video and audio outputs must be bit-identical; the forward time (wall clock with a device
sync, median of ``--reps``) and the peak memory above what was allocated before the call
(``torch.cuda.max_memory_allocated``) are recorded per arm.

    python benchmarks/full_model.py [--out FILE] [--reps 3]       # GPU, full size (~3-5 minutes on an H200)
    python benchmarks/full_model.py --tiny                          # CPU, tiny width, 2 blocks: a wiring check

Exit status 0 only if every compared output is bit-identical and the fused arm ran fused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shlex
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The first fused forward must run the block check: no verdict from an earlier run (the selfcheck runs now).
os.environ.setdefault("H3_FUSED_NVFP4_SELFCHECK", "force")

import torch  # noqa: E402

import report  # noqa: E402  (the repository's report.py: imports this folder as the package h3_fused_nvfp4)

report.import_pack()

from h3_fused_nvfp4.tools import comfy_env  # noqa: E402
from h3_fused_nvfp4.tools import synthetic as syn

SIGMAS = (0.7, 0.3)
FULL = dict(dims=syn.H3_FULL, layers=50, refiners=2, text_dim=5120, text=100, latent=(37, 48, 84), audio_t=207)
TINY = dict(dims=syn.H3_SMALL, layers=2, refiners=2, text_dim=64, text=7, latent=(2, 8, 8), audio_t=5)


def log(msg: str) -> None:
    print(f"[full_model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_inputs(cfg: dict, dm, device, seed: int):
    t, h, w = cfg["latent"]
    gen = torch.Generator().manual_seed(seed)
    video = torch.randn((1, dm.latents_dim, t, h, w), generator=gen)
    audio = torch.randn((1, dm.audio_latents_dim, 2, cfg["audio_t"]), generator=gen)
    context = torch.randn((1, cfg["text"], dm.condition_proj.in_features), generator=gen).to(torch.bfloat16)
    tags = torch.tensor(syn.text_tag_runs(cfg["text"]))
    return [video.to(device), audio.to(device)], context.to(device), tags


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Arm:
    """One ModelPatcher (stock or the fused clone) loaded the way sampling loads it, and its forwards."""

    def __init__(self, name, patcher, inputs, device):
        self.name, self.patcher, self.device = name, patcher, device
        self.x, self.context, self.tags = inputs
        self.forwards: list[dict] = []

    def forward(self, sigma: float, label: str):
        import comfy.model_management as mm

        mm.load_models_gpu([self.patcher])  # applies this clone's object patches, as sampling does
        dm = self.patcher.model.diffusion_model
        options = dict(self.patcher.model_options.get("transformer_options", {}))
        payload = {"text_token_tags": self.tags}
        timestep = torch.tensor([sigma * 1000.0], device=self.device)
        sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = dm([t.clone() for t in self.x], timestep, self.context, transformer_options=options,
                     minimax_payload=payload)
        sync(self.device)
        seconds = time.perf_counter() - t0
        record = {"label": label, "sigma": sigma, "seconds": round(seconds, 4)}
        if cuda:
            record["peak_extra_gib"] = round((torch.cuda.max_memory_allocated(self.device) - base) / 2**30, 3)
        self.forwards.append(record)
        log(f"{self.name}: {label} forward at sigma {sigma}: {seconds:.3f} s"
            + (f", peak {record['peak_extra_gib']} GiB above {base / 2**30:.2f} GiB" if cuda else ""))
        return [o.detach().clone() for o in out]


def build_model(cfg: dict, device, seed: int):
    import comfy.sd

    t0 = time.perf_counter()
    log(f"random NVFP4 checkpoint: {cfg['layers']} blocks + {cfg['refiners']} refiner blocks, {cfg['dims'].label}, "
        f"drawn on {device}")
    sd = syn.model_state_dict(cfg["dims"], num_layers=cfg["layers"], refiner_layers=cfg["refiners"],
                              text_dim=cfg["text_dim"], seed=seed, device=device)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    made = time.perf_counter() - t0
    log(f"checkpoint made: {len(sd)} tensors, {nbytes / 2**30:.2f} GiB in {made:.1f} s; loading through "
        f"comfy.sd.load_diffusion_model_state_dict")
    t1 = time.perf_counter()
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={})
    del sd
    if patcher is None:
        raise RuntimeError("ComfyUI did not recognise the random checkpoint as a diffusion model")
    dm = patcher.model.diffusion_model
    name = type(dm).__name__
    if name != "MiniMaxH3Model" or len(dm.blocks) != cfg["layers"]:
        raise RuntimeError(f"ComfyUI loaded a {name} with {len(getattr(dm, 'blocks', []))} blocks, expected "
                           f"MiniMaxH3Model with {cfg['layers']}")
    return patcher, {"checkpoint_gib": round(nbytes / 2**30, 2), "make_seconds": round(made, 1),
                     "load_seconds": round(time.perf_counter() - t1, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny width, 2 blocks, few tokens, on the CPU")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/full-model.json, else "
                                                    "benchmarks/out/full-model.json)")
    parser.add_argument("--reps", type=int, default=3, help="timed forwards per arm after the compared ones")
    parser.add_argument("--seed", type=int, default=440420)
    args = parser.parse_args(argv)
    out_path = pathlib.Path(args.out or pathlib.Path(os.environ.get("OUT", ROOT / "benchmarks" / "out"))
                            / ("full-model-tiny.json" if args.tiny else "full-model.json"))

    info = comfy_env.import_comfyui()
    logging.getLogger("comfy_kitchen.tensor.nvfp4").setLevel(logging.ERROR)  # the emulated-GEMM warning
    if args.tiny:
        device, cfg = torch.device("cpu"), TINY
    else:
        if not torch.cuda.is_available():
            print("full_model.py: no CUDA device; use --tiny for the CPU wiring check", file=sys.stderr)
            return 2
        device, cfg = torch.device("cuda", torch.cuda.current_device()), FULL
    import comfy.model_management as mm

    from h3_fused_nvfp4.models import patch
    from h3_fused_nvfp4.tools.report import device_info, differing, stock_gemm_note

    comfy_env.force_nvfp4_compute("bf16")
    if not args.tiny and mm.get_torch_device() != device:
        raise RuntimeError(f"ComfyUI's device is {mm.get_torch_device()}, expected {device}")
    result = {"benchmark": "whole MiniMax H3 model, ComfyUI stock vs fused (Patch node), one forward",
              "command": "python " + " ".join(shlex.quote(a) for a in [str(pathlib.Path(sys.argv[0]))] + sys.argv[1:]),
              "device": device_info(device), "comfyui": {"version": info.version, "root": str(info.location.root)},
              "workload": {"size": "tiny (wiring check, no speed figures)" if args.tiny else "full H3",
                           "dims": cfg["dims"].label, "dit_blocks": cfg["layers"], "refiner_blocks": cfg["refiners"],
                           "video_latent": [1, 24, *cfg["latent"]], "audio_latent": [1, 32, 2, cfg["audio_t"]],
                           "text_tokens": cfg["text"], "text_dim": cfg["text_dim"], "sigmas": list(SIGMAS),
                           "seed": args.seed, "nvfp4_compute": "forced on (GEMM emulated below sm_100)",
                           "stock_arm_gemm": stock_gemm_note(device)}}
    stock_patcher, result["load"] = build_model(cfg, device, args.seed)
    dm = stock_patcher.model.diffusion_model
    inputs = make_inputs(cfg, dm, device, args.seed + 1)
    t, h, w = cfg["latent"]
    result["workload"]["packed_tokens"] = cfg["text"] + 2 * cfg["audio_t"] + t * (h // 2) * (w // 2)
    log(f"{result['workload']['packed_tokens']} packed tokens")

    stock = Arm("stock", stock_patcher, inputs, device)
    stock.forward(SIGMAS[0], "warm-up")  # the first stock call of a process differs on the H200's emulated path
    reference = {s: stock.forward(s, "reference") for s in SIGMAS}
    for _ in range(args.reps):
        stock.forward(SIGMAS[0], "timed")

    fused_patcher, patch_report = patch.apply_fused(stock_patcher, "block", allow_reference_backend=args.tiny)
    result["patch_summary"] = patch_report.summary()
    log(result["patch_summary"])
    if not patch_report.applied:
        raise RuntimeError(f"the Patch node left the model unpatched: {patch_report.reason}")
    fused = Arm("fused", fused_patcher, inputs, device)
    compared = {}
    for i, s in enumerate(SIGMAS):
        got = fused.forward(s, "first (block check)" if i == 0 else "compared")
        compared[s] = [differing(a, b) for a, b in zip(got, reference[s])]
        log(f"sigma {s}: video {compared[s][0]}, audio {compared[s][1]} differing elements "
            f"(of {got[0].numel()} / {got[1].numel()})")
    state = next(v.state for k, v in fused_patcher.object_patches.items() if k.endswith("blocks.0.forward"))
    for _ in range(args.reps):
        fused.forward(SIGMAS[0], "timed")

    linears = [v for v in fused_patcher.object_patches.values() if type(v).__name__ == "FusedNVFP4Linear"]
    blocks = [v for v in fused_patcher.object_patches.values() if type(v).__name__ == "FusedDiTBlock"]
    forwards = len(SIGMAS) + args.reps
    fully_fused = all(v.calls_stock == 0 and v.calls_fused > 0 for v in linears)
    result["parity"] = {
        "differing_elements": {f"sigma_{s}": {"video": d[0], "audio": d[1]} for s, d in compared.items()},
        "total_differing_elements": sum(sum(d) for d in compared.values()),
        "first_fused_forward_included": True,
        "block_check": state.block_check, "block_check_detail": state.block_check_detail,
        "fused_linears": len(linears), "fused_linear_stock_calls": sum(v.calls_stock for v in linears),
        "fused_blocks": len(blocks), "fused_block_calls": sum(v.counts["fused"] for v in blocks),
        "forwards_per_arm_after_patching": forwards,
    }

    def summary(arm: Arm) -> dict:
        timed = [f["seconds"] for f in arm.forwards if f["label"] == "timed"]
        out = {"forwards": arm.forwards,
               "forward_seconds_median": round(statistics.median(timed), 4) if timed else None}
        if device.type == "cuda":
            out["peak_extra_gib_timed_max"] = max(f["peak_extra_gib"] for f in arm.forwards if f["label"] == "timed") \
                if timed else None
        return out

    result["stock"], result["fused"] = summary(stock), summary(fused)
    if args.reps and device.type == "cuda":
        result["speedup_forward"] = round(result["stock"]["forward_seconds_median"]
                                          / result["fused"]["forward_seconds_median"], 4)
    ok = (result["parity"]["total_differing_elements"] == 0 and state.block_check == "passed" and fully_fused
          and bool(linears))
    result["ok"] = ok
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out_path}")
    s, f = result["stock"], result["fused"]
    print(f"differing elements: {result['parity']['total_differing_elements']} (video + audio, {len(SIGMAS)} sigmas, "
          f"first fused forward included); block check {state.block_check}; "
          f"{len(linears)} fused Linears, {result['parity']['fused_linear_stock_calls']} stock calls")
    if device.type == "cuda" and args.reps:
        print(f"forward: stock {s['forward_seconds_median']:.3f} s -> fused {f['forward_seconds_median']:.3f} s; "
              f"peak extra memory {s['peak_extra_gib_timed_max']:.2f} -> {f['peak_extra_gib_timed_max']:.2f} GiB")
    if not ok:
        print("FAILED: " + ("outputs differ; " if result["parity"]["total_differing_elements"] else "")
              + (f"block check {state.block_check}: {state.block_check_detail}; "
                 if state.block_check != "passed" else "")
              + ("not every NVFP4 Linear ran fused" if not fully_fused or not linears else ""), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
