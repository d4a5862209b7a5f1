// Fused NVFP4 activation packing for the MiniMax H3 block: global-scale reduction, pack, gated residual.
//
// Math. Every kernel reads its activation through a *source* that may apply the elementwise op that
// ComfyUI runs right before the quantized Linear, so that op's output never goes to memory:
//   PlainSource     h = x                                             (out_proj input, generic layers)
//   ModulateSource  h = bf16(bf16(x * bf16(1 + scale[m])) + shift[m]) (adaLN modulation, qkv_proj / fc1 input)
//   SwigluSource    h = bf16(bf16(silu(gate)) * up)                   (fc1 output -> fc2 input)
// with m = mod_index[row] the adaLN modulation row of the token. Each bf16() is one round-to-nearest-even,
// exactly where PyTorch rounds in ComfyUI's stock ops (mul_, add_, silu, mul_), and the fp32 arithmetic
// between them is IEEE (this file is compiled without fast math; _rn intrinsics prevent contraction).
//
//   nvfp4_absmax_*   one pass over h: amax|h| (NaN wins, as torch.amax), then the LAST CTA to finish turns
//                    it into the global scale g = fp32(bf16(amax * fp32(1/2688))) and the GEMM alpha
//                    g * weight_scale_2, writes both to device memory and re-arms the workspace. One launch,
//                    no host sync: the pack kernel and the GEMM read g / alpha from memory.
//   nvfp4_pack_*     one pass over h: block scales + E2M1 codes (nvfp4_common.cuh), every padding byte written
//                    here (pad rows of qdata, pad rows and columns of the scales), so no zero-fill launch.
//   h3_gated_residual  x[r] += other[r] * gate[m]  in place (ComfyUI's per-segment addcmul_).
//
// Thread mapping of the pack. One warp packs one row at a time. The padded
// scale matrix has U = roundup(K/16, 4)/4 column groups per row; a group covers 64 input columns and owns 4
// contiguous scale bytes of the swizzled layout. Each lane packs one 16-block (two 16-byte loads, one block
// scale, 8 bytes of codes); lane 0 of each 4-lane group gathers the group's 4 scale bytes with three shuffles
// and stores them as one word. Items blocks per lane are in flight to cover HBM latency. Rows cover
// [0, roundup(roundup(M,16),128)): rows in [M, roundup(M,16)) are packed from zeros (as comfy-kitchen pads
// them), rows beyond only get zero scales. Measured slower on the H200 (benchmarks/README.md): splitting a block
// over two lanes for 512-byte coalesced loads (+17% at K=5376), and persistent warps walking the flat block list
// across row ends (+34%).
//
// Requirements checked on the host (kernels/ops.py): K % 16 == 0, 16-byte aligned rows and tables.
#include "nvfp4_common.cuh"

// Tuning knobs (kernels/ops.py reads the same values; benchmarks may override them with -D).
#ifndef ITEMS
#define ITEMS 1        // modulated and SwiGLU sources (more arithmetic per value, more registers)
#endif
#ifndef PLAIN_ITEMS
#define PLAIN_ITEMS 4  // plain source: only loads in flight matter
#endif
#ifndef PACK_THREADS
#define PACK_THREADS 256
#endif
#ifndef SILU_TABLE_THREADS
#define SILU_TABLE_THREADS 512
#endif
#ifndef ABSMAX_THREADS
#define ABSMAX_THREADS 512
#endif

struct SourceParams {
    const u16* x;          // bf16 activation rows (SwiGLU: fc1 output, gate half first)
    i64 x_row_stride;      // in elements
    i64 rows;              // M
    i64 cols;              // K, the packed width
    i64 up_offset;         // SwiGLU: elements from gate[c] to up[c] within a row
    const u16* mod_scale;  // bf16 adaLN scale rows (before the 1 +), row stride mod_row_stride
    const u16* mod_shift;  // bf16 adaLN shift rows
    i64 mod_row_stride;    // in elements
    const i32* mod_index;  // modulation row of each token
    const u16* silu_table; // SwiGLU with a table: bf16 silu(x) for each of the 65536 bf16 bit patterns x
};

