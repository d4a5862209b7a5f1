// Fused NVFP4 activation packing for the model blocks: the packs and their global-scale reductions.
//
// Math. Every pack and reduction reads its activation through a *source* that applies the elementwise ops ComfyUI
// runs right before the quantized Linear, so their outputs never go to memory:
//   PlainSource          h = x                                               (out_proj input, generic layers)
//   ModulateSource       h = bf16(bf16(x * bf16(1 + scale[m])) + shift[m])   (adaLN modulation of a norm output)
//   NormalizedSource<F>  n = bf16(w * (rstd[row] * x)), then modulation form F (nvfp4_common.cuh):
//     <ScaleShift>       h = bf16(bf16(n * bf16(1 + scale[m])) + shift[m])   (NormModulateSource: H3's qkv_proj, fc1)
//     <ScaleOnly>        h = bf16(n * bf16(1 + scale[m]))                    (Z-Image's qkv and w1 / w3 inputs)
//     <Unmodulated>      h = n                                               (Z-Image's refiner blocks)
//   SwigluSource         h = bf16(bf16(silu(gate)) * up)                     (fc1 output -> fc2 input)
//     gate and up in one row (UpInRow: H3's fc1 output, gate half first) or in two tensors (UpBeside: Z-Image's
//     w1 and w3 outputs -> w2's input, ComfyUI's F.silu(x1) * x3)
//   PrescaleSource       h = bf16(x * p[c])                                  (AWQ pre_quant_scale of a Linear)
//   LayerNormModulateOf  h = T(shift[m] + n * T(1 + scale[m])), n = T(rstd[row] * (x - mean[row]))   (Wan: q/k/v, ffn.0)
//   LayerNormAffineOf    h = T(fma(w[c], rstd[row] * (x - mean[row]), b[c]))                       (Wan: cross-attn q)
//   GeluOf               h = gelu_tanh(x), looked up in torch's own table                           (Wan: ffn.2)
// with m = mod_index[row] the adaLN modulation row of the token (T: the activation dtype of the LayerNorm block's
// sources, bf16 or fp16; their statistics come from residual_norm.cu layer_norm_*). Each bf16() is one round-to-nearest-even,
// exactly where PyTorch rounds in ComfyUI's stock ops (rms_norm, mul_, add_, silu, mul_), and the fp32 arithmetic
// between them is IEEE (this file is compiled without fast math; _rn intrinsics prevent contraction). The rstd of
// the normalized sources and their global scale come from residual_norm.cu (the row-norm and residual kernels).
//
// Element types. The plain and prescale sources also read fp16 activations (models that compute in fp16, Wan by
// default): PlainOf<F16> and PrescaleOf<F16>, h = fp16(x * p[c]) with p the table cast to fp16, and the global scale
// rounded to fp16 (the _f16 entry points). Each source names its element type (Elem), which selects the
// instructions of the block quantizer and of the global scale (nvfp4_common.cuh Bf16 / F16); the H3 sources
// (modulate, normalized, SwiGLU) read bf16 only; the sources of a LayerNorm block read either (_f16: fp16).
//
//   nvfp4_absmax_*      one pass over h: amax|h| (NaN wins, as torch.amax); the LAST CTA to finish turns it into
//                       the global scale g = fp32(bf16(amax * fp32(1/2688))), writes it to device memory and
//                       re-arms its workspace (absmax_finish, nvfp4_common.cuh). No host sync: the pack kernel reads
//                       g from memory.
//   nvfp4_pack_*        one pass over h: block scales + E2M1 codes (nvfp4_common.cuh), every padding byte written
//                       here (pad rows of qdata, pad rows and columns of the scales), so no zero-fill launch; CTA 0
//                       also writes the GEMM alpha g * weight_scale_2 for comfy-kitchen's device-alpha GEMM. The
//                       SwiGLU pack looks silu up in torch's own table: all 65536 entries (_table, 128 KB of shared
//                       memory) or the 12 KB window (_window, where 128 KB do not fit: sm_120 / sm_121).
//
// Thread mapping of the pack. A warp packs one row (the SwiGLU sources) or two rows, half a warp each (the others:
// kPairedRows), at a time. The padded scale matrix has U = roundup(K/16, 4)/4 column groups per row; a group covers
// 64 input columns and owns 4 contiguous scale bytes of the swizzled layout. Each lane packs one 16-block (two
// 16-byte loads, one block scale, 8 bytes of codes) and stores its scale byte: the 4 lanes of a group write their
// word in one instruction (the same DRAM bytes as gathering the word with two shuffles for one lane to store, and
// fewer instructions). Items blocks per lane are in flight to cover DRAM latency (PLAIN_ITEMS in the plain pack, one
// in the others). Half a warp per row leaves no idle half warp at the end of a row of 336 blocks (K = 5376, qkv_proj
// and fc1: fewer instructions, and faster, also for the plain pack of out_proj), and the paired units run from the
// last rows back, which the kernel before (the global-scale pass, the residual) touched last, so part of them is
// still in L2. The SwiGLU table pack was slower with half warps and keeps whole rows in order (benchmarks/README.md,
// tuning logs). The plain pack's unit of work is one step of a row pair (kSegmentSteps) where the pair splits into
// whole steps (out_proj, K = 7168: faster than whole pairs); the norm-modulate pack keeps whole pairs (shorter
// segments were slower for it: the row set-up per unit). Rows cover [0, roundup(roundup(M,16),128)): rows in [M,
// roundup(M,16)) are packed from zeros (as comfy-kitchen pads them), rows beyond only get zero scales. Slower
// alternatives (benchmarks/README.md): splitting a block over two lanes for 512-byte coalesced loads, and persistent
// warps walking the flat block list across row ends.
//
// Requirements checked on the host (kernels/cuda_ops.py): K % 16 == 0, 16-byte aligned rows and tables, the two
// tensors of an UpBeside SwiGLU source with one row stride.
#include "nvfp4_common.cuh"

