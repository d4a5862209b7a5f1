"""Every NVFP4 model family ComfyUI runs, stock vs fused Linears, on the CPU (tiny widths).

Each family's random-weight checkpoint (tools/families.py, built from ComfyUI's own model class) is loaded through
``comfy.sd.load_diffusion_model_state_dict`` with NVFP4 compute forced on and bf16 compute; the test checks that
ComfyUI detected the family and built every quantized Linear as an NVFP4 Linear, runs the diffusion model once as
ComfyUI builds it and once with every NVFP4 Linear's forward replaced by the pack's fused Linear (a ModelPatcher
object patch), and requires bit-identical outputs with (nearly) every Linear call on the fused path. Off the GPU
the fused path runs kernels/twin_ops.py, the Python twin of the kernels.

Z-Image's and Qwen-Image's detection pins the official widths and ignores the file's metadata, so their tiny files
are loaded with detection honouring the metadata config (as ComfyUI's LTX-2, Wan and H3 branches do); the
full-width detection of every family is checked on shape-only (meta) checkpoints.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from parity import assert_bit_identical

from h3_fused_nvfp4.core.linear import FusedNVFP4Linear, is_nvfp4_linear
from h3_fused_nvfp4.core.nvfp4_weights import nvfp4_checkpoint_entries
from h3_fused_nvfp4.models import patch
from h3_fused_nvfp4.tools import families as fam

pytestmark = pytest.mark.usefixtures("comfyui")

FUSED_SHARE = 0.99  # of the NVFP4 Linear calls of one forward
TIMINGS: dict[str, dict] = {}


def apply_fused(model_patcher):
    """The Patch node's clone (scope "linears": every NVFP4 Linear through the fused pack; no block fusion, which
    H3's own tests cover); returns (clone, the FusedNVFP4Linear objects)."""
    clone, report = patch.apply_fused(model_patcher, "linears", allow_reference_backend=True)
    assert report.applied, report.reason
    return clone, [v for v in clone.object_patches.values() if isinstance(v, FusedNVFP4Linear)]


@pytest.fixture
def detection_reads_metadata(comfyui):
    """ComfyUI's detection, with the file's metadata transformer config merged for every family (tiny Z-Image and
    Qwen-Image files are otherwise taken for their official widths)."""
    with fam.detection_reads_metadata():
        yield


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_forward(model_patcher, inputs):
    import comfy.model_management as mm

    mm.load_models_gpu([model_patcher])  # applies the clone's object patches, as sampling does
    dm = model_patcher.model.diffusion_model
    options = dict(model_patcher.model_options.get("transformer_options", {}))
    with torch.inference_mode():
        out = dm(*inputs.args, **inputs.kwargs, transformer_options=options)
    return [o.cpu() for o in out] if isinstance(out, (list, tuple)) else [out.cpu()]


@pytest.mark.parametrize("name", list(fam.FAMILIES))
def test_family_stock_vs_fused(name, force_nvfp4_compute, detection_reads_metadata, clean_models):
    import comfy.sd

    family = fam.FAMILIES[name]
    t0 = time.perf_counter()
    sd, metadata = fam.family_state_dict(name, width="tiny", seed=11)
    quantized = {k.rsplit(".", 1)[0] for k in sd if k.endswith(".comfy_quant")}  # the loader consumes sd
    t1 = time.perf_counter()
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
    assert patcher is not None, f"{name}: ComfyUI did not detect the checkpoint"
    dm = patcher.model.diffusion_model
    assert type(dm).__name__ == family.model_class, (name, type(dm).__name__)
    if name not in ("z_image",):  # tiny Z-Image (dim 256) is ComfyUI's Lumina2 entry; full width is ZImage
        assert type(patcher.model.model_config).__name__ == family.supported_model

    nvfp4 = {n for n, m in dm.named_modules() if is_nvfp4_linear(m)}
    assert quantized and nvfp4 == quantized, (name, sorted(quantized ^ nvfp4)[:8])
    assert all(getattr(dm.get_submodule(n), "_full_precision_mm", False) is False for n in nvfp4)

    inputs = fam.family_inputs(name, dm, seed=5)
    t2 = time.perf_counter()
    stock = run_forward(patcher, inputs)
    t3 = time.perf_counter()
    clone, linears = apply_fused(patcher)
    assert len(linears) == len(nvfp4)
    capture = LogCapture()
    logging.getLogger("h3_fused_nvfp4").addHandler(capture)
    try:
        fused = run_forward(clone, inputs)
    finally:
        logging.getLogger("h3_fused_nvfp4").removeHandler(capture)
    t4 = time.perf_counter()
    assert len(fused) == len(stock)
    for i, (a, b) in enumerate(zip(fused, stock)):
        assert_bit_identical(a, b, f"{name} output {i}")

    fused_calls = sum(v.calls_fused for v in linears)
    stock_calls = sum(v.calls_stock for v in linears)
    refused = sorted({m for m in capture.messages if "uses ComfyUI's path" in m})
    TIMINGS[name] = dict(build=t1 - t0, load=t2 - t1, stock=t3 - t2, fused=t4 - t3, linears=len(linears),
                         fused_calls=fused_calls, stock_calls=stock_calls, refusals=refused)
    assert fused_calls + stock_calls > 0
    assert fused_calls >= FUSED_SHARE * (fused_calls + stock_calls), (name, fused_calls, stock_calls, refused)


