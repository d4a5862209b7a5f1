// Shared device code of the fused NVFP4 kernels: bf16 and fp16 helpers, the exact "16 values -> block scale +
// codes" routine, E2M1 conversion and the swizzled block-scale layout.
//
// Exactness contract: every operation whose result can change a bit of the packed output is written as the
// same PTX instruction that comfy-kitchen's quantize_nvfp4 kernel compiles to (nvcc --use_fast_math; the kernel is
// templated on the activation type, bf16 or fp16, and these are its instructions for either, written for bf16):
//   a  = max.bf16(abs.bf16(x_i))                           NaN operands skipped (fp16: max.f16, abs.f16)
//   d  = div.approx.ftz(div.approx.ftz(float(a), 6.0), g)
//   d  = min.ftz(d, 448)                                   NaN -> 448
//   s8 = cvt.rn.satfinite.e4m3x2(d)
//   e  = min.ftz(rcp.approx.ftz(mul.ftz(g, float(s8))), FLT_MAX)
//   q  = cvt.rn.satfinite.e2m1x2(mul.ftz(e, x_i))          software RNE on sm_90 (no e2m1 instruction)
// float(a) and float(x_i) are exact widenings (an fp16 subnormal becomes a normal fp32 value, so the .ftz of the
// fp32 operations that follow never sees it). The element type is a template parameter of the routine (Bf16, F16
// below: the same instructions on the other 16-bit format). On sm_90 the conversion is done two values at a time in
// bf16x2 arithmetic on the fp32 magnitudes (see e2m1_magnitude_codes_x2), for either element type; the rounding
// argument is spelled out there and tests/test_gpu_arith.py checks it on every fp32 input.
// The Python twin of this routine is tests/nvfp4_oracle.py; keep the two in step.
//
// Everything else (the elementwise prologues in packs.cu, the residual and norm statistics in residual_norm.cu)
// reproduces PyTorch's own CUDA arithmetic and is compiled WITHOUT fast math: plain IEEE fp32 with denormals,
// explicit _rn intrinsics so nothing is contracted.
//
// The file is self-contained (no CUDA headers) so that NVRTC can compile it on a machine without a toolkit.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef int i32;

#define NVFP4_DEVICE static __device__ __forceinline__

// ---- bf16 <-> fp32 ---------------------------------------------------------------------------------------

NVFP4_DEVICE float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }
NVFP4_DEVICE float bf16_lo(u32 pair) { return __uint_as_float(pair << 16); }
NVFP4_DEVICE float bf16_hi(u32 pair) { return __uint_as_float(pair & 0xFFFF0000u); }