// Launch shape: kernels/cuda_ops.py (LAUNCH) is the one source of these values and passes them as -D options.
#if !defined(PLAIN_ITEMS) || !defined(PACK_THREADS) || !defined(SILU_TABLE_THREADS) || !defined(ABSMAX_THREADS) ||   \
    !defined(PACK_MIN_CTAS) || !defined(PLAIN_MIN_CTAS) || !defined(SILU_WINDOW_MIN_CTAS) ||                         \
    !defined(SWIGLU_ABSMAX_ITEMS) || !defined(SILU_WINDOW_LO) || !defined(SILU_WINDOW)
#error "kernels/cuda_ops.py passes the launch constants (PLAIN_ITEMS, PACK_THREADS, SILU_WINDOW, ...) as -D options"
#endif

struct SourceParams {
    const u16* x;          // bf16 (plain, prescale: or fp16) activation rows (SwiGLU: fc1 output, gate half first)
    i64 x_row_stride;      // in elements
    i64 rows;              // M
    i64 cols;              // K, the packed width
    union {                // the sources that read one never meet
        i64 up_offset;     // SwiGLU, UpInRow: elements from gate[c] to up[c] within a row
        const u16* up;     // SwiGLU, UpBeside: a second bf16 tensor [M, K] with x's row stride
        const float* mean; // folded LayerNorm: per-row mean (fused_layer_norm_* in residual_norm.cu)
    };
    const u16* mod_scale;  // bf16 adaLN scale rows (before the 1 +), row stride mod_row_stride
    union {
        const u16* mod_shift;  // bf16 adaLN shift rows
        const u16* norm_bias;  // folded LayerNorm with affine parameters: its bias [K]
    };
    i64 mod_row_stride;    // in elements
    const i32* mod_index;  // modulation row of each token
    union {
        const u16* silu_table; // SwiGLU with a table: bf16 silu(x) for each of the 65536 bf16 bit patterns x (or its window)
        const u16* gelu_table; // GELU (tanh): torch's gelu of each of the 65536 bit patterns of the activation dtype
    };
    const float* rstd;     // folded RMSNorm / LayerNorm: per-row rstd (fused_row_norm_*, fused_layer_norm_*), and its weight [K]
    union {                // one per-column table [K]: the two sources that read one never meet
        const u16* norm_weight;
        const u16* prescale;  // PrescaleOf: the layer's pre_quant_scale cast to the activation dtype
    };
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

struct AbsmaxParams {
    SourceParams src;
    GlobalScaleOut out;
};
// ---- sources ---------------------------------------------------------------------------------------------

// Each source splits its addressing into a per-row part (Row, formed once per row: the loop's stores would force
// the row's index, rstd and table pointers to be re-read from memory for every block) and per-column loads.
template <class E>
struct PlainOf {
    using Elem = E;
    static constexpr bool kScaleEvictLast = false;  // see store_scale_byte
    static constexpr bool kPairedRows = true;       // see pack_body
    static constexpr u32 kSegmentSteps = 1;  // one step of a row pair per unit of work (see pack_body)
    struct Row { const u16* x; };
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) { return Row{p.x + r * p.x_row_stride}; }
    // Through L1: each lane reads 32 contiguous bytes in two 16-byte loads, and the second load of each sector
    // hits L1 (faster than L1::no_allocate, which fetches each sector twice).
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        u32x4 v = load_16B(r.x + col);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
};
using PlainSource = PlainOf<Bf16>;

