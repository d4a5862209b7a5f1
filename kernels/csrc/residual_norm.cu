// Residuals and RMSNorm statistics for the model blocks, and the bounds of the amax pass:
//   fused_gated_residual   x[r] += other[r] * gate[m] in place (ComfyUI's per-segment addcmul_), m = mod_index[r].
//   fused_row_norm_*       RMSNorm statistics of x (optionally first updated by the gated residual): rstd[r] with
//                       torch's CUDA rms_norm arithmetic, and optionally the amax of the modulated, normalized rows
//                       (the next projection's global scale, see packs.cu), so torch's norm never writes its output.
//                       MiniMax H3: the ScaleShift modulation form (nvfp4_common.cuh).
//   fused_row_norm_amax_scale, _norm: the statistics and amax with the ScaleOnly form and without a
//                       modulation (Unmodulated), for Z-Image's blocks.
//   fused_post_norm_residual* Z-Image's sandwich-norm residual, in place:
//                         gated:    x[r] = bf16(x[r] + bf16(gate[m] * bf16(w_o * (rstd_o[r] * other[r]))))
//                         ungated:  x[r] = bf16(x[r] + bf16(w_o * (rstd_o[r] * other[r])))
//                       (ComfyUI's x + apply_gate(tanh(gate), norm2(out)) and x + norm2(out); gate is the table of
//                       tanh(gate) rows torch computed), where rstd_o is torch's rms_norm statistic of the row of
//                       `other` (the norm weight w_o, eps other_eps), computed in the same pass: the row is staged
//                       first, reduced, then combined with x. _stats / _amax_scale / _amax_norm: then the next
//                       norm's statistics of the new x (and the next projection's amax with the ScaleOnly or
//                       Unmodulated form), as fused_row_norm_residual_*. _from: the same out of place, x read from
//                       x_from and the new x written to x (a block's first residual: its input stays as it is).
//   fused_modulation_bounds, _scale, fused_norm_bounds: per modulation row (one row without a modulation),
//                       the bounds that let the amax pass skip columns that cannot raise the maximum (see
//                       bounded_amax), for the ScaleShift, ScaleOnly and Unmodulated forms.
// and for blocks built on LayerNorm (Wan), in bf16 and fp16 (_f16):
//   fused_*layer_norm_* torch's LayerNorm statistics of x (mean[r], rstd[r]: its Welford arithmetic), optionally
//                       after ComfyUI's residual (gated_residual_: addcmul(x, other, gate[m]); add_residual_: x +
//                       other) and with the amax of the next projection's input (the norm modulated by ComfyUI's
//                       addcmul, or with its affine parameters): see "LayerNorm statistics" below.
//   fused_rms_norm_rope*, torch's rms_norm over the whole row in place, then comfy-kitchen's interleaved RoPE (or
//   fused_rms_norm_rows*  none): see "full-width RMSNorm" below.
// Each bf16() below is one round-to-nearest-even where PyTorch rounds, with IEEE fp32 between (no fast math).
//
// torch's rms_norm (vectorized_layer_norm_kernel<BFloat16, float, rms=true>, identical arithmetic in torch 2.9.0 to
// 2.15.0; kernels/cuda_ops.py rms_norm_support and the first-use self-check guard it): one CTA of 128 threads per row;
// logical thread t sums the squares of the 4-element vectors t, t + 128, ... (fma.rn from 0, elements in order);
// a shfl_down tree 16, 8, 4, 2, 1 of add.rn per warp; S = (W0 + W2) + (W1 + W3); var = div.rn(S, float(K));
// rstd = rsqrt.approx.f32(add.rn(var, float(eps))) (non-ftz); n = bf16(mul.rn(w, mul.rn(rstd, x))). Here one warp
// (fused_row_norm_stats / _amax) or two (the residual kernels) hold a row, each lane four or two of torch's logical
// threads (row_norm_body and residual_norm_body say which), so the partial sums and the tree replay torch's exactly.
// The post-norm residual replays it twice per row: for `other` (its norm), then for the new x (the next norm).
//
// Requirements checked on the host (kernels/cuda_ops.py): K % 16 == 0 (% 8 for fused_gated_residual), 16-byte aligned rows
// and tables.
#include "nvfp4_common.cuh"

// Launch shape: kernels/cuda_ops.py (LAUNCH) is the one source of these values and passes them as -D options.
#if !defined(RESIDUAL_THREADS) || !defined(ROW_NORM_THREADS) || !defined(ROW_NORM_MAX_STEPS) ||                      \
    !defined(ROW_NORM_BATCH) || !defined(RESIDUAL_NORM_THREADS) || !defined(RESIDUAL_NORM_BATCH) ||                   \
    !defined(RESIDUAL_AMAX_BATCH) || !defined(RESIDUAL_NORM_MIN_CTAS) || !defined(POST_NORM_BATCH) ||                  \
    !defined(ROW_NORM_MIN_CTAS)
#error "kernels/cuda_ops.py passes the launch constants (ROW_NORM_THREADS, ROW_NORM_MAX_STEPS, ...) as -D options"
#endif


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
    const u16* bound_scale;  // amax variants: the modulation bounds of (norm_weight, mod_scale, mod_shift)
    const u16* bound_shift;
    const u16* other_weight; // post-norm residuals: the bf16 [K] weight of the norm of `other`, and its eps
    float other_eps;
    const u16* x_from;       // the _from post-norm residuals: the stream read (row stride x_row_stride); x is written
};

struct ModBoundsParams {
    const u16* norm_weight;  // bf16 [K]
    const u16* mod_scale;    // bf16 modulation rows [R, K], row stride mod_row_stride
    const u16* mod_shift;
    i64 mod_row_stride;
    i64 table_rows;          // R
    i64 cols;                // K
    u16* bound_scale;        // out: bf16 [R, K], |w| |bf16(1 + scale)| rounded up (NaN stays NaN); |w| unmodulated
    u16* bound_shift;        // out: bf16 [R, K / 8], max |shift| of each 8 columns (forms with a shift only)
};

