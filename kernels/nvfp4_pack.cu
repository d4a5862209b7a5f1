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
//                       also writes the GEMM alpha g * weight_scale_2 for comfy-kitchen's device-alpha GEMM. The
//                       SwiGLU pack looks silu up in torch's own table: all 65536 entries (_table, 128 KB of shared
//                       memory) or the 12 KB window (_window, where 128 KB do not fit), or evaluates it (_swiglu).
//   h3_gated_residual   x[r] += other[r] * gate[m] in place (ComfyUI's per-segment addcmul_).
//   h3_row_norm_*       RMSNorm statistics of x (optionally first updated by the gated residual): rstd[r] with
//                       torch's CUDA rms_norm arithmetic, and optionally the amax of the modulated, normalized rows
//                       (the next projection's global scale), so torch's norm never writes its output.
//   h3_modulation_bounds per modulation row, the bounds that let the amax pass skip columns that cannot raise the
//                       maximum (see bounded_amax).
//
// torch's rms_norm (vectorized_layer_norm_kernel<BFloat16, float, rms=true>, identical arithmetic in torch 2.9.0 to
// 2.14.1; kernels/ops.py rms_norm_support and the first-use self-check guard it): one CTA of 128 threads per row;
// logical thread t sums the squares of the 4-element vectors t, t + 128, ... (fma.rn from 0, elements in order);
// a shfl_down tree 16, 8, 4, 2, 1 of add.rn per warp; S = (W0 + W2) + (W1 + W3); var = div.rn(S, float(K));
// rstd = rsqrt.approx.f32(add.rn(var, float(eps))) (non-ftz); n = bf16(mul.rn(w, mul.rn(rstd, x))). Here one warp
// (h3_row_norm_stats / _amax) or two (the residual kernels) hold a row, each lane four or two of torch's logical
// threads (row_norm_body and residual_norm_body say which), so the partial sums and the tree replay torch's exactly.
//
// Thread mapping of the pack. A warp packs one row (the SwiGLU sources) or two rows, half a warp each (the others:
// kPairedRows), at a time. The padded scale matrix has
// U = roundup(K/16, 4)/4 column groups per row; a group covers 64 input columns and owns 4 contiguous scale bytes
// of the swizzled layout. Each lane packs one 16-block (two 16-byte loads, one block scale, 8 bytes of codes) and
// stores its scale byte: the 4 lanes of a group write their word in one instruction (measured on the H200 against
// gathering the word with two shuffles for one lane to store: the same DRAM bytes, 3% fewer instructions,
// norm-modulate 0.181 -> 0.177 ms). Items blocks per lane are in flight to cover DRAM latency. Half a warp per row
// leaves no idle half warp at the end of a row of 336 blocks (K = 5376, qkv_proj and fc1: 5% fewer instructions,
// norm-modulate 0.176 -> 0.170 ms in ncu; the plain pack of out_proj, 4 blocks a lane, 0.174 -> 0.171), and the
// paired units run from the last rows back, which the kernel before (the global-scale pass, the residual) touched
// last: the pairs of kernels gain 3-4 us on the H200. The SwiGLU table pack is slower with half warps (0.593 ->
// 0.633 ms) and keeps whole rows in order (benchmarks/README.md, tuning log). The plain pack's unit of work is one
// step of a row pair (PLAIN_SEGMENT_STEPS) where the pair splits into whole steps (out_proj, K = 7168: ncu 0.172 ->
// 0.168 ms, 0.171 -> 0.166 in the block); the norm-modulate pack keeps whole pairs (segments of 11, 7 or 3 steps:
// 0.172 -> 0.175-0.181 ms, the row set-up per unit). Rows cover
// [0, roundup(roundup(M,16),128)): rows in [M, roundup(M,16)) are packed from zeros (as comfy-kitchen pads them),
// rows beyond only get zero scales. Measured slower on the H200 (benchmarks/README.md): splitting a block over two
// lanes for 512-byte coalesced loads (+17% at K=5376), and persistent warps walking the flat block list across row
// ends (+34%).
//
// Requirements checked on the host (kernels/ops.py): K % 16 == 0, 16-byte aligned rows and tables.
#include "nvfp4_common.cuh"

// Launch shape: kernels/ops.py (LAUNCH) is the one source of these values and passes them as -D options.
#if !defined(ITEMS) || !defined(PLAIN_ITEMS) || !defined(SWIGLU_ITEMS) || !defined(PACK_THREADS) || !defined(SILU_TABLE_THREADS) ||          \
    !defined(ABSMAX_THREADS) || !defined(RESIDUAL_THREADS) || !defined(ROW_NORM_THREADS) ||                         \
    !defined(ROW_NORM_MAX_STEPS) || !defined(ROW_NORM_BATCH) || !defined(RESIDUAL_NORM_THREADS) ||   \
    !defined(RESIDUAL_NORM_BATCH) || !defined(RESIDUAL_AMAX_BATCH) || !defined(RESIDUAL_NORM_MIN_CTAS) ||           \
    !defined(PACK_MIN_CTAS) || !defined(PLAIN_MIN_CTAS) || !defined(SILU_WINDOW_MIN_CTAS) ||           \
    !defined(SWIGLU_SCALE_EVICT_LAST) || !defined(SWIGLU_ABSMAX_ITEMS) || !defined(PLAIN_SEGMENT_STEPS)
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
    const u16* silu_table; // SwiGLU with a table: bf16 silu(x) for each of the 65536 bf16 bit patterns x (or its window)
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
    const u16* bound_scale;  // amax variants: h3_modulation_bounds of (norm_weight, mod_scale, mod_shift)
    const u16* bound_shift;
};

