"""NVFP4 Linears computing in fp16 (Wan's default compute dtype): ComfyUI rounds the dynamic global scale and the
``pre_quant_scale`` product in fp16, and the fused Linear's fp16 packs do the same. Against ComfyUI's real NVFP4
Linear built for fp16 compute (on the CPU through the kernels' Python twin, on a GPU through the fp16 kernels):
equal output bytes, every call fused; the twin's fp16 packs against ComfyUI's own op sequence on the self-check's
fp16 hard cases (subnormals, overflow to inf in the product, global scales in the fp16 subnormals and on 0); the
fp16 probes and the faults they catch; refusals with a reason (fp32 activations, fp16 through the H3 sources).
(The fp16 kernels' pack parity: tests/test_gpu_pack_parity.py; the oracle's fp16 model: tests/
test_reference_nvfp4.py.)"""

import logging

import pytest
import torch
from conftest import cuda_available
from parity import assert_bit_identical, assert_fused_linear_matches_stock, fresh_seed

from h3_fused_nvfp4 import comfy_adapter
from h3_fused_nvfp4.core import plan, probes, verdicts
from h3_fused_nvfp4.core.linear import FusedNVFP4Linear, checked_op
from h3_fused_nvfp4.kernels import twin_ops
from h3_fused_nvfp4.layout import Modulation
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")
F16 = torch.float16
GPU = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (CPU-only machines skip the GPU tests)")
SHAPES = [("cpu", 256, 768, 310, None, False), ("cpu", 512, 256, 47, 0.02, True), ("cpu", 1056, 128, 129, None, True),
          pytest.param("cuda", 5376, 5376, 37810, None, False, marks=GPU),
          pytest.param("cuda", 4096, 14336, 1001, 0.02, True, marks=GPU),
          pytest.param("cuda", 5120, 13824, 517, None, True, marks=GPU)]


def fp16_layer(in_f, out_f, *, seed=0, device="cpu", static=None, bias=False, table=None):
    layer = syn.make_nvfp4_linear(in_f, out_f, seed=seed, device=device, input_scale=static, bias=bias,
                                  compute_dtype=F16, pre_quant_scale=table)
    return layer


@pytest.mark.parametrize("magnitude", [2.0, 0.02, 1e-5])
@pytest.mark.parametrize("device,in_f,out_f,rows,static,bias", SHAPES)
def test_fp16_linear_bit_identical(device, in_f, out_f, rows, static, bias, magnitude):
    """Dynamic and static scales, with and without bias; activations whose dynamic scale is an fp16 normal,
    subnormal (amax ~0.1) or 0 (amax ~5e-5)."""
    seed = fresh_seed()
    layer = fp16_layer(in_f, out_f, seed=seed, device=device, static=static, bias=bias)
    x = (torch.randn(rows, in_f, device=device) * magnitude).to(F16)
    fused = FusedNVFP4Linear(layer, "fp16 layer")
    assert fused.static_refusal() is None and fused.refusal(x, in_f) is None
    assert_fused_linear_matches_stock(layer, fused, x, f"fp16 x{magnitude} seed {seed}")


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, F16])
@pytest.mark.parametrize("device,in_f,out_f,rows,static,bias", SHAPES)
def test_fp16_linear_with_pre_quant_scale_bit_identical(device, in_f, out_f, rows, static, bias, table_dtype):
    seed = fresh_seed()
    table = torch.exp(torch.randn(in_f) * 0.8).to(table_dtype)
    layer = fp16_layer(in_f, out_f, seed=seed, device=device, static=static, bias=bias, table=table)
    x = (torch.randn(rows, in_f, device=device) * 2).to(F16)
    fused = FusedNVFP4Linear(layer, "fp16 awq layer")
    assert_fused_linear_matches_stock(layer, fused, x, f"fp16 prescale seed {seed}")
    assert fused.prescale(x.device, F16).dtype == F16


def test_fp16_hard_tables_through_the_linear():
    """The fp16 probe table (overflow to inf in the cast and in the product, products in the fp16 subnormals,
    zeros, -0.0, negatives) in a real fp16 layer, finite and non-finite: equal bytes to ComfyUI's Linear."""
    k = 1056
    table = probes.prescale_table_f16(k)
    layer = fp16_layer(k, 64, seed=3, table=table)
    x, _ = probes.probe_activations_f16("cpu", k=k)["fp16 random rows, dynamic scale"]
    finite = torch.nan_to_num(table, posinf=2.0, neginf=-2.0).clamp(-1e3, 1e3)
    fused = FusedNVFP4Linear(layer, "fp16 awq layer")
    with torch.inference_mode():
        for t in (table, finite):
            layer.pre_quant_scale = torch.nn.Parameter(t, requires_grad=False)
            h = x * comfy_adapter.cast_to_device(t, x.device, F16)
            assert torch.isinf(h).any() == (t is table)  # the hard table overflows fp16 products to inf
            assert_bit_identical(fused(x), layer(x), "fp16 hard table")
    assert fused.calls_fused == 2