// ---- gated residual --------------------------------------------------------------------------------------

// torch's addcmul_ in fp32 opmath. The product of two bf16 values is exact in fp32, so a fused or a separate
// multiply-add round identically: one rounding of the sum, then one to bf16.
__device__ __forceinline__ float gated_add(float x, float o, float gate) {
    return addcmul_f32(x, o, gate);
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
// RESIDUAL_AMAX_BATCH chunks at a time. At H3's shape each step was faster than loading one chunk at a time into
// registers: the cp.async row copy, then two warps per row (benchmarks/README.md). Slower: the whole row in
// registers (too many registers: fewer warps per SM) and re-reading it from L2 (part of the rows evicted first: more
// DRAM traffic). The non-residual kernels load x into registers ROW_NORM_BATCH chunks at a time.
#define ROW_NORM_CHUNKS (2 * ROW_NORM_MAX_STEPS)
#define ROW_NORM_STAGE_WORDS (ROW_NORM_MAX_STEPS * 256)  // one staged row, bf16x2 words
#if ROW_NORM_BATCH % 2
#error "ROW_NORM_BATCH must be even (a batch starts at an even chunk: the partial sums are indexed by c % 2)"
#endif
extern __shared__ __align__(16) u32 row_shared[];

// Sums of squares of torch's logical threads 2p + j (+ 64 in odd chunks) over one chunk: 4 elements each, in order
// (elements of type E: torch's rms_norm kernel is the same for bf16 and fp16 but for the widening).
template <class E = Bf16>
NVFP4_DEVICE void add_squares(const u32 w[4], float sums[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float e0 = E::lo(w[2 * j]), e1 = E::hi(w[2 * j]);
        const float e2 = E::lo(w[2 * j + 1]), e3 = E::hi(w[2 * j + 1]);
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
// bf16(bf16(n s1) + shift), n = bf16(w (rstd x)), s1 = bf16(1 + scale). Per modulation row, fused_modulation_bounds
// stores T = |w| |s1| per column (exact in fp32, rounded up to bf16) and S = max |shift| per 8 columns. Every h
// of 8 columns then satisfies
//   |h| <= (rstd max|x T| (1 + 2^-24)^2 (1 + 2^-8)^2 + S) (1 + 2^-8)
// (two fp32 products, then three bf16 roundings, each of relative error <= 2^-8). The other forms are special cases
// of this one: ScaleOnly has S = 0 and one rounding fewer, Unmodulated also s1 = 1 (one bounds row, T = |w|); their
// bounds kernels write no S and the passes read none. The kernels take max|x T| in
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

template <class Form>
__device__ __forceinline__ void modulation_bounds_body(const ModBoundsParams& p) {
    const u32 groups = (u32)(p.cols / 8), total = (u32)p.table_rows * groups;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const u32 r = i / groups, col = (i - r * groups) * 8;
        const u32x4 wv = load_16B(p.norm_weight + col);
        u32x4 sv = {0, 0, 0, 0}, hv = {0, 0, 0, 0};
        if (Form::kScale) sv = load_16B(p.mod_scale + (i64)r * p.mod_row_stride + col);
        if (Form::kShift) hv = load_16B(p.mod_shift + (i64)r * p.mod_row_stride + col);
        const u32 ws[4] = {wv.x, wv.y, wv.z, wv.w}, ss[4] = {sv.x, sv.y, sv.z, sv.w}, hs[4] = {hv.x, hv.y, hv.z, hv.w};
        u32 t[4], s_abs = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 w = ws[j] & 0x7FFF7FFFu;
            const u32 s1 = Form::kScale ? bf16x2_add(BF16X2_ONE, ss[j]) & 0x7FFF7FFFu : BF16X2_ONE;
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
        if (Form::kShift) p.bound_shift[i] = (u16)max(s_abs & 0xFFFFu, s_abs >> 16);
    }
}

// The amax pass over a warp's staged chunks c = Step k + first (the whole row: Step 1; half a row: Step 2), chunk k
// staged at word 128 k: the bounds of Batch chunks loaded at a time, the exact value only where a bound requires it.
// Form: the modulation form of the next projection's input; m its modulation row (0 for Unmodulated).
template <int Batch, int Step, class Form>
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
                sv[b] = Form::kShift ? load_2B(s_ptr + b * ColStep / 8) : 0u;
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
                u32x4 sc = {0, 0, 0, 0}, sh = {0, 0, 0, 0};
                if (Form::kScale) sc = load_16B(p.mod_scale + m * p.mod_row_stride + col);
                if (Form::kShift) sh = load_16B(p.mod_shift + m * p.mod_row_stride + col);
                const u32 ws[4] = {nw.x, nw.y, nw.z, nw.w}, ss[4] = {sc.x, sc.y, sc.z, sc.w}, ts[4] = {sh.x, sh.y, sh.z, sh.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) acc = abs_bits_max_x2(acc, Form::apply(rms_norm_x2(xs[i], ws[i], rstd), ss[i], ts[i]));
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

// Statistics of x itself (no residual): x loaded into registers ROW_NORM_BATCH chunks at a time. Form: the
// modulation form of the amax pass.
template <bool Amax, class Form>
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
        if (Amax) {
            const i64 m = Form::kScale ? (i64)p.mod_index[row] : 0;
            acc = warp_running_max(bounded_amax<ROW_NORM_BATCH, 1, Form>(acc, staged, p, m, rstd, 0, lane));
        }
    }
    if (Amax) absmax_finish<ROW_NORM_THREADS>(p.out, acc);
}

// ---- the residual kernels: two warps per row ----------------------------------------------------------------
// Warp h (h = 0, 1) of a CTA takes the chunks c = 2k + h of the CTA's row, i.e. torch's warps 2h and 2h + 1, and
// stages its half of x and other (k-th chunk at word 128 k); after the tree each warp holds two of torch's four
// warp sums, exchanged through shared memory, and both form S = (W0 + W2) + (W1 + W3). Half a row per warp halves
// each warp's chain of L2 round trips and the shared memory per warp (11 KB: 20 warps per SM on sm_90).
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