struct ModBoundsParams {
    const u16* norm_weight;  // bf16 [K]
    const u16* mod_scale;    // bf16 modulation rows [R, K], row stride mod_row_stride
    const u16* mod_shift;
    i64 mod_row_stride;
    i64 table_rows;          // R
    i64 cols;                // K
    u16* bound_scale;        // out: bf16 [R, K], |w| |bf16(1 + scale)| rounded up (NaN stays NaN)
    u16* bound_shift;        // out: bf16 [R, K / 8], max |shift| of each 8 columns
};

// ---- sources ---------------------------------------------------------------------------------------------

// Each source splits its addressing into a per-row part (Row, formed once per row: the loop's stores would force
// the row's index, rstd and table pointers to be re-read from memory for every block) and per-column loads.
struct PlainSource {
    static constexpr bool kScaleEvictLast = false;  // see store_scale_byte
    static constexpr bool kPairedRows = true;       // see pack_body
    static constexpr u32 kSegmentSteps = PLAIN_SEGMENT_STEPS;  // see pack_body
    struct Row { const u16* x; };
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) { return Row{p.x + r * p.x_row_stride}; }
    // Through L1: each lane reads 32 contiguous bytes in two 16-byte loads, and the second load of each sector
    // hits L1 (measured 12% faster on the H200 than L1::no_allocate).
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        u32x4 v = load_16B(r.x + col);
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
    static constexpr bool kScaleEvictLast = false;
    static constexpr bool kPairedRows = true;
    static constexpr u32 kSegmentSteps = 0;  // whole row pairs (see pack_body)
    struct Row { const u16* x; const u16* scale; const u16* shift; };
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) {
        const i64 m = p.mod_index[r];
        return Row{p.x + r * p.x_row_stride, p.mod_scale + m * p.mod_row_stride, p.mod_shift + m * p.mod_row_stride};
    }
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(r.x + col);
        u32x4 s = load_16B(r.scale + col);
        u32x4 t = load_16B(r.shift + col);
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
    static constexpr bool kScaleEvictLast = false;
    static constexpr bool kPairedRows = true;
    static constexpr u32 kSegmentSteps = 0;
    struct Row { ModulateSource::Row mod; float rstd; };
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) { return Row{ModulateSource::row(p, r), p.rstd[r]}; }
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& row, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(row.mod.x + col);
        u32x4 nw = load_16B(p.norm_weight + col);
        const float r = row.rstd;
        u32x4 s = load_16B(row.mod.scale + col);
        u32x4 t = load_16B(row.mod.shift + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ws[4] = {nw.x, nw.y, nw.z, nw.w};
        const u32 ss[4] = {s.x, s.y, s.z, s.w}, ts[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = modulate_x2(rms_norm_x2(xs[i], ws[i], r), ss[i], ts[i]);
    }
};

// silu(gate) * up for a word of two gate and two up values, silu evaluated (torch's formula, fp32 product).
struct SiluEvaluated {
    static __device__ __forceinline__ u32 times(u32 gate, u32 up) { return swiglu_evaluated_x2(gate, up); }
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

// What the SwiGLU sources share: rows addressed as plain rows (gate half first), scales stored with evict_last. They
// read fc1's output (2.2 GB at H3's shapes) through L1, as PlainSource does: with L1::no_allocate the table pack ran
// 0.645 ms on the H200, through L1 0.597 ms (benchmarks/h200-load-path-sweep.json run 1); the modulate packs gain
// nothing from it and keep the streaming loads.
struct SwigluRows {
    static constexpr bool kScaleEvictLast = SWIGLU_SCALE_EVICT_LAST;
    static constexpr bool kPairedRows = false;
    static constexpr u32 kSegmentSteps = 0;
    using Row = PlainSource::Row;
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) { return PlainSource::row(p, r); }
};

// The same with a window of the table (nvfp4_common.cuh swiglu_window_x8), 12 KB of shared memory: several CTAs
// per SM fit, and so does sm_120's shared memory. Its four loads first, then the window test for all 16 gates.
extern __shared__ __align__(16) u16 silu_window_shared[];

struct SwigluWindowSource : SwigluRows {
    static __device__ __forceinline__ void load16(const SourceParams& p, const Row& r, i64 col, u32 w[8]) {
        const u16* base = r.x + col;
        const u32x4 g0 = load_16B(base), g1 = load_16B(base + 8);
        const u32x4 u0 = load_16B(base + p.up_offset), u1 = load_16B(base + p.up_offset + 8);
        const u32 g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        const u32 u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
        swiglu_window_x8(g, u, silu_window_shared, w);
    }
};

// A 16-value block of any source: two 8-value loads, unless the source loads whole blocks.
template <class Source>
__device__ __forceinline__ void load_block16(const SourceParams& p, const typename Source::Row& r, i64 col, u32 w[8]) {
    Source::load(p, r, col, w);
    Source::load(p, r, col + 8, w + 4);
}
template <>
__device__ __forceinline__ void load_block16<SwigluWindowSource>(const SourceParams& p, const SwigluWindowSource::Row& r,
                                                                 i64 col, u32 w[8]) {
    SwigluWindowSource::load16(p, r, col, w);
}

