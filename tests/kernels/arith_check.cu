// Exhaustive checks of the arithmetic identities the sm_90 kernels rely on (tests/test_gpu_arith.py):
//   * bf16x2 fma-based mul/add == PyTorch's bf16 mul/add (fp32 op, then one rounding to bf16), all operand pairs;
//   * e2m1_magnitude_codes_x2 == the E2M1 rounding rules, every non-negative fp32 value up to +inf;
//   * silu_bf16 == torch's bf16 silu (a table torch computed for every bf16 value);
//   * swiglu_window_x8 (silu looked up in a window of that table, evaluated outside it) == the same, every bf16
//     gate, in groups of 16 consecutive bit patterns (each group in or out of the window) and shifted by 8 (groups
//     straddling the window's ends).
// Built with -D SILU_WINDOW and SILU_WINDOW_LO from kernels/ops.py (tests/test_gpu_arith.py arith_defines).
#include "nvfp4_common.cuh"

// The rules, value by value: count the rounding boundaries below |v|, ties toward the even code (> vs >=),
// saturate at 6 (code 7).
static __device__ u32 e2m1_rule(float m) {
    return (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) + (m > 5.0f);
}

static __device__ bool same_bf16(u16 a, u16 b) {
    const bool nan_a = (a & 0x7FFF) > 0x7F80, nan_b = (b & 0x7FFF) > 0x7F80;
    return nan_a ? nan_b : a == b;  // NaN payloads are not part of the contract
}

// Every (a, b) in bf16 x bf16: thread items cover b two at a time for one a.
extern "C" __global__ void check_bf16x2_ops(u32* mismatches, u32* first_bad) {
    const u64 pairs = 1ull << 31;  // 2^32 operand pairs, two per item
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < pairs; i += (u64)gridDim.x * blockDim.x) {
        const u32 a = (u32)(i >> 15), b0 = (u32)(i & 0x7FFF) * 2, b1 = b0 + 1;
        const u32 A = a | (a << 16), B = b0 | (b1 << 16);
        const float fa = bf16_to_f32((u16)a), f0 = bf16_to_f32((u16)b0), f1 = bf16_to_f32((u16)b1);
        const u32 mul = bf16x2_mul(A, B), add = bf16x2_add(A, B);
        const bool ok = same_bf16((u16)mul, f32_to_bf16(__fmul_rn(fa, f0))) &&
                        same_bf16((u16)(mul >> 16), f32_to_bf16(__fmul_rn(fa, f1))) &&
                        same_bf16((u16)add, f32_to_bf16(__fadd_rn(fa, f0))) &&
                        same_bf16((u16)(add >> 16), f32_to_bf16(__fadd_rn(fa, f1)));
        if (!ok) {
            atomicAdd(mismatches, 1u);
            atomicCAS(first_bad, 0xFFFFFFFFu, (a << 16) | b0);
        }
    }
}

// Every fp32 bit pattern in [0, +inf], two per item.
extern "C" __global__ void check_e2m1_codes(u32* mismatches, u32* first_bad) {
    const u32 items = (0x7F800000u >> 1) + 1;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const u32 v0 = 2 * i, v1 = min(2 * i + 1, 0x7F800000u);
        const u32 codes = e2m1_magnitude_codes_x2(__uint_as_float(v0), __uint_as_float(v1));
        const bool ok = (codes & 0xFFFFu) == 0x4300u + e2m1_rule(__uint_as_float(v0)) &&
                        (codes >> 16) == 0x4300u + e2m1_rule(__uint_as_float(v1));
        if (!ok) {
            atomicAdd(mismatches, 1u);
            atomicCAS(first_bad, 0xFFFFFFFFu, v0);
        }
    }
}

// Every bf16 value: the evaluated silu against torch's (the table the SwiGLU pack kernels can look up instead).
extern "C" __global__ void check_silu(u32* mismatches, u32* first_bad, const u16* torch_silu) {
    for (u32 b = blockIdx.x * blockDim.x + threadIdx.x; b < 65536; b += gridDim.x * blockDim.x) {
        if (!same_bf16(f32_to_bf16(silu_bf16(bf16_to_f32((u16)b))), torch_silu[b])) {
            atomicAdd(mismatches, 1u);
            atomicCAS(first_bad, 0xFFFFFFFFu, b);
        }
    }
}

// Every bf16 gate through swiglu_window_x8 with up = 1 (so the output is bf16(silu(gate))), 16 per thread.
template <u32 Shift>
__device__ void check_silu_window(u32* mismatches, u32* first_bad, const u16* torch_silu, const u16* window) {
    __shared__ __align__(16) u16 staged[2 * SILU_WINDOW];
    for (u32 i = threadIdx.x; i < 2 * SILU_WINDOW; i += blockDim.x) staged[i] = window[i];
    __syncthreads();
    for (u32 group = blockIdx.x * blockDim.x + threadIdx.x; group < 65536 / 16; group += gridDim.x * blockDim.x) {
        u32 g[8], u[8], w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 b0 = (16 * group + 2 * j + Shift) & 0xFFFFu, b1 = (b0 + 1) & 0xFFFFu;
            g[j] = b0 | (b1 << 16);
            u[j] = BF16X2_ONE;
        }
        swiglu_window_x8(g, u, staged, w);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 b0 = g[j] & 0xFFFFu, b1 = g[j] >> 16;
            if (!same_bf16((u16)w[j], torch_silu[b0]) || !same_bf16((u16)(w[j] >> 16), torch_silu[b1])) {
                atomicAdd(mismatches, 1u);
                atomicCAS(first_bad, 0xFFFFFFFFu, b0);
            }
        }
    }
}
extern "C" __global__ void check_silu_window_aligned(u32* m, u32* f, const u16* t, const u16* w) { check_silu_window<0>(m, f, t, w); }
extern "C" __global__ void check_silu_window_straddling(u32* m, u32* f, const u16* t, const u16* w) { check_silu_window<8>(m, f, t, w); }
