// Fused NVFP4 activation packing for the MiniMax H3 block: global-scale reductions, packs, gated residuals, and
// RMSNorm statistics.
//
// Math. Every pack and reduction reads its activation through a *source* that applies the elementwise ops ComfyUI
// runs right before the quantized Linear, so their outputs never go to memory:
//   PlainSource          h = x                                               (out_proj input, generic layers)
//   ModulateSource       h = bf16(bf16(x * bf16(1 + scale[m])) + shift[m])   (adaLN modulation of a norm output)
//   NormModulateSource   the same on n = bf16(w * (rstd[row] * x))           (RMSNorm folded in: qkv_proj, fc1)
//   SwigluSource         h = bf16(bf16(silu(gate)) * up)                     (fc1 output -> fc2 input)
// with m = mod_index[row] the adaLN modulation row of the token. Each bf16() is one round-to-nearest-even,
// exactly where PyTorch rounds in ComfyUI's stock ops (rms_norm, mul_, add_, silu, mul_), and the fp32 arithmetic
// between them is IEEE (this file is compiled without fast math; _rn intrinsics prevent contraction).
//
//   nvfp4_absmax_*      one pass over h: amax|h| (NaN wins, as torch.amax); the LAST CTA to finish turns it into
//                       the global scale g = fp32(bf16(amax * fp32(1/2688))), writes it to device memory and
//                       re-arms its workspace. No host sync: the pack kernel reads g from memory.
//   nvfp4_pack_*        one pass over h: block scales + E2M1 codes (nvfp4_common.cuh), every padding byte written
//                       here (pad rows of qdata, pad rows and columns of the scales), so no zero-fill launch; CTA 0
//                       also writes the GEMM alpha g * weight_scale_2 for comfy-kitchen's device-alpha GEMM.
//   h3_gated_residual   x[r] += other[r] * gate[m] in place (ComfyUI's per-segment addcmul_).
//   h3_row_norm_*       RMSNorm statistics of x (optionally first updated by the gated residual): rstd[r] with
//                       torch's CUDA rms_norm arithmetic, and optionally the amax of the modulated, normalized rows
//                       (the next projection's global scale), so torch's norm never writes its output.
//
// torch's rms_norm (vectorized_layer_norm_kernel<BFloat16, float, rms=true>, identical arithmetic in torch 2.9.0 to
// 2.14.1; kernels/ops.py rms_norm_support and the first-use self-check guard it): one CTA of 128 threads per row;
// logical thread t sums the squares of the 4-element vectors t, t + 128, ... (fma.rn from 0, elements in order);
// a shfl_down tree 16, 8, 4, 2, 1 of add.rn per warp; S = (W0 + W2) + (W1 + W3); var = div.rn(S, float(K));
// rstd = rsqrt.approx.f32(add.rn(var, float(eps))) (non-ftz); n = bf16(mul.rn(w, mul.rn(rstd, x))). Here one warp
// holds a row, each lane four of torch's logical threads (row_norm_body says which), so the four partial sums and
// the tree replay torch's exactly.
//
// Thread mapping of the pack. One warp packs one row at a time. The padded scale matrix has
// U = roundup(K/16, 4)/4 column groups per row; a group covers 64 input columns and owns 4 contiguous scale bytes
// of the swizzled layout. Each lane packs one 16-block (two 16-byte loads, one block scale, 8 bytes of codes); lane
// 0 of each 4-lane group gathers the group's 4 scale bytes with three shuffles and stores them as one word. Items
// blocks per lane are in flight to cover DRAM latency. Rows cover [0, roundup(roundup(M,16),128)): rows in
// [M, roundup(M,16)) are packed from zeros (as comfy-kitchen pads them), rows beyond only get zero scales. Measured
// slower on the H200 (benchmarks/README.md): splitting a block over two lanes for 512-byte coalesced loads
// (+17% at K=5376), and persistent warps walking the flat block list across row ends (+34%).
//
// Requirements checked on the host (kernels/ops.py): K % 16 == 0, 16-byte aligned rows and tables.
#include "nvfp4_common.cuh"