struct PackParams {
    SourceParams src;
    const float* global_scale;  // g (dynamic: written by nvfp4_absmax_*, static: the layer's input_scale)
    u8* qdata;                  // [rows16, K/2]
    u8* scales;                 // [rows128, 4*U], swizzled
    i64 rows16;
    i64 rows128;
    i64 groups;                 // U
};

struct AbsmaxParams {
    SourceParams src;
    u32* workspace;               // {amax bits, finished-CTA counter}; zero between launches
    float* global_scale_out;      // g
    float* alpha_out;             // g * weight_scale_2 (nullptr: not wanted)
    const float* weight_scale_2;
};

struct GatedResidualParams {
    u16* x;                 // residual stream, updated in place
    i64 x_row_stride;
    const u16* other;       // attention / MLP output
    i64 other_row_stride;
    const u16* gate;        // bf16 adaLN gate rows
    i64 gate_row_stride;
    const i32* mod_index;
    i64 rows;
    i64 cols;
};

// ---- sources ---------------------------------------------------------------------------------------------

// 0: the plain pack's loads go through L1: each lane reads 32 contiguous bytes in two 16-byte loads, and the
// second load of each sector hits L1 (measured 12% faster on the H200 than L1::no_allocate).
#ifndef PLAIN_LOAD_NO_ALLOCATE
#define PLAIN_LOAD_NO_ALLOCATE 0
#endif

struct PlainSource {
    static __device__ __forceinline__ void load(const SourceParams& p, i64 row, i64 col, u32 w[4]) {
#if PLAIN_LOAD_NO_ALLOCATE
        u32x4 v = load_16B_stream(p.x + row * p.x_row_stride + col);
#else
        u32x4 v = load_16B(p.x + row * p.x_row_stride + col);
#endif
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
};

// ComfyUI: h[a:b].mul_(1.0 + scale[m]).add_(shift[m]) with bf16 tensors: three bf16 roundings, done here as
// three bf16x2 operations (each one rounding, the same as torch's fp32 opmath for bf16 operands; see
// nvfp4_common.cuh), two values per instruction.
struct ModulateSource {
    static __device__ __forceinline__ void load(const SourceParams& p, i64 row, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(p.x + row * p.x_row_stride + col);
        i64 m = p.mod_index[row];
        u32x4 s = load_16B(p.mod_scale + m * p.mod_row_stride + col);
        u32x4 t = load_16B(p.mod_shift + m * p.mod_row_stride + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ss[4] = {s.x, s.y, s.z, s.w}, ts[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = bf16x2_add(bf16x2_mul(xs[i], bf16x2_add(BF16X2_ONE, ss[i])), ts[i]);
        }
    }
};


// silu(gate) * up for a word of two gate and two up values, silu evaluated (torch's formula, fp32 product).
struct SiluEvaluated {
    static __device__ __forceinline__ u32 times(u32 gate, u32 up) {
        return pack_bf16x2(__fmul_rn(silu_bf16(bf16_lo(gate)), bf16_lo(up)),
                           __fmul_rn(silu_bf16(bf16_hi(gate)), bf16_hi(up)));
    }
};

// The same with silu looked up: the table (kernels/ops.py builds it with torch's own silu on every bf16 value, so
// it holds exactly what ComfyUI's silu returns) is copied into shared memory by nvfp4_pack_swiglu_table. Replaces
// an exp and an IEEE division per value by one shared-memory load.
extern __shared__ __align__(16) u16 silu_shared[];

struct SiluLookedUp {
    static __device__ __forceinline__ u32 times(u32 gate, u32 up) {
        return bf16x2_mul((u32)silu_shared[gate & 0xFFFFu] | ((u32)silu_shared[gate >> 16] << 16), up);
    }
};

template <class Silu>
struct SwigluSource {
    static __device__ __forceinline__ void load(const SourceParams& p, i64 row, i64 col, u32 w[4]) {
        const u16* base = p.x + row * p.x_row_stride + col;
        u32x4 g = load_16B_stream(base);
        u32x4 u = load_16B_stream(base + p.up_offset);
        const u32 gs[4] = {g.x, g.y, g.z, g.w}, us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = Silu::times(gs[i], us[i]);
    }
};

// ---- global scale ----------------------------------------------------------------------------------------

// Block reduction of the per-thread |h| maxima, then the last CTA turns the grid's max into g and alpha.
__device__ __forceinline__ void absmax_finish(const AbsmaxParams& p, u32 acc) {
    u32 m = max(acc & 0xFFFFu, acc >> 16);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));