@pytest.mark.parametrize("label", list(probes.probe_activations_f16("cpu")))
def test_twin_fp16_pack_equals_comfyui_sequence(label):
    """The twin's fp16 pack against ComfyUI's ``QuantizedTensor.from_float`` of the same fp16 tensor."""
    x, scale = probes.probe_activations_f16("cpu")[label]
    packed = twin_ops.pack_nvfp4(x, static_scale=probes.static_scale(scale, "cpu"))
    assert probes.compare_packed(label, packed, probes.comfy_quantized(x, scale)) is None


@pytest.mark.parametrize("label", list(probes.prescale_activations_f16("cpu")))
def test_twin_fp16_prescale_pack_equals_comfyui_sequence(label):
    x, table, scale = probes.prescale_activations_f16("cpu")[label]
    prescale = comfy_adapter.cast_to_device(table, torch.device("cpu"), F16)
    packed = twin_ops.pack_nvfp4(x, static_scale=probes.static_scale(scale, "cpu"), prescale=prescale)
    h = x * comfy_adapter.cast_to_device(table, x.device, x.dtype)  # comfy/ops.py, MixedPrecisionOps.Linear.forward
    assert probes.compare_packed(label, packed, probes.comfy_quantized(h, scale)) is None


def test_fp16_probe_cases_cover_the_hard_cases():
    """The fp16 probes hold what they claim: fp16 subnormal inputs, dynamic scales that are fp16 subnormals and 0,
    scales that round up and down, products that overflow to inf and that land in the fp16 subnormals."""
    acts = probes.probe_activations_f16("cpu")
    hard, _ = acts["fp16 hard cases, static scale 1"]
    tiny = hard.float().abs()
    assert ((tiny > 0) & (tiny < 2.0 ** -14)).any()
    g_sub = twin_ops.dynamic_global_scale(acts["fp16 rows with a subnormal dynamic scale"][0])
    assert 0 < float(g_sub) < 2.0 ** -14
    assert float(twin_ops.dynamic_global_scale(acts["fp16 rows whose dynamic scale is 0"][0])) == 0.0
    inv = torch.tensor(1 / 2688, dtype=torch.float32)
    amaxes = torch.tensor(probes.scale_rounding_amaxes_f16(), dtype=torch.float32)
    exact = amaxes * inv
    rounded = exact.to(F16).float()
    assert (rounded > exact).any() and (rounded < exact).any() and (rounded == 0).any()
    assert ((rounded > 0) & (rounded < 2.0 ** -14) & (rounded < exact)).any()  # a subnormal rounded down
    x, table, _ = probes.prescale_activations_f16("cpu")["fp16 random rows x hard table, dynamic scale"]
    h = x * comfy_adapter.cast_to_device(table, x.device, F16)
    assert torch.isinf(h).any() and ((h != 0) & (h.abs() < 2.0 ** -14)).any()


@pytest.mark.parametrize("probe", ["global_scale_f16", "pack_f16", "pack_prescale_f16"])
def test_fp16_probes_pass_on_the_twin(probe):
    assert probes.LINEAR_PROBES.probes[probe](twin_ops, "cpu") is None


def test_fp16_probes_catch_a_bf16_rounding(monkeypatch):
    """Planted faults: the global scale rounded through bf16 (the bf16 arithmetic applied to fp16 activations), and
    the prescale product rounded through bf16. Each fp16 probe that covers the op fails; the bf16 probes pass."""
    real_scale, real_source = twin_ops.dynamic_global_scale, twin_ops.source_output

    def bf16_scale(h):
        return (torch.amax(h.abs()).to(torch.bfloat16) / 2688.0).to(torch.float32).reshape(1)

    monkeypatch.setattr(twin_ops, "dynamic_global_scale", bf16_scale)
    for probe in ("global_scale_f16", "pack_f16"):
        detail = probes.LINEAR_PROBES.probes[probe](twin_ops, "cpu")
        assert detail is not None and "global scale differs" in detail, (probe, detail)
    monkeypatch.setattr(twin_ops, "dynamic_global_scale", real_scale)

    def bf16_product(x, *, prescale=None, **kwargs):
        if prescale is not None and x.dtype == F16:
            return (x.to(torch.bfloat16) * prescale.to(torch.bfloat16)).to(F16)
        return real_source(x, prescale=prescale, **kwargs)

    monkeypatch.setattr(twin_ops, "source_output", bf16_product)
    detail = probes.check_pack_prescale_f16(twin_ops, "cpu")
    assert detail is not None and "differs at index" in detail, detail
    assert probes.check_pack_prescale(twin_ops, "cpu") is None and probes.check_pack(twin_ops, "cpu") is None


