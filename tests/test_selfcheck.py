"""The first-use self-check (core/verdicts.py, core/probes.py, models/h3/probes.py) on the CPU, with the Python
twin of the kernels.

Planted faults: a wrong twin op (the modulation's shift applied before the scale) fails the kernel check and the
model falls back for that op with the message; a changed ComfyUI block (its op order, through a monkeypatched
DiTBlock.forward) is caught by the block check. Verdicts are cached on disk and re-checked when a key part
changes. (Planted wrong CUDA kernels: tests/test_gpu_selfcheck.py; corrupt kernel cache files:
tests/test_kernel_build.py.)
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from parity import assert_bit_identical, selfcheck_mode, within
from test_h3_block_cpu import TOKENS, linears, run_blocks

from h3_fused_nvfp4.core import plan, verdicts
from h3_fused_nvfp4.kernels import twin_ops as fused_ops
from h3_fused_nvfp4.models import patch
from h3_fused_nvfp4.models.h3 import patch as h3_patch
from h3_fused_nvfp4.models.h3.patch import PROBE_SETS
from h3_fused_nvfp4.tools import synthetic as syn

pytestmark = pytest.mark.usefixtures("comfyui")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("H3_FUSED_NVFP4_CACHE", str(tmp_path / "cache"))
    with selfcheck_mode("auto"):
        yield tmp_path / "cache"


def swapped_modulate(x, modulation):
    """The planted fault: ComfyUI's modulation with its two roundings swapped (shift before scale)."""
    scale = modulation.scale[modulation.mod_index.long()]
    shift = modulation.shift[modulation.mod_index.long()]
    return x.add(shift).mul_(1.0 + scale)


def patched_model(blocks):
    patcher = syn.model_patcher_for(syn.BlockHolder(blocks), "cpu")
    return patch.apply_fused(patcher, "block", allow_reference_backend=True)


def run_patched(clone, blocks, inputs):
    clone.patch_model(load_weights=False)
    try:
        return run_blocks(blocks, inputs)
    finally:
        clone.unpatch_model()


def changed_block_forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
    """ComfyUI's DiTBlock.forward with one planted change: the MLP modulation applies its shift before its scale."""
    import comfy.ldm.minimax.model as m

    attention = self.attn if attention is None else attention
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
    h = m._mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)
    x = m._mod_gate(x, gate_msa, attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options),
                    mod_segments)
    h = self.norm2(x)
    for a, b, row in mod_segments:
        h[a:b].add_(m._mod_row(shift_mlp, row, h.dtype)).mul_(1.0 + m._mod_row(scale_mlp, row, h.dtype))
    return m._mod_gate(x, gate_mlp, self.mlp(h), mod_segments)


def test_every_probe_passes_on_the_twin():
    """(How long the check takes is measured by report.py: ``selfcheck.seconds``, and per op ``ms``.)"""
    results = verdicts.run_probes(fused_ops, CPU, PROBE_SETS)
    declared = {op for s in PROBE_SETS for op in (*s.probes, *s.aliases)}
    assert set(results) == declared and set(plan.OPS) <= declared
    assert {n for n, r in results.items() if r.ok is False} == set(), {n: r.detail for n, r in results.items()}
    assert results["linear"].ok is None and "no FP4 GEMM" in results["linear"].detail
    assert results["linear_f16"].ok is None and results["pack_f16"].ok is True