// What the residual kernels add to x (the Residual policy of residual_norm_body), per bf16x2 word x of the row, o of
// `other`, g of the gate row and w of the norm weight of `other` (post-norm only), rstd_o the row's rstd of `other`:
//   AddcmulResidual         bf16(x + o g): torch's addcmul_ (gated_add), H3's _mod_gate
//   PostNormResidual<true>  bf16(x + bf16(g bf16(w (rstd_o o)))): rms_norm, mul, add (Z-Image's gated residual)
//   PostNormResidual<false> bf16(x + bf16(w (rstd_o o))): rms_norm, add (Z-Image's refiner blocks)
// kGated: the kernel reads the gate rows; kNormsOther: it reduces the staged row of `other` first; kBatch: gate
// (and norm weight) chunks loaded at a time; kFrom: x is read from x_from and the new x written to x (out of place:
// ComfyUI's block returns a new tensor and leaves its input as it is), else x is updated in place.
struct AddcmulResidual {
    static constexpr bool kGated = true, kNormsOther = false, kFrom = false;
    static constexpr int kBatch = RESIDUAL_NORM_BATCH;
    static __device__ __forceinline__ u32 update(u32 x, u32 o, u32 g, u32, float) {
        return pack_bf16x2(gated_add(bf16_lo(x), bf16_lo(o), bf16_lo(g)), gated_add(bf16_hi(x), bf16_hi(o), bf16_hi(g)));
    }
};
template <bool Gated, bool From = false>
struct PostNormResidual {
    static constexpr bool kGated = Gated, kNormsOther = true, kFrom = From;
    static constexpr int kBatch = POST_NORM_BATCH;
    static __device__ __forceinline__ u32 update(u32 x, u32 o, u32 g, u32 w, float rstd_other) {
        const u32 n = rms_norm_x2(o, w, rstd_other);
        return bf16x2_add(x, Gated ? bf16x2_mul(g, n) : n);
    }
};

// Where a residual kernel reads x: the stream it updates, or x_from (Residual::kFrom).
template <class Residual>
NVFP4_DEVICE const u16* stream_source(const RowNormParams& p) { return Residual::kFrom ? p.x_from : p.x; }

// torch's rstd of a staged half row pair: each warp sums the squares of its chunks of the row (chunk k at word
// 128 k of `half_row`), the trees, the two warps' sums exchanged through sums[half][(0, 1)] (one barrier), then
// S = (W0 + W2) + (W1 + W3) as in the statistics of x below.
NVFP4_DEVICE float staged_row_rstd(const u32* half_row, float sums[2][2], u32 half, u32 lane, u32 cols, float eps) {
    float part[2] = {0.0f, 0.0f};  // torch's logical threads 64 half + 2 lane + j
#pragma unroll
    for (int k = 0; k < ROW_NORM_MAX_STEPS; ++k) {
        const u32 col = 256u * (2 * k + half) + 8u * lane;
        if (col >= cols) break;
        const u32x4 v = *reinterpret_cast<const u32x4*>(half_row + 4 * (32 * k + lane));
        const u32 w[4] = {v.x, v.y, v.z, v.w};
        add_squares(w, part);
    }
    half_warp_tree<2>(part);
    const float sum = __fadd_rn(part[0], part[1]);
    if (lane == 0 || lane == 16) sums[half][lane >> 4] = sum;
    __syncthreads();
    const float total = __fadd_rn(__fadd_rn(sums[0][0], sums[1][0]), __fadd_rn(sums[0][1], sums[1][1]));
    return torch_rstd_of(total, (float)cols, eps);
}

