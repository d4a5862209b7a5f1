// In-place per-head RMSNorm + split-half RoPE on H3's q and k views (the qkv_proj output), bit-identical to
// comfy-kitchen's rms_rope_split_half_ (rms_rope.cu, built with --use_fast_math) for head_dim 128.
//
// Math per (token, head), for q and k with their own norm weights w:
//   sum  = sum_e x_e^2        lane l accumulates e = l, l+32, l+64, l+96 with fma.rn.ftz starting from 0, then
//                             a shfl_down tree (16, 8, 4, 2, 1) of add.ftz; lane 0's total is broadcast
//   r    = rsqrt.approx.ftz(div.approx.ftz(sum, head_dim) + eps)
//   n_e  = bf16(mul.ftz(mul.ftz(r, x_e), w_e))
//   pair i < rot/2 = (i, i + rot/2), table [c, -s, s, c] = (f00, f01, f10, f11) in bf16:
//   y_i       = bf16(fma.rn.ftz(n_i, f00, mul.ftz(n_j, f01)))      j = i + rot/2
//   y_j       = bf16(fma.rn.ftz(n_i, f10, mul.ftz(n_j, f11)))
//   e >= rot: y_e = n_e
// These are comfy-kitchen's instructions in its order; change nothing without re-running the GPU parity test.
//
// Thread mapping: one warp per (token, head), lane l owns elements l + 32 s (s = 0..3), exactly the elements
// comfy-kitchen's lane l sums. With rot = 96 every rotation partner lives in lane l ^ 16: three shuffles
// exchange the normalized values. Reads and writes each element once (comfy-kitchen reads q and k twice and
// runs 4 warps per CTA on 2.1M tiny items).
#include "nvfp4_common.cuh"

#define ROPE_THREADS 256

struct RmsRopeParams {
    u16* q;               // q of token 0, head 0; element stride 1, head stride head_dim
    u16* k;
    i64 row_stride;       // elements between tokens (q and k share it: views of one qkv buffer)
    const u16* freqs;     // bf16 [tokens, rot/2, 2, 2] contiguous
    const u16* q_weight;  // bf16 [head_dim]
    const u16* k_weight;
    i64 tokens;
    i32 heads;
    i32 head_dim;         // 128
    i32 rot_dim;          // 96
    float eps;
};

NVFP4_DEVICE float fma_ftz(float a, float b, float c) {
    float r;
    asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
NVFP4_DEVICE float add_ftz(float a, float b) {
    float r;
    asm("add.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// The normalized elements of one head (slots s = 0..3 hold element lane + 32 s), comfy-kitchen's arithmetic.
NVFP4_DEVICE void rms_normalize(const u16* head, const u16* weight, float head_dim, float eps, u32 lane, float n[4]) {
    float x[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) x[s] = bf16_to_f32(head[lane + 32 * s]);
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < 4; ++s) sum = fma_ftz(x[s], x[s], sum);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum = add_ftz(sum, __shfl_down_sync(0xFFFFFFFFu, sum, off));
    sum = __shfl_sync(0xFFFFFFFFu, sum, 0);
    float r;
    asm("{ .reg .f32 t;\n"
        "  div.approx.ftz.f32 t, %1, %2;\n"
        "  add.ftz.f32 t, t, %3;\n"
        "  rsqrt.approx.ftz.f32 %0, t; }" : "=f"(r) : "f"(sum), "f"(head_dim), "f"(eps));
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        n[s] = bf16_to_f32(f32_to_bf16(mul_ftz(mul_ftz(r, x[s]), bf16_to_f32(weight[lane + 32 * s]))));
    }
}

// Rotate and store one head in place (rot_dim 96: pairs (i, i + 48), partner lane = lane ^ 16).
NVFP4_DEVICE void rotate_store(u16* head, const u16* freq_row, u32 lane, const float n[4]) {
    // Partner values: for lane < 16 slot s pairs with the partner's slot s+1 (mod 3); for lane >= 16 with s+2.
    const float p0 = __shfl_xor_sync(0xFFFFFFFFu, n[0], 16);
    const float p1 = __shfl_xor_sync(0xFFFFFFFFu, n[1], 16);
    const float p2 = __shfl_xor_sync(0xFFFFFFFFu, n[2], 16);
    const bool low = lane < 16;
    const float partner[3] = {low ? p1 : p2, low ? p2 : p0, low ? p0 : p1};
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const u32 e = lane + 32 * s;
        const bool first = e < 48;                  // element i of pair (i, i + 48)
        const u32 pair = first ? e : e - 48;
        const u64 f = *reinterpret_cast<const u64*>(freq_row + 4 * pair);  // f00 f01 | f10 f11
        const u32 row0 = (u32)f, row1 = (u32)(f >> 32);
        const float x0 = first ? n[s] : partner[s];
        const float x1 = first ? partner[s] : n[s];
        float y;
        if (first) {
            y = fma_ftz(x0, bf16_lo(row0), mul_ftz(x1, bf16_hi(row0)));
        } else {
            y = fma_ftz(x0, bf16_lo(row1), mul_ftz(x1, bf16_hi(row1)));
        }
        head[e] = f32_to_bf16(y);
    }
    head[lane + 96] = f32_to_bf16(n[3]);  // beyond rot_dim: normalized only (n[3] is already bf16-exact)
}

extern "C" __global__ void __launch_bounds__(ROPE_THREADS) h3_rms_rope_split_half(const RmsRopeParams p) {
    const u32 lane = threadIdx.x & 31;
    const u32 warps_total = gridDim.x * (ROPE_THREADS / 32);
    const u32 items = (u32)p.tokens * (u32)p.heads;
    const float head_dim = (float)p.head_dim;
    for (u32 item = (blockIdx.x * ROPE_THREADS + threadIdx.x) >> 5; item < items; item += warps_total) {
        const u32 token = item / (u32)p.heads;
        const u32 h = item - token * (u32)p.heads;
        const i64 offset = (i64)token * p.row_stride + (i64)h * p.head_dim;
        const u16* freq_row = p.freqs + (i64)token * (p.rot_dim / 2) * 4;
        float nq[4], nk[4];
        rms_normalize(p.q + offset, p.q_weight, head_dim, p.eps, lane, nq);
        rms_normalize(p.k + offset, p.k_weight, head_dim, p.eps, lane, nk);
        rotate_store(p.q + offset, freq_row, lane, nq);
        rotate_store(p.k + offset, freq_row, lane, nk);
    }
}