def test_planted_wrong_op_fails_the_check_and_the_model_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(fused_ops, "modulate", swapped_modulate)
    results = verdicts.run_probes(fused_ops, CPU, PROBE_SETS)
    failed = {n for n, r in results.items() if r.ok is False}
    assert {"pack_modulate", "rms_norm", "pack_norm"} <= failed and "pack" not in failed, failed
    detail = results["pack_modulate"].detail
    assert "differs at index" in detail and "fused" in detail and "ComfyUI" in detail, detail

    blocks = [syn.make_dit_block(seed=3 + i) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=5)
    stock = run_blocks(blocks, inputs)
    caplog.set_level(logging.INFO, logger="h3_fused_nvfp4")
    clone, report = patched_model(blocks)
    assert report.applied and "self-check FAILED for" in report.summary() and "pack_modulate" in report.summary()
    assert "report.py" in report.summary()
    assert_bit_identical(run_patched(clone, blocks, inputs), stock, "with the failed ops on ComfyUI's path")
    qkv = [v for v in linears(clone.object_patches, "blocks.") if v.name.endswith("qkv_proj")]
    assert qkv and all(v.calls_fused == 0 and v.calls_stock > 0 for v in qkv)
    notes = [r.getMessage() for r in caplog.records if "the self-check found" in r.getMessage()]
    assert notes, "the fallback did not say why"


def test_fp16_probes_exist_and_catch_a_planted_fp16_fault(monkeypatch):
    """The fp16 Linear ops have probes of their own; a twin that rounds fp16 activations' global scale through bf16
    (the bf16 arithmetic applied to fp16) fails exactly the fp16 ops that use it, and the model's bf16 ops pass."""
    assert {"global_scale_f16", "pack_f16", "pack_prescale_f16", "linear_f16"} <= set(plan.OPS)
    real = fused_ops.dynamic_global_scale

    def bf16_rounded(h):
        if h.dtype == torch.float16:
            return (torch.amax(h.abs()).to(torch.bfloat16) / 2688.0).to(torch.float32).reshape(1)
        return real(h)

    monkeypatch.setattr(fused_ops, "dynamic_global_scale", bf16_rounded)
    results = verdicts.run_probes(fused_ops, CPU, PROBE_SETS)
    failed = {n for n, r in results.items() if r.ok is False}
    assert {"global_scale_f16", "pack_f16", "pack_prescale_f16"} <= failed, failed
    assert not failed & {"global_scale", "pack", "pack_prescale", "pack_modulate", "pack_swiglu"}, failed
    assert results["linear_f16"].ok is None and "no FP4 GEMM" in results["linear_f16"].detail
    assert "global scale differs" in results["global_scale_f16"].detail


def test_changed_comfyui_block_is_caught_by_the_block_check(monkeypatch):
    """ComfyUI's DiTBlock.forward applying the MLP modulation's shift before its scale: only the block check can
    see it (every kernel probe still passes); the model then runs ComfyUI's path, and the verdict is remembered."""
    import comfy.ldm.minimax.model as m

    monkeypatch.setattr(m.DiTBlock, "forward", changed_block_forward)
    blocks = [syn.make_dit_block(seed=11 + i) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=13)
    stock = run_blocks(blocks, inputs)  # the changed ComfyUI
    clone, report = patched_model(blocks)
    assert report.applied and "self-check passed" in report.summary()
    result = run_patched(clone, blocks, inputs)
    state = clone.object_patches["diffusion_model.blocks.0.forward"].state
    assert state.block_check == "failed" and "differs at index" in state.block_check_detail
    assert_bit_identical(result, stock, "the call that found the difference returns ComfyUI's result")
    assert_bit_identical(run_patched(clone, blocks, inputs), stock, "later calls run ComfyUI's path")
    # The next patch of a model in this environment knows it at once, from the cached verdict.
    verdicts.forget_verdicts()
    _, again = patched_model([syn.make_dit_block(seed=17)])
    assert not again.applied and "block check FAILED" in again.reason