// x[r] = Residual::update(x[r], other[r], ...) (x_from[r] in place of x[r] where Residual::kFrom), then the
// statistics (and, Amax, the amax with the modulation form Form) of the new x. The next row's x and other are copied
// into shared memory while the current one is finished (other during the statistics and amax pass, x after it).
template <class Residual, bool Amax, class Form>
__device__ __forceinline__ void residual_norm_body(const RowNormParams& p) {
    const u32 lane = threadIdx.x & 31, half = threadIdx.x >> 5;
    const u32 cols = (u32)p.cols, rows = (u32)p.rows;
    u32 acc = 0;
    u32* staged = row_shared + half * (2 * HALF_ROW_WORDS);  // x, updated in place, then read by the amax pass
    const u32* other_staged = staged + HALF_ROW_WORDS;
    const u32 x_shared = (u32)__cvta_generic_to_shared(staged), other_shared = x_shared + 4 * HALF_ROW_WORDS;
    __shared__ float warp_sums[2][2][2];  // [row parity][half][torch warp 2 half + (0, 1)]
    __shared__ u32 warp_amax[2][2];       // [row parity][half]
    __shared__ float other_sums[2][2][2]; // the same as warp_sums for the norm of `other` (post-norm residuals)

    // The CTAs walk the rows from the last one back (row rows - 1 - r for r = CTA + k * grid): the GEMM before wrote
    // `other`'s last rows last, and part of them is still in L2 (faster right after a bf16 GEMM of the out_proj
    // shape; in the whole block no difference beyond noise; benchmarks/README.md).
#define ROW_AT(r) (rows - 1 - (r))
    u32 row = blockIdx.x, parity = 0;
    if (row < rows) {
        copy_half_row_async(x_shared, stream_source<Residual>(p) + (i64)ROW_AT(row) * p.x_row_stride, half, lane, cols);
        copy_half_row_async(other_shared, p.other + (i64)ROW_AT(row) * p.other_row_stride, half, lane, cols);
    }
    commit_copies();
    for (; row < rows; row += gridDim.x, parity ^= 1) {
        const u32 next = row + gridDim.x;
        u16* xrow = p.x + (i64)ROW_AT(row) * p.x_row_stride;
        const i64 m = (Residual::kGated || (Amax && Form::kScale)) ? (i64)p.mod_index[ROW_AT(row)] : 0;
        const u16* grow = p.gate + m * p.gate_row_stride;
        float part[2] = {0.0f, 0.0f};  // torch's logical threads 64 half + 2 lane + j
        wait_copies();  // this row's x and other (the lane's own chunks)
        float rstd_other = 0.0f;
        if (Residual::kNormsOther) rstd_other = staged_row_rstd(other_staged, other_sums[parity], half, lane, cols, p.other_eps);
#pragma unroll 1
        for (int k0 = 0; k0 < ROW_NORM_MAX_STEPS; k0 += Residual::kBatch) {
            u32x4 gv[Residual::kBatch], wv[Residual::kBatch];
#pragma unroll
            for (int b = 0; b < Residual::kBatch; ++b) {
                const u32 col = 256u * (2 * (k0 + b) + half) + 8u * lane;
                if (k0 + b < ROW_NORM_MAX_STEPS && col < cols) {
                    if (Residual::kGated) gv[b] = load_16B(grow + col);
                    if (Residual::kNormsOther) wv[b] = load_16B(p.other_weight + col);
                }
            }
#pragma unroll
            for (int b = 0; b < Residual::kBatch; ++b) {
                const u32 col = 256u * (2 * (k0 + b) + half) + 8u * lane;
                if (k0 + b >= ROW_NORM_MAX_STEPS || col >= cols) continue;
                const u32 slot = 4 * (32 * (k0 + b) + lane);
                const u32x4 xv = *reinterpret_cast<const u32x4*>(staged + slot);
                const u32x4 ov = *reinterpret_cast<const u32x4*>(other_staged + slot);
                u32 w[4] = {xv.x, xv.y, xv.z, xv.w};
                const u32 os[4] = {ov.x, ov.y, ov.z, ov.w}, gs[4] = {gv[b].x, gv[b].y, gv[b].z, gv[b].w};
                const u32 ws[4] = {wv[b].x, wv[b].y, wv[b].z, wv[b].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) w[i] = Residual::update(w[i], os[i], gs[i], ws[i], rstd_other);
                const u32x4 r = u32x4{w[0], w[1], w[2], w[3]};
                store_16B(xrow + col, r);
                add_squares(w, part);
                if (Amax) *reinterpret_cast<u32x4*>(staged + slot) = r;
            }
        }
        if (next < rows) copy_half_row_async(other_shared, p.other + (i64)ROW_AT(next) * p.other_row_stride, half, lane, cols);
        if (!Amax && next < rows) copy_half_row_async(x_shared, stream_source<Residual>(p) + (i64)ROW_AT(next) * p.x_row_stride, half, lane, cols);
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
        if (Amax) acc = bounded_amax<RESIDUAL_AMAX_BATCH, 2, Form>(acc, staged, p, m, rstd, half, lane);
        if (Amax && next < rows) copy_half_row_async(x_shared, stream_source<Residual>(p) + (i64)ROW_AT(next) * p.x_row_stride, half, lane, cols);
        commit_copies();
    }
    wait_copies();
    if (Amax) absmax_finish<RESIDUAL_NORM_THREADS, Bf16, Residual>(p.out, acc);
#undef ROW_AT
}

// ---- LayerNorm statistics (torch's Welford), after an optional residual update, and the next projection's amax ----
// torch's layer_norm (vectorized_layer_norm_kernel<T, float, rms=false>, T = Half or BFloat16; the arithmetic read
// from its compiled code for sm_90, sm_100 and sm_120 in torch 2.11, scripts/check_torch_release.py layer_norm*):
// one CTA of 128 threads (4 warps) per row; logical thread t folds the elements of its 4-element vectors t, t + 128,
// ... in order into a Welford state {mean, sigma2, count} (welford_add):
//     delta = x - mean;  count = count + 1;  mean = fma(delta, rcp.rn(count), mean);  sigma2 = fma(delta, x - mean, sigma2)
// then a shfl_down tree 16, 8, 4, 2, 1 per warp, each step combining the lower lane B with the upper lane A
// (welford_combine: count = A.count + B.count; if count > 0, with c = rcp.rn(count), nA = A.count c, nB = B.count c,
// delta = B.mean - A.mean: mean = fma(nA, A.mean, nB B.mean), sigma2 = fma(nB, (delta delta) A.count, A.sigma2 +
// B.sigma2); else mean = sigma2 = 0), then the warps W0 = W0 + W2, W1 = W1 + W3, W0 = W0 + W1 (the same combine,
// lower warp as B); var = div.rn(sigma2, float(K)), rstd = rsqrt.approx.f32(var + eps) (non-ftz). The normalized
// value itself is formed where it is used: nvfp4_common.cuh layer_norm_x2 / layer_norm_affine_x2.
// One warp per row, in the chunk mapping of row_norm_body (lane p of chunk c holds the vectors of torch's logical
// threads 64 (c % 2) + 2p + j, j = 0, 1), so the Welford states and the tree replay torch's. The residual variants
// first form the new x with ComfyUI's ops on 16-bit tensors (torch.addcmul(x, other, gate[m]) or x + other: fp32
// opmath, one rounding of the sum to fp32 and one to T) and write it (to x itself or to another buffer); the amax
// variants also stage the row in shared memory and take the amax of the next projection's input (the LayerNorm with
// its affine parameters, or followed by ComfyUI's addcmul modulation) for its dynamic global scale, evaluated at every
// element (no bounds: the row is in shared memory, the work is arithmetic only).
enum ResidualKind { kNoResidual = 0, kGatedResidual = 1, kAddResidual = 2 };
enum AmaxKind { kNoAmax = 0, kModulatedAmax = 1, kAffineAmax = 2 };

