"""Shared helpers of the parity tests: byte comparison, fresh seeds, poisoned outputs, ComfyUI's own packer."""

from __future__ import annotations

import contextlib

import torch

POISON = 0xA5


def fresh_seed() -> int:
    """A new seed per call, applied to torch's generators and printed by the callers' messages; ``H3_TEST_SEED``
    replays one."""
    import os

    env = os.environ.get("H3_TEST_SEED")
    seed = int(env) if env else torch.seed() % (2**31)
    torch.manual_seed(seed)
    return seed


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of differing elements, compared as bit patterns (NaN == NaN of the same bits, -0.0 != 0.0)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


def assert_bit_identical(a: torch.Tensor, b: torch.Tensor, label: str = "") -> None:
    n = differing(a, b)
    if n:
        diff = (a.float() - b.float()).abs()
        raise AssertionError(f"{label}: {n} of {a.numel()} elements differ (max |diff| {diff.nan_to_num(0).max()})")


def random_activation(rows: int, cols: int, device="cuda", dtype=torch.bfloat16) -> torch.Tensor:
    """Per-row magnitudes over many binades, so block scales cover the e4m3 range (in fp16 the quietest rows reach
    its subnormals)."""
    mag = torch.exp2(torch.randint(-12, 8, (rows, 1), device=device).float())
    return (torch.randn(rows, cols, device=device) * mag).to(dtype)


def comfy_pack(h: torch.Tensor, scale: torch.Tensor | None = None):
    """ComfyUI's own activation quantization: ``QuantizedTensor.from_float(h, "TensorCoreNVFP4Layout")``."""
    from comfy.quant_ops import QuantizedTensor

    qt = QuantizedTensor.from_float(h.contiguous(), "TensorCoreNVFP4Layout",
                                    scale=None if scale is None else scale.reshape(()))
    return qt._qdata, qt._params.block_scale, qt._params.scale


def fused_pack(x: torch.Tensor, **kwargs):
    """ops.pack_nvfp4 into a poisoned buffer (every byte the kernel leaves unwritten shows as a difference)."""
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    k = x.shape[1] // 2 if kwargs.get("swiglu") and kwargs.get("up") is None else x.shape[1]  # one tensor: gate | up
    out = torch.full((ops.packed_buffer_bytes(x.shape[0], k),), POISON, dtype=torch.uint8, device=x.device)
    return ops.pack_nvfp4(x, out=out, **kwargs)


def assert_same_pack(fused, q, s, g, label: str) -> None:
    assert fused.qdata.shape == q.shape and fused.block_scales.shape == s.shape, label
    dq = differing(fused.qdata, q)
    ds = differing(fused.block_scales.view(torch.uint8), s.view(torch.uint8))
    dg = differing(fused.global_scale.reshape(1), g.reshape(1).to(torch.float32))
    assert (dq, ds, dg) == (0, 0, 0), (f"{label}: {dq} qdata bytes and {ds} block-scale bytes differ; global scale "
                                       f"{fused.global_scale.reshape(-1).tolist()} vs {g.reshape(-1).tolist()}")


def segments_and_index(rows: int, table_rows: int, device="cuda", per_token: bool = True):
    """ComfyUI-style ``mod_segments`` (integer rows, and a per-token LongTensor run) and the int32 index."""
    cuts = sorted(set([0, rows] + torch.randint(1, rows, (3,)).tolist()))
    segments = [(a, b, i % table_rows) for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    if per_token:
        a, b, _ = segments[-1]
        segments[-1] = (a, b, torch.randint(0, table_rows, (b - a,), device=device))
    from h3_fused_nvfp4.models.h3.modulation import ModulationIndexCache

    return segments, ModulationIndexCache().index(segments, rows, torch.device(device))


def _selfcheck_modules():
    """Every loaded copy of core/verdicts.py (ComfyUI imports the pack under its folder path, the tests as
    h3_fused_nvfp4: each copy keeps its own verdicts)."""
    import sys

    return [m for name, m in list(sys.modules.items()) if name.endswith("core.verdicts") and m is not None]


@contextlib.contextmanager
def selfcheck_mode(value: str):
    """Run with H3_FUSED_NVFP4_SELFCHECK=value and fresh in-memory verdicts in every copy of the pack."""
    import os

    from h3_fused_nvfp4.core import verdicts

    old = os.environ.get(verdicts.SELFCHECK_ENV)
    os.environ[verdicts.SELFCHECK_ENV] = value
    for module in _selfcheck_modules():
        module.forget_verdicts()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(verdicts.SELFCHECK_ENV, None)
        else:
            os.environ[verdicts.SELFCHECK_ENV] = old
        for module in _selfcheck_modules():
            module.forget_verdicts()


def within(seconds: float, fn):
    """``fn()``'s result, run in a daemon thread: a call that blocks (a FIFO read) fails the test, never hangs it."""
    import threading

    result, error = [], []

    def target():
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the test
            error.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (blocked on a cache file?)"
    if error:
        raise error[0]
    return result[0]


def assert_fused_linear_matches_stock(layer, fused, x: torch.Tensor, label: str) -> None:
    """``fused`` (a FusedNVFP4Linear over ``layer``) against ComfyUI's own forward of ``layer``, 2-D and 3-D input:
    same bytes, every fused call taken. Both arms warm first (the first emulated call of a process differs on the
    H200)."""
    rows, out_f = x.shape[0], layer.out_features
    with torch.inference_mode():
        layer(x)
        fused(x)
        stock, out = layer(x), fused(x)
        stock3, out3 = layer(x[None]), fused(x[None])
    assert fused.calls_fused == 3 and fused.calls_stock == 0
    assert out.shape == stock.shape == (rows, out_f) and out3.shape == stock3.shape == (1, rows, out_f)
    assert_bit_identical(out, stock, f"2-D {label}")
    assert_bit_identical(out3, stock3, f"3-D {label}")