template <class Silu>
struct SwigluSource : SwigluRows {
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        const u16* base = r.x + col;
        u32x4 g = load_16B(base);
        u32x4 u = load_16B(base + p.up_offset);
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
                Source::load(s, Source::row(s, (i64)row), (i64)(c - row * chunks_per_row) * 8, w[i]);
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


// SwiGLU global scale without evaluating silu where it cannot matter. |h| = |bf16(bf16(silu(g)) u)| <= bf16(|g u|):
// |silu(g)| <= |g| (torch's IEEE division by 1 + exp(-g) >= 1 cannot round above the representable |g|, nor can the
// bf16 rounding of silu), the product of two bf16 values is exact in fp32, and rounding is monotone. So a pair of
// elements whose bf16x2 product magnitudes (one fma.rn.bf16x2; |.| patterns order NaN above inf) are both <= the
// thread's running max cannot change it; only the others (every NaN or inf among them) are evaluated exactly. The
// result is the exact amax, at the cost of reading the input (H200, fc1's output: 2.40e8 instructions, 0.503 ms, where
// an fp32 bound with a 2^-6 margin took 3.06e8 and 0.512 ms). SWIGLU_ABSMAX_ITEMS chunks of gate and up per thread
// are in flight (3: 40 registers, 3 CTAs of 512 per SM; ncu 0.505 -> 0.499 ms against 1, 2 and 4 within 1%).
__device__ __forceinline__ void absmax_swiglu_body(const AbsmaxParams& p) {
    const SourceParams& s = p.src;
    const u32 chunks_per_row = (u32)(s.cols / 8);
    const u32 total = (u32)s.rows * chunks_per_row;
    const u32 stride = gridDim.x * blockDim.x;
    u32 acc = 0;
    for (u32 base = blockIdx.x * blockDim.x * SWIGLU_ABSMAX_ITEMS + threadIdx.x; base < total; base += stride * SWIGLU_ABSMAX_ITEMS) {
        u32 gw[SWIGLU_ABSMAX_ITEMS][4], uw[SWIGLU_ABSMAX_ITEMS][4];
#pragma unroll
        for (int i = 0; i < SWIGLU_ABSMAX_ITEMS; ++i) {
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
        for (int i = 0; i < SWIGLU_ABSMAX_ITEMS; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // |h| <= bf16(|g u|) (see above), one bf16x2 product for both elements; their |.| patterns (NaN
                // above inf) against the running max, which acc holds in both halves
                const u32 bound = bf16x2_mul(gw[i][j], uw[i][j]) & 0x7FFF7FFFu;
                if (__vmaxu2(bound, acc) != acc) {
                    const u32 m = abs_bits_max_x2(acc, swiglu_evaluated_x2(gw[i][j], uw[i][j]));
                    const u32 r = max(m & 0xFFFFu, m >> 16);
                    acc = r | (r << 16);
                }
            }
        }
    }
    absmax_finish<ABSMAX_THREADS>(p.out, acc);
}

// ---- pack ------------------------------------------------------------------------------------------------

// A 32-byte sector of the swizzled scales holds the words of 8 rows (r..r+7 of each 32-row quarter), written by 8
// warps at about the same time. Under a long input stream (the SwiGLU pack reads 2.2 GB) L2 evicts some sectors
// half written, and each costs a DRAM read-modify-write: there the bytes go out with L2 evict_last (H200, SwiGLU
// pack at H3's fc2: 0.679 -> 0.633-0.644 ms, and 13 MB less DRAM traffic; the packs of 5376 / 7168 columns gain
// nothing and keep plain stores; benchmarks/h200-scale-store-sweep.json runs 3, 6, 9). One
// wave of rows later, when those warps are done, release_scale_lines returns the lines to normal priority, so they
// do not hold L2 after the pack.
template <bool EvictLast>
__device__ __forceinline__ void store_scale_byte(u8* p, u32 byte) {
    if (EvictLast) {
        asm volatile("{ .reg .b64 pol;\n"
                     "  createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
                     "  st.global.L2::cache_hint.u8 [%0], %1, pol; }" :: "l"(p), "r"(byte) : "memory");
    } else {
        asm volatile("st.global.u8 [%0], %1;" :: "l"(p), "r"(byte) : "memory");
    }
}
// The warp of the first row of each 8 x 4 group (row % 128 in {0, 8, 16, 24}) releases the group's lines: one 128-byte
// line per 512-byte column-group tile.
NVFP4_DEVICE void release_scale_lines(u8* scales, u32 row, u32 scale_groups, u32 lane) {
    if ((row & 0x67u) != 0) return;
    const u8* line = scales + swizzled_scale_offset32(row, 0, scale_groups * 4);
    for (u32 c = lane; c < scale_groups; c += 32) {
        asm volatile("applypriority.global.L2::evict_normal [%0], 128;" :: "l"(line + 512 * c) : "memory");
    }
}

template <class Source, int Items>
__device__ __forceinline__ void pack_body(const PackParams& p) {
    const SourceParams& s = p.src;
    const u32 lanes_per_row = (u32)p.groups * 4;
    const u32 cols = (u32)s.cols, rows = (u32)s.rows, rows16 = (u32)p.rows16, rows128 = (u32)p.rows128;
    const u32 scale_groups = (u32)p.groups;
    const float g = p.global_scale[0], rcp_g = rcp_approx_ftz(g);
    const u32 lane = threadIdx.x & 31;
    // A warp's unit of work: one row (32 lanes), or two rows of 16 lanes each for the sources with kPairedRows,
    // whole or kSegmentSteps steps of them (0: whole rows). Paired units are taken from the end of the tensor,
    // where the kernel before left data in L2.
    constexpr u32 RowLanes = Source::kPairedRows ? 16 : 32, RowsPerWarp = Source::kPairedRows ? 2 : 1;
    constexpr u32 StepLanes = RowLanes * Items;  // blocks of a row per step
    const u32 sublane = lane % RowLanes;
    const u32 row_units = rows128 / RowsPerWarp;  // rows128 is a multiple of 128
    // segments only where a row pair splits into whole ones (a partial step as a unit of its own: the plain pack at
    // K = 5376 2% slower than with whole pairs)
    u32 seg_lanes = lanes_per_row, segments = 1;
    if (Source::kSegmentSteps && lanes_per_row % (Source::kSegmentSteps * StepLanes) == 0) {
        seg_lanes = Source::kSegmentSteps * StepLanes;
        segments = lanes_per_row / seg_lanes;
    }
    const u32 units = row_units * segments;
    const u32 warps_total = gridDim.x * (blockDim.x >> 5);
    if (p.alpha_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) p.alpha_out[0] = __fmul_rn(g, p.weight_scale_2[0]);

    u32 i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
#define PACK_UNIT(i) (Source::kPairedRows ? row_units - 1 - (i) : (i))
    for (; i < units; i += warps_total) {
        if (Source::kScaleEvictLast && i >= warps_total)
            release_scale_lines(p.scales, PACK_UNIT(i - warps_total) * RowsPerWarp, scale_groups, lane);
        const u32 row_unit = Source::kSegmentSteps ? i / segments : i;
        const u32 seg_begin = Source::kSegmentSteps ? (i - row_unit * segments) * seg_lanes : 0u;
        const u32 seg_end = Source::kSegmentSteps ? seg_begin + seg_lanes : lanes_per_row;
        const u32 row = PACK_UNIT(row_unit) * RowsPerWarp + lane / RowLanes;
        const bool data_row = row < rows;
        const bool packed_row = row < rows16;
        u8* qrow = p.qdata + (u64)row * (cols / 2);
        u8* srow = p.scales + swizzled_scale_offset32(row, 0, scale_groups * 4);  // + 512 per column group
        // opaque copies: kept in registers instead of being re-derived from the parameters at every store
        asm("mov.b64 %0, %0;" : "+l"(qrow));
        asm("mov.b64 %0, %0;" : "+l"(srow));
        typename Source::Row src_row;  // pad rows have no index, rstd or input row: never read
        if (data_row) src_row = Source::row(s, (i64)row);
        for (u32 c0 = seg_begin; c0 < seg_end; c0 += StepLanes) {
            u32 w[Items][8];
#pragma unroll
            for (int it = 0; it < Items; ++it) {
                const u32 col = (c0 + RowLanes * it + sublane) * 16;
                if (data_row) {  // a lane past the row end loads the row's last block: its results are not stored
                    load_block16<Source>(s, src_row, (i64)min(col, cols - 16), w[it]);
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) w[it][j] = 0;
                }
            }
#pragma unroll
            for (int it = 0; it < Items; ++it) {
                if (c0 + RowLanes * it >= seg_end) break;  // warp-uniform: no block of this unit left (row tail)
                const u32 c = c0 + RowLanes * it + sublane;
                const u32 col = c * 16;
                u32 block_scale, lo, hi;
                quantize_block16(w[it], g, rcp_g, block_scale, lo, hi);
                const bool in_cols = col < cols;
                if (c >= seg_end) continue;
                if (packed_row && in_cols) {
                    asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(qrow + 8 * c), "r"(lo), "r"(hi) : "memory");
                }
                // each lane stores its own scale byte: the 4 lanes of a group write one 4-byte word of one sector in
                // the same instruction, as a single word store would (no shuffles)
                store_scale_byte<Source::kScaleEvictLast>(srow + 512 * (c >> 2) + (lane & 3),
                                                          (in_cols && packed_row) ? block_scale : 0u);
            }
        }
    }
    if (Source::kScaleEvictLast && i >= warps_total)
        release_scale_lines(p.scales, PACK_UNIT(i - warps_total) * RowsPerWarp, scale_groups, lane);
