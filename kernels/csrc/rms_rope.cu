// In-place per-head RMSNorm + split-half RoPE on q and k views of one projection output (H3's qkv_proj),
// bit-identical to comfy-kitchen's rms_rope_split_half_ (rms_rope.cu, built with --use_fast_math) for head_dim 128.
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
// head, each holding 4 lanes' worth, so every register access is 8 bytes wide: closer to copy bandwidth than one
// warp per head with 2-byte accesses, and than 16-byte accesses (4 threads per head: register pressure); staging the
// heads ahead in shared memory (below) brought it closer still. Reads and writes each element once (comfy-kitchen
// reads q and k twice).
// Instructions: a (token, quad) cursor instead of two divisions per quad, the staging offsets formed once, the norm
// weights as fp32 in shared memory, partner values shuffled as fp32 and rotated pairs rounded two per instruction
// cut the hot loop's instructions a quad by a sixth, which made the kernel faster alone and in the block after the
// qkv GEMM (benchmarks/README.md, tuning log of the RoPE instructions).
#include "nvfp4_common.cuh"

// kernels/cuda_ops.py passes the shape constants (H3: head_dim 128, rotation over the first 96 dims = 48 pairs) and the
// launch shape; the code below is written for exactly these values.
#if !defined(ROPE_HEAD_DIM) || !defined(ROPE_ROT_DIM) || !defined(ROPE_THREADS) || !defined(ROPE_THREADS_PER_HEAD)
#error "kernels/cuda_ops.py passes ROPE_HEAD_DIM, ROPE_ROT_DIM, ROPE_THREADS and ROPE_THREADS_PER_HEAD as -D options"
#endif
#if ROPE_HEAD_DIM != 128 || ROPE_ROT_DIM != 96 || ROPE_THREADS_PER_HEAD != 8
#error "the lane mapping below is written for 128-dim heads, 96 rotated dims and 8 threads per head"
#endif
#define ROPE_PAIRS (ROPE_ROT_DIM / 2)  // 48: element i < 48 rotates with i + 48