struct LayerNormParams {
    const u16* x;            // [rows, cols], elements of the kernel's type
    i64 x_row_stride;
    u16* out;                // residual variants: the new x (x itself for an update in place)
    i64 out_row_stride;
    const u16* other;        // residual variants: the attention / MLP output
    i64 other_row_stride;
    const u16* gate;         // gated residual: gate rows [R, cols]
    i64 gate_row_stride;
    const i32* mod_index;    // table row of each token (gate, modulation scale and shift)
    i64 rows;
    i64 cols;                // a multiple of 16, at most 512 * ROW_NORM_MAX_STEPS
    float eps;
    float* mean;             // out: fp32 [rows]
    float* rstd;             // out: fp32 [rows]
    const u16* norm_weight;  // affine amax: the norm's weight and bias [cols]
    const u16* norm_bias;
    const u16* mod_scale;    // modulated amax: the next projection's modulation rows (scale before the 1 +, shift)
    const u16* mod_shift;
    i64 mod_row_stride;
    GlobalScaleOut out_scale;  // amax variants
};

struct Welford {
    float mean, sigma2, count;
};

// rcp_count: rcp.rn of the count after this element (count_rcp below).
NVFP4_DEVICE void welford_add(Welford& s, float x, float rcp_count) {
    const float delta = __fsub_rn(x, s.mean);
    s.count = __fadd_rn(s.count, 1.0f);
    s.mean = __fmaf_rn(delta, rcp_count, s.mean);
    s.sigma2 = __fmaf_rn(delta, __fsub_rn(x, s.mean), s.sigma2);
}

// rcp.rn(k) of the counts k = 1 .. 4 ROW_NORM_MAX_STEPS a logical thread reaches, once per CTA (the same for every
// thread and row: the element of chunk c at position i is the (4 (c / 2) + i + 1)-th of its logical thread). Taking
// them from a table keeps the reciprocal's slow-path call out of the row loop (registers: it spilled there).
NVFP4_DEVICE void fill_count_rcp(float* count_rcp) {
    for (int i = threadIdx.x; i < 4 * ROW_NORM_MAX_STEPS; i += blockDim.x) count_rcp[i] = __frcp_rn((float)(i + 1));
    __syncthreads();
}

// torch's cuWelfordCombine(dataB = b, dataA = a): b is the lower lane / warp.
NVFP4_DEVICE Welford welford_combine(const Welford& b, const Welford& a) {
    const float count = __fadd_rn(a.count, b.count);
    if (!(count > 0.0f)) return Welford{0.0f, 0.0f, count};
    const float delta = __fsub_rn(b.mean, a.mean), coef = __frcp_rn(count);
    const float na = __fmul_rn(a.count, coef), nb = __fmul_rn(b.count, coef);
    return Welford{__fmaf_rn(na, a.mean, __fmul_rn(nb, b.mean)),
                   __fmaf_rn(nb, __fmul_rn(__fmul_rn(delta, delta), a.count), __fadd_rn(a.sigma2, b.sigma2)), count};
}

// Torch's logical threads 2p + j (+ 64 in odd chunks) over chunk c of element type E: 4 elements each, in order
// (rcp: count_rcp + 4 (c / 2)).
template <class E>
NVFP4_DEVICE void welford_add_chunk(const u32 w[4], Welford states[2], const float* rcp) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        welford_add(states[j], E::lo(w[2 * j]), rcp[0]);
        welford_add(states[j], E::hi(w[2 * j]), rcp[1]);
        welford_add(states[j], E::lo(w[2 * j + 1]), rcp[2]);
        welford_add(states[j], E::hi(w[2 * j + 1]), rcp[3]);
    }
}

NVFP4_DEVICE Welford shfl_down_welford(const Welford& s, int offset, int width) {
    return Welford{__shfl_down_sync(0xFFFFFFFFu, s.mean, offset, width),
                   __shfl_down_sync(0xFFFFFFFFu, s.sigma2, offset, width),
                   __shfl_down_sync(0xFFFFFFFFu, s.count, offset, width)};
}

// The row's statistics from the four states every lane holds (part[2 * odd + j]: logical thread 64 odd + 2p + j), in
// every lane: the tree of half_warp_tree (offsets 16, 8, 4, 2 of torch's warps as shuffles by 8, 4, 2, 1 inside each
// half-warp, offset 1 inside the lane), then torch's warps as in torch_rstd (lane 0 holds warps 0 and 2, lane 16
// warps 1 and 3).
NVFP4_DEVICE Welford torch_welford_row(Welford part[4]) {
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
#pragma unroll
        for (int j = 0; j < 4; ++j) part[j] = welford_combine(part[j], shfl_down_welford(part[j], off, 16));
    }
    const Welford even = welford_combine(part[0], part[1]), odd = welford_combine(part[2], part[3]);
#if defined(NVFP4_PLANT_FAULT) && NVFP4_PLANT_FAULT
    // tests of the self-check only: the warps combined in another order, (W0 + W1) + (W2 + W3), a wrong kernel it
    // must catch
    const Welford total = welford_combine(welford_combine(even, shfl_down_welford(even, 16, 32)),
                                          welford_combine(odd, shfl_down_welford(odd, 16, 32)));
#else
    const Welford pair = welford_combine(even, odd);  // lane 0: W0 + W2, lane 16: W1 + W3
    const Welford total = welford_combine(pair, shfl_down_welford(pair, 16, 32));
#endif
    return Welford{__shfl_sync(0xFFFFFFFFu, total.mean, 0), __shfl_sync(0xFFFFFFFFu, total.sigma2, 0), total.count};
}