@pytest.mark.parametrize("first", ["all NaN", "all inf", "NaN in one row"])
def test_a_first_input_that_proves_nothing_neither_passes_nor_is_stored(monkeypatch, first):
    """A changed ComfyUI block (as above) whose first input is not finite: NaN or inf reaches every output element
    of both blocks (through RMSNorm and attention), so their equal bytes prove nothing about the arithmetic. The
    check must neither pass nor be stored as passed: that call returns ComfyUI's result, and the next call with a
    finite input runs the check, which finds the difference."""
    import comfy.ldm.minimax.model as m

    monkeypatch.setattr(m.DiTBlock, "forward", changed_block_forward)
    blocks = [syn.make_dit_block(seed=31 + i) for i in range(2)]
    inputs = syn.make_block_inputs(tokens=TOKENS, seed=33)
    x = inputs[0].clone()
    if first == "NaN in one row":
        x[5] = float("nan")
    else:
        x.fill_(float("nan") if first == "all NaN" else float("inf"))
    broken = (x, *inputs[1:])
    clone, report = patched_model(blocks)
    assert report.applied
    result = run_patched(clone, blocks, broken)
    state = clone.object_patches["diffusion_model.blocks.0.forward"].state
    assert state.block_check == "pending", state.block_check_detail
    assert_bit_identical(result, run_blocks(blocks, broken), "the inconclusive call returns ComfyUI's result")
    assert json.loads(verdict_path().read_text())["block"] == "pending"
    assert_bit_identical(run_patched(clone, blocks, inputs), run_blocks(blocks, inputs), "the next call")
    assert state.block_check == "failed" and "differs at index" in state.block_check_detail
    assert json.loads(verdict_path().read_text())["block"] == "failed"


def test_verdict_is_cached_and_rechecked_when_a_key_part_changes(monkeypatch, own_cache):
    first = verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops)
    assert first.origin == "ran" and not first.failed()
    assert list((own_cache / "selfcheck").glob("*.json"))
    verdicts.forget_verdicts()

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cached verdict should have been used")

    monkeypatch.setattr(verdicts, "run_probes", must_not_run)
    cached = verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops)
    assert cached.origin == "cached" and cached.ops.keys() == first.ops.keys()
    changed = PROBE_SETS[1].__class__(**{**PROBE_SETS[1].__dict__, "comfy_source": lambda: "changed"})
    for owner, name, value in ((verdicts.comfy_adapter, "comfyui_version", lambda: "changed"),  # another ComfyUI
                               (verdicts, "pack_source_digest", lambda: "changed"),  # an edited or updated pack
                               (h3_patch, "probe_sets", (PROBE_SETS[0], changed))):  # changed ComfyUI H3 code
        verdicts.forget_verdicts()
        with monkeypatch.context() as m:
            m.setattr(owner, name, value)
            with pytest.raises(AssertionError, match="cached verdict should have been used"):
                verdicts.kernel_verdict(CPU, h3_patch.probe_sets, fused_ops)


def test_force_reruns_and_skip_checks_nothing(monkeypatch):
    verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops)
    with selfcheck_mode("force"):
        assert verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops).origin == "ran"
    with selfcheck_mode("skip"):
        verdict = verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops)
        assert verdict.origin == "skipped" and "skipped" in verdict.summary()