#undef PACK_UNIT
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

// One warp per row, 256 columns per chunk: in chunk c lane p holds columns 256 c + 8 p .. + 7, i.e. the 4-element
// vectors of torch's logical threads 64 (c % 2) + 2p and 64 (c % 2) + 2p + 1 (a 512-column step of torch's 128
// threads is two chunks), so every load and store instruction of a warp covers 512 contiguous bytes. rstd needs
// the whole row before any normalized value can be formed: the amax pass reads the row from the warp's slice of
// shared memory (ROW_NORM_MAX_STEPS * 1 KB), where the first pass left it; each lane only ever touches its own
// chunks there, so no barrier is needed.
//
// Latency. The residual kernels (below) copy the next row's x and other into shared memory with cp.async while they
// finish the current row, and issue their L2 loads (gate, norm weight, modulation rows) RESIDUAL_NORM_BATCH /
// RESIDUAL_AMAX_BATCH chunks at a time. Measured on the H200 at 37,810 x 5376 (benchmarks/README.md): one chunk
// at a time into registers 0.41-0.49 ms, the cp.async row copy 0.39 ms, and two warps per row 0.38 ms. Also
// slower there: the whole row in registers (177 registers, 1.6x) and re-reading it from L2 (45% of the rows
// evicted first, +0.18 GB). The non-residual kernels load x into registers ROW_NORM_BATCH chunks at a time.
#define ROW_NORM_CHUNKS (2 * ROW_NORM_MAX_STEPS)
#define ROW_NORM_STAGE_WORDS (ROW_NORM_MAX_STEPS * 256)  // one staged row, bf16x2 words
#if ROW_NORM_BATCH % 2
#error "ROW_NORM_BATCH must be even (a batch starts at an even chunk: the partial sums are indexed by c % 2)"
#endif
extern __shared__ __align__(16) u32 row_shared[];