// ComfyUI: h[a:b].mul_(1.0 + scale[m]).add_(shift[m]) with bf16 tensors: three bf16 roundings, done here as
// three bf16x2 operations (each one rounding, the same as torch's fp32 opmath for bf16 operands; see
// nvfp4_common.cuh), two values per instruction.
struct ModulateSource {
    using Elem = Bf16;
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

// RMSNorm folded in front of the modulation: n = bf16(w * (rstd * x)) with rstd from the row-norm or residual
// kernels of residual_norm.cu (torch's rms_norm output, element for element), then the modulation form's roundings
// (Form: ScaleShift, ScaleOnly or Unmodulated, nvfp4_common.cuh). A form reads only its own tables (and without
// them no modulation index).
template <class Form>
struct NormalizedSource {
    using Elem = Bf16;
    static constexpr bool kScaleEvictLast = false;
    static constexpr bool kPairedRows = true;
    static constexpr u32 kSegmentSteps = 0;
    struct Row { ModulateSource::Row mod; float rstd; };
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) {
        if (Form::kScale) return Row{ModulateSource::row(p, r), p.rstd[r]};
        return Row{ModulateSource::Row{p.x + r * p.x_row_stride, nullptr, nullptr}, p.rstd[r]};
    }
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& row, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(row.mod.x + col);
        u32x4 nw = load_16B(p.norm_weight + col);
        const float r = row.rstd;
        u32x4 s = {0, 0, 0, 0}, t = {0, 0, 0, 0};
        if (Form::kScale) s = load_16B(row.mod.scale + col);
        if (Form::kShift) t = load_16B(row.mod.shift + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ws[4] = {nw.x, nw.y, nw.z, nw.w};
        const u32 ss[4] = {s.x, s.y, s.z, s.w}, ts[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = Form::apply(rms_norm_x2(xs[i], ws[i], r), ss[i], ts[i]);
    }
};
using NormModulateSource = NormalizedSource<ScaleShift>;

// ComfyUI's NVFP4 Linear with a pre_quant_scale (AWQ smoothing): input * pre_quant_scale cast to the input dtype,
// one multiply in that dtype (torch's fp32 opmath product of two bf16 or two fp16 values, exact, then one rounding:
// E::mul_x2) per value. The rows stream once; the [K] table is re-read by every row and stays in L1 / L2.
template <class E>
struct PrescaleOf {
    using Elem = E;
    static constexpr bool kScaleEvictLast = false;
    static constexpr bool kPairedRows = true;
    static constexpr u32 kSegmentSteps = 0;  // whole row pairs (not tuned: the text encoder's Linears)
    using Row = PlainSource::Row;
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) { return PlainSource::row(p, r); }
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(r.x + col);
        u32x4 s = load_16B(p.prescale + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ss[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = E::mul_x2(xs[i], ss[i]);
    }
};
using PrescaleSource = PrescaleOf<Bf16>;

// silu(gate) * up for a word of two gate and two up values, silu looked up: the table (kernels/cuda_ops.py builds it with torch's own silu on every bf16 value, so
// it holds exactly what ComfyUI's silu returns) is copied into shared memory by nvfp4_pack_swiglu_table. Replaces
// an exp and an IEEE division per value by one shared-memory load.
extern __shared__ __align__(16) u16 silu_shared[];

struct SiluLookedUp {
    static __device__ __forceinline__ u32 times(u32 gate, u32 up) {
        return bf16x2_mul((u32)silu_shared[gate & 0xFFFFu] | ((u32)silu_shared[gate >> 16] << 16), up);
    }
};

// Where a SwiGLU row's up values are, from the address of its gates: in the same row (UpInRow: fc1's [M, 2K]
// output, gate half first, H3), or at the same place of a second tensor with the same row stride (UpBeside:
// w3's output beside w1's, Z-Image's FeedForward).
struct UpInRow {
    static __device__ __forceinline__ const u16* at(const SourceParams& p, const u16* gate) { return gate + p.up_offset; }
};
struct UpBeside {
    static __device__ __forceinline__ const u16* at(const SourceParams& p, const u16* gate) { return p.up + (gate - p.x); }
};

// What the SwiGLU sources share: rows addressed as plain rows (the gates), scales stored with evict_last (see
// store_scale_byte). They read fc1's output (2.2 GB at H3's shapes) through L1, as PlainSource does, which was
// faster for the table pack than L1::no_allocate; the modulate packs gain nothing from it and keep the streaming
// loads.
template <class Up>
struct SwigluRowsOf {
    using Elem = Bf16;
    static constexpr bool kScaleEvictLast = true;
    static constexpr bool kPairedRows = false;
    static constexpr u32 kSegmentSteps = 0;
    using Row = PlainSource::Row;
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) { return PlainSource::row(p, r); }
};