    __shared__ u32 warp_max[ABSMAX_THREADS / 32];
    __shared__ bool is_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 block_max = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); ++i) block_max = max(block_max, warp_max[i]);
        atomicMax(&p.workspace[0], block_max);
        __threadfence();  // publish this CTA's max before counting it as finished
        is_last = atomicAdd(&p.workspace[1], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last && threadIdx.x == 0) {
        __threadfence();
        u32 amax_bits = atomicExch(&p.workspace[0], 0u);
        p.workspace[1] = 0;  // re-arm for the next launch on this stream
        // torch: (amax_bf16 / 2688.0) -> bf16 computed as fp32(amax) * fp32(1/2688), then .to(float32)
        float g = bf16_to_f32(f32_to_bf16(__fmul_rn(bf16_to_f32((u16)amax_bits), 1.0f / 2688.0f)));
        p.global_scale_out[0] = g;
        if (p.alpha_out) p.alpha_out[0] = __fmul_rn(g, p.weight_scale_2[0]);
    }
}


template <class Source, int Items>
__device__ __forceinline__ void absmax_body(const AbsmaxParams& p) {
    const SourceParams& s = p.src;
    // 32-bit index math throughout: the host guarantees every count fits in 31 bits (64-bit division is slow).
    const u32 chunks_per_row = (u32)(s.cols / 8);
    const u32 total = (u32)s.rows * chunks_per_row;
    const u32 stride = gridDim.x * blockDim.x;
    u32 acc = 0;
    for (u32 base = blockIdx.x * blockDim.x * Items + threadIdx.x; base < total; base += stride * Items) {
        u32 w[Items][4];
#pragma unroll
        for (int i = 0; i < Items; ++i) {
            u32 c = base + (u32)i * blockDim.x;
            if (c < total) {
                u32 row = c / chunks_per_row;
                Source::load(s, (i64)row, (i64)(c - row * chunks_per_row) * 8, w[i]);
            } else {
                w[i][0] = w[i][1] = w[i][2] = w[i][3] = 0;
            }
        }
#pragma unroll
        for (int i = 0; i < Items; ++i) {
            acc = abs_bits_max_x2(acc, w[i][0]);
            acc = abs_bits_max_x2(acc, w[i][1]);
            acc = abs_bits_max_x2(acc, w[i][2]);
            acc = abs_bits_max_x2(acc, w[i][3]);
        }
    }
    absmax_finish(p, acc);
}