// Sums of squares of torch's logical threads 2p + j (+ 64 in odd chunks) over one chunk: 4 elements each, in order.
NVFP4_DEVICE void add_squares(const u32 w[4], float sums[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float e0 = bf16_lo(w[2 * j]), e1 = bf16_hi(w[2 * j]);
        const float e2 = bf16_lo(w[2 * j + 1]), e3 = bf16_hi(w[2 * j + 1]);
        float& s = sums[j];
        s = __fmaf_rn(e0, e0, s);
        s = __fmaf_rn(e1, e1, s);
        s = __fmaf_rn(e2, e2, s);
        s = __fmaf_rn(e3, e3, s);
    }
}

// torch's warp tree on logical lanes 2q + j (q = lane % 16) for N / 2 pairs of partials: offsets 16, 8, 4, 2 are
// shuffles by 8, 4, 2, 1 lanes inside each half-warp; offset 1 adds the two partials of a pair (the caller).
template <int N>
__device__ __forceinline__ void half_warp_tree(float part[N]) {
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
#pragma unroll
        for (int j = 0; j < N; ++j) part[j] = __fadd_rn(part[j], __shfl_down_sync(0xFFFFFFFFu, part[j], off, 16));
    }
}

// torch's rstd = rsqrt.approx(S / K + eps) from the row's sum of squares S.
NVFP4_DEVICE float torch_rstd_of(float total, float n_f, float eps) {
    float rstd;
    asm("rsqrt.approx.f32 %0, %1;" : "=f"(rstd) : "f"(__fadd_rn(__fdiv_rn(total, n_f), eps)));
    return rstd;
}

// torch's rstd from the four partial sums every lane holds (part[2 * odd + j]: logical thread 64 odd + 2p + j).
NVFP4_DEVICE float torch_rstd(float part[4], float n_f, float eps) {
    half_warp_tree<4>(part);
    // lane 0 holds torch's warps 0 (even chunks) and 2 (odd chunks), lane 16 warps 1 and 3: S = (W0 + W2) + (W1 + W3)
    const float pair = __fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3]));
    float total = __fadd_rn(pair, __shfl_down_sync(0xFFFFFFFFu, pair, 16));
    return torch_rstd_of(__shfl_sync(0xFFFFFFFFu, total, 0), n_f, eps);
}

// ---- the amax pass, skipping what cannot matter ------------------------------------------------------------
// The next projection's global scale is max |h| over the tensor, h = modulate(rms_norm(x)) =
// bf16(bf16(n s1) + shift), n = bf16(w (rstd x)), s1 = bf16(1 + scale). Per modulation row, h3_modulation_bounds
// stores T = |w| |s1| per column (exact in fp32, rounded up to bf16) and S = max |shift| per 8 columns. Every h
// of 8 columns then satisfies
//   |h| <= (rstd max|x T| (1 + 2^-24)^2 (1 + 2^-8)^2 + S) (1 + 2^-8)
// (two fp32 products, then three bf16 roundings, each of relative error <= 2^-8). The kernels take max|x T| in
// bf16x2 (one more rounding), evaluate the bound with margin (factors 1.04 and 1.01; 2^-126 added to max|x T|
// before the multiply by rstd and 2^-120 at the end cover subnormal roundings, whose error is absolute; a T that
// underflowed is harmless as rstd |x| <= sqrt(K)) and evaluate exactly only the chunks whose bound is not below the
// running max. A NaN or inf anywhere makes the bound NaN or inf (max.NaN keeps NaN), which fails the test, and a
// running max of 0 skips nothing. The result is the exact amax; how much is skipped depends on the data.
NVFP4_DEVICE u32 load_2B(const u16* p) {
    u16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
NVFP4_DEVICE float running_max_of(u32 acc) { return bf16_to_f32((u16)max(acc & 0xFFFFu, acc >> 16)); }
NVFP4_DEVICE u32 bf16x2_max_nan(u32 a, u32 b) {
    u32 r;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// One bf16 rounding of |x| t per half.
NVFP4_DEVICE u32 bf16x2_abs_mul(u32 x, u32 t) {
    u32 r;
    asm("{ .reg .b32 a;\n"
        "  abs.bf16x2 a, %1;\n"
        "  fma.rn.bf16x2 %0, a, %2, %3; }" : "=r"(r) : "r"(x), "r"(t), "r"(BF16X2_NEG_ZERO));
    return r;
}

extern "C" __global__ void __launch_bounds__(256) h3_modulation_bounds(const ModBoundsParams p) {
    const u32 groups = (u32)(p.cols / 8), total = (u32)p.table_rows * groups;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const u32 r = i / groups, col = (i - r * groups) * 8;
        const u32x4 wv = load_16B(p.norm_weight + col);
        const u32x4 sv = load_16B(p.mod_scale + (i64)r * p.mod_row_stride + col);
        const u32x4 hv = load_16B(p.mod_shift + (i64)r * p.mod_row_stride + col);
        const u32 ws[4] = {wv.x, wv.y, wv.z, wv.w}, ss[4] = {sv.x, sv.y, sv.z, sv.w}, hs[4] = {hv.x, hv.y, hv.z, hv.w};
        u32 t[4], s_abs = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 w = ws[j] & 0x7FFF7FFFu, s1 = bf16x2_add(BF16X2_ONE, ss[j]) & 0x7FFF7FFFu;
            u32 half16[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // a product of two bf16 is exact in fp32; rounded up to bf16 on its bit pattern, NaN kept NaN
                const u32 bits = __float_as_uint(__fmul_rn(h ? bf16_hi(w) : bf16_lo(w), h ? bf16_hi(s1) : bf16_lo(s1)));
                half16[h] = bits > 0x7F800000u ? 0x7FC0u : (bits + 0xFFFFu) >> 16;
            }
            t[j] = half16[0] | (half16[1] << 16);
            s_abs = abs_bits_max_x2(s_abs, hs[j]);
        }
        store_16B(p.bound_scale + (i64)r * p.cols + col, u32x4{t[0], t[1], t[2], t[3]});
        p.bound_shift[i] = (u16)max(s_abs & 0xFFFFu, s_abs >> 16);
    }
}