// The same with a window of the table (nvfp4_common.cuh swiglu_window_x8), 12 KB of shared memory: several CTAs
// per SM fit, and so does sm_120's shared memory. Its four loads first, then the window test for all 16 gates.
extern __shared__ __align__(16) u16 silu_window_shared[];

template <class Up>
struct SwigluWindowOf : SwigluRowsOf<Up> {
    using Row = typename SwigluRowsOf<Up>::Row;
    static __device__ __forceinline__ void load16(const SourceParams& p, const Row& r, i64 col, u32 w[8]) {
        const u16* base = r.x + col;
        const u32x4 g0 = load_16B(base), g1 = load_16B(base + 8);
        const u32x4 u0 = load_16B(Up::at(p, base)), u1 = load_16B(Up::at(p, base) + 8);
        const u32 g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        const u32 u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
        swiglu_window_x8(g, u, silu_window_shared, w);
    }
};
using SwigluWindowSource = SwigluWindowOf<UpInRow>;

// A 16-value block of any source: two 8-value loads, unless the source loads whole blocks (the window sources).
template <class Source>
struct BlockLoader {
    static __device__ __forceinline__ void load(const SourceParams& p, const typename Source::Row& r, i64 col, u32 w[8]) {
        Source::load(p, r, col, w);
        Source::load(p, r, col + 8, w + 4);
    }
};
template <class Up>
struct BlockLoader<SwigluWindowOf<Up>> {
    static __device__ __forceinline__ void load(const SourceParams& p, const typename SwigluWindowOf<Up>::Row& r,
                                                i64 col, u32 w[8]) {
        SwigluWindowOf<Up>::load16(p, r, col, w);
    }
};
template <class Source>
__device__ __forceinline__ void load_block16(const SourceParams& p, const typename Source::Row& r, i64 col, u32 w[8]) {
    BlockLoader<Source>::load(p, r, col, w);
}

template <class Silu, class Up = UpInRow>
struct SwigluSource : SwigluRowsOf<Up> {
    using Row = typename SwigluRowsOf<Up>::Row;
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        const u16* base = r.x + col;
        u32x4 g = load_16B(base);
        u32x4 u = load_16B(Up::at(p, base));
        const u32 gs[4] = {g.x, g.y, g.z, g.w}, us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = Silu::times(gs[i], us[i]);
    }
};