// SwiGLU global scale without evaluating silu where it cannot matter. |silu(g)| <= |g| (IEEE division by
// 1 + exp(-g) >= 1) and each of the two bf16 roundings adds at most 2^-8 relative, so
// |bf16(bf16(silu(g)) * u)| <= |g * u| * (1 + 2^-6) with the fp32 product error included. An element whose bound does not exceed this thread's running max cannot change the max;
// only the others (and every non-finite bound, which fails the <= test) are evaluated exactly. The result is
// the exact amax, at close to the cost of reading the input.
__device__ __forceinline__ void absmax_swiglu_body(const AbsmaxParams& p) {
    const SourceParams& s = p.src;
    const u32 chunks_per_row = (u32)(s.cols / 8);
    const u32 total = (u32)s.rows * chunks_per_row;
    const u32 stride = gridDim.x * blockDim.x;
    u32 acc = 0;
    for (u32 base = blockIdx.x * blockDim.x * ITEMS + threadIdx.x; base < total; base += stride * ITEMS) {
        u32 gw[ITEMS][4], uw[ITEMS][4];
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            u32 c = base + (u32)i * blockDim.x;
            if (c < total) {
                u32 row = c / chunks_per_row;
                const u16* g = s.x + (i64)row * s.x_row_stride + (i64)(c - row * chunks_per_row) * 8;
                u32x4 gv = load_16B_stream(g), uv = load_16B_stream(g + s.up_offset);
                gw[i][0] = gv.x; gw[i][1] = gv.y; gw[i][2] = gv.z; gw[i][3] = gv.w;
                uw[i][0] = uv.x; uw[i][1] = uv.y; uw[i][2] = uv.z; uw[i][3] = uv.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) gw[i][j] = uw[i][j] = 0;
            }
        }
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float running = bf16_to_f32((u16)max(acc & 0xFFFFu, acc >> 16));
                const float g0 = bf16_lo(gw[i][j]), g1 = bf16_hi(gw[i][j]);
                const float u0 = bf16_lo(uw[i][j]), u1 = bf16_hi(uw[i][j]);
                // Two separate tests (not fmaxf, which would drop a NaN bound): NaN or inf always evaluates.
                const bool below = fabsf(__fmul_rn(g0, u0)) * 1.015625f <= running &&
                                   fabsf(__fmul_rn(g1, u1)) * 1.015625f <= running;
                if (!below) {
                    acc = abs_bits_max_x2(acc, pack_bf16x2(__fmul_rn(silu_bf16(g0), u0), __fmul_rn(silu_bf16(g1), u1)));
                }
            }
        }
    }
    absmax_finish(p, acc);
}

// ---- pack ------------------------------------------------------------------------------------------------

template <class Source, int Items>
__device__ __forceinline__ void pack_body(const PackParams& p) {
    const SourceParams& s = p.src;
    const u32 lanes_per_row = (u32)p.groups * 4;
    const u32 cols = (u32)s.cols, rows = (u32)s.rows, rows16 = (u32)p.rows16, rows128 = (u32)p.rows128;
    const u32 scale_groups = (u32)p.groups;
    const float g = p.global_scale[0], rcp_g = rcp_approx_ftz(g);
    const u32 lane = threadIdx.x & 31;
    const u32 group_leader = lane & ~3u;
    const u32 warps_total = gridDim.x * (blockDim.x >> 5);

    for (u32 row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows128; row += warps_total) {
        const bool data_row = row < rows;
        const bool packed_row = row < rows16;
        u8* qrow = p.qdata + (u64)row * (cols / 2);
        u8* srow = p.scales + (u64)(row >> 7) * scale_groups * 512 + (row & 31) * 16 + ((row & 127) >> 5) * 4;
        for (u32 c0 = 0; c0 < lanes_per_row; c0 += 32 * Items) {
            u32 w[Items][8];
#pragma unroll
            for (int i = 0; i < Items; ++i) {
                const u32 col = (c0 + 32 * i + lane) * 16;
                if (data_row && col < cols) {
                    Source::load(s, (i64)row, (i64)col, w[i]);
                    Source::load(s, (i64)row, (i64)col + 8, w[i] + 4);
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) w[i][j] = 0;
                }
            }
#pragma unroll
            for (int i = 0; i < Items; ++i) {
                if (c0 + 32 * i >= lanes_per_row) break;  // warp-uniform: no block of this row left (row tail)
                const u32 c = c0 + 32 * i + lane;
                const u32 col = c * 16;
                u32 block_scale, lo, hi;
                quantize_block16(w[i], g, rcp_g, block_scale, lo, hi);
                const bool in_cols = col < cols;
                u32 scale_byte = (in_cols && packed_row) ? block_scale : 0u;
                u32 b1 = __shfl_sync(0xFFFFFFFFu, scale_byte, group_leader + 1);
                u32 b2 = __shfl_sync(0xFFFFFFFFu, scale_byte, group_leader + 2);
                u32 b3 = __shfl_sync(0xFFFFFFFFu, scale_byte, group_leader + 3);
                if (c >= lanes_per_row) continue;
                if (packed_row && in_cols) {
                    asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(qrow + col / 2), "r"(lo), "r"(hi) : "memory");
                }
#ifndef PACK_SKIP_SCALE_STORE
                if (lane == group_leader) {
                    *reinterpret_cast<u32*>(srow + (c >> 2) * 512) = scale_byte | (b1 << 8) | (b2 << 16) | (b3 << 24);
                }
#endif
            }
        }
    }
}

