"""NVFP4 Linears with a ``pre_quant_scale`` (AWQ smoothing; H3's NVFP4 text encoder has them): ComfyUI's Linear
multiplies its input by the table cast to the input dtype, then quantizes. The fused Linear folds that multiply into
the pack (the prescale source). Against ComfyUI's real NVFP4 Linear loaded from a state dict with a
``pre_quant_scale`` entry (on the CPU through the kernels' Python twin, on a GPU through the kernels): equal output
bytes, every call fused; the twin's pack against ComfyUI's own op sequence on the self-check's hard tables; refusals
with a reason. (The kernels' pack parity: tests/test_gpu_pack_parity.py.)"""

import logging

import pytest
import torch
from conftest import cuda_available
from parity import assert_bit_identical, assert_fused_linear_matches_stock, fresh_seed

from h3_fused_nvfp4 import comfy_adapter
from h3_fused_nvfp4.core import probes
from h3_fused_nvfp4.core.calibration import RecordingForward
from h3_fused_nvfp4.core.linear import FusedNVFP4Linear
from h3_fused_nvfp4.kernels import twin_ops
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")


def awq_table(k: int, dtype=torch.float32) -> torch.Tensor:
    """AWQ-like smoothing factors (positive, around 1, some large and small), as ModelOpt stores them."""
    return torch.exp(torch.randn(k) * 0.8).to(dtype)


def comfy_layer(in_f, out_f, table, *, seed=0, static=None, bias=False):
    layer = syn.make_nvfp4_linear(in_f, out_f, seed=seed, input_scale=static, bias=bias, pre_quant_scale=table)
    assert isinstance(layer.pre_quant_scale, torch.nn.Parameter) and layer.pre_quant_scale.dtype == table.dtype
    return layer


GPU = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (CPU-only machines skip the GPU tests)")
SHAPES = [("cpu", 256, 768, 310, None, False), ("cpu", 512, 256, 47, 0.02, True), ("cpu", 1056, 128, 129, None, True),
          pytest.param("cuda", 4096, 4096, 1001, None, False, marks=GPU),
          pytest.param("cuda", 4096, 14336, 517, 0.02, True, marks=GPU)]


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device,in_f,out_f,rows,static,bias", SHAPES)
def test_fused_linear_with_pre_quant_scale_bit_identical(device, in_f, out_f, rows, static, bias, table_dtype):
    seed = fresh_seed()
    layer = syn.make_nvfp4_linear(in_f, out_f, seed=seed, input_scale=static, bias=bias, device=device,
                                  pre_quant_scale=awq_table(in_f, table_dtype))
    assert isinstance(layer.pre_quant_scale, torch.nn.Parameter) and layer.pre_quant_scale.dtype == table_dtype
    x = (torch.randn(rows, in_f, device=device) * 2).to(torch.bfloat16)
    fused = FusedNVFP4Linear(layer, "awq layer")
    assert fused.static_refusal() is None
    assert_fused_linear_matches_stock(layer, fused, x, f"seed {seed}")


def test_the_prescale_table_changes_the_output():
    """The parity above is not vacuous: the same layer without its table gives other bytes."""
    layer = comfy_layer(256, 128, awq_table(256) * 3)
    x = (torch.randn(64, 256) * 2).to(torch.bfloat16)
    fused = FusedNVFP4Linear(layer, "awq layer")
    with torch.inference_mode():
        out = fused(x)
        del layer.pre_quant_scale
        plain = fused(x)
    assert fused.calls_fused == 2
    assert not torch.equal(out.view(torch.int16), plain.view(torch.int16))


def test_hard_tables_through_the_linear():
    """The self-check's hard table (zeros, -0.0, negatives, values overflowing to inf or underflowing in the bf16
    cast, subnormals) in a real layer, with finite and non-finite inputs: equal bytes to ComfyUI's Linear."""
    k = 1056
    table = probes.prescale_table(k)
    layer = comfy_layer(k, 64, table, seed=3)
    x, _ = probes.probe_activations("cpu", k=k)["random rows, dynamic scale"]
    finite = torch.nan_to_num(table, posinf=2.0, neginf=-2.0).clamp(-1e4, 1e4)
    fused = FusedNVFP4Linear(layer, "awq layer")
    with torch.inference_mode():
        for t in (table, finite):
            layer.pre_quant_scale = torch.nn.Parameter(t, requires_grad=False)
            assert_bit_identical(fused(x), layer(x), "hard table")
    assert fused.calls_fused == 2


DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_a_table_changed_in_place_gives_comfyuis_new_bytes(device, table_dtype):
    """ComfyUI casts the ``pre_quant_scale`` per call. Everything its executor loads is an inference tensor, which
    keeps no version counter: after the table changes in place (same tensor, same address) the fused Linear must
    read the new values, as ComfyUI's Linear does, whether the table needs a cast (fp32) or not (bf16)."""
    seed = fresh_seed()
    with torch.inference_mode():
        layer = syn.make_nvfp4_linear(256, 64, seed=seed, device=device, pre_quant_scale=awq_table(256, table_dtype))
        assert layer.pre_quant_scale.is_inference()
        fused = FusedNVFP4Linear(layer, "awq layer")
        x = (torch.randn(48, 256, device=device) * 2).to(torch.bfloat16)
        layer(x)
        fused(x)  # both arms warm (the first emulated call of a process differs on the H200)
        for step, change in enumerate((lambda t: t.mul_(3), lambda t: t.copy_(awq_table(256, t.dtype)),
                                       lambda t: t.neg_())):
            change(layer.pre_quant_scale)
            assert_bit_identical(fused(x), layer(x), f"after in-place change {step}, seed {seed}")
    assert fused.calls_fused == 4 and fused.calls_stock == 0