// ---- the sources of a LayerNorm block (Wan computes in fp16 by default; bf16 too) ------------------------------

// torch's LayerNorm without affine parameters folded in, n = T(rstd * (x - mean)) from the row's statistics
// (layer_norm_* in residual_norm.cu), then ComfyUI's modulation torch.addcmul(shift, n, 1 + scale) with the token's
// modulation row (nvfp4_common.cuh layer_norm_x2, addcmul_modulate_x2): Wan's norm1 -> q, k, v and norm2 -> ffn.0.
template <class E>
struct LayerNormModulateOf {
    using Elem = E;
    static constexpr bool kScaleEvictLast = false;
    static constexpr bool kPairedRows = true;
    static constexpr u32 kSegmentSteps = 0;  // whole row pairs (as the norm-modulate pack)
    struct Row { const u16* x; const u16* scale; const u16* shift; float mean, rstd; };
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) {
        const i64 m = p.mod_index[r];
        return Row{p.x + r * p.x_row_stride, p.mod_scale + m * p.mod_row_stride, p.mod_shift + m * p.mod_row_stride,
                   p.mean[r], p.rstd[r]};
    }
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(r.x + col);
        u32x4 s = load_16B(r.scale + col);
        u32x4 t = load_16B(r.shift + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ss[4] = {s.x, s.y, s.z, s.w}, ts[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = addcmul_modulate_x2<E>(layer_norm_x2<E>(xs[i], r.mean, r.rstd), ss[i], ts[i]);
    }
};

// torch's LayerNorm with its weight and bias folded in, n = T(fma(w, rstd * (x - mean), b)) (Wan's norm3 -> the
// cross-attention q). The [K] weight and bias are re-read by every row and stay in L1 / L2.
template <class E>
struct LayerNormAffineOf {
    using Elem = E;
    static constexpr bool kScaleEvictLast = false;
    static constexpr bool kPairedRows = true;
    static constexpr u32 kSegmentSteps = 0;
    struct Row { const u16* x; float mean, rstd; };
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) {
        return Row{p.x + r * p.x_row_stride, p.mean[r], p.rstd[r]};
    }
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        u32x4 x = load_16B_stream(r.x + col);
        u32x4 nw = load_16B(p.norm_weight + col);
        u32x4 nb = load_16B(p.norm_bias + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ws[4] = {nw.x, nw.y, nw.z, nw.w}, bs[4] = {nb.x, nb.y, nb.z, nb.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = layer_norm_affine_x2<E>(xs[i], ws[i], bs[i], r.mean, r.rstd);
    }
};

// GELU (tanh approximation) of each element, looked up in torch's own table: the gelu of every bit pattern of the
// activation dtype, made by torch.nn.functional.gelu(approximate="tanh") on the device (kernels/cuda_ops.py
// gelu_table), so a lookup returns exactly what ComfyUI's eager activation of a down-projection's input computes
// (Wan's ffn.0 output -> ffn.2). The table is read from shared memory (128 KB: the _table pack, where it fits, one
// CTA per SM as the SwiGLU table pack) or from global memory through L1.
extern __shared__ __align__(16) u16 gelu_shared[];

// NVFP4_PLANT_FAULT (tests of the self-check only) looks up the neighbouring entry: a wrong kernel it must catch.
#if defined(NVFP4_PLANT_FAULT) && NVFP4_PLANT_FAULT
#define GELU_ENTRY(v) ((v) ^ 1u)
#else
#define GELU_ENTRY(v) (v)
#endif
struct GeluShared {
    static __device__ __forceinline__ u32 pair(const SourceParams&, u32 v) {
        return (u32)gelu_shared[GELU_ENTRY(v & 0xFFFFu)] | ((u32)gelu_shared[GELU_ENTRY(v >> 16)] << 16);
    }
};
struct GeluGlobal {
    static __device__ __forceinline__ u32 pair(const SourceParams& p, u32 v) {
        return (u32)__ldg(p.gelu_table + GELU_ENTRY(v & 0xFFFFu)) | ((u32)__ldg(p.gelu_table + GELU_ENTRY(v >> 16)) << 16);
    }
};