// ---- gated residual --------------------------------------------------------------------------------------

// torch's addcmul_ in fp32 opmath. The product of two bf16 values is exact in fp32, so a fused or a separate
// multiply-add round identically: one rounding of the sum, then one to bf16.
__device__ __forceinline__ float gated_add(float x, float o, float gate) {
    return __fadd_rn(x, __fmul_rn(o, gate));
}

__device__ __forceinline__ void gated_residual_body(const GatedResidualParams& p) {
    const u32 chunks_per_row = (u32)(p.cols / 8);
    const u32 total = (u32)p.rows * chunks_per_row;
    const u32 stride = gridDim.x * blockDim.x;
    for (u32 c = blockIdx.x * blockDim.x + threadIdx.x; c < total; c += stride) {
        const u32 row32 = c / chunks_per_row;
        const i64 row = (i64)row32, col = (i64)(c - row32 * chunks_per_row) * 8;
        u16* xp = p.x + row * p.x_row_stride + col;
        u32x4 x = load_16B(xp);
        u32x4 o = load_16B_stream(p.other + row * p.other_row_stride + col);
        u32x4 g = load_16B(p.gate + (i64)p.mod_index[row] * p.gate_row_stride + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, os[4] = {o.x, o.y, o.z, o.w}, gs[4] = {g.x, g.y, g.z, g.w};
        u32 r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            r[i] = pack_bf16x2(gated_add(bf16_lo(xs[i]), bf16_lo(os[i]), bf16_lo(gs[i])),
                               gated_add(bf16_hi(xs[i]), bf16_hi(os[i]), bf16_hi(gs[i])));
        }
        store_16B(xp, u32x4{r[0], r[1], r[2], r[3]});
    }
}

// ---- entry points (one name per variant; kernels/runtime.py looks them up by name) -------------------------

extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_plain(const AbsmaxParams p) { absmax_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_modulate(const AbsmaxParams p) { absmax_body<ModulateSource, ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_swiglu(const AbsmaxParams p) { absmax_swiglu_body(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS) nvfp4_pack_plain(const PackParams p) { pack_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS) nvfp4_pack_modulate(const PackParams p) { pack_body<ModulateSource, ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS) nvfp4_pack_swiglu(const PackParams p) { pack_body<SwigluSource<SiluEvaluated>, ITEMS>(p); }
// One CTA per SM (the table takes 128 KB of shared memory); kernels/ops.py launches it where that fits.
extern "C" __global__ void __launch_bounds__(SILU_TABLE_THREADS, 1) nvfp4_pack_swiglu_table(const PackParams p) {
    for (u32 i = threadIdx.x; i < 65536 / 8; i += blockDim.x) {
        const u32x4 v = load_16B(p.src.silu_table + 8 * i);
        *reinterpret_cast<u32x4*>(silu_shared + 8 * i) = v;
    }
    __syncthreads();
    pack_body<SwigluSource<SiluLookedUp>, ITEMS>(p);
}
extern "C" __global__ void __launch_bounds__(256) h3_gated_residual(const GatedResidualParams p) { gated_residual_body(p); }