@pytest.mark.parametrize("name", [n for n in fam.FAMILIES if n != "minimax_h3"])
def test_full_width_detection(name, comfyui):
    """A full-width file (shape-only, 2 layers) is detected as the official release by ComfyUI's own detection,
    metadata as it ships (no merging), with the NVFP4 layers recognised."""
    import comfy.model_detection as md

    family = fam.FAMILIES[name]
    sd, metadata = fam.family_state_dict(name, width="full", layers=2, device="meta")
    config = md.model_config_from_unet(sd, "", metadata=metadata)
    assert config is not None and type(config).__name__ == family.supported_model, (name, type(config).__name__)
    expected = fam.family_config(name, width="full", layers=2)
    detected = config.unet_config
    differ = {k: (detected.get(k), v) for k, v in expected.items()
              if k in detected and (list(v) if isinstance(v, tuple) else v)
              != (list(detected[k]) if isinstance(detected[k], tuple) else detected[k])}
    assert not differ, (name, differ)
    assert config.quant_config == {"mixed_ops": True}, (name, config.quant_config)  # per-layer comfy_quant tags


def test_meta_entry_shapes_match_comfy_quantization():
    """The shape-only NVFP4 entries of the full-width detection checks are those ComfyUI's quantizer makes."""
    for out_features, in_features in ((144, 48), (256, 4096), (3, 32)):
        real = nvfp4_checkpoint_entries("l", torch.randn(out_features, in_features).to(torch.bfloat16))
        meta = fam.nvfp4_entry_shapes("l", out_features, in_features)
        assert {k: (tuple(v.shape), v.dtype) for k, v in real.items()} == \
               {k: (tuple(v.shape), v.dtype) for k, v in meta.items()}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_node_text_names_the_compute_dtype_of_the_emulated_gemm(dtype, monkeypatch, detection_reads_metadata,
                                                                 clean_models):
    """Wan 2.2 loaded by ComfyUI to compute in fp16 (its default) or bf16: the patch's summary, the text the nodes
    show, names the dtype the emulated GEMM multiplies in (the activation's: ComfyUI's apply_model casts the input to
    the model's inference dtype)."""
    import comfy.sd

    from h3_fused_nvfp4.tools import comfy_env

    comfy_env.force_nvfp4_compute(dtype, monkeypatch.setattr)
    sd, metadata = fam.family_state_dict("wan22_14b", width="tiny", seed=11)
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
    want = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert patcher.model.get_dtype_inference() == want
    clone, report = patch.apply_fused(patcher, "linears", allow_reference_backend=True)
    assert report.applied, report.reason
    other = {"fp16": "bf16", "bf16": "fp16"}[dtype]
    assert f"GEMM emulated (dequantize + {dtype} matmul)" in report.summary(), report.summary()
    assert f"{other} matmul" not in report.summary(), report.summary()


@pytest.mark.parametrize("dtype, layers, emulation", [
    (torch.float16, "fp16", "dequantize + fp16 matmul"), (torch.bfloat16, "bf16", "dequantize + bf16 matmul"),
    (None, "the model's compute dtype", "dequantize + matmul in the model's compute dtype")])
def test_gemm_text_on_a_gpu_without_fp4_names_the_compute_dtype(monkeypatch, dtype, layers, emulation):
    """On a GPU without FP4 tensor cores (the H200) the text says which dtype ComfyUI keeps the layers in."""
    from h3_fused_nvfp4.core import patching

    monkeypatch.setattr(patching, "gemm_mode", lambda device: "emulated")
    text = patching.gemm_description(torch.device("cuda", 0), dtype)
    assert f"keeps NVFP4 layers in {layers} here" in text and f"({emulation})" in text, text
    assert not {"bf16", "fp16"} - {layers} & set(text.replace("(", " ").split()), text


def test_print_timings():
    """Summary of the family runs above (pytest -s shows it)."""
    for name, t in TIMINGS.items():
        print(f"{name}: build {t['build']:.1f}s load {t['load']:.1f}s stock {t['stock']:.1f}s fused {t['fused']:.1f}s, "
              f"{t['linears']} NVFP4 Linears, calls fused {t['fused_calls']} stock {t['stock_calls']}; "
              f"refusals {t['refusals']}")
