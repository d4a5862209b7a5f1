"""Exhaustive GPU checks of the arithmetic identities behind the sm_90 kernels (tests/kernels/arith_check.cu).

* bf16x2 multiply / add (one rounding each) give PyTorch's bf16 results (fp32 op, then one rounding) for every
  pair of bf16 operands: the modulation is computed that way, two values per instruction.
* The evaluated silu (fp32 expf and IEEE division, as PyTorch's kernel) gives torch's bf16 silu for every bf16
  value, including NaN, infinities and subnormals: the global-scale reduction evaluates it where a bound says
  it can matter, and the windowed lookup below outside its window.
* The windowed silu lookup of the SwiGLU pack (a 12 KB slice of that table, the formula outside it) gives torch's
  bf16 silu for every bf16 gate, in groups inside, outside and straddling the window.
* The two-at-a-time software E2M1 conversion gives the E2M1 rounding rules' code for every fp32 value in
  [0, +inf] (the pack kernels call it only on Hopper, where the conversion instruction does not exist; the
  routine itself runs on any GPU).
"""

from __future__ import annotations

import ctypes
import pathlib

import pytest
import torch
from conftest import requires_cuda

SOURCE = str(pathlib.Path(__file__).resolve().parent / "kernels" / "arith_check.cu")


def arith_defines() -> tuple:
    """The -D options of the checks: the silu window, defined once in kernels/ops.py."""
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    return (("SILU_WINDOW", ops.SILU_WINDOW), ("SILU_WINDOW_LO", ops.SILU_WINDOW_LO))


def _run(kernel: str, *extra: torch.Tensor) -> tuple[int, int]:
    """Launch ``kernel(u32* mismatches, u32* first_bad, extra...)`` over its input space; return both counters."""
    from h3_fused_nvfp4.kernels import runtime

    if runtime.device_arch(0) not in runtime.SUPPORTED_ARCHS:
        pytest.skip(f"no kernels for {runtime.device_arch(0)}")
    mod = runtime.module(0, source=SOURCE, defines=arith_defines())
    out = torch.tensor([0, -1], dtype=torch.int32, device="cuda")  # mismatch count, first failing input
    pointers = [ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(out.data_ptr() + 4),
                *(ctypes.c_void_p(t.data_ptr()) for t in extra)]
    args = (ctypes.c_void_p * len(pointers))(*(ctypes.addressof(p) for p in pointers))
    lib = runtime.driver()
    stream = torch.cuda.current_stream().cuda_stream
    result = lib.cuLaunchKernel(mod.function(kernel), mod.sm_count * 8, 1, 1, 512, 1, 1, 0, stream, args, None)
    runtime._check_cu(lib, result, kernel)
    torch.cuda.synchronize()
    mismatches, first = out.tolist()
    return mismatches, first & 0xFFFFFFFF


@requires_cuda
def test_bf16x2_mul_add_match_torch_for_every_operand_pair():
    mismatches, first = _run("check_bf16x2_ops")
    assert mismatches == 0, f"{mismatches} mismatches, first a={first >> 16:#06x} b={first & 0xFFFF:#06x}"


@requires_cuda
def test_pairwise_e2m1_matches_the_rounding_rules_for_every_fp32_magnitude():
    mismatches, first = _run("check_e2m1_codes")
    assert mismatches == 0, f"{mismatches} mismatches, first at fp32 bits {first:#010x}"


@requires_cuda
def test_evaluated_silu_matches_torch_for_every_bf16_value():
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    mismatches, first = _run("check_silu", ops.silu_table(torch.device("cuda", 0)))
    assert mismatches == 0, f"{mismatches} bf16 values differ, first bit pattern {first:#06x}"


@requires_cuda
def test_silu_table_is_torch_silu_of_each_bit_pattern():
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    table = ops.silu_table(torch.device("cuda", 0))
    for bits in (0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x0001, 0xC2B0):
        value = torch.tensor([bits - 65536 if bits >= 32768 else bits], dtype=torch.int16).view(torch.bfloat16)
        expected = torch.nn.functional.silu(value.cuda()).view(torch.int16).item() & 0xFFFF
        assert table.view(torch.int16)[bits].item() & 0xFFFF == expected, f"entry {bits:#06x}"


@requires_cuda
@pytest.mark.parametrize("groups", ["aligned", "straddling"])
def test_windowed_silu_matches_torch_for_every_bf16_gate(groups):
    from h3_fused_nvfp4.kernels import cuda_ops as ops

    device = torch.device("cuda", 0)
    mismatches, first = _run(f"check_silu_window_{groups}", ops.silu_table(device), ops.silu_window_table(device))
    assert mismatches == 0, f"{mismatches} groups differ, first group starting at bit pattern {first:#06x}"