// The amax pass over a warp's staged chunks c = Step k + first (the whole row: Step 1; half a row: Step 2), chunk k
// staged at word 128 k: the bounds of Batch chunks loaded at a time, the exact value only where a bound requires it.
template <int Batch, int Step>
__device__ __forceinline__ u32 bounded_amax(u32 acc, const u32* staged, const RowNormParams& p, i64 m, float rstd,
                                            u32 first, u32 lane) {
    constexpr int Chunks = ROW_NORM_CHUNKS / Step;
    constexpr u32 ColStep = 256 * Step;  // columns from one of the warp's chunks to the next
    const u32 cols = (u32)p.cols;
    // per-lane pointers, advanced a batch at a time: the offsets inside a batch are immediates of the loads
    u32 col0 = 256u * first + 8u * lane;
    const u16* t_ptr = p.bound_scale + m * (i64)cols + col0;
    const u16* s_ptr = p.bound_shift + m * (i64)(cols / 8) + col0 / 8;
    const u32* x_ptr = staged + 4 * lane;
    float running = running_max_of(acc);
#pragma unroll 1
    for (int k0 = 0; k0 < Chunks; k0 += Batch, col0 += Batch * ColStep, t_ptr += Batch * ColStep,
                                   s_ptr += Batch * ColStep / 8, x_ptr += 128 * Batch) {
        u32x4 tv[Batch];
        u32 sv[Batch];
#pragma unroll
        for (int b = 0; b < Batch; ++b) {
            if (k0 + b < Chunks && col0 + b * ColStep < cols) {  // cols % 16 == 0: a lane's 8 are in or out
                tv[b] = load_16B(t_ptr + b * ColStep);
                sv[b] = load_2B(s_ptr + b * ColStep / 8);
            }
        }
#pragma unroll
        for (int b = 0; b < Batch; ++b) {
            const u32 col = col0 + b * ColStep;
            if (k0 + b >= Chunks || col >= cols) continue;
            const u32x4 xv = *reinterpret_cast<const u32x4*>(x_ptr + 128 * b);
            const u32 xs[4] = {xv.x, xv.y, xv.z, xv.w};
            const u32 xt = bf16x2_max_nan(bf16x2_max_nan(bf16x2_abs_mul(xs[0], tv[b].x), bf16x2_abs_mul(xs[1], tv[b].y)),
                                          bf16x2_max_nan(bf16x2_abs_mul(xs[2], tv[b].z), bf16x2_abs_mul(xs[3], tv[b].w)));
            const float xt_max = bf16_lo(bf16x2_max_nan(xt, xt >> 16));
            const float bound = __fmaf_rn(__fmaf_rn(__fmul_rn(rstd, __fadd_rn(xt_max, 0x1p-126f)), 1.04f, bf16_to_f32((u16)sv[b])),
                                          1.01f, 0x1p-120f);
            if (!(bound < running)) {  // rare: the exact values
                const u32x4 nw = load_16B(p.norm_weight + col);
                const u32x4 sc = load_16B(p.mod_scale + m * p.mod_row_stride + col);
                const u32x4 sh = load_16B(p.mod_shift + m * p.mod_row_stride + col);
                const u32 ws[4] = {nw.x, nw.y, nw.z, nw.w}, ss[4] = {sc.x, sc.y, sc.z, sc.w}, ts[4] = {sh.x, sh.y, sh.z, sh.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) acc = abs_bits_max_x2(acc, modulate_x2(rms_norm_x2(xs[i], ws[i], rstd), ss[i], ts[i]));
                running = running_max_of(acc);
            }
        }
    }
    return acc;
}

// The warp's running max in every lane (unsigned max of |h| bit patterns: NaN stays on top).
NVFP4_DEVICE u32 warp_running_max(u32 acc) {
    u32 m = max(acc & 0xFFFFu, acc >> 16), r;
    asm("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(m));
    return r;
}

// Statistics of x itself (no residual): x loaded into registers ROW_NORM_BATCH chunks at a time.
template <bool Amax>
__device__ __forceinline__ void row_norm_body(const RowNormParams& p) {
    const u32 lane = threadIdx.x & 31;
    const u32 cols = (u32)p.cols, rows = (u32)p.rows;
    const u32 warps_total = gridDim.x * (blockDim.x >> 5);
    u32 acc = 0;  // amax of |h| as bf16x2 bit patterns (NaN above inf)
    u32* staged = row_shared + (threadIdx.x >> 5) * ROW_NORM_STAGE_WORDS;

    for (u32 row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps_total) {
        const u16* xrow = p.x + (i64)row * p.x_row_stride;
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
        for (int c0 = 0; c0 < ROW_NORM_CHUNKS; c0 += ROW_NORM_BATCH) {
            u32x4 xv[ROW_NORM_BATCH];
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {  // all loads of the batch first
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b < ROW_NORM_CHUNKS && col < cols) xv[b] = load_16B(xrow + col);
            }
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b >= ROW_NORM_CHUNKS || col >= cols) continue;
                const u32 w[4] = {xv[b].x, xv[b].y, xv[b].z, xv[b].w};
                add_squares(w, part + 2 * (b & 1));
                if (Amax) *reinterpret_cast<u32x4*>(staged + 4 * (32 * (c0 + b) + lane)) = xv[b];  // = col / 2
            }
        }
        const float rstd = torch_rstd(part, (float)cols, p.eps);
        if (lane == 0) p.rstd[row] = rstd;
        if (Amax) acc = warp_running_max(bounded_amax<ROW_NORM_BATCH, 1>(acc, staged, p, (i64)p.mod_index[row], rstd, 0, lane));
    }
    if (Amax) absmax_finish<ROW_NORM_THREADS>(p.out, acc);
}