// Round to nearest even, NaN -> canonical NaN: the instruction torch's c10::BFloat16(float) uses on CUDA.
// NVFP4_PLANT_FAULT (tests of the self-check only) rounds toward zero instead: a wrong kernel it must catch.
NVFP4_DEVICE u16 f32_to_bf16(float f) {
    u16 r;
#if defined(NVFP4_PLANT_FAULT) && NVFP4_PLANT_FAULT
    asm("cvt.rz.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}
// Two values in one instruction, each rounded exactly as f32_to_bf16 rounds it (hi -> upper half).
NVFP4_DEVICE u32 pack_bf16x2(float lo, float hi) {
    u32 r;
#if defined(NVFP4_PLANT_FAULT) && NVFP4_PLANT_FAULT
    asm("cvt.rz.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// ---- fp16 <-> fp32 ---------------------------------------------------------------------------------------
// cvt.f32.f16 is exact (fp16 subnormals become normal fp32 values); cvt.rn.f16.f32 rounds to nearest even with
// fp16 subnormals and overflow to +-inf, NaN -> canonical NaN: torch's c10::Half(float) on CUDA (__float2half).

NVFP4_DEVICE float f16_to_f32(u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
NVFP4_DEVICE float f16_lo(u32 pair) { return f16_to_f32((u16)(pair & 0xFFFFu)); }
NVFP4_DEVICE float f16_hi(u32 pair) { return f16_to_f32((u16)(pair >> 16)); }
// NVFP4_PLANT_FAULT rounds toward zero here too (the fp16 global scale's probe must catch it).
NVFP4_DEVICE u16 f32_to_f16(float f) {
    u16 r;
#if defined(NVFP4_PLANT_FAULT) && NVFP4_PLANT_FAULT
    asm("cvt.rz.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}
// Two values in one instruction, each rounded exactly as f32_to_f16 rounds it (hi -> upper half).
NVFP4_DEVICE u32 pack_f16x2(float lo, float hi) {
    u32 r;
#if defined(NVFP4_PLANT_FAULT) && NVFP4_PLANT_FAULT
    asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// ---- 16-byte global loads/stores -------------------------------------------------------------------------

struct alignas(16) u32x4 { u32 x, y, z, w; };

NVFP4_DEVICE u32x4 load_16B(const void* p) {
    u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// Streaming variant for data read exactly once (keeps L2 for the tensors that are re-read).
NVFP4_DEVICE u32x4 load_16B_stream(const void* p) {
    u32x4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// Coherent load for data this kernel also writes (the in-place residual stream).
NVFP4_DEVICE u32x4 load_16B_coherent(const void* p) {
    u32x4 v;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
NVFP4_DEVICE void store_16B(void* p, u32x4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// ---- absmax ----------------------------------------------------------------------------------------------

// max.bf16 semantics (comfy-kitchen's __hmax): a NaN operand is ignored, two NaNs give NaN.
NVFP4_DEVICE u32 bf16x2_absmax(u32 a, u32 b) {
    u32 r;
    asm("{ .reg .b32 ta, tb;\n"
        "  abs.bf16x2 ta, %1;\n"
        "  abs.bf16x2 tb, %2;\n"
        "  max.bf16x2 %0, ta, tb; }" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// |x| per half on the FMA pipe (the packs are bound by the integer ALU pipe on sm_90): exact, NaN stays NaN.
NVFP4_DEVICE u32 bf16x2_abs(u32 a) {
    u32 r;
    asm("abs.bf16x2 %0, %1;" : "=r"(r) : "r"(a));
    return r;
}
NVFP4_DEVICE u32 bf16x2_max(u32 a, u32 b) {
    u32 r;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// Max of the two halves of a bf16x2, as a bf16 in the low half.
NVFP4_DEVICE u16 bf16x2_hmax(u32 v) {
    u16 r;
    asm("{ .reg .b16 lo, hi;\n"
        "  mov.b32 {lo, hi}, %1;\n"
        "  max.bf16 %0, lo, hi; }" : "=h"(r) : "r"(v));
    return r;
}

// ---- bf16x2 arithmetic ------------------------------------------------------------------------------------
// One IEEE round-to-nearest-even per half. For bf16 operands this equals PyTorch's bf16 ops (fp32 opmath, then
// one rounding to bf16): a product of two bf16 values is exact in fp32, and a sum of two bf16 values rounded to
// fp32 first and then to bf16 rounds the same as once (double rounding is innocuous for + and * when the
// intermediate format has at least 2p+1 bits: 24 >= 2*8+1). tests/test_gpu_arith.py checks every operand pair.

NVFP4_DEVICE u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
NVFP4_DEVICE u32 bf16x2_min(u32 a, u32 b) {
    u32 r;
    asm("min.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
#define BF16X2_ONE 0x3F803F80u
#define BF16X2_NEG_ZERO 0x80008000u
NVFP4_DEVICE u32 bf16x2_add(u32 a, u32 b) { return bf16x2_fma(a, BF16X2_ONE, b); }
#if defined(NVFP4_PLANT_FAULT) && NVFP4_PLANT_FAULT
// The planted fault rounds the product toward zero too (fma.bf16x2 has no such rounding: the fp32 product of two
// bf16 values is exact, then pack_bf16x2 rounds it toward zero).
NVFP4_DEVICE u32 bf16x2_mul(u32 a, u32 b) {
    return pack_bf16x2(__fmul_rn(bf16_lo(a), bf16_lo(b)), __fmul_rn(bf16_hi(a), bf16_hi(b)));
}
#else
NVFP4_DEVICE u32 bf16x2_mul(u32 a, u32 b) { return bf16x2_fma(a, b, BF16X2_NEG_ZERO); }  // -0 keeps the sign of a zero product
#endif

// ---- f16x2 arithmetic ------------------------------------------------------------------------------------
// The same operations on fp16 pairs: comfy-kitchen's __habs / __hmax on __half are abs.f16 / max.f16 (sm_80 on: a
// NaN operand is ignored, two NaNs give NaN), and torch's fp16 multiply is an fp32 opmath product, exact for two fp16
// values (11 + 11 significant bits, and fp16 subnormals are normal in fp32), rounded once to fp16: one
// fma.rn.f16x2 with a -0 addend (subnormal results kept, overflow to +-inf, the sign of a zero product kept).

NVFP4_DEVICE u32 f16x2_abs(u32 a) {
    u32 r;
    asm("abs.f16x2 %0, %1;" : "=r"(r) : "r"(a));
    return r;
}
NVFP4_DEVICE u32 f16x2_max(u32 a, u32 b) {
    u32 r;
    asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
NVFP4_DEVICE u32 f16x2_absmax(u32 a, u32 b) { return f16x2_max(f16x2_abs(a), f16x2_abs(b)); }
NVFP4_DEVICE u16 f16x2_hmax(u32 v) {
    u16 r;
    asm("{ .reg .b16 lo, hi;\n"
        "  mov.b32 {lo, hi}, %1;\n"
        "  max.f16 %0, lo, hi; }" : "=h"(r) : "r"(v));
    return r;
}
#define F16X2_NEG_ZERO 0x80008000u
NVFP4_DEVICE u32 f16x2_mul(u32 a, u32 b) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(F16X2_NEG_ZERO));
    return r;
}

// ---- element types ---------------------------------------------------------------------------------------
// The activation formats the plain and prescale packs read, as a template parameter of the shared routines:
// widening to fp32 (one value, or the low / high half of a pair), the NaN-skipping |.| max of the block absmax, the
// one-rounding multiply of the prescale source, the rounding of ComfyUI's dynamic global scale to the activation
// dtype, and kInfBits, the |x| bit pattern of +inf (every NaN's |x| pattern is above it). Both formats keep the
// sign in bit 15 of each half, which the sm_90 encoder gathers by byte (encode8_no_nan). The row kernels and block
// sources (norms, modulation, residuals: residual_norm.cu, packs.cu) also round pairs of fp32 results (pack).
struct Bf16 {
    static constexpr u32 kInfBits = 0x7F80u;
    static __device__ __forceinline__ float to_f32(u16 v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ float lo(u32 pair) { return bf16_lo(pair); }
    static __device__ __forceinline__ float hi(u32 pair) { return bf16_hi(pair); }
    static __device__ __forceinline__ u16 round(float f) { return f32_to_bf16(f); }
    static __device__ __forceinline__ u32 abs_x2(u32 a) { return bf16x2_abs(a); }
    static __device__ __forceinline__ u32 max_x2(u32 a, u32 b) { return bf16x2_max(a, b); }
    static __device__ __forceinline__ u32 absmax_x2(u32 a, u32 b) { return bf16x2_absmax(a, b); }
    static __device__ __forceinline__ u16 hmax(u32 v) { return bf16x2_hmax(v); }
    static __device__ __forceinline__ u32 mul_x2(u32 a, u32 b) { return bf16x2_mul(a, b); }
    static __device__ __forceinline__ u32 pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
};
struct F16 {
    static constexpr u32 kInfBits = 0x7C00u;
    static __device__ __forceinline__ float to_f32(u16 v) { return f16_to_f32(v); }
    static __device__ __forceinline__ float lo(u32 pair) { return f16_lo(pair); }
    static __device__ __forceinline__ float hi(u32 pair) { return f16_hi(pair); }
    static __device__ __forceinline__ u16 round(float f) { return f32_to_f16(f); }
    static __device__ __forceinline__ u32 abs_x2(u32 a) { return f16x2_abs(a); }
    static __device__ __forceinline__ u32 max_x2(u32 a, u32 b) { return f16x2_max(a, b); }
    static __device__ __forceinline__ u32 absmax_x2(u32 a, u32 b) { return f16x2_absmax(a, b); }
    static __device__ __forceinline__ u16 hmax(u32 v) { return f16x2_hmax(v); }
    static __device__ __forceinline__ u32 mul_x2(u32 a, u32 b) { return f16x2_mul(a, b); }
    static __device__ __forceinline__ u32 pack(float lo, float hi) { return pack_f16x2(lo, hi); }
};

// torch's CUDA silu in fp32 opmath: x / (1 + expf(-x)), IEEE division, then rounded to bf16 (the pack kernels
// compile without fast math, so expf is the accurate libdevice one, as in PyTorch's build).
NVFP4_DEVICE float silu_bf16(float x) {
    return bf16_to_f32(f32_to_bf16(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x)))));
}

// bf16(bf16(silu(gate)) * up) for a word of two gates and two ups (torch's silu_ then mul_).
NVFP4_DEVICE u32 swiglu_evaluated_x2(u32 gate, u32 up) {
    return pack_bf16x2(__fmul_rn(silu_bf16(bf16_lo(gate)), bf16_lo(up)), __fmul_rn(silu_bf16(bf16_hi(gate)), bf16_hi(up)));
}

// The same for 8 words with silu looked up in a window of torch's silu table: |x| in [2^-16, 2^8) for both signs,
// SILU_WINDOW entries each (positive x first; kernels/cuda_ops.py silu_window_table slices it from torch's silu of every
// bf16 value). If any of the 16 gates is outside the window (tiny, huge, inf or NaN: rare in activations) all are
// evaluated. v = gate - LO per half keeps the sign in bit 15 and |x| - LO in bits 0-14; a low half below LO borrows
// from the high half but is itself outside the window, so the words are evaluated. A half is in the window iff
// (v & 0x7FFF) < SILU_WINDOW. tests/test_gpu_arith.py checks every bf16 gate, in aligned and straddling groups.
// SILU_WINDOW_LO (the |x| bits of 2^-16) and SILU_WINDOW (entries up to 2^8: 24 binades of 128 values) are defined
// once, in kernels/cuda_ops.py, and passed as -D options to the sources that use the window (packs.cu).
#if defined(SILU_WINDOW_LO) && defined(SILU_WINDOW)
NVFP4_DEVICE u32 silu_window_offset(u32 v16) {  // byte offset of the entry of v's half
    return 2u * (v16 & 0x7FFFu) + (v16 >> 15) * (2u * (u32)SILU_WINDOW);
}
NVFP4_DEVICE void swiglu_window_x8(const u32 g[8], const u32 u[8], const u16* window, u32 w[8]) {
    u32 v[8], outside = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = g[i] - ((u32)SILU_WINDOW_LO | ((u32)SILU_WINDOW_LO << 16));
        outside = __vmaxu2(outside, v[i] & 0x7FFF7FFFu);
    }
    if (max(outside & 0xFFFFu, outside >> 16) >= (u32)SILU_WINDOW) {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = swiglu_evaluated_x2(g[i], u[i]);
        return;
    }
    const u8* table = reinterpret_cast<const u8*>(window);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 lo = *reinterpret_cast<const u16*>(table + silu_window_offset(v[i] & 0xFFFFu));
        const u32 hi = *reinterpret_cast<const u16*>(table + silu_window_offset(v[i] >> 16));
        w[i] = bf16x2_mul(lo | (hi << 16), u[i]);
    }
}
#endif

// torch.amax semantics for the global scale: NaN wins. On |x| bit patterns (sign cleared) of bf16 or fp16 pairs an
// unsigned compare orders every NaN above +inf, so an integer max is exact and NaN-propagating.
NVFP4_DEVICE u32 abs_bits_max_x2(u32 acc, u32 pair) { return __vmaxu2(acc, pair & 0x7FFF7FFFu); }

// ---- the block quantizer ---------------------------------------------------------------------------------

struct BlockScale {
    u8 byte;        // e4m3 block scale
    float encode;   // multiplier applied to each element before the E2M1 conversion
};

// The global scale's reciprocal, once per kernel: comfy-kitchen's d = (a / 6) / g compiles to a multiply by
// rcp.approx.ftz(g) (div.approx.ftz is exactly that: MUFU.RCP, then FMUL.FTZ).
NVFP4_DEVICE float rcp_approx_ftz(float g) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(g));
    return r;
}

// Block scale and encode multiplier from the block absmax (widened exactly to fp32 from the element type), the
// global decode scale g and its reciprocal rcp_approx_ftz(g).
NVFP4_DEVICE BlockScale block_scale_from_absmax(float a, float g, float rcp_g) {
    BlockScale out;
    float d, s;
    u16 packed;
    u32 halves;
    asm("{ .reg .f32 t;\n"
        "  div.approx.ftz.f32 t, %1, 0f40C00000;\n"  // / 6.0 (a multiply by 0x3E2AAAAB)
        "  mul.ftz.f32 t, t, %2;\n"                 // * rcp(g)
        "  min.ftz.f32 %0, t, 0f43E00000; }"         // min(., 448)
        : "=f"(d) : "f"(a), "f"(rcp_g));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(0.0f), "f"(d));
    packed &= 0xFF;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(packed));
    asm("{ .reg .b16 hb;\n"
        "  cvt.u16.u32 hb, %1;\n"
        "  cvt.f32.f16 %0, hb; }" : "=f"(s) : "r"(halves));
    float e;
    asm("{ .reg .f32 t;\n"
        "  mul.ftz.f32 t, %1, %2;\n"
        "  rcp.approx.ftz.f32 t, t;\n"
        "  min.ftz.f32 %0, t, 0f7F7FFFFF; }"         // min(., FLT_MAX)
        : "=f"(e) : "f"(g), "f"(s));
    out.byte = (u8)packed;
    out.encode = e;
    return out;
}

NVFP4_DEVICE float mul_ftz(float a, float b) {
    float r;
    asm("mul.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// The E2M1 conversion exists on every arch-specific ("a") and family-specific ("f") target from sm_100 on.
// NVRTC 13.0 defines no __CUDA_ARCH_FEAT_SM121_ALL for sm_121a (nvcc does), so also test the generic
// __CUDA_ARCH_SPECIFIC__ / __CUDA_ARCH_FAMILY_SPECIFIC__ (e.g. 1210); tests/test_kernel_build.py checks the PTX.
#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM101_ALL) ||                        \
    defined(__CUDA_ARCH_FEAT_SM103_ALL) || defined(__CUDA_ARCH_FEAT_SM110_ALL) ||                        \
    defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) ||                        \
    (defined(__CUDA_ARCH_SPECIFIC__) && __CUDA_ARCH_SPECIFIC__ >= 1000) ||                               \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000)
#define NVFP4_HW_E2M1 1
#endif
// NVFP4_EMULATE_BLACKWELL=1 (a build option for Hopper development GPUs): compile the Blackwell code path, with
// each Blackwell-only instruction replaced by a software model of its PTX semantics (e2m1x2_model below), so
// the GPU parity suite runs that path on sm_90. Never set for users.
#if defined(NVFP4_EMULATE_BLACKWELL) && NVFP4_EMULATE_BLACKWELL && !defined(NVFP4_HW_E2M1)
#define NVFP4_HW_E2M1 1
#define NVFP4_E2M1_MODEL 1
#endif

// Software cvt.rn.satfinite.e2m1 of one value: round to nearest even on the magnitudes {0, .5, 1, 1.5, 2, 3, 4,
// 6}, saturate above 5 (inf included), NaN -> +6, keep the sign of zero. The inputs come from mul.ftz, so they are
// never subnormal. Same results as cuda_fp4.hpp's software path and the sm_100 instruction. The grid step is 0.5
// below 2, 1 below 4 and 2 above, i.e. 2^(e-1) with e = clamp(exponent, 0, 2): scale |v| onto a unit grid
// (exact: a power of two), round half to even by adding 1.5 * 2^23 and read the integer from the mantissa, then
// saturate the code at 7 (= 6.0): values above 5, inf and NaN (whose sums read as huge unsigned integers) all land
// there. Checked against the rounding rules on every fp32 value in [0, inf] (tests/test_gpu_arith.py).
NVFP4_DEVICE u32 e2m1_code_sw(float v) {
    const u32 b = __float_as_uint(v);
    const u32 a = b & 0x7FFFFFFFu;                                                  // |v| bits
    const u32 sign = a > 0x7F800000u ? 0u : ((b >> 28) & 8u);                       // NaN -> +6
    const u32 e = (u32)min(max((int)(a >> 23) - 127, 0), 2);
    const float t = __fmul_rn(__uint_as_float(a), __uint_as_float((128u - e) << 23));   // |v| * 2, 1, 0.5
    const u32 code = min(__float_as_uint(__fadd_rn(t, 12582912.0f)) - 0x4B400000u + 2u * e, 7u);
    return code | sign;
}

#ifdef NVFP4_E2M1_MODEL
// Model of `cvt.rn.satfinite.e2m1x2.f32 d, a, b`: each operand converted as above, a in the upper nibble of the
// byte d, b in the lower one (PTX ISA: "the value converted from input a is stored in the upper half").
NVFP4_DEVICE u32 e2m1x2_model(float a, float b) { return (e2m1_code_sw(a) << 4) | e2m1_code_sw(b); }
#endif

// Two codes in one byte: `first` (the even element) in the high nibble, as comfy-kitchen's hi_first=True.
NVFP4_DEVICE u32 e2m1x2(float first, float second) {
#if defined(NVFP4_E2M1_MODEL)
    return e2m1x2_model(first, second);
#elif defined(NVFP4_HW_E2M1)
    u16 r;
    asm("{ .reg .b8 t;\n"
        "  cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n"
        "  mov.b16 %0, {t, 0}; }" : "=h"(r) : "f"(first), "f"(second));
    return (u32)r & 0xFF;
#else
    return (e2m1_code_sw(first) << 4) | e2m1_code_sw(second);
#endif
}

// 8 values of element type E (4 words, element 0 in the low half of word 0) scaled by `e` -> 8 codes in 4 bytes.
template <class E>
__device__ __forceinline__ u32 encode8(const u32 w[4], float e) {
    u32 out = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 byte = e2m1x2(mul_ftz(e, E::lo(w[i])), mul_ftz(e, E::hi(w[i])));
        out |= byte << (8 * i);
    }
    return out;
}

// E2M1 codes of two magnitudes v0, v1 (fp32 >= 0 or +inf, never NaN) in bf16x2 arithmetic, two values per
// instruction (used on GPUs without the E2M1 instruction). Returns the bf16x2 pair 128 + code (code in bits 0-2 and 16-18, 0x43 in bytes 1 and 3).
//   1. Round to odd into bf16: truncate to the high half and set its last bit if any dropped bit was set
//      (min(dropped 16 bits, 1) per half). A value rounded to odd with at least two more bits than
//      the target rounds to nearest even exactly like the original; bf16 keeps >= 6 more bits than the E2M1
//      grid anywhere the grid is finer than 2^-1, and ties (0.25, 0.75, ..., 5) are bf16 values, kept as is.
//   2. Clamp to 6 (the saturation value; inf -> 6).
//   3. On [0, 6] the code is min(rne(2y), rne(y) + 2, rne(y / 2) + 4): each term is the E2M1 grid of one range
//      (step 0.5 below 2, 1 below 4, 2 above) and is the smallest exactly on its own range. Each term is one
//      fma into [128, 256), where the bf16 step is 1, so the hardware's round-to-nearest-even of the sum is the
//      rne of the term and ties go to the even code.
NVFP4_DEVICE u32 e2m1_magnitude_codes_x2(float v0, float v1) {
    const u32 b0 = __float_as_uint(v0), b1 = __float_as_uint(v1);
    const u32 truncated = __byte_perm(b0, b1, 0x7632), dropped = __byte_perm(b0, b1, 0x5410);
    u32 y = truncated | __vminu2(dropped, 0x00010001u);              // round to odd: last bit |= any dropped bit
    y = bf16x2_min(y, 0x40C040C0u);                                  // min(., 6)
    const u32 fine = bf16x2_fma(y, 0x40004000u, 0x43004300u);        // 2y    + 128
    const u32 mid = bf16x2_fma(y, BF16X2_ONE, 0x43024302u);          // y     + 130
    const u32 coarse = bf16x2_fma(y, 0x3F003F00u, 0x43044304u);      // y / 2 + 132
    return bf16x2_min(bf16x2_min(fine, mid), coarse);
}

// 8 values of element type E (words w, their magnitudes a) scaled by e -> 8 codes in 4 bytes, as encode8 for
// NaN-free input. The sign of each code is the sign of x (e > 0, so x * e has the sign of x, zeros included): bit 15
// of each half in both formats.
template <class E>
__device__ __forceinline__ u32 encode8_no_nan(const u32 w[4], const u32 a[4], float e) {
    u32 pair[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pair[i] = e2m1_magnitude_codes_x2(mul_ftz(e, E::lo(a[i])), mul_ftz(e, E::hi(a[i])));
    // Gather byte 0 (first value of each pair) and byte 2 (second value): codes of values 0, 2, 1, 3 (4, 6, 5, 7),
    // with the sign of each in bit 3 (from the bytes of w that hold the signs, in the same order); the first value
    // of each output byte goes to the high nibble.
    const u32 s01 = __byte_perm(w[0], w[1], 0x7351), s23 = __byte_perm(w[2], w[3], 0x7351);
    const u32 p01 = __byte_perm(pair[0], pair[1], 0x6240) | ((s01 >> 4) & 0x08080808u);
    const u32 p23 = __byte_perm(pair[2], pair[3], 0x6240) | ((s23 >> 4) & 0x08080808u);
    return (__byte_perm(p01, p23, 0x5410) << 4) | __byte_perm(p01, p23, 0x7632);
}

// One 16-value block (8 words of element type E): block scale byte and 16 codes (lo: values 0-7, hi: values 8-15).
template <class E>
__device__ __forceinline__ void quantize_block16(const u32 w[8], float g, float rcp_g, u32& scale_byte, u32& lo,
                                                 u32& hi) {
#if !defined(NVFP4_HW_E2M1)
    // |x| bit patterns order like magnitudes, with NaN above inf (abs keeps a NaN a NaN, whatever its sign bit, so
    // its pattern stays above E::kInfBits: 0x7F80 in bf16, 0x7C00 in fp16): an integer max finds the block absmax and
    // tells whether the block holds a NaN. Without one it equals the NaN-skipping max of the reference.
    u32 a[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = E::abs_x2(w[j]);
    const u32 m = __vmaxu2(__vmaxu2(__vmaxu2(a[0], a[1]), __vmaxu2(a[2], a[3])),
                           __vmaxu2(__vmaxu2(a[4], a[5]), __vmaxu2(a[6], a[7])));
    const u32 amax = max(m & 0xFFFFu, m >> 16);
    if (amax <= E::kInfBits) {
        const BlockScale bs = block_scale_from_absmax(E::to_f32((u16)amax), g, rcp_g);
        // The pairwise path needs every x * e to be a non-NaN magnitude with the sign of x: e > 0. (e is 0 when
        // g is inf and the block holds an inf: then inf * 0 is NaN, which converts to +6.)
        if (bs.encode > 0.0f) {
            scale_byte = bs.byte;
            lo = encode8_no_nan<E>(w, a, bs.encode);
            hi = encode8_no_nan<E>(w + 4, a + 4, bs.encode);
            return;
        }
    }
    // A NaN in the block, or e <= 0 (rare): the value-at-a-time sequence below.
#endif
    const u32 mx = E::max_x2(E::max_x2(E::absmax_x2(w[0], w[1]), E::absmax_x2(w[2], w[3])),
                             E::max_x2(E::absmax_x2(w[4], w[5]), E::absmax_x2(w[6], w[7])));
    const BlockScale bs = block_scale_from_absmax(E::to_f32(E::hmax(mx)), g, rcp_g);
    scale_byte = bs.byte;
    lo = encode8<E>(w, bs.encode);
    hi = encode8<E>(w + 4, bs.encode);
}

// ---- swizzled block-scale layout (must match layout.py swizzled_scale_offset) ------------------------------
// cuBLASLt's 1x16 block-scale layout: 128-row x 4-column tiles of 512 bytes; inside a tile, row r sits at
// (r % 32) * 16 + (r % 128) / 32 * 4 and column c at c % 4.
NVFP4_DEVICE u32 swizzled_scale_offset32(u32 row, u32 col, u32 padded_scale_cols) {
    return ((row >> 7) * (padded_scale_cols >> 2) + (col >> 2)) * 512 + (row & 31) * 16 + ((row & 127) >> 5) * 4 + (col & 3);
}

// ---- shared by the packs (packs.cu) and the row-norm kernels (residual_norm.cu) --------------------------------

// cp.async groups: issue every copy, then one wait (a load-then-store loop waits for L2 once per iteration).
NVFP4_DEVICE void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
NVFP4_DEVICE void wait_copies() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// The adaLN modulation of bf16x2 words: ComfyUI's h.mul_(1.0 + scale[m]).add_(shift[m]) on bf16 tensors, three
// bf16 roundings, each one bf16x2 operation (see the bf16x2 arithmetic above), two values per instruction.
NVFP4_DEVICE u32 modulate_x2(u32 x, u32 scale, u32 shift) {
    return bf16x2_add(bf16x2_mul(x, bf16x2_add(BF16X2_ONE, scale)), shift);
}

// torch's rms_norm output element pair: T(w * (rstd * x)), two separately rounded fp32 products (T: the element type,
// the same arithmetic in bf16 and fp16: vectorized_layer_norm_kernel<T, float, rms=true>).
template <class E = Bf16>
NVFP4_DEVICE u32 rms_norm_x2(u32 x, u32 w, float rstd) {
    return E::pack(__fmul_rn(E::lo(w), __fmul_rn(rstd, E::lo(x))), __fmul_rn(E::hi(w), __fmul_rn(rstd, E::hi(x))));
}

// ---- torch's LayerNorm output and ComfyUI's addcmul modulation, for either element type -------------------------
// torch's layer_norm (vectorized_layer_norm_kernel<T, float, rms=false>, its compiled code for sm_90, sm_100 and
// sm_120 in torch 2.11) writes each element from the row's fp32 mean and rstd (residual_norm.cu layer_norm_*):
//   no affine parameters:  n = T(rstd * (x - mean))                  a subtraction and a product, each rounded once
//   weight w and bias b:   n = T(fma(w, rstd * (x - mean), b))       the bias added in the fma, as compiled
// (torch fuses nothing else here: the two forms are the branches of its kernel for these parameter sets).
template <class E>
NVFP4_DEVICE u32 layer_norm_x2(u32 x, float mean, float rstd) {
    return E::pack(__fmul_rn(rstd, __fsub_rn(E::lo(x), mean)), __fmul_rn(rstd, __fsub_rn(E::hi(x), mean)));
}
template <class E>
NVFP4_DEVICE u32 layer_norm_affine_x2(u32 x, u32 w, u32 b, float mean, float rstd) {
    return E::pack(__fmaf_rn(E::lo(w), __fmul_rn(rstd, __fsub_rn(E::lo(x), mean)), E::lo(b)),
                   __fmaf_rn(E::hi(w), __fmul_rn(rstd, __fsub_rn(E::hi(x), mean)), E::hi(b)));
}

// torch's addcmul(a, b, c) = a + b * c on 16-bit tensors, in fp32 opmath: the product of two 16-bit values is exact
// in fp32, so a fused or a separate multiply-add round identically: one rounding of the sum; the caller rounds to T.
NVFP4_DEVICE float addcmul_f32(float a, float b, float c) { return __fadd_rn(a, __fmul_rn(b, c)); }

// ComfyUI's modulation torch.addcmul(shift, n, 1 + scale) (Wan's block): s1 = T(1 + scale) (torch's add of a Python
// scalar: fp32 opmath, one rounding to T), then T(addcmul_f32(shift, n, s1)).
template <class E>
NVFP4_DEVICE u32 addcmul_modulate_x2(u32 n, u32 scale, u32 shift) {
    const u32 s1 = E::pack(__fadd_rn(1.0f, E::lo(scale)), __fadd_rn(1.0f, E::hi(scale)));
    return E::pack(addcmul_f32(E::lo(shift), E::lo(n), E::lo(s1)), addcmul_f32(E::hi(shift), E::hi(n), E::hi(s1)));
}

// The modulation forms of a normalized row before its projection (template parameters of the normalized packs,
// packs.cu, and of the amax passes, residual_norm.cu), each ComfyUI's op sequence on bf16 tensors with one bf16
// rounding per op (bf16x2 arithmetic, above), n the RMSNorm output, m the token's modulation row:
//   ScaleShift   h = bf16(bf16(n * bf16(1 + scale[m])) + shift[m])    MiniMax H3 (_mod_scale_shift, modulate_x2)
//   ScaleOnly    h = bf16(n * bf16(1 + scale[m]))                      Z-Image's modulate (comfy/ldm/lumina)
//   Unmodulated  h = n                                                  a norm alone (Z-Image's refiner blocks)
// kScale / kShift: which tables the form reads (a form without them reads no modulation index either).
struct ScaleShift {
    static constexpr bool kScale = true, kShift = true;
    static __device__ __forceinline__ u32 apply(u32 n, u32 scale, u32 shift) { return modulate_x2(n, scale, shift); }
};
struct ScaleOnly {
    static constexpr bool kScale = true, kShift = false;
    static __device__ __forceinline__ u32 apply(u32 n, u32 scale, u32) {
        return bf16x2_mul(n, bf16x2_add(BF16X2_ONE, scale));
    }
};
struct Unmodulated {
    static constexpr bool kScale = false, kShift = false;
    static __device__ __forceinline__ u32 apply(u32 n, u32, u32) { return n; }
};

// Where a grid-wide amax lands: {amax bits, finished-CTA counter} (zero between launches, re-armed by the last
// CTA) and the global scale g it becomes.
struct GlobalScaleOut {
    u32* workspace;
    float* global_scale;
};

// Block reduction of the per-thread |h| maxima (bit patterns of |h| pairs of element type E), then the last CTA to
// finish turns the grid's max into ComfyUI's dynamic global scale g = fp32(E(amax * fp32(1/2688))) and re-arms the
// workspace, so no host sync is needed: the pack reads g from memory. Every thread of the CTA must call it.
// For fp16 the rounding lands in the fp16 subnormals when amax < ~0.16 and on 0 when amax < ~8e-5 (as torch's does).
// Owner: kernels of one family pass their own type, so that each family has its own instance of the shared-memory
// scratch below (kernels of a module that share it are register-allocated differently by ptxas).
template <int Threads, class E = Bf16, class Owner = void>
__device__ __forceinline__ void absmax_finish(const GlobalScaleOut& out, u32 acc) {
    u32 m = max(acc & 0xFFFFu, acc >> 16);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));

    __shared__ u32 warp_max[Threads / 32];
    __shared__ bool is_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 block_max = 0;
        for (int i = 0; i < Threads / 32; ++i) block_max = max(block_max, warp_max[i]);
        atomicMax(&out.workspace[0], block_max);
        __threadfence();  // publish this CTA's max before counting it as finished
        is_last = atomicAdd(&out.workspace[1], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last && threadIdx.x == 0) {
        __threadfence();
        u32 amax_bits = atomicExch(&out.workspace[0], 0u);
        out.workspace[1] = 0;  // re-arm for the next launch on this stream
        // torch: (amax / 2688.0) in the activation dtype, computed as fp32(amax) * fp32(1/2688) rounded once to that
        // dtype, then .to(float32)
        out.global_scale[0] = E::to_f32(E::round(__fmul_rn(E::to_f32((u16)amax_bits), 1.0f / 2688.0f)));
    }
}