struct RmsRopeParams {
    u16* q;               // q of token 0, head 0; element stride 1, head stride ROPE_HEAD_DIM
    u16* k;
    i64 row_stride;       // elements between tokens (q and k share it: views of one qkv buffer)
    const u16* freqs;     // bf16 [tokens, ROPE_PAIRS, 2, 2] contiguous
    const u16* q_weight;  // bf16 [ROPE_HEAD_DIM]
    const u16* k_weight;
    i64 tokens;
    i32 heads;
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

// ---- 8 threads per (token, head), 4 consecutive elements (8 bytes) per register access ------------------------
// Thread t (t = lane % 8) holds lanes 4t .. 4t+3 of the mapping above: elements e = 4t + j + 32 s (j, s = 0..3),
// and a warp works on 4 consecutive heads of one token (a "quad"). The sum is comfy-kitchen's, term for term: each of
// the thread's 4 lane partials is its own fma chain over s, and the shfl_down tree is replayed on the lane numbering
// (lane offsets 16, 8, 4 are shuffles by 4, 2, 1 threads; offsets 2 and 1 are additions inside the thread). Rotation
// partners are in thread t ^ 4 (for t < 4 slot s pairs with the partner's slot s+1 mod 3, else s+2); 48 is a
// multiple of 4, so no access straddles a pair boundary.
//
// Memory pipeline: each warp walks a contiguous range of quads and copies the q and k heads of the quads ahead of
// the one it works on into shared memory with cp.async (ROPE_STAGES quads in flight, no registers held), so DRAM
// latency is not waited for once per head; results are stored straight to global memory (waiting for each head's
// loads was further from copy bandwidth, benchmarks/README.md).

#if !defined(ROPE_STAGES) || ROPE_STAGES < 2
#error "kernels/cuda_ops.py passes ROPE_STAGES (>= 2) as a -D option"
#endif
#define ROPE_HEAD_BYTES (ROPE_HEAD_DIM * 2)
// A staged head takes 320 bytes: with 256 the four groups of a warp would read the same banks (4-way conflicts).
#define ROPE_STAGED_HEAD_BYTES (ROPE_HEAD_BYTES + 64)
#define ROPE_STAGE_BYTES (2 * 4 * ROPE_STAGED_HEAD_BYTES)  // q and k of one quad
#define ROPE_WARPS (ROPE_THREADS / 32)

NVFP4_DEVICE void unpack4(u64 w, float v[4]) {
    v[0] = bf16_lo((u32)w); v[1] = bf16_hi((u32)w); v[2] = bf16_lo((u32)(w >> 32)); v[3] = bf16_hi((u32)(w >> 32));
}
NVFP4_DEVICE void store4(u16* p, u32 lo, u32 hi) {
    *reinterpret_cast<u64*>(p) = (u64)lo | ((u64)hi << 32);
}

// Normalized elements n[s][j] of one head (x: the thread's 4 slots, read from the staged copy; weight: the norm
// weight as fp32, in shared memory), from the 8 threads of its group (group_mask: those lanes).
struct alignas(16) f32x4 { float x, y, z, w; };
NVFP4_DEVICE void rms_normalize(const u16* staged_head, const float* weight, float head_dim, float eps, u32 t,
                                u32 group_mask, float n[4][4]) {
    float x[4][4];
#pragma unroll
    for (int s = 0; s < 4; ++s) unpack4(*reinterpret_cast<const u64*>(staged_head + 4 * t + 32 * s), x[s]);
    float v[4];  // v[j]: the partial sum of lane 4t + j
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[j] = 0.0f;
#pragma unroll
        for (int s = 0; s < 4; ++s) v[j] = fma_ftz(x[s][j], x[s][j], v[j]);
    }
#pragma unroll
    for (int threads = 4; threads > 0; threads >>= 1) {  // lane offsets 16, 8, 4
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[j] = add_ftz(v[j], __shfl_down_sync(group_mask, v[j], threads, ROPE_THREADS_PER_HEAD));
        }
    }
    v[0] = add_ftz(v[0], v[2]);  // lane offset 2
    v[1] = add_ftz(v[1], v[3]);
    v[0] = add_ftz(v[0], v[1]);  // lane offset 1
    const float sum = __shfl_sync(group_mask, v[0], 0, ROPE_THREADS_PER_HEAD);
    float r;
    asm("{ .reg .f32 t;\n"
        "  div.approx.ftz.f32 t, %1, %2;\n"
        "  add.ftz.f32 t, t, %3;\n"
        "  rsqrt.approx.ftz.f32 %0, t; }" : "=f"(r) : "f"(sum), "f"(head_dim), "f"(eps));
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const f32x4 w = *reinterpret_cast<const f32x4*>(weight + 4 * t + 32 * s);
        const float ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) n[s][j] = bf16_to_f32(f32_to_bf16(mul_ftz(mul_ftz(r, x[s][j]), ws[j])));
    }
}

// The rotation coefficients this thread needs, for q and k alike: for slot s < 3 and element j, the two entries of
// its pair's row in [c, -s, s, c]: (f00, f01) for the first element of a pair, (f10, f11) for the second.
NVFP4_DEVICE void load_rotation(const u16* freq_row, u32 t, u32 f[3][4]) {
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const u32 e0 = 4 * t + 32 * s;
        const bool first = e0 < ROPE_PAIRS;
        const u32 pair0 = first ? e0 : e0 - ROPE_PAIRS;
#pragma unroll
        for (int j = 0; j < 4; ++j) f[s][j] = *reinterpret_cast<const u32*>(freq_row + 4 * (pair0 + j) + (first ? 0 : 2));
    }
}

