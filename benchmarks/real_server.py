"""ComfyUI's real server with this pack installed as a custom node, driven through its HTTP API: comfy and fused
runs of random-weight NVFP4 models give the same latents in every memory mode, every NVFP4 call accounted for.

1. **Files.** A child process (``--write-models``) writes random-weight NVFP4 diffusion models with
   tools/families.py (ComfyUI's own model classes and quantizer; every NVFP4 Linear kind of the family present) and
   a random LoRA for each into a fresh base folder: MiniMax H3 (3 DiT + 2 refiner blocks, hidden 256), Wan 2.2 14B's
   architecture (2 blocks, dim 128; ComfyUI computes it in fp16), Z-Image at its official width (the detection
   recognises Z-Image by it; 1 layer + the 2 + 2 refiners; GPU only). The LoRA touches one Linear of each NVFP4
   kind; on H3 also the adaLN projections and a norm the hand-over between blocks reads.
2. **The server.** ComfyUI's ``main.py`` from its own folder, only ComfyUI's own flags: ``--base-directory`` (the
   pack linked into its ``custom_nodes``, beside benchmarks/server_check_nodes.py as ``h3_server_check``), an
   in-memory database, ``--front-end-root`` with a one-page stand-in (only the API is used), and per memory mode:
   ``dynamic`` (ComfyUI's default on NVIDIA: dynamic VRAM with the Comfy compiler), ``dynamic-no-compiler``
   (``--disable-comfy-compiler``), ``classic`` (``--disable-dynamic-vram``); ``cpu`` (``--cpu``) without a GPU.
3. **Graphs**, queued with ``POST /prompt``, read back from ``/history``: pack Loader -> (LoraLoaderModelOnly) ->
   Toggle ``fused`` or ``comfy`` -> KSampler (``--steps`` steps, euler, cfg 1, fixed seed; conditioning from
   ``H3ServerCheck_Conditioning``) -> SaveLatent (H3: LTXVSeparateAVLatent first, one file per stream), and
   ``H3ServerCheck_Calls`` after the sampler. Arm ``unpatched``: ComfyUI's UNETLoader, no pack node. Round 1 (seed
   1) warms both arms (ComfyUI's first emulated GEMM of a process on Hopper gives other bits than its later ones);
   round 2 (seed 2) runs fused, comfy and unpatched, whose latents are compared byte for byte (bit patterns of the
   saved tensors).
4. **Accounting.** Per fused run: the NVFP4 Linears of the model, those with a fused patch, calls fused and on
   ComfyUI's path with their reasons, H3 block calls and hand-overs (from ``H3ServerCheck_Calls``); the Loader's
   and Toggle's node text (``/history`` outputs) and the pack's log lines of that run (the server log).
   ``accounted``: every NVFP4 Linear has a fused patch or is counted as left on ComfyUI's path in the node text,
   every patched Linear was called, and every call on ComfyUI's path has its reason in the log.
5. **Output.** JSON (``--out``, written after each memory mode) and a table printed last. Exit status 0 when every
   run succeeded with 0 differing elements and every call accounted for.

``--dram`` measures instead one MiniMax H3 block at full width in the server, in the memory modes of ``--configs``
(default ``dynamic,classic``): ComfyUI's ``main.py`` runs under Nsight Compute (tools/report.py ``ncu_prefix``:
only the kernels between ``cudaProfilerStart`` and ``Stop``), ``H3ServerCheck_MarkBlock`` opens that window around
the second call (the second sampling step) of DiT block 1 of 3 at 1344x768, 124 frames (37,810 tokens), once for
the comfy and once for the fused arm; the server is then stopped with SIGINT so that ncu writes its CSV. Per mode and
arm: the block's DRAM bytes outside GEMMs and attention (tools/report.py ``block_dram``, the report's scope), and
``fused_dynamic_over_classic``: the fused block's bytes in the default mode over classic mode's (must be <= 1.01).

    python benchmarks/real_server.py --out $OUT/server.json                 # GPU: every memory mode
    python benchmarks/real_server.py --out F --models h3 --steps 2          # CPU: --cpu, the pack's Python twin
    python benchmarks/real_server.py --dram --out $OUT/server-dram.json     # GPU with ncu: H3 block bytes per mode
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import report  # noqa: E402  (the repository's report.py: imports this folder as the package h3_fused_nvfp4)

report.import_pack()

from h3_fused_nvfp4.tools import comfy_env  # noqa: E402

PACK_FOLDER = "h3-fused-nvfp4"  # the folder name a registry install uses
CHECK_FOLDER = "h3_server_check"
COMMON_FLAGS = ["--listen", "127.0.0.1", "--database-url", "sqlite:///:memory:", "--disable-auto-launch",
                "--disable-api-nodes"]
CONFIGS = {
    "dynamic": [],  # ComfyUI's default on NVIDIA: dynamic VRAM (ModelPatcherDynamic, comfy-aimdo), Comfy compiler on
    "dynamic-no-compiler": ["--disable-comfy-compiler"],
    "classic": ["--disable-dynamic-vram"],
    "cpu": ["--cpu"],
}
GPU_CONFIGS = ("dynamic", "dynamic-no-compiler", "classic")
DRAM_CONFIGS = ("dynamic", "classic")
SEEDS = (1, 2)  # round 1 warms both arms, round 2 is compared
START_S = 600
RUN_S = 900
LORA_RANK = 4


# ---- the models --------------------------------------------------------------------------------------------

# name -> (family, width, layers, latent node, (text width, tokens)); widths where dynamic VRAM stages the NVFP4
# Linears in VRAM (it loads a layer of 16 KB or less to the device instead: Wan's attention projections at dim 128).
MODELS = {
    "h3": ("minimax_h3", "tiny", 3, {"class_type": "EmptyMiniMaxH3LatentAV",
                                     "inputs": {"width": 256, "height": 256, "length": 5}}, (64, 8)),
    "wan": ("wan22_14b", "tiny", 2, {"class_type": "EmptyHunyuanLatentVideo",
                                     "inputs": {"width": 128, "height": 128, "length": 5, "batch_size": 1}}, (4096, 8)),
    "zimage": ("z_image", "full", 1, {"class_type": "EmptySD3LatentImage",
                                      "inputs": {"width": 256, "height": 256, "batch_size": 1}}, (2560, 8)),
}
GPU_MODELS = ("h3", "wan", "zimage")
CPU_MODELS = ("h3", "wan")
# --dram: three full-width DiT blocks, the report's workload (1344x768, 124 frames, 100 text tokens).
DRAM_MODEL = ("minimax_h3", "full", 3, {"class_type": "EmptyMiniMaxH3LatentAV",
                                        "inputs": {"width": 1344, "height": 768, "length": 124}}, (4096, 100))


def model_file(name: str) -> str:
    return f"server_check_{name}_nvfp4.safetensors"


def lora_file(name: str) -> str:
    return f"server_check_{name}_lora.safetensors"


def lora_targets(name: str, sd: dict) -> list[str]:
    """One NVFP4 Linear of each kind (its path with the block index taken out), the first block's that has it; on
    H3 also the adaLN projections of the blocks after the first and block 1's norm1 (the hand-over reads them)."""
    nvfp4 = sorted(k[: -len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant"))
    kinds = {}
    for module in nvfp4:
        kinds.setdefault(re.sub(r"\.\d+\.", ".#.", module), module)
    targets = sorted(kinds.values())
    if name == "h3":
        blocks = sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.")})
        targets += [f"blocks.{i}.adaln_proj.linear" for i in blocks[1:]] + ["blocks.1.norm1"]
    return targets


def lora_state_dict(sd: dict, targets: list[str], seed: int) -> dict:
    """Random LoRA tensors under ComfyUI's ``diffusion_model.`` keys: rank-4 ``lora_up`` / ``lora_down`` of a size
    that moves each weight by a few percent, a ``diff`` for a norm."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module in targets:
        key = f"diffusion_model.{module}"
        if f"{module}.comfy_quant" in sd:  # NVFP4: the stored weight packs two codes per byte
            rows, cols = sd[f"{module}.weight"].shape[0], sd[f"{module}.weight"].shape[1] * 2
        else:
            shape = tuple(sd[f"{module}.weight"].shape)
            if len(shape) == 1:
                out[f"{key}.diff"] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
                continue
            rows, cols = shape
        out[f"{key}.lora_up.weight"] = (torch.randn((rows, LORA_RANK), generator=gen) * 0.1).to(torch.bfloat16)
        out[f"{key}.lora_down.weight"] = (torch.randn((LORA_RANK, cols), generator=gen) * 0.1 * cols ** -0.5).to(
            torch.bfloat16)
    return out


def write_models(folder: pathlib.Path, names: list[str], dram: bool) -> None:
    """The child's work: each model file (and, unless ``dram``, its LoRA) under ``folder`` (ComfyUI's models/)."""
    import torch
    from safetensors.torch import save_file

    comfy_env.import_comfyui()
    from h3_fused_nvfp4.tools import families as fam

    device = "cuda" if torch.cuda.is_available() else "cpu"
    (folder / "diffusion_models").mkdir(parents=True, exist_ok=True)
    (folder / "loras").mkdir(parents=True, exist_ok=True)
    for name in names:
        family, width, layers, _, _ = DRAM_MODEL if dram else MODELS[name]
        start = time.monotonic()
        sd, metadata = fam.family_state_dict(family, width=width, layers=layers, seed=440420, device=device)
        save_file(sd, str(folder / "diffusion_models" / model_file(name)), metadata=metadata)
        if not dram:
            save_file(lora_state_dict(sd, lora_targets(name, sd), seed=7), str(folder / "loras" / lora_file(name)))
        print(f"wrote {name} ({family}, {width} width, {layers} blocks) in {time.monotonic() - start:.1f} s",
              flush=True)
        del sd
        if device == "cuda":
            torch.cuda.empty_cache()


# ---- the graphs --------------------------------------------------------------------------------------------

def graph(name: str, arm: str, seed: int, *, lora: bool, steps: int, prefix: str, spec=None, mark=None) -> dict:
    """The API-format prompt of one run (``arm``: fused, comfy or unpatched). ``mark``: (block, call) of an
    ``H3ServerCheck_MarkBlock`` profiler window before the sampler."""
    family, _, _, latent, (text_width, tokens) = spec or MODELS[name]
    nodes = {}
    if arm == "unpatched":
        nodes["loader"] = {"class_type": "UNETLoader", "inputs": {"unet_name": model_file(name),
                                                                  "weight_dtype": "default"}}
    else:
        nodes["loader"] = {"class_type": "H3FusedNVFP4Loader",
                           "inputs": {"unet_name": model_file(name), "weight_dtype": "default", "scope": "block"}}
    model = ["loader", 0]
    if lora:
        nodes["lora"] = {"class_type": "LoraLoaderModelOnly",
                         "inputs": {"model": model, "lora_name": lora_file(name), "strength_model": 1.0}}
        model = ["lora", 0]
    if arm != "unpatched":
        nodes["toggle"] = {"class_type": "H3FusedNVFP4Toggle",
                           "inputs": {"model": model, "path": arm, "scope": "as patched"}}
        model = ["toggle", 0]
    if mark is not None:
        nodes["mark"] = {"class_type": "H3ServerCheck_MarkBlock",
                         "inputs": {"model": model, "block": mark[0], "call": mark[1]}}
        model = ["mark", 0]
    nodes["text"] = {"class_type": "H3ServerCheck_Conditioning",
                     "inputs": {"width": text_width, "tokens": tokens, "seed": 11}}
    nodes["latent"] = latent
    nodes["sampler"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["text", 0], "negative": ["text", 0], "latent_image": ["latent", 0], "denoise": 1.0}}
    if family == "minimax_h3":  # a joint video + audio latent: one file per stream
        nodes["separate"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sampler", 0]}}
        nodes["save_video"] = {"class_type": "SaveLatent", "inputs": {"samples": ["separate", 0],
                                                                      "filename_prefix": f"{prefix}/video"}}
        nodes["save_audio"] = {"class_type": "SaveLatent", "inputs": {"samples": ["separate", 1],
                                                                      "filename_prefix": f"{prefix}/audio"}}
    else:
        nodes["save"] = {"class_type": "SaveLatent", "inputs": {"samples": ["sampler", 0],
                                                                "filename_prefix": f"{prefix}/latent"}}
    if arm != "unpatched":
        nodes["calls"] = {"class_type": "H3ServerCheck_Calls", "inputs": {"model": model, "samples": ["sampler", 0]}}
    return nodes


# ---- the server --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """ComfyUI's ``main.py`` on 127.0.0.1 with ``flags`` (``prefix``: e.g. Nsight Compute), its log in a file."""

    def __init__(self, comfy_root: pathlib.Path, base: pathlib.Path, frontend: pathlib.Path, flags: list[str],
                 log: pathlib.Path, cpu: bool, prefix: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.command = [*(prefix or []), sys.executable, "main.py", *COMMON_FLAGS, "--port", str(self.port),
                        "--base-directory", str(base), "--front-end-root", str(frontend), *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
                   H3_SERVER_CHECK_PACK=str(base / "custom_nodes" / PACK_FOLDER))
        if cpu:
            env["H3_FUSED_NVFP4_REFERENCE_ON_CPU"] = "1"  # the pack patches a model on the CPU (its Python twin)
        self.started = time.monotonic()
        with open(log, "w", encoding="utf-8") as out:
            self.process = subprocess.Popen(self.command, cwd=comfy_root, env=env, stdout=out,
                                            stderr=subprocess.STDOUT)
        self.start_seconds = None

    def log_text(self, start: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def get(self, path: str, timeout: float = 10.0):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # ComfyUI answers a refused prompt with 400 and its reasons
            return {"error": json.loads(exc.read() or b"{}")}

    def wait_ready(self, node_ids: tuple[str, ...]) -> None:
        deadline = time.monotonic() + START_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log_text()[-4000:]}")
            try:
                missing = [n for n in node_ids if n not in self.get(f"/object_info/{n}")]
            except (urllib.error.URLError, OSError, ValueError):
                missing = None  # not answering yet
            if missing == []:
                break
            if missing:  # the server answers once every custom node has loaded
                raise RuntimeError(f"ComfyUI runs without the nodes {missing}:\n{self.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ComfyUI did not answer within {START_S} s:\n{self.log_text()[-4000:]}")
            time.sleep(0.5)
        self.start_seconds = round(time.monotonic() - self.started, 1)

    def run(self, prompt: dict) -> dict:
        """Queue ``prompt`` and wait for its history entry."""
        queued = self.post("/prompt", {"prompt": prompt, "client_id": uuid.uuid4().hex})
        if "prompt_id" not in queued:
            return {"status": {"status_str": "refused", "messages": []}, "refused": queued}
        prompt_id = queued["prompt_id"]
        deadline = time.monotonic() + RUN_S
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            status = (entry or {}).get("status", {})
            if entry and (status.get("completed") or status.get("status_str") == "error"):
                return entry
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited during a run:\n{self.log_text()[-4000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"prompt {prompt_id} did not finish within {RUN_S} s:\n{self.log_text()[-4000:]}")

    def stop(self, wait: float = 120.0) -> int | None:
        """SIGINT to ComfyUI's own process (under ncu: the child, so that ncu writes its results), then wait."""
        if self.process.poll() is None:
            try:
                pid = self.get("/h3_server_check/pid")["pid"]
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pid = self.process.pid
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        try:
            return self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                return self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait(timeout=10)


# ---- one run, its record -------------------------------------------------------------------------------------

def history_seconds(entry: dict) -> float | None:
    """From ComfyUI's execution_start to its execution_success message (ms timestamps in the history)."""
    stamps = {kind: data.get("timestamp") for kind, data in entry.get("status", {}).get("messages", [])}
    start, end = stamps.get("execution_start"), stamps.get("execution_success")
    return round((end - start) / 1000, 3) if start is not None and end is not None else None


PACK_LINE = re.compile(r"H3 fused NVFP4: .*")
STOCK_LINE = re.compile(r"H3 fused NVFP4: (.*?) uses ComfyUI's path: (.*)")


def run_record(server: Server, base: pathlib.Path, prompt: dict, **labels) -> dict:
    log_start = server.log_size()
    wall = time.monotonic()
    entry = server.run(prompt)
    record = dict(labels, status=entry["status"].get("status_str"), wall_seconds=round(time.monotonic() - wall, 3),
                  seconds=history_seconds(entry))
    if "refused" in entry:
        record["error"] = entry["refused"]
    elif record["status"] != "success":
        record["error"] = [{k: m[1].get(k) for k in ("node_id", "node_type", "exception_type", "exception_message")}
                           | {"traceback": "".join(m[1].get("traceback", []))[-3000:]}
                           for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
    outputs = entry.get("outputs", {})
    record["node_text"] = {node: out["text"][0] for node, out in outputs.items()
                           if node in ("loader", "toggle") and out.get("text")}
    if "calls" in outputs and outputs["calls"].get("text"):
        record["calls"] = json.loads(outputs["calls"]["text"][0])
    record["latents"] = [str(pathlib.Path("output") / item.get("subfolder", "") / item["filename"])
                         for node in ("save", "save_video", "save_audio") for item in outputs.get(node, {})
                         .get("latents", [])]
    time.sleep(0.3)  # the worker logs the end of the prompt after the history entry
    text = server.log_text(log_start)
    record["pack_log"] = PACK_LINE.findall(text)[:40]
    record["stock_log"] = [{"where": w, "reason": r} for w, r in STOCK_LINE.findall(text)]
    return record


def left_on_comfy_path(node_text: str) -> int:
    """How many NVFP4 Linears the node text counts as left on ComfyUI's path (PatchReport.summary)."""
    match = re.search(r", (\d+) left on ComfyUI's path", node_text or "")
    return int(match.group(1)) if match else 0


def accounting(record: dict, logged: set[str] | None = None) -> dict:
    """Whether every NVFP4 call of a fused run is accounted for (module docstring). ``logged``: the reasons the
    server logged up to this run (the pack logs a reason once per layer and process), else this run's."""
    calls = record.get("calls")
    if calls is None:
        return {"accounted": False, "why": "no H3ServerCheck_Calls output"}
    left = left_on_comfy_path(record["node_text"].get("toggle", ""))
    logged = logged if logged is not None else {entry["reason"] for entry in record["stock_log"]}
    problems = []
    if calls["nvfp4_linears"] != calls["fused_patches"] + left:
        problems.append(f"{calls['nvfp4_linears']} NVFP4 Linears, {calls['fused_patches']} fused patches, {left} "
                        f"left in the node text")
    if calls["linears_not_called"]:
        problems.append(f"patched but never called: {calls['linears_not_called'][:5]}")
    unlogged = [r for r in calls["stock_reasons"] if r not in logged and not any(r in line for line in
                                                                                 record["pack_log"])]
    if unlogged:
        problems.append(f"calls on ComfyUI's path without their reason in this run's log: {unlogged}")
    return {"accounted": not problems, "why": "; ".join(problems),
            "all_calls_fused": calls["calls_stock"] == 0 and calls["calls_fused"] > 0 and not left}


# ---- comparing the latents -------------------------------------------------------------------------------------

def load_latent(base: pathlib.Path, relative: str):
    from safetensors.torch import load_file

    return load_file(str(base / relative))["latent_tensor"]


def compare(base: pathlib.Path, a: dict, b: dict) -> dict:
    """Differing elements (bit patterns) of two runs' saved latents, stream by stream."""
    from h3_fused_nvfp4.tools.report import differing

    if a.get("status") != "success" or b.get("status") != "success":
        return {"differing": None, "why": "a run failed"}
    if len(a["latents"]) != len(b["latents"]) or not a["latents"]:
        return {"differing": None, "why": f"latent files {a['latents']} vs {b['latents']}"}
    counts = []
    nonfinite = 0
    for x, y in zip(a["latents"], b["latents"]):
        tx, ty = load_latent(base, x), load_latent(base, y)
        counts.append(differing(tx, ty))
        nonfinite += int((~tx.float().isfinite()).sum())
    return {"differing": sum(counts), "per_stream": counts, "nonfinite_first": nonfinite}


# ---- the check: every memory mode ---------------------------------------------------------------------------

def plan(models, quick: bool = False):
    """(model, lora, round, arm, seed) of every run, round 1 warming both arms; ``quick``: round 2 with the LoRA
    only (a wiring check: no warm-up, whose need is an emulated GEMM's first call on a GPU)."""
    for name in models:
        for lora in ((True,) if quick else (False, True)):
            for round_, seed in enumerate(SEEDS, start=1):
                if quick and round_ == 1:
                    continue
                arms = ("fused", "comfy") if round_ == 1 else ("fused", "comfy", "unpatched")
                for arm in arms:
                    yield name, lora, round_, arm, seed


def logged_until(runs: list[dict], record: dict) -> set[str]:
    """The reasons the same server logged for calls on ComfyUI's path up to and including ``record``'s run."""
    upto = runs[: next(i for i, r in enumerate(runs) if r is record) + 1]
    return {e["reason"] for r in upto if r["config"] == record["config"] for e in r["stock_log"]}


def summarize(base: pathlib.Path, runs: list[dict]) -> list[dict]:
    rows = []
    keys = sorted({(r["config"], r["model"], r["lora"]) for r in runs}, key=lambda k: (k[0], k[1], k[2]))
    for config, model, lora in keys:
        mine = {(r["round"], r["arm"]): r for r in runs
                if (r["config"], r["model"], r["lora"]) == (config, model, lora)}
        last = max(rnd for rnd, _ in mine)
        fused, comfy, unpatched = (mine.get((last, arm), {}) for arm in ("fused", "comfy", "unpatched"))
        row = {"config": config, "model": model, "lora": lora,
               "fused_vs_comfy": compare(base, fused, comfy), "fused_vs_unpatched": compare(base, fused, unpatched),
               "comfy_vs_unpatched": compare(base, comfy, unpatched)}
        if (1, "fused") in mine and last > 1:
            row["round1_fused_vs_comfy"] = compare(base, mine[(1, "fused")], mine[(1, "comfy")])
        fused_runs = [r for (rnd, arm), r in sorted(mine.items()) if arm == "fused"]
        row["accounting"] = [dict(round=r["round"], **accounting(r, logged_until(runs, r))) for r in fused_runs]
        if lora:  # the LoRA took effect: its latents differ from the same arm's without it
            plain = next((r for r in runs if (r["config"], r["model"], r["lora"], r["round"], r["arm"]) ==
                          (config, model, False, last, "comfy")), None)
            row["lora_vs_no_lora"] = compare(base, comfy, plain) if plain else {"differing": None, "why": "not run"}
        row["calls_last_round"] = fused.get("calls")
        row["seconds"] = {f"r{rnd}-{arm}": r.get("seconds") for (rnd, arm), r in sorted(mine.items())}
        row["ok"] = (all(row[k]["differing"] == 0 for k in ("fused_vs_comfy", "fused_vs_unpatched",
                                                           "comfy_vs_unpatched"))
                     and all(a["accounted"] for a in row["accounting"])
                     and row.get("lora_vs_no_lora", {}).get("differing") != 0
                     and all(r.get("status") == "success" for r in mine.values()))
        rows.append(row)
    return rows


MODE_LINES = {
    "dynamic_vram_enabled": "DynamicVRAM support detected and enabled",
    "dynamic_vram_disabled_by_flag": "Dynamic vram disabled with argument",
    "nvfp4_compute_forced": "NVFP4 compute forced on",
}
STAGED_LINE = re.compile(r"prepared for dynamic VRAM loading\. (\d+)MB Staged\. (\d+) patches attached")
COMPILER_LINE = re.compile(r"Comfy model compiler graph breaks: (\d+), rogues: (\d+)")


def server_facts(server: Server) -> dict:
    text = server.log_text()
    return {**{k: line in text for k, line in MODE_LINES.items()},
            "dynamic_vram_loads": [{"staged_mb": int(a), "patches": int(b)} for a, b in STAGED_LINE.findall(text)],
            "compiler_graph_breaks_rogues": [[int(a), int(b)] for a, b in COMPILER_LINE.findall(text)],
            "start_seconds": server.start_seconds, "command": server.command[server.command.index("main.py"):]}


def prepare_base(work: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The base folder ComfyUI runs in (the pack linked into custom_nodes, the check nodes beside it) and the
    frontend stand-in."""
    base = work / "base"
    nodes = base / "custom_nodes"
    nodes.mkdir(parents=True, exist_ok=True)
    link = nodes / PACK_FOLDER
    if not link.exists():
        link.symlink_to(ROOT, target_is_directory=True)
    (nodes / CHECK_FOLDER).mkdir(exist_ok=True)
    shutil.copyfile(ROOT / "benchmarks" / "server_check_nodes.py", nodes / CHECK_FOLDER / "__init__.py")
    frontend = work / "frontend"
    frontend.mkdir(exist_ok=True)
    (frontend / "index.html").write_text("<!doctype html><title>ComfyUI API only</title>\n", encoding="utf-8")
    return base, frontend


def write_model_files(base: pathlib.Path, models, dram: bool, log: pathlib.Path) -> float:
    start = time.monotonic()
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--write-models", str(base / "models"),
           "--models", ",".join(models)] + (["--dram"] if dram else [])
    with open(log, "w", encoding="utf-8") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_S).returncode
    if rc != 0:
        raise RuntimeError(f"writing the model files failed ({rc}):\n{log.read_text()[-4000:]}")
    return round(time.monotonic() - start, 1)


def write_json(out: pathlib.Path, result: dict, comfy_root: pathlib.Path, work: pathlib.Path) -> None:
    """The JSON, made to be shared: machine paths named by role (<work>, <ComfyUI>, <pack>, ...)."""
    from h3_fused_nvfp4.tools import report as rep

    pairs = sorted([(str(work), "<work>"), (str(work.resolve()), "<work>"), *rep.local_paths(comfy_root)],
                   key=lambda kv: -len(kv[0]))
    out.write_text(json.dumps(rep.without_local_paths(json.loads(json.dumps(result, default=str)), pairs), indent=1))


def check(args, comfy_root, work, base, frontend, result, out: pathlib.Path) -> bool:
    runs = result["runs"]
    for config in args.configs:
        server = Server(comfy_root, base, frontend, CONFIGS[config], work / f"server-{config}.log", args.cpu)
        facts = {"config": config}
        try:
            server.wait_ready(("H3FusedNVFP4Loader", "H3ServerCheck_Calls"))
            for name, lora, round_, arm, seed in plan(args.models, args.quick):
                prefix = f"server_check/{config}/{name}/{'lora' if lora else 'plain'}/r{round_}/{arm}"
                record = run_record(server, base, graph(name, arm, seed, lora=lora, steps=args.steps, prefix=prefix),
                                    config=config, model=name, lora=lora, round=round_, arm=arm, seed=seed)
                runs.append(record)
                print(f"[server {time.strftime('%H:%M:%S')}] {config} {name} lora={lora} r{round_} {arm}: "
                      f"{record['status']} {record.get('seconds')} s", flush=True)
        except RuntimeError as exc:
            facts["error"] = str(exc)[-4000:]
        finally:
            facts["exit_code"] = server.stop()
            facts.update(server_facts(server))
            result["servers"].append(facts)
        result["summary"] = summarize(base, runs)
        write_json(out, result, comfy_root, work)
    result["complete"] = True
    result["ok"] = bool(result["summary"]) and all(r["ok"] for r in result["summary"]) and not any(
        "error" in s for s in result["servers"])
    write_json(out, result, comfy_root, work)
    print_table(result)
    return result["ok"]


def cell(c: dict) -> str:
    return "-" if c.get("differing") is None else str(c["differing"])


def print_table(result: dict) -> None:
    print("\nconfig               model   lora  fused/comfy fused/unpatched  NVFP4 calls fused/all  hand-overs  "
          "accounted  s per run (r2 comfy / fused)")
    for r in result.get("summary", []):
        calls = r.get("calls_last_round") or {}
        total = (calls.get("calls_fused", 0) + calls.get("calls_stock", 0)) if calls else 0
        hand = calls.get("blocks", {}).get("handoff_out") if calls else None
        secs = r["seconds"]
        print(f"{r['config']:20s} {r['model']:7s} {'yes' if r['lora'] else 'no':5s} {cell(r['fused_vs_comfy']):>11s} "
              f"{cell(r['fused_vs_unpatched']):>15s}  {calls.get('calls_fused', '-')!s:>10s}/{total:<11d} "
              f"{'-' if hand is None else hand!s:>10s}  {str(all(a['accounted'] for a in r['accounting'])):9s}  "
              f"{secs.get('r2-comfy')} / {secs.get('r2-fused')}")
    for s in result.get("servers", []):
        if "error" in s:
            print(f"{s['config']}: ERROR {s['error'][-600:]}")
    print(f"ok: {result.get('ok')}")


# ---- --dram: one full-width H3 block's DRAM bytes in the server, per memory mode ----------------------------

def block_windows(ncu_text: str) -> dict:
    """One memory mode's ncu output: its two profiler windows (the comfy arm's block, the fused arm's), each in the
    report's layout (tools/report.py ``block_dram``), or why not."""
    from h3_fused_nvfp4.tools import report as rep

    windows = rep.ncu_windows(ncu_text) if '"ID"' in ncu_text else []
    if len(windows) != 2:
        return {"error": f"expected 2 profiler windows (comfy, fused) in the ncu output, found {len(windows)}",
                "ncu_tail": ncu_text[-2000:]}
    return {arm: rep.block_dram(kernels) for arm, kernels in zip(("comfy", "fused"), windows)}


def dram_verdict(per_mode: dict) -> dict:
    """The fused block's DRAM bytes in the default memory mode over classic mode's (at most 1.01), and the latents
    of both arms equal in every mode."""
    measured = {c: e["fused"]["non_gemm_non_attention_dram_bytes"] for c, e in per_mode.items() if "fused" in e}
    ratio = (round(measured["dynamic"] / max(measured["classic"], 1.0), 4)
             if "dynamic" in measured and "classic" in measured else None)
    return {"fused_dynamic_over_classic": ratio,
            "ok": ratio is not None and ratio <= 1.01
            and all(e["latents_fused_vs_comfy"].get("differing") == 0 for e in per_mode.values())}


def dram(args, comfy_root, work, base, frontend, result, out: pathlib.Path) -> bool:
    from h3_fused_nvfp4.tools import report as rep

    result["dram"] = {}
    for config in args.configs:
        ncu_log = work / f"ncu-{config}.csv"
        server = Server(comfy_root, base, frontend, CONFIGS[config], work / f"server-{config}.log", args.cpu,
                        prefix=rep.ncu_prefix(str(ncu_log)))
        facts = {"config": config, "ncu_command": server.command[:server.command.index(sys.executable)]}
        arms = {}
        try:
            server.wait_ready(("H3FusedNVFP4Loader", "H3ServerCheck_MarkBlock"))
            # ComfyUI's first emulated NVFP4 call of a process differs from its later ones on Hopper: one unmarked
            # comfy run first, so the compared arms are both warm (and the profiled windows stay the two below)
            warm = run_record(server, base, graph("h3", "comfy", SEEDS[1], lora=False, steps=2,
                                                  prefix=f"server_dram/{config}/warm", spec=DRAM_MODEL),
                              config=config, model="h3-full", lora=False, round=0, arm="comfy", seed=SEEDS[1])
            result["runs"].append(warm)
            for arm in ("comfy", "fused"):
                prefix = f"server_dram/{config}/{arm}"
                record = run_record(server, base, graph("h3", arm, SEEDS[1], lora=False, steps=2, prefix=prefix,
                                                        spec=DRAM_MODEL, mark=(1, 2)),
                                    config=config, model="h3-full", lora=False, round=1, arm=arm, seed=SEEDS[1])
                result["runs"].append(record)
                arms[arm] = record
                print(f"[server-dram {time.strftime('%H:%M:%S')}] {config} {arm}: {record['status']} "
                      f"{record.get('wall_seconds')} s", flush=True)
        except RuntimeError as exc:
            facts["error"] = str(exc)[-4000:]
        finally:
            facts["exit_code"] = server.stop(wait=600)
            facts.update(server_facts(server))
            result["servers"].append(facts)
        entry = {"latents_fused_vs_comfy": compare(base, arms.get("fused", {}), arms.get("comfy", {})),
                 "calls": arms.get("fused", {}).get("calls")}
        entry.update(block_windows(ncu_log.read_text(encoding="utf-8", errors="replace") if ncu_log.exists() else ""))
        result["dram"][config] = entry
        write_json(out, result, comfy_root, work)
    result.update(dram_verdict(result["dram"]))
    result["complete"] = True
    write_json(out, result, comfy_root, work)
    print("\nconfig               arm    DRAM GB (non-GEMM, non-attention)  launches  ncu ms  latents fused/comfy")
    for config, e in result["dram"].items():
        for arm in ("comfy", "fused"):
            d = e.get(arm)
            if d:
                print(f"{config:20s} {arm:6s} {d['non_gemm_non_attention_dram_gb']:>10.3f} "
                      f"{d['non_gemm_non_attention_launches']:>28d}  {d['non_gemm_non_attention_ncu_ms']:>7.3f}  "
                      f"{cell(e['latents_fused_vs_comfy'])}")
        if "error" in e:
            print(f"{config}: {e['error']}")
    print(f"fused block, dynamic / classic DRAM bytes: {result.get('fused_dynamic_over_classic')} (must be <= 1.01)")
    print(f"ok: {result['ok']}")
    return result["ok"]


# ---- main --------------------------------------------------------------------------------------------------

def comfyui_version(root: pathlib.Path) -> str:
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", (root / "comfyui_version.py").read_text(encoding="utf-8"))
    return match.group(1) if match else "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file (default server-check.json, or server-dram.json with --dram)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (GPU: all; CPU: h3,wan)")
    parser.add_argument("--configs", help=f"comma-separated memory modes, of {', '.join(CONFIGS)} "
                                          f"(GPU: {','.join(GPU_CONFIGS)}; --dram: {','.join(DRAM_CONFIGS)})")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="only round 2, with the LoRA (a wiring check)")
    parser.add_argument("--dram", action="store_true", help="one full-width H3 block's DRAM bytes under ncu")
    parser.add_argument("--work", help="work folder (default: a new temporary one, removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (models, logs, latents)")
    parser.add_argument("--write-models", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_models:
        write_models(pathlib.Path(args.write_models), args.models.split(","), args.dram)
        return 0

    import torch

    args.cpu = not torch.cuda.is_available()
    if args.dram and args.cpu:
        parser.error("--dram needs an NVIDIA GPU and Nsight Compute")
    args.models = ["h3"] if args.dram else (args.models.split(",") if args.models else
                                            list(CPU_MODELS if args.cpu else GPU_MODELS))
    default_configs = ("cpu",) if args.cpu else (DRAM_CONFIGS if args.dram else GPU_CONFIGS)
    args.configs = args.configs.split(",") if args.configs else list(default_configs)
    unknown = [m for m in args.models if m not in MODELS] + [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown models / memory modes: {unknown}")
    location = comfy_env.find_comfyui()
    if location is None:
        parser.error("no ComfyUI found: set COMFYUI_PATH")
    out = pathlib.Path(args.out or ("server-dram.json" if args.dram else "server-check.json"))
    work = pathlib.Path(args.work) if args.work else pathlib.Path(tempfile.mkdtemp(prefix="h3-server-check-"))
    work.mkdir(parents=True, exist_ok=True)
    base, frontend = prepare_base(work)
    result = {"what": __doc__.split("\n\n")[0], "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
              "comfyui": {"found_as": location.how, "version": comfyui_version(location.root)}, "steps": args.steps,
              "models": {m: dict(zip(("family", "width", "blocks"), (DRAM_MODEL if args.dram else MODELS[m])[:3]))
                         for m in args.models},
              "configs": {c: CONFIGS[c] for c in args.configs}, "servers": [], "runs": [], "complete": False}
    try:
        result["write_models_seconds"] = write_model_files(base, args.models, args.dram, work / "write-models.log")
        ok = (dram if args.dram else check)(args, location.root, work, base, frontend, result, out)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"JSON: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