def test_a_check_that_raises_is_a_failed_check_not_an_exception(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded (planted)")

    monkeypatch.setattr(fused_ops, "gated_residual_", broken)
    results = verdicts.run_probes(fused_ops, CPU, PROBE_SETS)
    assert results["gated_residual"].ok is False and "kernel exploded (planted)" in results["gated_residual"].detail


# ---- damaged, foreign or hostile verdict files -------------------------------------------------------------

def verdict_path():
    return verdicts._cache_path(verdicts.environment_key(CPU, PROBE_SETS))


@pytest.fixture
def count_runs(monkeypatch):
    runs = []
    real = verdicts.run_probes

    def counted(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(verdicts, "run_probes", counted)
    return runs


def passed_op_zero(text: str) -> str:
    data = json.loads(text)
    name = next(n for n, r in data["ops"].items() if r["ok"] is True)
    data["ops"][name]["ok"] = 0  # a falsy non-boolean: neither passed nor failed
    return json.dumps(data)


def op_without_ok(text: str) -> str:
    data = json.loads(text)
    del data["ops"][next(iter(data["ops"]))]["ok"]
    return json.dumps(data)


def no_ops(text: str) -> str:
    return json.dumps({**json.loads(text), "ops": {}})


def a_subset_of_ops(text: str) -> str:  # every op that stays passed; the one left out (pack) would run unchecked
    data = json.loads(text)
    del data["ops"]["pack"]
    return json.dumps(data)


def deeply_nested(text: str) -> str:  # 200 KB, deeper than Python's recursion limit
    return '{"key": ' + "[" * 100_000 + "]" * 100_000 + "}"


# this environment's own verdict, changed by each function
OWN_VERDICT_CHANGED = {"ok: 0": passed_op_zero, "an op without ok": op_without_ok, "no ops": no_ops,
                       "a subset of ops": a_subset_of_ops, "deeply nested": deeply_nested}


@pytest.mark.parametrize("content", ["[]", "null", '"x"', '{"ops": []}', "{", *OWN_VERDICT_CHANGED])
def test_a_verdict_file_of_another_shape_is_ignored_and_the_check_reruns(content, count_runs, caplog):
    path = verdict_path()
    if content in OWN_VERDICT_CHANGED:
        verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops)
        verdicts.forget_verdicts()
        count_runs.clear()
        content = OWN_VERDICT_CHANGED[content](path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    caplog.set_level(logging.INFO, logger="h3_fused_nvfp4")
    clone, report = within(60, lambda: patched_model([syn.make_dit_block(seed=21)]))
    assert report.applied and "self-check passed" in report.summary(), report.summary()
    assert count_runs == [1], "the check did not run again"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("ignoring the self-check verdict file" in w for w in warnings), warnings
    assert verdicts.Verdict.from_json(json.loads(path.read_text()), verdicts.environment_key(CPU, PROBE_SETS),
                                      verdicts.checked_ops(PROBE_SETS))


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "oversized"])
def test_a_hostile_verdict_path_neither_hangs_nor_is_trusted(kind, count_runs, caplog, tmp_path):
    path = verdict_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        path.write_bytes(b" " * (verdicts.VERDICT_FILE_MAX_BYTES + 1))
    caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
    verdict = within(60, lambda: verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops))
    assert verdict.origin == "ran" and not verdict.failed() and count_runs == [1]
    assert path.is_file() and not path.is_symlink() and path.stat().st_size < verdicts.VERDICT_FILE_MAX_BYTES
    assert any(str(path) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_verdict_cache_others_can_write_is_warned_about(own_cache, monkeypatch, caplog):
    from h3_fused_nvfp4.kernels import runtime

    monkeypatch.setattr(runtime, "_warned_folders", set())
    own_cache.mkdir(parents=True, exist_ok=True)
    os.chmod(own_cache, 0o777)
    caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
    verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops)
    assert any("writable by other users" in r.getMessage() for r in caplog.records)


def test_a_verdict_folder_others_can_write_is_warned_about(own_cache, monkeypatch, caplog):
    """The verdicts live in the cache's selfcheck/ folder: others who can write there could plant a passing one."""
    from h3_fused_nvfp4.kernels import runtime

    monkeypatch.setattr(runtime, "_warned_folders", set())
    (own_cache / "selfcheck").mkdir(parents=True)
    os.chmod(own_cache / "selfcheck", 0o777)
    caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
    verdicts.kernel_verdict(CPU, PROBE_SETS, fused_ops)
    warnings = [r.getMessage() for r in caplog.records if "writable by other users" in r.getMessage()]
    assert any(str(own_cache / "selfcheck") in w for w in warnings), warnings


def test_an_unknown_selfcheck_mode_is_auto_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(verdicts, "_warned_mode", set())
    monkeypatch.setenv(verdicts.SELFCHECK_ENV, "banana")
    caplog.set_level(logging.WARNING, logger="h3_fused_nvfp4")
    assert verdicts.mode() == "auto" and verdicts.mode() == "auto"
    warnings = [r.getMessage() for r in caplog.records if "banana" in r.getMessage()]
    assert len(warnings) == 1 and verdicts.SELFCHECK_ENV in warnings[0] and "auto" in warnings[0], warnings