def test_the_cast_table_lives_in_one_persistent_buffer():
    """A table that needs a cast is cast into the same buffer each call (no per-call allocation); one already in
    the activation dtype and aligned is read as it is."""
    layer = comfy_layer(256, 64, awq_table(256))
    fused = FusedNVFP4Linear(layer, "awq layer")
    first = fused.prescale(torch.device("cpu"), torch.bfloat16)
    expected = comfy_adapter.cast_to_device(layer.pre_quant_scale, torch.device("cpu"), torch.bfloat16)
    assert first.dtype == torch.bfloat16 and first.data_ptr() % 16 == 0
    assert torch.equal(first.view(torch.int16), expected.view(torch.int16))
    assert fused.prescale(torch.device("cpu"), torch.bfloat16).data_ptr() == first.data_ptr()
    bf16 = comfy_layer(256, 64, awq_table(256, torch.bfloat16))
    table = FusedNVFP4Linear(bf16, "bf16 table").prescale(torch.device("cpu"), torch.bfloat16)
    assert table.data_ptr() == bf16.pre_quant_scale.data_ptr()


@pytest.mark.parametrize("label", list(probes.prescale_activations("cpu")))
def test_twin_prescale_pack_equals_comfyui_sequence(label):
    """The twin's prescale pack against ComfyUI's Linear's multiply (``input * cast_to_device(pqs, ...)``) and
    ``QuantizedTensor.from_float``: codes, block scales and global scale."""
    x, table, scale = probes.prescale_activations("cpu")[label]
    prescale = comfy_adapter.cast_to_device(table, torch.device("cpu"), torch.bfloat16)
    packed = twin_ops.pack_nvfp4(x, static_scale=probes.static_scale(scale, "cpu"), prescale=prescale)
    h = x * comfy_adapter.cast_to_device(table, x.device, x.dtype)  # comfy/ops.py, MixedPrecisionOps.Linear.forward
    assert probes.compare_packed(label, packed, probes.comfy_quantized(h, scale)) is None


def test_prescale_probe_passes_and_catches_a_wrong_multiply(monkeypatch):
    assert probes.check_pack_prescale(twin_ops, "cpu") is None
    real = twin_ops.source_output

    def rounded_twice(x, *, prescale=None, **kwargs):  # planted fault: the product through fp16 first
        if prescale is not None:
            return (x.float() * prescale.float()).to(torch.float16).to(torch.bfloat16)
        return real(x, **kwargs)

    monkeypatch.setattr(twin_ops, "source_output", rounded_twice)
    detail = probes.check_pack_prescale(twin_ops, "cpu")
    assert detail is not None and "differs at index" in detail, detail


def test_prescale_with_another_source_is_refused_with_a_reason(caplog):
    """The pack reads one source: a prescaled layer fed through SwiGLU (or a modulated / normalized source) runs
    ComfyUI's ops, which apply the table themselves."""
    k = 256
    layer = comfy_layer(k, 64, awq_table(k))
    fused = FusedNVFP4Linear(layer, "awq fc2")
    y = (torch.randn(40, 2 * k) * 2).to(torch.bfloat16)
    stock_input = comfy_adapter.eager_swiglu(y)
    caplog.set_level(logging.INFO, logger="h3_fused_nvfp4")
    with torch.inference_mode():
        out = fused(y, swiglu=True, stock=lambda: comfy_adapter.eager_swiglu(y))
        assert_bit_identical(out, layer(stock_input), "stock fallback")
    assert fused.calls_fused == 0 and fused.calls_stock == 1
    assert any("pre_quant_scale" in r.getMessage() for r in caplog.records)
    assert "pre_quant_scale" in twin_ops.pack_support(y[:, :k], swiglu=True, prescale=torch.ones(k // 2))


def test_malformed_tables_are_refused():
    layer = comfy_layer(256, 64, awq_table(256))
    layer.pre_quant_scale = torch.nn.Parameter(torch.ones(1, 256), requires_grad=False)
    assert "pre_quant_scale" in FusedNVFP4Linear(layer, "awq").static_refusal()
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert "bf16 [256]" in twin_ops.pack_support(x, prescale=torch.ones(256))
    with pytest.raises(ValueError):
        twin_ops.pack_nvfp4(x, prescale=torch.ones(128, dtype=torch.bfloat16))


def test_calibration_records_the_prescaled_input():
    """A static ``input_scale`` applies to what ComfyUI quantizes: the input times the table, on both paths."""
    layer = comfy_layer(256, 64, awq_table(256))
    fused = FusedNVFP4Linear(layer, "awq layer")
    seen = []

    class Recorder:
        def active(self):
            return True

        def record(self, name, h):
            seen.append(h)

    fused.recorder = Recorder()
    x = (torch.randn(8, 256) * 2).to(torch.bfloat16)
    with torch.inference_mode():
        fused(x)
    expected = x * comfy_adapter.cast_to_device(layer.pre_quant_scale, x.device, x.dtype)
    assert len(seen) == 1 and torch.equal(seen[0].view(torch.int16), expected.view(torch.int16))
    # ComfyUI's own path records the same (the Calibrate node on a stock model)
    with torch.inference_mode():
        RecordingForward(layer, "awq layer", Recorder())(x)
    assert len(seen) == 2 and torch.equal(seen[1].view(torch.int16), expected.view(torch.int16))