// Rotate and store one head in place (pairs (i, i + ROPE_PAIRS)).
NVFP4_DEVICE void rotate_store(u16* head, const u32 f[3][4], u32 t, u32 group_mask, const float n[4][4]) {
    float p[3][4];  // the partner's slots 0..2 (fp32 shuffles: no packing and unpacking on the integer pipe)
#pragma unroll
    for (int s = 0; s < 3; ++s) {
#pragma unroll
        for (int j = 0; j < 4; ++j) p[s][j] = __shfl_xor_sync(group_mask, n[s][j], 4, ROPE_THREADS_PER_HEAD);
    }
    const bool low = t < 4;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const u32 e0 = 4 * t + 32 * s;              // first element of this slot
        const bool first = e0 < ROPE_PAIRS;         // elements i of pairs (i, i + ROPE_PAIRS)
        float y[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float partner = low ? p[(s + 1) % 3][j] : p[(s + 2) % 3][j];
            // first: (f00, f01) = (lo, hi) of f; second: (f10, f11)
            y[j] = first ? fma_ftz(n[s][j], bf16_lo(f[s][j]), mul_ftz(partner, bf16_hi(f[s][j])))
                         : fma_ftz(partner, bf16_lo(f[s][j]), mul_ftz(n[s][j], bf16_hi(f[s][j])));
        }
        store4(head + e0, pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));  // two roundings per instruction
    }
    // beyond ROPE_ROT_DIM: normalized only
    store4(head + 4 * t + ROPE_ROT_DIM, pack_bf16x2(n[3][0], n[3][1]), pack_bf16x2(n[3][2], n[3][3]));
}

// A warp's place in its range of quads, (token, quad of heads), advanced one quad at a time: no division per quad.
struct QuadCursor {
    u32 token, quad;
    __device__ __forceinline__ void advance(u32 quads) {
        if (++quad == quads) { quad = 0; ++token; }
    }
};