// The next projection's input for a word of the staged (normalized) row, its amax folded into acc.
template <class E, int Amax>
__device__ __forceinline__ u32 layer_norm_amax(u32 acc, const u32* staged, const LayerNormParams& p, i64 m,
                                               float mean, float rstd, u32 lane) {
    const u32 cols = (u32)p.cols;
    const u16* a_row = Amax == kModulatedAmax ? p.mod_scale + m * p.mod_row_stride : p.norm_weight;
    const u16* b_row = Amax == kModulatedAmax ? p.mod_shift + m * p.mod_row_stride : p.norm_bias;
#pragma unroll 1
    for (int c0 = 0; c0 < ROW_NORM_CHUNKS; c0 += ROW_NORM_BATCH) {
        u32x4 av[ROW_NORM_BATCH], bv[ROW_NORM_BATCH];
#pragma unroll
        for (int b = 0; b < ROW_NORM_BATCH; ++b) {  // the table loads of the batch first
            const u32 col = 256u * (c0 + b) + 8u * lane;
            if (c0 + b < ROW_NORM_CHUNKS && col < cols) {
                av[b] = load_16B(a_row + col);
                bv[b] = load_16B(b_row + col);
            }
        }
#pragma unroll
        for (int b = 0; b < ROW_NORM_BATCH; ++b) {
            const u32 col = 256u * (c0 + b) + 8u * lane;
            if (c0 + b >= ROW_NORM_CHUNKS || col >= cols) continue;
            const u32x4 xv = *reinterpret_cast<const u32x4*>(staged + 4 * (32 * (c0 + b) + lane));
            const u32 xs[4] = {xv.x, xv.y, xv.z, xv.w}, as[4] = {av[b].x, av[b].y, av[b].z, av[b].w};
            const u32 bs[4] = {bv[b].x, bv[b].y, bv[b].z, bv[b].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 h = Amax == kModulatedAmax
                    ? addcmul_modulate_x2<E>(layer_norm_x2<E>(xs[i], mean, rstd), as[i], bs[i])
                    : layer_norm_affine_x2<E>(xs[i], as[i], bs[i], mean, rstd);
                acc = abs_bits_max_x2(acc, h);
            }
        }
    }
    return acc;
}

template <class E, int Residual, int Amax>
__device__ __forceinline__ void layer_norm_body(const LayerNormParams& p) {
    const u32 lane = threadIdx.x & 31;
    const u32 cols = (u32)p.cols, rows = (u32)p.rows;
    const u32 warps_total = gridDim.x * (blockDim.x >> 5);
    u32 acc = 0;  // amax of |h| as 16-bit pair bit patterns (NaN above inf)
    u32* staged = row_shared + (threadIdx.x >> 5) * ROW_NORM_STAGE_WORDS;
    __shared__ __align__(16) float count_rcp[4 * ROW_NORM_MAX_STEPS];
    fill_count_rcp(count_rcp);

    for (u32 row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps_total) {
        const u16* xrow = p.x + (i64)row * p.x_row_stride;
        u16* orow = Residual != kNoResidual ? p.out + (i64)row * p.out_row_stride : nullptr;
        const u16* yrow = Residual != kNoResidual ? p.other + (i64)row * p.other_row_stride : nullptr;
        const i64 m = (Residual == kGatedResidual || Amax == kModulatedAmax) ? (i64)p.mod_index[row] : 0;
        const u16* grow = Residual == kGatedResidual ? p.gate + m * p.gate_row_stride : nullptr;
        Welford part[4] = {{0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f}};
#pragma unroll 1
        for (int c0 = 0; c0 < ROW_NORM_CHUNKS; c0 += ROW_NORM_BATCH) {
            u32x4 xv[ROW_NORM_BATCH], yv[ROW_NORM_BATCH], gv[ROW_NORM_BATCH];
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {  // all loads of the batch first
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b < ROW_NORM_CHUNKS && col < cols) {
                    // x may be rewritten by this kernel (in place): no read-only (.nc) path then
                    xv[b] = Residual != kNoResidual ? load_16B_coherent(xrow + col) : load_16B(xrow + col);
                    if (Residual != kNoResidual) yv[b] = load_16B_stream(yrow + col);
                    if (Residual == kGatedResidual) gv[b] = load_16B(grow + col);
                }
            }
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b >= ROW_NORM_CHUNKS || col >= cols) continue;
                u32 w[4] = {xv[b].x, xv[b].y, xv[b].z, xv[b].w};
                if (Residual != kNoResidual) {
                    const u32 ys[4] = {yv[b].x, yv[b].y, yv[b].z, yv[b].w}, gs[4] = {gv[b].x, gv[b].y, gv[b].z, gv[b].w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        w[i] = Residual == kGatedResidual
                            ? E::pack(addcmul_f32(E::lo(w[i]), E::lo(ys[i]), E::lo(gs[i])),
                                      addcmul_f32(E::hi(w[i]), E::hi(ys[i]), E::hi(gs[i])))
                            : E::pack(__fadd_rn(E::lo(w[i]), E::lo(ys[i])), __fadd_rn(E::hi(w[i]), E::hi(ys[i])));
                    }
                    store_16B(orow + col, u32x4{w[0], w[1], w[2], w[3]});
                }
                welford_add_chunk<E>(w, part + 2 * (b & 1), count_rcp + 4 * ((c0 + b) >> 1));
                if (Amax != kNoAmax) *reinterpret_cast<u32x4*>(staged + 4 * (32 * (c0 + b) + lane)) = u32x4{w[0], w[1], w[2], w[3]};
            }
        }
        const Welford stats = torch_welford_row(part);
        const float rstd = torch_rstd_of(stats.sigma2, (float)cols, p.eps);
        if (lane == 0) {
            p.mean[row] = stats.mean;
            p.rstd[row] = rstd;
        }
        if (Amax != kNoAmax) acc = warp_running_max(layer_norm_amax<E, Amax>(acc, staged, p, m, stats.mean, rstd, lane));
    }
    if (Amax != kNoAmax) absmax_finish<ROW_NORM_THREADS, E>(p.out_scale, acc);
}

