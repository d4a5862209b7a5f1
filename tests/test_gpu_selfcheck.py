"""The first-use self-check on the GPU: every kernel probe passes against ComfyUI's ops (its time: report.py), a
planted wrong kernel (NVFP4_PLANT_FAULT: bf16 and fp16 rounding toward zero) fails it and the model falls back for
those ops with the message, and a cached cubin the driver refuses is rebuilt."""

import logging

import pytest
import torch
from conftest import requires_cuda
from parity import assert_bit_identical, selfcheck_mode
from test_h3_block_cpu import TOKENS, run_blocks

from h3_fused_nvfp4.core import verdicts
from h3_fused_nvfp4.models import patch
from h3_fused_nvfp4.models.h3.patch import PROBE_SETS
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = [requires_cuda, pytest.mark.usefixtures("comfyui")]
CUDA = torch.device("cuda", 0)


def _ops():
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    return ops


def test_kernel_selfcheck_passes():
    """(How long the check takes on the GPU is measured by report.py: ``selfcheck.seconds``, and per op ``ms``.)"""
    ops = _ops()
    results = verdicts.run_probes(ops, CUDA, PROBE_SETS)
    failed = {n: r.detail for n, r in results.items() if r.ok is False}
    assert not failed, failed
    assert results["rms_rope"].ok is True and results["rms_norm"].ok is True
    if torch.cuda.get_device_capability()[0] >= 10:
        assert results["linear"].ok is True


def test_planted_wrong_kernel_fails_and_the_model_falls_back(monkeypatch, tmp_path, caplog):
    ops = _ops()
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ops, "EXTRA_DEFINES", (("NVFP4_PLANT_FAULT", 1),))
    results = verdicts.run_probes(ops, CUDA, PROBE_SETS)
    failed = {n for n, r in results.items() if r.ok is False}
    # Every op that rounds to bf16 sees it; the packs round only their global scale, which the global_scale probe
    # checks with scales that round up and down (a fault there turns every dynamic pack off).
    assert {"global_scale", "global_scale_f16", "gated_residual", "rms_norm", "pack_norm", "rms_rope"} <= failed, {
        n: r.detail for n, r in results.items()}
    assert "differs at index" in results["gated_residual"].detail

    with selfcheck_mode("force"):
        blocks = [syn.make_dit_block(syn.H3_SMALL, seed=7 + i, device="cuda") for i in range(2)]
        inputs = syn.make_block_inputs(syn.H3_SMALL, TOKENS, seed=8, device="cuda")
        run_blocks(blocks, inputs)
        stock = run_blocks(blocks, inputs)
        caplog.set_level(logging.INFO, logger="h3_fused_nvfp4")
        clone, report = patch.apply_fused(syn.model_patcher_for(syn.BlockHolder(blocks)), "block")
        assert report.applied and "self-check FAILED" in report.summary(), report.summary()
        clone.patch_model(load_weights=False)
        try:
            run_blocks(blocks, inputs)  # the block check's call
            result = run_blocks(blocks, inputs)
        finally:
            clone.unpatch_model()
    assert_bit_identical(result, stock, "with the planted kernel's ops on ComfyUI's path")
    assert any("the self-check found" in r.getMessage() for r in caplog.records)


def test_cached_cubin_the_driver_refuses_is_rebuilt(monkeypatch, tmp_path):
    from h3_fused_nvfp4.kernels import runtime

    ops = _ops()
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", str(tmp_path / "cache"))
    defines = ops.kernel_defines() + (("NVFP4_CACHE_TEST", 1),)  # a key no other test uses
    arch = runtime.device_arch(0)
    path = runtime.cubin_cache_path(arch, "packs.cu", defines)
    garbage = b"\x7fELF not a cubin"
    runtime.atomic_write(path, garbage + runtime.CUBIN_TRAILER + __import__("hashlib").sha256(garbage).digest())
    mod = runtime.Module(0, "packs.cu", defines)  # loads, finds the driver refusing it, rebuilds
    assert mod.function("nvfp4_pack_plain")
    assert runtime._read_cached(path) != garbage


def test_changed_comfyui_block_is_caught_on_the_gpu(monkeypatch):
    """ComfyUI's DiTBlock.forward with the MLP modulation's two roundings swapped: the kernel probes still pass, the
    block check on the first forward sees it, and the model then runs ComfyUI's path."""
    import comfy.ldm.minimax.model as m
    from test_selfcheck import changed_block_forward

    monkeypatch.setattr(m.DiTBlock, "forward", changed_block_forward)
    with selfcheck_mode("force"):
        blocks = [syn.make_dit_block(syn.H3_SMALL, seed=21 + i, device="cuda") for i in range(2)]
        inputs = syn.make_block_inputs(syn.H3_SMALL, TOKENS, seed=22, device="cuda")
        run_blocks(blocks, inputs)
        stock = run_blocks(blocks, inputs)
        clone, report = patch.apply_fused(syn.model_patcher_for(syn.BlockHolder(blocks)), "block")
        assert report.applied and "self-check passed" in report.summary()
        clone.patch_model(load_weights=False)
        try:
            first = run_blocks(blocks, inputs)
            state = clone.object_patches["diffusion_model.blocks.0.forward"].state
            assert state.block_check == "failed" and "differs at index" in state.block_check_detail
            later = run_blocks(blocks, inputs)
        finally:
            clone.unpatch_model()
    assert_bit_identical(first, stock, "the checking call returns ComfyUI's result")
    assert_bit_identical(later, stock, "later calls run ComfyUI's path")