// Copy the quad's q and k heads into a stage: 16 bytes per lane and copy (4 heads x 16 pieces per tensor). Lane l
// copies piece l % 16 of heads l / 16 and l / 16 + 2 of q and of k; its source and stage offsets (StageLane) are
// the same for every quad.
struct StageLane {
    u32 src;  // elements from the quad's first head
    u32 dst;  // bytes from the stage's start
    u32 head; // l / 16
};
NVFP4_DEVICE StageLane stage_lane(u32 lane) {
    return StageLane{(lane / 16) * ROPE_HEAD_DIM + (lane % 16) * 8, (lane / 16) * ROPE_STAGED_HEAD_BYTES + (lane % 16) * 16,
                     lane / 16};
}
NVFP4_DEVICE void copy_16B_async(u32 dst, const u16* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
NVFP4_DEVICE void stage_quad(const RmsRopeParams& p, QuadCursor at, const StageLane& l, u32 stage_base) {
    const u32 head0 = at.quad * 4;
    const i64 row = (i64)at.token * p.row_stride + (i64)head0 * ROPE_HEAD_DIM + l.src;
    const u16* q = p.q + row;
    const u16* k = p.k + row;
    const u32 dst = stage_base + l.dst;
    if (head0 + l.head < (u32)p.heads) {
        copy_16B_async(dst, q);
        copy_16B_async(dst + 4 * ROPE_STAGED_HEAD_BYTES, k);
    }
    if (head0 + l.head + 2 < (u32)p.heads) {
        copy_16B_async(dst + 2 * ROPE_STAGED_HEAD_BYTES, q + 2 * ROPE_HEAD_DIM);
        copy_16B_async(dst + 6 * ROPE_STAGED_HEAD_BYTES, k + 2 * ROPE_HEAD_DIM);
    }
}

extern __shared__ __align__(16) u8 rope_stages[];

// q, k rows 16-byte aligned, norm weights and rope table 8-byte aligned (kernels/cuda_ops.py checks).
extern "C" __global__ void __launch_bounds__(ROPE_THREADS) fused_rms_rope_split_half(const RmsRopeParams p) {
    const u32 lane = threadIdx.x & 31, t = lane % ROPE_THREADS_PER_HEAD, group = lane / ROPE_THREADS_PER_HEAD;
    const u32 group_mask = 0xFFu << (lane & ~7u);
    const u32 quads = ((u32)p.heads + 3) / 4;
    const u64 items = (u64)p.tokens * quads;
    const u64 warps = (u64)gridDim.x * ROPE_WARPS, warp = (u64)blockIdx.x * ROPE_WARPS + threadIdx.x / 32;
    const u32 begin = (u32)(items * warp / warps), end = (u32)(items * (warp + 1) / warps);
    const u8* warp_stages = rope_stages + (threadIdx.x / 32) * (ROPE_STAGES * ROPE_STAGE_BYTES);
    const u32 stages = (u32)__cvta_generic_to_shared(warp_stages);  // cp.async takes shared-window addresses
    const float head_dim = (float)ROPE_HEAD_DIM;

    // the norm weights as fp32, once per CTA: four values of a slot in one shared load, no unpacking per head
    __shared__ __align__(16) float weights[2][ROPE_HEAD_DIM];
    for (u32 i = threadIdx.x; i < 2 * ROPE_HEAD_DIM; i += ROPE_THREADS) {
        weights[i / ROPE_HEAD_DIM][i % ROPE_HEAD_DIM] = bf16_to_f32((i < ROPE_HEAD_DIM ? p.q_weight : p.k_weight)[i % ROPE_HEAD_DIM]);
    }
    __syncthreads();
    const StageLane staging = stage_lane(lane);
    QuadCursor current{begin / quads, begin - (begin / quads) * quads}, ahead = current;
#pragma unroll
    for (int s = 0; s < ROPE_STAGES - 1; ++s) {
        if (begin + s < end) stage_quad(p, ahead, staging, stages + s * ROPE_STAGE_BYTES);
        asm volatile("cp.async.commit_group;" ::: "memory");
        ahead.advance(quads);
    }
    u32 slot = 0;
    for (u32 item = begin; item < end; ++item, current.advance(quads)) {
        ahead = current;  // re-derived, not carried: two registers fewer (no spills at 72)
#pragma unroll
        for (int s = 0; s < ROPE_STAGES - 1; ++s) ahead.advance(quads);
        const u32 ahead_slot = slot == 0 ? ROPE_STAGES - 1 : slot - 1;  // = (slot + ROPE_STAGES - 1) % ROPE_STAGES
        if (item + ROPE_STAGES - 1 < end) stage_quad(p, ahead, staging, stages + ahead_slot * ROPE_STAGE_BYTES);
        asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group %0;" :: "n"(ROPE_STAGES - 1) : "memory");
        __syncwarp();  // the other lanes' copies of this quad are complete and visible

        const u32 token = current.token, h = current.quad * 4 + group;
        if (h < (u32)p.heads) {
            const u16* staged = reinterpret_cast<const u16*>(warp_stages + slot * ROPE_STAGE_BYTES);
            const i64 offset = (i64)token * p.row_stride + (i64)h * ROPE_HEAD_DIM;
            u32 f[3][4];
            load_rotation(p.freqs + (i64)token * ROPE_PAIRS * 4, t, f);
            float n[4][4];
            rms_normalize(staged + group * (ROPE_STAGED_HEAD_BYTES / 2), weights[0], head_dim, p.eps, t, group_mask, n);
            rotate_store(p.q + offset, f, t, group_mask, n);
            rms_normalize(staged + (4 + group) * (ROPE_STAGED_HEAD_BYTES / 2), weights[1], head_dim, p.eps, t, group_mask, n);
            rotate_store(p.k + offset, f, t, group_mask, n);
        }
        __syncwarp();  // every lane is done with this stage before a later iteration refills it
        slot = slot + 1 == ROPE_STAGES ? 0 : slot + 1;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}