def test_a_failed_fp16_probe_turns_off_only_fp16_calls(monkeypatch):
    """A verdict with pack_f16 failed: fp16 calls of a Linear run ComfyUI's path with the reason, bf16 calls stay
    fused; a failed global_scale_f16 turns off both fp16 packs (they share the reduction), not the bf16 ones."""
    results = {op: verdicts.OpResult(True, "bit-identical") for op in probes.LINEAR_PROBES.probes}
    results["pack_f16"] = verdicts.OpResult(False, "fp16 codes differ at index (0, 0) (planted)")
    probe_sets = (probes.LINEAR_PROBES,)
    key = f"cpu|{probes.LINEAR_PROBES.name}"
    monkeypatch.setitem(verdicts._verdicts, key, verdicts.Verdict({}, results, 0.0, "ran"))
    monkeypatch.setitem(verdicts._probe_sets, key, probe_sets)
    verdicts._changed()
    try:
        cpu = torch.device("cpu")
        assert "pack_f16" in verdicts.op_refusal(cpu, "pack_f16")
        assert verdicts.op_refusal(cpu, "pack") is None and verdicts.op_refusal(cpu, "pack_prescale_f16") is None
        layer = fp16_layer(256, 64, seed=5)
        fused = FusedNVFP4Linear(layer, "fp16 layer")
        x = (torch.randn(40, 256) * 2).to(F16)
        with torch.inference_mode():
            assert_bit_identical(fused(x), layer(x), "fp16 call on ComfyUI's path")
        assert fused.calls_fused == 0 and fused.calls_stock == 1
        bf16_layer = syn.make_nvfp4_linear(256, 64, seed=5)
        bf16 = FusedNVFP4Linear(bf16_layer, "bf16 layer")
        with torch.inference_mode():
            bf16(x.to(torch.bfloat16))
        assert bf16.calls_fused == 1
        results["pack_f16"] = verdicts.OpResult(True, "bit-identical")
        results["global_scale_f16"] = verdicts.OpResult(False, "fp16 global scale differs (planted)")
        verdicts._changed()
        assert "global_scale_f16" in verdicts.op_refusal(cpu, "pack_prescale_f16")
        assert verdicts.op_refusal(cpu, "pack_prescale") is None and verdicts.op_refusal(cpu, "linear") is None
    finally:
        verdicts._changed()


def test_checked_ops_by_dtype():
    assert checked_op("pack", F16) == "pack_f16" and checked_op("pack_prescale", F16) == "pack_prescale_f16"
    assert checked_op("linear", F16) == "linear_f16" and checked_op("pack", torch.bfloat16) == "pack"
    assert checked_op("pack_swiglu", F16) == "pack_swiglu_f16"  # no bf16 verdict stands for fp16 arithmetic
    assert {"global_scale_f16", "pack_f16", "pack_prescale_f16", "linear_f16"} <= set(plan.OPS)
    assert set(probes.LINEAR_PROBES.probes) <= set(plan.OPS)


def test_fp32_activations_and_fp16_h3_sources_are_refused_with_a_reason(caplog):
    layer = syn.make_nvfp4_linear(256, 64, seed=1, compute_dtype=torch.float32)
    fused = FusedNVFP4Linear(layer, "fp32 layer")
    x = torch.randn(8, 256)
    assert fused.refusal(x, 256) == "the activation is torch.float32, not bfloat16 or float16"
    caplog.set_level(logging.INFO, logger="h3_fused_nvfp4")
    with torch.inference_mode():
        assert_bit_identical(fused(x), layer(x), "fp32 on ComfyUI's path")
    assert fused.calls_fused == 0 and any("float32" in r.getMessage() for r in caplog.records)
    h = torch.zeros(8, 256, dtype=F16)
    assert "float32" in twin_ops.pack_support(x) and "bfloat16 or float16" in twin_ops.pack_support(x)
    modulation = Modulation(torch.zeros(1, 256, dtype=F16), torch.zeros(1, 256, dtype=F16),
                            torch.zeros(8, dtype=torch.int32))
    for kwargs in (dict(swiglu=True), dict(modulation=modulation)):
        reason = twin_ops.pack_support(torch.zeros(8, 512, dtype=F16) if "swiglu" in kwargs else h, **kwargs)
        assert reason is not None and "take bfloat16" in reason, (kwargs, reason)
        with pytest.raises(ValueError, match="take bfloat16"):
            twin_ops.pack_nvfp4(torch.zeros(8, 512, dtype=F16) if "swiglu" in kwargs else h, **kwargs)
    assert "fp16 [256]" in twin_ops.pack_support(h, prescale=torch.ones(256, dtype=torch.bfloat16))
    assert twin_ops.pack_support(h, prescale=torch.ones(256, dtype=F16)) is None