// Launch shape: kernels/ops.py (LAUNCH) is the one source of these values and passes them as -D options.
#if !defined(ITEMS) || !defined(PLAIN_ITEMS) || !defined(PACK_THREADS) || !defined(SILU_TABLE_THREADS) ||          \
    !defined(ABSMAX_THREADS) || !defined(RESIDUAL_THREADS) || !defined(ROW_NORM_THREADS) ||                         \
    !defined(ROW_NORM_MAX_STEPS)
#error "kernels/ops.py passes the launch constants (ITEMS, PLAIN_ITEMS, PACK_THREADS, ...) as -D options"
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
    const float* rstd;     // folded RMSNorm: per-row rstd (h3_row_norm_*), and its bf16 weight [K]
    const u16* norm_weight;
};

struct PackParams {
    SourceParams src;
    const float* global_scale;  // g (dynamic: written by nvfp4_absmax_*, static: the layer's input_scale)
    u8* qdata;                  // [rows16, K/2]
    u8* scales;                 // [rows128, 4*U], swizzled
    i64 rows16;
    i64 rows128;
    i64 groups;                 // U
    float* alpha_out;           // g * weight_scale_2, written by CTA 0 (nullptr: not wanted)
    const float* weight_scale_2;
};

// Where a grid-wide amax lands: {amax bits, finished-CTA counter} (zero between launches, re-armed by the last
// CTA) and the global scale g it becomes.
struct GlobalScaleOut {
    u32* workspace;
    float* global_scale;
};

struct AbsmaxParams {
    SourceParams src;
    GlobalScaleOut out;
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

struct RowNormParams {
    u16* x;                  // residual stream [rows, cols], updated in place by the residual variants
    i64 x_row_stride;
    const u16* other;        // residual variants: attention / MLP output, and the bf16 gate rows
    i64 other_row_stride;
    const u16* gate;
    i64 gate_row_stride;
    const i32* mod_index;    // modulation row of each token (gate, scale and shift tables)
    i64 rows;
    i64 cols;                // K: a multiple of 16, at most 512 * ROW_NORM_MAX_STEPS
    const u16* norm_weight;  // bf16 [K]
    float eps;
    float* rstd;             // out: fp32 [rows]
    const u16* mod_scale;    // amax variants: the next projection's modulation tables
    const u16* mod_shift;
    i64 mod_row_stride;
    GlobalScaleOut out;      // amax variants
};

// ---- sources ---------------------------------------------------------------------------------------------

struct PlainSource {
    // Through L1: each lane reads 32 contiguous bytes in two 16-byte loads, and the second load of each sector
    // hits L1 (measured 12% faster on the H200 than L1::no_allocate).
    static __device__ __forceinline__ void load(const SourceParams& p, i64 row, i64 col, u32 w[4]) {
        u32x4 v = load_16B(p.x + row * p.x_row_stride + col);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
};

// The adaLN modulation of bf16x2 words, shared with the row-norm kernels.
NVFP4_DEVICE u32 modulate_x2(u32 x, u32 scale, u32 shift) {
    return bf16x2_add(bf16x2_mul(x, bf16x2_add(BF16X2_ONE, scale)), shift);
}

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
        for (int i = 0; i < 4; ++i) w[i] = modulate_x2(xs[i], ss[i], ts[i]);
    }
};


// torch's rms_norm output element pair: bf16(w * (rstd * x)), two separately rounded fp32 products.
NVFP4_DEVICE u32 rms_norm_x2(u32 x, u32 w, float rstd) {
    return pack_bf16x2(__fmul_rn(bf16_lo(w), __fmul_rn(rstd, bf16_lo(x))),
                       __fmul_rn(bf16_hi(w), __fmul_rn(rstd, bf16_hi(x))));
}