// ---- the residual kernels: two warps per row ----------------------------------------------------------------
// Warp h (h = 0, 1) of a CTA takes the chunks c = 2k + h of the CTA's row, i.e. torch's warps 2h and 2h + 1, and
// stages its half of x and other (k-th chunk at word 128 k); after the tree each warp holds two of torch's four
// warp sums, exchanged through shared memory, and both form S = (W0 + W2) + (W1 + W3). Half a row per warp halves
// each warp's chain of L2 round trips and the shared memory per warp (11 KB: 20 warps per H200 SM).
#define HALF_ROW_WORDS (ROW_NORM_MAX_STEPS * 128)
#if RESIDUAL_NORM_THREADS != 64
#error "the residual kernels run one row per CTA of two warps"
#endif

// This lane's chunks of one half row, global -> shared (16-byte cp.async each).
NVFP4_DEVICE void copy_half_row_async(u32 shared_addr, const u16* src, u32 half, u32 lane, u32 cols) {
#pragma unroll
    for (int k = 0; k < ROW_NORM_MAX_STEPS; ++k) {
        const u32 col = 256u * (2 * k + half) + 8u * lane;
        if (col < cols) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(shared_addr + 16 * (32 * k + lane)), "l"(src + col) : "memory");
    }
}
NVFP4_DEVICE void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
NVFP4_DEVICE void wait_copies() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// x[r] += other[r] * gate[m], then the statistics (and the amax) of the new x. The next row's x and other are copied
// into shared memory while the current one is finished (other during the statistics and amax pass, x after it).
template <bool Amax>
__device__ __forceinline__ void residual_norm_body(const RowNormParams& p) {
    const u32 lane = threadIdx.x & 31, half = threadIdx.x >> 5;
    const u32 cols = (u32)p.cols, rows = (u32)p.rows;
    u32 acc = 0;
    u32* staged = row_shared + half * (2 * HALF_ROW_WORDS);  // x, updated in place, then read by the amax pass
    const u32* other_staged = staged + HALF_ROW_WORDS;
    const u32 x_shared = (u32)__cvta_generic_to_shared(staged), other_shared = x_shared + 4 * HALF_ROW_WORDS;
    __shared__ float warp_sums[2][2][2];  // [row parity][half][torch warp 2 half + (0, 1)]
    __shared__ u32 warp_amax[2][2];       // [row parity][half]

    // The CTAs walk the rows from the last one back (row rows - 1 - r for r = CTA + k * grid): the GEMM before wrote
    // `other`'s last rows last, and part of them is still in L2 (H200, right after a bf16 GEMM of the out_proj shape:
    // 0.356-0.360 -> 0.350-0.351 ms; in the whole block within run-to-run noise; benchmarks/README.md).
#define ROW_AT(r) (rows - 1 - (r))
    u32 row = blockIdx.x, parity = 0;
    if (row < rows) {
        copy_half_row_async(x_shared, p.x + (i64)ROW_AT(row) * p.x_row_stride, half, lane, cols);
        copy_half_row_async(other_shared, p.other + (i64)ROW_AT(row) * p.other_row_stride, half, lane, cols);
    }
    commit_copies();
    for (; row < rows; row += gridDim.x, parity ^= 1) {
        const u32 next = row + gridDim.x;
        u16* xrow = p.x + (i64)ROW_AT(row) * p.x_row_stride;
        const i64 m = (i64)p.mod_index[ROW_AT(row)];
        const u16* grow = p.gate + m * p.gate_row_stride;
        float part[2] = {0.0f, 0.0f};  // torch's logical threads 64 half + 2 lane + j
        wait_copies();  // this row's x and other (the lane's own chunks)
#pragma unroll 1
        for (int k0 = 0; k0 < ROW_NORM_MAX_STEPS; k0 += RESIDUAL_NORM_BATCH) {
            u32x4 gv[RESIDUAL_NORM_BATCH];
#pragma unroll
            for (int b = 0; b < RESIDUAL_NORM_BATCH; ++b) {
                const u32 col = 256u * (2 * (k0 + b) + half) + 8u * lane;
                if (k0 + b < ROW_NORM_MAX_STEPS && col < cols) gv[b] = load_16B(grow + col);
            }
#pragma unroll
            for (int b = 0; b < RESIDUAL_NORM_BATCH; ++b) {
                const u32 col = 256u * (2 * (k0 + b) + half) + 8u * lane;
                if (k0 + b >= ROW_NORM_MAX_STEPS || col >= cols) continue;
                const u32 slot = 4 * (32 * (k0 + b) + lane);
                const u32x4 xv = *reinterpret_cast<const u32x4*>(staged + slot);
                const u32x4 ov = *reinterpret_cast<const u32x4*>(other_staged + slot);
                u32 w[4] = {xv.x, xv.y, xv.z, xv.w};
                const u32 os[4] = {ov.x, ov.y, ov.z, ov.w}, gs[4] = {gv[b].x, gv[b].y, gv[b].z, gv[b].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // torch's addcmul_: see gated_add
                    w[i] = pack_bf16x2(gated_add(bf16_lo(w[i]), bf16_lo(os[i]), bf16_lo(gs[i])),
                                       gated_add(bf16_hi(w[i]), bf16_hi(os[i]), bf16_hi(gs[i])));
                }
                const u32x4 r = u32x4{w[0], w[1], w[2], w[3]};
                store_16B(xrow + col, r);
                add_squares(w, part);
                if (Amax) *reinterpret_cast<u32x4*>(staged + slot) = r;
            }
        }
        if (next < rows) copy_half_row_async(other_shared, p.other + (i64)ROW_AT(next) * p.other_row_stride, half, lane, cols);
        if (!Amax && next < rows) copy_half_row_async(x_shared, p.x + (i64)ROW_AT(next) * p.x_row_stride, half, lane, cols);
        commit_copies();
        // lane 0 ends with torch's warp 2 half, lane 16 with warp 2 half + 1
        half_warp_tree<2>(part);
        const float sum = __fadd_rn(part[0], part[1]);
        if (lane == 0 || lane == 16) warp_sums[parity][half][lane >> 4] = sum;
        if (Amax) {  // the CTA's running max so far, for the bounds of this row
            const u32 warp_max = warp_running_max(acc);
            if (lane == 0) warp_amax[parity][half] = warp_max;
        }
        __syncthreads();  // both halves' sums (a row's slots are rewritten two rows later, after another barrier)
        if (Amax) acc = max(warp_amax[parity][0], warp_amax[parity][1]);
        const float total = __fadd_rn(__fadd_rn(warp_sums[parity][0][0], warp_sums[parity][1][0]),
                                      __fadd_rn(warp_sums[parity][0][1], warp_sums[parity][1][1]));
        const float rstd = torch_rstd_of(total, (float)cols, p.eps);
        if (threadIdx.x == 0) p.rstd[ROW_AT(row)] = rstd;
        if (Amax) acc = bounded_amax<RESIDUAL_AMAX_BATCH, 2>(acc, staged, p, m, rstd, half, lane);
        if (Amax && next < rows) copy_half_row_async(x_shared, p.x + (i64)ROW_AT(next) * p.x_row_stride, half, lane, cols);
        commit_copies();
    }
    wait_copies();
    if (Amax) absmax_finish<RESIDUAL_NORM_THREADS>(p.out, acc);
#undef ROW_AT
}

