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
// Lane mapping of the arithmetic above: comfy-kitchen runs one warp per (token, head), lane l summing elements
// l + 32 s (s = 0..3). This kernel keeps that arithmetic but not that thread layout (see below): 8 threads per
// head, each holding 4 lanes' worth, so every access is 8 bytes wide; one warp-per-head version with 2-byte
// accesses ran at 66% of copy bandwidth on the H200, this one at 77%, and 16-byte accesses (4 threads per head)
// at 56% (register pressure). Reads and writes each element once (comfy-kitchen reads q and k twice).
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

// ---- V consecutive elements per access -----------------------------------------------------------------------
// T = 32 / V threads per (token, head). Thread t holds lanes V t .. V t + V-1 of the mapping above: elements
// e = V t + j + 32 s (j < V, s = 0..3), so every access is 2V bytes wide and a warp works on V heads. The sum is
// comfy-kitchen's, term for term: each of the thread's V lane partials is its own fma chain over s, and the
// shfl_down tree is replayed on the lane numbering (lane offsets >= V are shuffles by offset / V threads, smaller
// ones are additions inside the thread). Rotation partners are in thread t ^ (16 / V) (for t < T/2 slot s pairs
// with the partner's slot s+1 mod 3, else s+2); 48 is a multiple of V, so no access straddles a pair boundary.

template <int V> struct Vec;
template <> struct Vec<4> {
    static __device__ __forceinline__ void load(const u16* p, u32 w[2]) {
        const u64 v = *reinterpret_cast<const u64*>(p);
        w[0] = (u32)v; w[1] = (u32)(v >> 32);
    }
    static __device__ __forceinline__ void store(u16* p, const u32 w[2]) {
        *reinterpret_cast<u64*>(p) = (u64)w[0] | ((u64)w[1] << 32);
    }
};

template <int V>
NVFP4_DEVICE void load_values(const u16* p, float v[V]) {
    u32 w[V / 2];
    Vec<V>::load(p, w);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) { v[2 * i] = bf16_lo(w[i]); v[2 * i + 1] = bf16_hi(w[i]); }
}

// Normalized elements n[s][j] of one head, from the T threads of its group (group_mask: those lanes).
template <int V>
NVFP4_DEVICE void rms_normalize_vec(const u16* head, const u16* weight, float head_dim, float eps, u32 t,
                                    u32 group_mask, float n[4][V]) {
    constexpr int T = 32 / V;
    float x[4][V];
#pragma unroll
    for (int s = 0; s < 4; ++s) load_values<V>(head + V * t + 32 * s, x[s]);
    float v[V];  // v[j]: the partial sum of lane V t + j
#pragma unroll
    for (int j = 0; j < V; ++j) {
        v[j] = 0.0f;
#pragma unroll
        for (int s = 0; s < 4; ++s) v[j] = fma_ftz(x[s][j], x[s][j], v[j]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        if (off >= V) {
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] = add_ftz(v[j], __shfl_down_sync(group_mask, v[j], off / V, T));
        } else {
#pragma unroll
            for (int j = 0; j < off; ++j) v[j] = add_ftz(v[j], v[j + off]);
        }
    }
    const float sum = __shfl_sync(group_mask, v[0], 0, T);
    float r;
    asm("{ .reg .f32 t;\n"
        "  div.approx.ftz.f32 t, %1, %2;\n"
        "  add.ftz.f32 t, t, %3;\n"
        "  rsqrt.approx.ftz.f32 %0, t; }" : "=f"(r) : "f"(sum), "f"(head_dim), "f"(eps));
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        float w[V];
        load_values<V>(weight + V * t + 32 * s, w);
#pragma unroll
        for (int j = 0; j < V; ++j) n[s][j] = bf16_to_f32(f32_to_bf16(mul_ftz(mul_ftz(r, x[s][j]), w[j])));
    }
}

template <int V>
NVFP4_DEVICE void rotate_store_vec(u16* head, const u16* freq_row, u32 t, u32 group_mask, const float n[4][V]) {
    constexpr int T = 32 / V;
    float p[3][V];  // the partner's slots 0..2, exchanged as packed bf16 (n is bf16-exact)
#pragma unroll
    for (int s = 0; s < 3; ++s) {
#pragma unroll
        for (int i = 0; i < V / 2; ++i) {
            const u32 pair = __shfl_xor_sync(group_mask, pack_bf16x2(n[s][2 * i], n[s][2 * i + 1]), T / 2, T);
            p[s][2 * i] = bf16_lo(pair);
            p[s][2 * i + 1] = bf16_hi(pair);
        }
    }
    const bool low = t < T / 2;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const u32 e0 = V * t + 32 * s;              // first element of this slot
        const bool first = e0 < 48;                 // elements i of pairs (i, i + 48)
        const u32 pair0 = first ? e0 : e0 - 48;
        u32 out[V / 2];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float partner = low ? p[(s + 1) % 3][j] : p[(s + 2) % 3][j];
            const u64 f = *reinterpret_cast<const u64*>(freq_row + 4 * (pair0 + j));  // f00 f01 | f10 f11
            const u32 row0 = (u32)f, row1 = (u32)(f >> 32);
            const float y = first ? fma_ftz(n[s][j], bf16_lo(row0), mul_ftz(partner, bf16_hi(row0)))
                                  : fma_ftz(partner, bf16_lo(row1), mul_ftz(n[s][j], bf16_hi(row1)));
            const u32 bits = f32_to_bf16(y);
            out[j / 2] = (j & 1) ? (out[j / 2] | (bits << 16)) : bits;
        }
        Vec<V>::store(head + e0, out);
    }
    u32 tail[V / 2];  // beyond rot_dim: normalized only
#pragma unroll
    for (int i = 0; i < V / 2; ++i) tail[i] = pack_bf16x2(n[3][2 * i], n[3][2 * i + 1]);
    Vec<V>::store(head + V * t + 96, tail);
}

template <int V>
__device__ __forceinline__ void rms_rope_vec_body(const RmsRopeParams& p) {
    constexpr int T = 32 / V;
    const u32 lane = threadIdx.x & 31, t = lane & (T - 1);
    const u32 group_mask = (T == 32 ? 0xFFFFFFFFu : ((1u << T) - 1u)) << (lane & ~(u32)(T - 1));
    const u32 groups_total = gridDim.x * (ROPE_THREADS / T);
    const u32 items = (u32)p.tokens * (u32)p.heads;
    const float head_dim = (float)p.head_dim;
    for (u32 item = (blockIdx.x * ROPE_THREADS + threadIdx.x) / T; item < items; item += groups_total) {
        const u32 token = item / (u32)p.heads;
        const u32 h = item - token * (u32)p.heads;
        const i64 offset = (i64)token * p.row_stride + (i64)h * p.head_dim;
        const u16* freq_row = p.freqs + (i64)token * (p.rot_dim / 2) * 4;
        float nq[4][V], nk[4][V];
        rms_normalize_vec<V>(p.q + offset, p.q_weight, head_dim, p.eps, t, group_mask, nq);
        rms_normalize_vec<V>(p.k + offset, p.k_weight, head_dim, p.eps, t, group_mask, nk);
        rotate_store_vec<V>(p.q + offset, freq_row, t, group_mask, nq);
        rotate_store_vec<V>(p.k + offset, freq_row, t, group_mask, nk);
    }
}

// 8-byte accesses, 8 threads per head: q, k rows and the norm weights must be 8-byte aligned (kernels/ops.py).
extern "C" __global__ void __launch_bounds__(ROPE_THREADS) h3_rms_rope_split_half(const RmsRopeParams p) { rms_rope_vec_body<4>(p); }