// RMSNorm folded in front of the modulation: n = bf16(w * (rstd * x)) with rstd from h3_row_norm_* (torch's
// rms_norm output, element for element), then ModulateSource's three roundings.
struct NormModulateSource {
    static __device__ __forceinline__ void load(const SourceParams& p, i64 row, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(p.x + row * p.x_row_stride + col);
        u32x4 nw = load_16B(p.norm_weight + col);
        const float r = p.rstd[row];
        i64 m = p.mod_index[row];
        u32x4 s = load_16B(p.mod_scale + m * p.mod_row_stride + col);
        u32x4 t = load_16B(p.mod_shift + m * p.mod_row_stride + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ws[4] = {nw.x, nw.y, nw.z, nw.w};
        const u32 ss[4] = {s.x, s.y, s.z, s.w}, ts[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = modulate_x2(rms_norm_x2(xs[i], ws[i], r), ss[i], ts[i]);
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

// Block reduction of the per-thread |h| maxima (bf16x2 bit patterns of |h|), then the last CTA to finish turns the
// grid's max into g. Every thread of the CTA must call it.
template <int Threads>
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
        // torch: (amax_bf16 / 2688.0) -> bf16 computed as fp32(amax) * fp32(1/2688), then .to(float32)
        out.global_scale[0] = bf16_to_f32(f32_to_bf16(__fmul_rn(bf16_to_f32((u16)amax_bits), 1.0f / 2688.0f)));
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
    absmax_finish<ABSMAX_THREADS>(p.out, acc);
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
    absmax_finish<ABSMAX_THREADS>(p.out, acc);
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
    if (p.alpha_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) p.alpha_out[0] = __fmul_rn(g, p.weight_scale_2[0]);

    for (u32 row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows128; row += warps_total) {
        const bool data_row = row < rows;
        const bool packed_row = row < rows16;
        u8* qrow = p.qdata + (u64)row * (cols / 2);
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
                if (lane == group_leader) {
                    *reinterpret_cast<u32*>(p.scales + swizzled_scale_offset32(row, c, scale_groups * 4)) =
                        scale_byte | (b1 << 8) | (b2 << 16) | (b3 << 24);
                }
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
        u32x4 x = load_16B_coherent(xp);  // x is written by this kernel: no read-only (.nc) path
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

// ---- RMSNorm statistics (optionally after the gated residual), and the next projection's amax ----------------

// One warp per row, 512 columns per step: lane p holds columns 512 s + 8 p .. + 7 and 512 s + 256 + 8 p .. + 7, i.e.
// the 4-element vectors of torch's logical threads 2p, 2p + 1 (its warp p / 16) and 64 + 2p, 65 + 2p (its warp
// 2 + p / 16), so every load and store instruction of a warp covers 512 contiguous bytes. rstd needs the whole row
// before any normalized value can be formed: the amax pass reads the row from the warp's slice of shared memory
// (ROW_NORM_MAX_STEPS * 1 KB), where the first pass left it. Measured on the H200: keeping the row in registers took
// 177 registers and ran 1.6x slower; re-reading it from L2 lost 45% of the rows to eviction (+0.18 GB of DRAM reads).
extern __shared__ __align__(16) u32 row_shared[];
template <bool Residual, bool Amax>
__device__ __forceinline__ void row_norm_body(const RowNormParams& p) {
    const u32 lane = threadIdx.x & 31;
    const u32 cols = (u32)p.cols, rows = (u32)p.rows;
    const u32 warps_total = gridDim.x * (blockDim.x >> 5);
    const float n_f = (float)cols;
    u32 acc = 0;  // amax of |h| as bf16x2 bit patterns (NaN above inf)
    u32* staged = row_shared + (threadIdx.x >> 5) * (ROW_NORM_MAX_STEPS * 256);  // this warp's row, bf16x2 words

    for (u32 row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps_total) {
        u16* xrow = p.x + (i64)row * p.x_row_stride;
        const i64 m = (Residual || Amax) ? (i64)p.mod_index[row] : 0;
        // sums of squares of torch's logical threads 2p, 2p + 1, 64 + 2p, 65 + 2p
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int step = 0; step < ROW_NORM_MAX_STEPS; ++step) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 col = 512u * step + 256u * half + 8u * lane;
                if (col >= cols) continue;  // cols is a multiple of 16: a chunk is in or out as a whole
                u32x4 a = load_16B_coherent(xrow + col);
                u32 w[4] = {a.x, a.y, a.z, a.w};
                if (Residual) {
                    u32x4 o = load_16B_stream(p.other + (i64)row * p.other_row_stride + col);
                    u32x4 g = load_16B(p.gate + m * p.gate_row_stride + col);
                    const u32 os[4] = {o.x, o.y, o.z, o.w}, gs[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {  // torch's addcmul_: see gated_add
                        w[i] = pack_bf16x2(gated_add(bf16_lo(w[i]), bf16_lo(os[i]), bf16_lo(gs[i])),
                                           gated_add(bf16_hi(w[i]), bf16_hi(os[i]), bf16_hi(gs[i])));
                    }
                    store_16B(xrow + col, u32x4{w[0], w[1], w[2], w[3]});
                }
#pragma unroll
                for (int j = 0; j < 2; ++j) {  // logical thread 2p + j (+ 64 for the second half): 4 elements in order
                    const float e0 = bf16_lo(w[2 * j]), e1 = bf16_hi(w[2 * j]);
                    const float e2 = bf16_lo(w[2 * j + 1]), e3 = bf16_hi(w[2 * j + 1]);
                    float& s = part[2 * half + j];
                    s = __fmaf_rn(e0, e0, s);
                    s = __fmaf_rn(e1, e1, s);
                    s = __fmaf_rn(e2, e2, s);
                    s = __fmaf_rn(e3, e3, s);
                }
                // each lane reads back only its own words below: no barrier needed
                if (Amax) *reinterpret_cast<u32x4*>(staged + col / 2) = u32x4{w[0], w[1], w[2], w[3]};
            }
        }
        // torch's warp tree on logical lanes 2q + j (q = lane % 16): offsets 16, 8, 4, 2 are shuffles by 8, 4, 2, 1
        // lanes inside each half-warp; offset 1 adds the two partials a lane holds.
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) {
#pragma unroll
            for (int j = 0; j < 4; ++j) part[j] = __fadd_rn(part[j], __shfl_down_sync(0xFFFFFFFFu, part[j], off, 16));
        }
        // lane 0 holds torch's warps 0 (first half) and 2 (second half), lane 16 warps 1 and 3:
        // S = (W0 + W2) + (W1 + W3)
        const float pair = __fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3]));
        float total = __fadd_rn(pair, __shfl_down_sync(0xFFFFFFFFu, pair, 16));
        total = __shfl_sync(0xFFFFFFFFu, total, 0);
        float rstd;
        asm("rsqrt.approx.f32 %0, %1;" : "=f"(rstd) : "f"(__fadd_rn(__fdiv_rn(total, n_f), p.eps)));
        if (lane == 0) p.rstd[row] = rstd;
        if (Amax) {
#pragma unroll
            for (int step = 0; step < ROW_NORM_MAX_STEPS; ++step) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const u32 col = 512u * step + 256u * half + 8u * lane;
                    if (col >= cols) continue;
                    const u32x4 xv = *reinterpret_cast<const u32x4*>(staged + col / 2);
                    u32x4 nw = load_16B(p.norm_weight + col);
                    u32x4 sc = load_16B(p.mod_scale + m * p.mod_row_stride + col);
                    u32x4 sh = load_16B(p.mod_shift + m * p.mod_row_stride + col);
                    const u32 xs[4] = {xv.x, xv.y, xv.z, xv.w}, ws[4] = {nw.x, nw.y, nw.z, nw.w};
                    const u32 ss[4] = {sc.x, sc.y, sc.z, sc.w}, ts[4] = {sh.x, sh.y, sh.z, sh.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc = abs_bits_max_x2(acc, modulate_x2(rms_norm_x2(xs[i], ws[i], rstd), ss[i], ts[i]));
                    }
                }
            }
        }
    }
    if (Amax) absmax_finish<ROW_NORM_THREADS>(p.out, acc);
}

// ---- entry points (one name per variant; kernels/runtime.py looks them up by name) -------------------------

extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_plain(const AbsmaxParams p) { absmax_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_modulate(const AbsmaxParams p) { absmax_body<ModulateSource, ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_swiglu(const AbsmaxParams p) { absmax_swiglu_body(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS) nvfp4_pack_plain(const PackParams p) { pack_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS) nvfp4_pack_modulate(const PackParams p) { pack_body<ModulateSource, ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS) nvfp4_pack_norm_modulate(const PackParams p) { pack_body<NormModulateSource, ITEMS>(p); }
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
extern "C" __global__ void __launch_bounds__(RESIDUAL_THREADS) h3_gated_residual(const GatedResidualParams p) { gated_residual_body(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) h3_row_norm_stats(const RowNormParams p) { row_norm_body<false, false>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) h3_row_norm_amax(const RowNormParams p) { row_norm_body<false, true>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) h3_row_norm_residual_stats(const RowNormParams p) { row_norm_body<true, false>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) h3_row_norm_residual_amax(const RowNormParams p) { row_norm_body<true, true>(p); }