// ---- entry points (one name per variant; kernels/runtime.py looks them up by name) -------------------------

extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_plain(const AbsmaxParams p) { absmax_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_modulate(const AbsmaxParams p) { absmax_body<ModulateSource, ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_swiglu(const AbsmaxParams p) { absmax_swiglu_body(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PLAIN_MIN_CTAS) nvfp4_pack_plain(const PackParams p) { pack_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_modulate(const PackParams p) { pack_body<ModulateSource, ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_norm_modulate(const PackParams p) { pack_body<NormModulateSource, ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_swiglu(const PackParams p) { pack_body<SwigluSource<SiluEvaluated>, SWIGLU_ITEMS>(p); }
// One CTA per SM (the table takes 128 KB of shared memory); kernels/ops.py launches it where that fits.
// The silu table (or its window) into shared memory with every 16-byte copy in flight at once (cp.async), then one
// wait: a load-then-store loop waits for L2 once per iteration (8 times per thread for the 128 KB table).
NVFP4_DEVICE void copy_table_to_shared(void* dst, const u16* table, u32 bytes) {
    const u32 base = (u32)__cvta_generic_to_shared(dst);
    for (u32 i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(base + 16 * i), "l"(table + 8 * i) : "memory");
    }
    commit_copies();
    wait_copies();
    __syncthreads();
}
extern "C" __global__ void __launch_bounds__(SILU_TABLE_THREADS, 1) nvfp4_pack_swiglu_table(const PackParams p) {
    copy_table_to_shared(silu_shared, p.src.silu_table, 2 * 65536);
    pack_body<SwigluSource<SiluLookedUp>, SWIGLU_ITEMS>(p);
}
// Persistent CTAs (kernels/ops.py: the resident count), each copying the 12 KB window once.
extern "C" __global__ void __launch_bounds__(PACK_THREADS, SILU_WINDOW_MIN_CTAS) nvfp4_pack_swiglu_window(const PackParams p) {
    copy_table_to_shared(silu_window_shared, p.src.silu_table, 2 * 2 * SILU_WINDOW);
    pack_body<SwigluWindowSource, SWIGLU_ITEMS>(p);
}
extern "C" __global__ void __launch_bounds__(RESIDUAL_THREADS) h3_gated_residual(const GatedResidualParams p) { gated_residual_body(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) h3_row_norm_stats(const RowNormParams p) { row_norm_body<false>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) h3_row_norm_amax(const RowNormParams p) { row_norm_body<true>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) h3_row_norm_residual_stats(const RowNormParams p) { residual_norm_body<false>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) h3_row_norm_residual_amax(const RowNormParams p) { residual_norm_body<true>(p); }