// Rows as the SwiGLU sources read them (through L1; the scale bytes with evict_last: a long input stream), whole rows
// per warp for the shared-table pack (as the SwiGLU table pack), row pairs for the global-table one.
template <class E, class Lookup, bool PairedRows>
struct GeluOf {
    using Elem = E;
    static constexpr bool kScaleEvictLast = true;
    static constexpr bool kPairedRows = PairedRows;
    static constexpr u32 kSegmentSteps = 0;
    using Row = PlainSource::Row;
    static __device__ __forceinline__ Row row(const SourceParams& p, i64 r) { return PlainSource::row(p, r); }
    static __device__ __forceinline__ void load(const SourceParams& p, const Row& r, i64 col, u32 w[4]) {
        const u32x4 x = load_16B(r.x + col);
        const u32 xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = Lookup::pair(p, xs[i]);
    }
};
template <class E>
using GeluGlobalOf = GeluOf<E, GeluGlobal, true>;

// ---- global scale ----------------------------------------------------------------------------------------


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
    absmax_finish<ABSMAX_THREADS, typename Source::Elem>(p.out, acc);
}

// SwiGLU global scale without evaluating silu where it cannot matter. |h| = |bf16(bf16(silu(g)) u)| <= bf16(|g u|):
// |silu(g)| <= |g| (torch's IEEE division by 1 + exp(-g) >= 1 cannot round above the representable |g|, nor can the
// bf16 rounding of silu), the product of two bf16 values is exact in fp32, and rounding is monotone. So a pair of
// elements whose bf16x2 product magnitudes (one fma.rn.bf16x2; |.| patterns order NaN above inf) are both <= the
// thread's running max cannot change it; only the others (every NaN or inf among them) are evaluated exactly. The
// result is the exact amax, at the cost of reading the input (fewer instructions, and faster, than an fp32 bound
// with a margin). SWIGLU_ABSMAX_ITEMS chunks of gate and up per thread are in flight (3: 40 registers, 3 CTAs of
// 512 per SM; 1, 2 and 4 were no faster). Up: where the up values are (UpInRow, UpBeside).
template <class Up>
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
                u32x4 gv = load_16B_stream(g), uv = load_16B_stream(Up::at(s, g));
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
// half written, and each costs a DRAM read-modify-write: there the bytes go out with L2 evict_last (the SwiGLU
// packs at H3's fc2: faster, and less DRAM traffic; the packs of 5376 / 7168 columns gain nothing and keep plain
// stores). One wave of rows later, when those warps are done, release_scale_lines returns the lines to normal priority, so they
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
                quantize_block16<typename Source::Elem>(w[it], g, rcp_g, block_scale, lo, hi);
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

// ---- entry points (one name per variant; kernels/runtime.py looks them up by name) -------------------------

extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_plain(const AbsmaxParams p) { absmax_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_modulate(const AbsmaxParams p) { absmax_body<ModulateSource, 1>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_swiglu(const AbsmaxParams p) { absmax_swiglu_body<UpInRow>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PLAIN_MIN_CTAS) nvfp4_pack_plain(const PackParams p) { pack_body<PlainSource, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_modulate(const PackParams p) { pack_body<ModulateSource, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_norm_modulate(const PackParams p) { pack_body<NormModulateSource, 1>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_prescale(const AbsmaxParams p) { absmax_body<PrescaleSource, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_prescale(const PackParams p) { pack_body<PrescaleSource, 1>(p); }
// fp16 activations: the same kernels with the fp16 element type (launch shapes as their bf16 twins)
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_plain_f16(const AbsmaxParams p) { absmax_body<PlainOf<F16>, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PLAIN_MIN_CTAS) nvfp4_pack_plain_f16(const PackParams p) { pack_body<PlainOf<F16>, PLAIN_ITEMS>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_prescale_f16(const AbsmaxParams p) { absmax_body<PrescaleOf<F16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_prescale_f16(const PackParams p) { pack_body<PrescaleOf<F16>, 1>(p); }
// Z-Image's block: the normalized sources with the scale-only modulation and without one (launch shapes as
// nvfp4_pack_norm_modulate), and the SwiGLU of two tensors (as the fused-row SwiGLU kernels, below)
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_norm_scale(const PackParams p) { pack_body<NormalizedSource<ScaleOnly>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_norm(const PackParams p) { pack_body<NormalizedSource<Unmodulated>, 1>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_swiglu_pair(const AbsmaxParams p) { absmax_swiglu_body<UpBeside>(p); }
// One CTA per SM (the table takes 128 KB of shared memory); kernels/cuda_ops.py launches it where that fits.
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
    pack_body<SwigluSource<SiluLookedUp>, 1>(p);
}
extern "C" __global__ void __launch_bounds__(SILU_TABLE_THREADS, 1) nvfp4_pack_swiglu_pair_table(const PackParams p) {
    copy_table_to_shared(silu_shared, p.src.silu_table, 2 * 65536);
    pack_body<SwigluSource<SiluLookedUp, UpBeside>, 1>(p);
}
// Persistent CTAs (kernels/cuda_ops.py: the resident count), each copying the 12 KB window once.
extern "C" __global__ void __launch_bounds__(PACK_THREADS, SILU_WINDOW_MIN_CTAS) nvfp4_pack_swiglu_window(const PackParams p) {
    copy_table_to_shared(silu_window_shared, p.src.silu_table, 2 * 2 * SILU_WINDOW);
    pack_body<SwigluWindowSource, 1>(p);
}
extern "C" __global__ void __launch_bounds__(PACK_THREADS, SILU_WINDOW_MIN_CTAS) nvfp4_pack_swiglu_pair_window(const PackParams p) {
    copy_table_to_shared(silu_window_shared, p.src.silu_table, 2 * 2 * SILU_WINDOW);
    pack_body<SwigluWindowOf<UpBeside>, 1>(p);
}

// The sources of a LayerNorm block (bf16; _f16: fp16), with the launch shapes of the norm-modulate pack (the
// LayerNorm-modulate pack with the plain pack's register budget: its rows carry two more values, which spill at the
// other one's on sm_100a); the GELU table pack with the SwiGLU table pack's. Not tuned yet.
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_layer_norm_modulate(const AbsmaxParams p) { absmax_body<LayerNormModulateOf<Bf16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PLAIN_MIN_CTAS) nvfp4_pack_layer_norm_modulate(const PackParams p) { pack_body<LayerNormModulateOf<Bf16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_layer_norm_affine(const AbsmaxParams p) { absmax_body<LayerNormAffineOf<Bf16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_layer_norm_affine(const PackParams p) { pack_body<LayerNormAffineOf<Bf16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_gelu(const AbsmaxParams p) { absmax_body<GeluGlobalOf<Bf16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_gelu(const PackParams p) { pack_body<GeluGlobalOf<Bf16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(SILU_TABLE_THREADS, 1) nvfp4_pack_gelu_table(const PackParams p) {
    copy_table_to_shared(gelu_shared, p.src.gelu_table, 2 * 65536);
    pack_body<GeluOf<Bf16, GeluShared, false>, 1>(p);
}
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_layer_norm_modulate_f16(const AbsmaxParams p) { absmax_body<LayerNormModulateOf<F16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PLAIN_MIN_CTAS) nvfp4_pack_layer_norm_modulate_f16(const PackParams p) { pack_body<LayerNormModulateOf<F16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_layer_norm_affine_f16(const AbsmaxParams p) { absmax_body<LayerNormAffineOf<F16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_layer_norm_affine_f16(const PackParams p) { pack_body<LayerNormAffineOf<F16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(ABSMAX_THREADS) nvfp4_absmax_gelu_f16(const AbsmaxParams p) { absmax_body<GeluGlobalOf<F16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(PACK_THREADS, PACK_MIN_CTAS) nvfp4_pack_gelu_f16(const PackParams p) { pack_body<GeluGlobalOf<F16>, 1>(p); }
extern "C" __global__ void __launch_bounds__(SILU_TABLE_THREADS, 1) nvfp4_pack_gelu_table_f16(const PackParams p) {
    copy_table_to_shared(gelu_shared, p.src.gelu_table, 2 * 65536);
    pack_body<GeluOf<F16, GeluShared, false>, 1>(p);
}