// ---- full-width RMSNorm, then interleaved RoPE, in place ---------------------------------------------------------
// ComfyUI's q / k path of a block that normalizes the whole projection output and rotates adjacent pairs (Wan:
// RMSNorm over the full width, then comfy-kitchen's apply_rope1): n = T(w * (rstd * x)) with torch's rms_norm
// reduction (row_norm_body's mapping and tree, torch_rstd), then for each pair (2i, 2i + 1) of a head, with the
// rotation [[f00, f01], [f10, f11]] of its position and pair (fp32), comfy-kitchen's rope kernel as compiled
// (--use_fast_math, rms_rope.cu rope_kernel<T, float, ...>, read from its SASS for sm_90, sm_100 and sm_120):
//     y0 = T(fma.rn.ftz(n0, f00, mul.ftz(n1, f01)))      y1 = T(fma.rn.ftz(n0, f10, mul.ftz(n1, f11)))
// (n0, n1 widened exactly from T). Without a rope table the kernel only normalizes (a cross-attention q). One warp per
// row (q rows, then k rows), the row staged in shared memory between the reduction and the output pass; one read and
// one write of each element.
struct RmsRopeRowParams {
    u16* q;               // [rows, cols], updated in place
    i64 q_row_stride;
    u16* k;               // the same for k (nullptr: q only)
    i64 k_row_stride;
    i64 rows;
    i64 cols;             // a multiple of 16, at most 512 * ROW_NORM_MAX_STEPS
    const u16* q_weight;  // [cols]
    const u16* k_weight;
    float eps;
    const float* freqs;   // rope: fp32 [positions, head_dim / 2, 2, 2] (the rotation of each position and pair)
    i64 positions;        // tokens of one batch item: row r rotates with position r % positions
    i32 head_dim;         // a multiple of 8 dividing cols
};

struct alignas(16) f32x4 { float x, y, z, w; };

template <class E>
NVFP4_DEVICE u32 rope_pair_x2(u32 n, const f32x4& f) {
    const float n0 = E::lo(n), n1 = E::hi(n);
    float y0, y1;
    asm("{ .reg .f32 t;\n"
        "  mul.ftz.f32 t, %2, %4;\n"
        "  fma.rn.ftz.f32 %0, %1, %3, t; }" : "=f"(y0) : "f"(n0), "f"(n1), "f"(f.x), "f"(f.y));
    asm("{ .reg .f32 t;\n"
        "  mul.ftz.f32 t, %2, %4;\n"
        "  fma.rn.ftz.f32 %0, %1, %3, t; }" : "=f"(y1) : "f"(n0), "f"(n1), "f"(f.z), "f"(f.w));
    return E::pack(y0, y1);
}

template <class E, bool Rope>
__device__ __forceinline__ void rms_norm_rows_body(const RmsRopeRowParams& p) {
    const u32 lane = threadIdx.x & 31;
    const u32 cols = (u32)p.cols, rows = (u32)p.rows, units = p.k != nullptr ? 2 * rows : rows;
    const u32 warps_total = gridDim.x * (blockDim.x >> 5);
    u32* staged = row_shared + (threadIdx.x >> 5) * ROW_NORM_STAGE_WORDS;

    for (u32 unit = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; unit < units; unit += warps_total) {
        const bool is_k = unit >= rows;
        const u32 row = is_k ? unit - rows : unit;
        u16* xrow = is_k ? p.k + (i64)row * p.k_row_stride : p.q + (i64)row * p.q_row_stride;
        const u16* weight = is_k ? p.k_weight : p.q_weight;
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
        for (int c0 = 0; c0 < ROW_NORM_CHUNKS; c0 += ROW_NORM_BATCH) {
            u32x4 xv[ROW_NORM_BATCH];
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b < ROW_NORM_CHUNKS && col < cols) xv[b] = load_16B_coherent(xrow + col);  // rewritten below
            }
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b >= ROW_NORM_CHUNKS || col >= cols) continue;
                const u32 w[4] = {xv[b].x, xv[b].y, xv[b].z, xv[b].w};
                add_squares<E>(w, part + 2 * (b & 1));
                *reinterpret_cast<u32x4*>(staged + 4 * (32 * (c0 + b) + lane)) = xv[b];
            }
        }
        const float rstd = torch_rstd(part, (float)cols, p.eps);
        const f32x4* rotation = Rope ? reinterpret_cast<const f32x4*>(p.freqs) + (i64)(row % (u32)p.positions) * (p.head_dim / 2)
                                     : nullptr;
#pragma unroll 1
        for (int c0 = 0; c0 < ROW_NORM_CHUNKS; c0 += ROW_NORM_BATCH) {
            u32x4 wv[ROW_NORM_BATCH];
            f32x4 fv[ROW_NORM_BATCH][4];
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b < ROW_NORM_CHUNKS && col < cols) {
                    wv[b] = load_16B(weight + col);
                    if (Rope) {
                        const f32x4* f = rotation + (col % (u32)p.head_dim) / 2;  // 4 pairs of one head
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const u32x4 raw = load_16B(f + i);
                            fv[b][i] = f32x4{__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z),
                                             __uint_as_float(raw.w)};
                        }
                    }
                }
            }
#pragma unroll
            for (int b = 0; b < ROW_NORM_BATCH; ++b) {
                const u32 col = 256u * (c0 + b) + 8u * lane;
                if (c0 + b >= ROW_NORM_CHUNKS || col >= cols) continue;
                const u32x4 xv = *reinterpret_cast<const u32x4*>(staged + 4 * (32 * (c0 + b) + lane));
                const u32 xs[4] = {xv.x, xv.y, xv.z, xv.w}, ws[4] = {wv[b].x, wv[b].y, wv[b].z, wv[b].w};
                u32 y[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    y[i] = rms_norm_x2<E>(xs[i], ws[i], rstd);
                    if (Rope) y[i] = rope_pair_x2<E>(y[i], fv[b][i]);
                }
                store_16B(xrow + col, u32x4{y[0], y[1], y[2], y[3]});
            }
        }
    }
}

// Entry points of the LayerNorm statistics (bf16; _f16: fp16), by residual (none, gated_residual_, add_residual_) and
// amax (none, of the modulated normalized rows, of the norm with its affine parameters), and of the full-width
// RMSNorm (+ interleaved RoPE).
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_layer_norm_stats(const LayerNormParams p) { layer_norm_body<Bf16, kNoResidual, kNoAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_layer_norm_modulated_amax(const LayerNormParams p) { layer_norm_body<Bf16, kNoResidual, kModulatedAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_layer_norm_affine_amax(const LayerNormParams p) { layer_norm_body<Bf16, kNoResidual, kAffineAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_gated_residual_layer_norm_stats(const LayerNormParams p) { layer_norm_body<Bf16, kGatedResidual, kNoAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_gated_residual_layer_norm_modulated_amax(const LayerNormParams p) { layer_norm_body<Bf16, kGatedResidual, kModulatedAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_gated_residual_layer_norm_affine_amax(const LayerNormParams p) { layer_norm_body<Bf16, kGatedResidual, kAffineAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_add_residual_layer_norm_stats(const LayerNormParams p) { layer_norm_body<Bf16, kAddResidual, kNoAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_add_residual_layer_norm_modulated_amax(const LayerNormParams p) { layer_norm_body<Bf16, kAddResidual, kModulatedAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_add_residual_layer_norm_affine_amax(const LayerNormParams p) { layer_norm_body<Bf16, kAddResidual, kAffineAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_layer_norm_stats_f16(const LayerNormParams p) { layer_norm_body<F16, kNoResidual, kNoAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_layer_norm_modulated_amax_f16(const LayerNormParams p) { layer_norm_body<F16, kNoResidual, kModulatedAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_layer_norm_affine_amax_f16(const LayerNormParams p) { layer_norm_body<F16, kNoResidual, kAffineAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_gated_residual_layer_norm_stats_f16(const LayerNormParams p) { layer_norm_body<F16, kGatedResidual, kNoAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_gated_residual_layer_norm_modulated_amax_f16(const LayerNormParams p) { layer_norm_body<F16, kGatedResidual, kModulatedAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_gated_residual_layer_norm_affine_amax_f16(const LayerNormParams p) { layer_norm_body<F16, kGatedResidual, kAffineAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_add_residual_layer_norm_stats_f16(const LayerNormParams p) { layer_norm_body<F16, kAddResidual, kNoAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_add_residual_layer_norm_modulated_amax_f16(const LayerNormParams p) { layer_norm_body<F16, kAddResidual, kModulatedAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_add_residual_layer_norm_affine_amax_f16(const LayerNormParams p) { layer_norm_body<F16, kAddResidual, kAffineAmax>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_rms_norm_rope(const RmsRopeRowParams p) { rms_norm_rows_body<Bf16, true>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_rms_norm_rows(const RmsRopeRowParams p) { rms_norm_rows_body<Bf16, false>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_rms_norm_rope_f16(const RmsRopeRowParams p) { rms_norm_rows_body<F16, true>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_rms_norm_rows_f16(const RmsRopeRowParams p) { rms_norm_rows_body<F16, false>(p); }

// ---- entry points (one name per variant; kernels/runtime.py looks them up by name) -------------------------

extern "C" __global__ void __launch_bounds__(RESIDUAL_THREADS) fused_gated_residual(const GatedResidualParams p) { gated_residual_body(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_row_norm_stats(const RowNormParams p) { row_norm_body<false, ScaleShift>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS) fused_row_norm_amax(const RowNormParams p) { row_norm_body<true, ScaleShift>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_row_norm_residual_stats(const RowNormParams p) { residual_norm_body<AddcmulResidual, false, ScaleShift>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_row_norm_residual_amax(const RowNormParams p) { residual_norm_body<AddcmulResidual, true, ScaleShift>(p); }
extern "C" __global__ void __launch_bounds__(256) fused_modulation_bounds(const ModBoundsParams p) { modulation_bounds_body<ScaleShift>(p); }
// Z-Image: the statistics and amax with its modulation forms, and the post-norm residuals (gated: the modulated
// blocks, handing on to a ScaleOnly norm; ungated: the refiner blocks, handing on to an unmodulated norm). A
// residual without a next norm runs the _stats kernel into a scratch rstd (kernels/cuda_ops.py).
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS, ROW_NORM_MIN_CTAS) fused_row_norm_amax_scale(const RowNormParams p) { row_norm_body<true, ScaleOnly>(p); }
extern "C" __global__ void __launch_bounds__(ROW_NORM_THREADS, ROW_NORM_MIN_CTAS) fused_row_norm_amax_norm(const RowNormParams p) { row_norm_body<true, Unmodulated>(p); }
extern "C" __global__ void __launch_bounds__(256) fused_modulation_bounds_scale(const ModBoundsParams p) { modulation_bounds_body<ScaleOnly>(p); }
extern "C" __global__ void __launch_bounds__(256) fused_norm_bounds(const ModBoundsParams p) { modulation_bounds_body<Unmodulated>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_gated_stats(const RowNormParams p) { residual_norm_body<PostNormResidual<true>, false, ScaleOnly>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_gated_amax_scale(const RowNormParams p) { residual_norm_body<PostNormResidual<true>, true, ScaleOnly>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_stats(const RowNormParams p) { residual_norm_body<PostNormResidual<false>, false, Unmodulated>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_amax_norm(const RowNormParams p) { residual_norm_body<PostNormResidual<false>, true, Unmodulated>(p); }
// The same out of place (the first residual of a block: read the block's input from x_from, write a new stream).
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_gated_stats_from(const RowNormParams p) { residual_norm_body<PostNormResidual<true, true>, false, ScaleOnly>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_gated_amax_scale_from(const RowNormParams p) { residual_norm_body<PostNormResidual<true, true>, true, ScaleOnly>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_stats_from(const RowNormParams p) { residual_norm_body<PostNormResidual<false, true>, false, Unmodulated>(p); }
extern "C" __global__ void __launch_bounds__(RESIDUAL_NORM_THREADS, RESIDUAL_NORM_MIN_CTAS) fused_post_norm_residual_amax_norm_from(const RowNormParams p) { residual_norm_body<PostNormResidual<false, true>, true, Unmodulated>(p); }
