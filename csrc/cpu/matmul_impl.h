// Internals of matmul shared by its per-instruction-set files: the call's arguments, the
// per-ISA entry points, and the generic tiled driver (unpack a tile of weight rows into an
// int8 panel once, dot it with every token). Everything here that holds code is in an
// anonymous namespace: each ISA file compiles its own copy with its own -m flags.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "cpu/cpu_features.h"
#include "cpu/matmul.h"
#include "quant/dot.h"

namespace stowlm::cpu {

struct MatmulArgs {
    QType type;
    const uint8_t* w;     // row r at w + r * w_stride
    size_t w_stride;
    int64_t rows, cols;
    const float* x;       // token t at x + t * ldx (used by the float weight types)
    int64_t ldx;
    const void* act;      // quantized activations: token t at act + t * act_stride bytes
    size_t act_stride;
    int64_t n_tok;
    float* y;
    int64_t ldy;
    // Optional: the same activations regrouped for the row kernels (NibGroup, PairGroup below:
    // nib_act_kind of this type), token t at act_nib + t * nib_stride bytes; null where the
    // caller made none.
    const void* act_nib = nullptr;
    size_t nib_stride = 0;
    // The batched kernels whatever n_tok (a pass that must match the larger one it belongs to).
    bool batched = false;
    // Rows interleaved by 16 (cpu/repack.h): the repacked kernels run for every batch size and
    // read asum, the sums of each token's quantized activation blocks (token t at t * cols / 32).
    bool rows16 = false;
    const int32_t* asum = nullptr;
};

// Four 32-blocks of one token's quantized activations in the order of the nibbles of four
// Q4_0/Q4_1 blocks: lo = elements 0-15 of each block, hi = elements 16-31, so that a ZMM of
// the blocks' 64 quant bytes, split into low and high nibbles, meets them with two vpdpbusd.
// neg8: -8 * the sum of the 8 activations each int32 lane takes (Q4_0's offset); d4, s4: each
// block's scale and sum, four times over (block b in lanes 4b-4b+3). Blocks past the row's end
// are zero.
struct alignas(64) NibGroup {
    int8_t lo[64];
    int8_t hi[64];
    int32_t neg8[16];
    float d4[16];
    float s4[16];
};
static_assert(sizeof(NibGroup) == 320, "NibGroup layout: whole cache lines, aligned loads");
// Two 32-blocks of one token's quantized activations as the 4-row kernel of the other
// 32-element formats reads them (fused_q32_x2_r4): the 64 quant bytes, each int32 lane's
// -OFF * (sum of its 4 activations) for the format's offset OFF (weights as q + OFF), the
// blocks' d in the lane pattern [b x 8, b+1 x 8] and their sums [b x 4, b+1 x 4]: what the
// kernel otherwise makes per tile and token from the blocks. Made and read for 2+ tokens only
// (one token reads A.act: the larger rows would only cost cache).
struct alignas(64) PairGroup {
    int8_t qs[64];
    int32_t neg[16];
    float d[16];
    float s[8];
};
static_assert(sizeof(PairGroup) == 256, "PairGroup layout: whole cache lines, aligned loads");
// One 256-block of a token's Q8_K activations as the Q4_K/Q5_K kernel reads them (2+ tokens):
// the quants in its ZMM order (elements 0-31 and 64-95, 32-63 and 96-127, 128-159 and
// 192-223, 160-191 and 224-255) and [d_g | bsum_g * d_g] of the eight 32-groups g.
struct alignas(64) K4Group {
    int8_t qs[256];
    float v[16];
};
static_assert(sizeof(K4Group) == 320, "K4Group layout: whole cache lines, aligned loads");
// The regrouped activations a type's AVX-512 row kernels read: 0 none, 1 NibGroups (Q4_0,
// Q4_1), 2 + k PairGroups for the two-block formats with offset 128, 16, 0 (k = 0, 1, 2) when
// the row has an even number of blocks, 5 K4Groups (Q4_K, Q5_K). Matrices of one kind share
// one regrouping.
int nib_act_kind(QType t, int64_t cols);
// Bytes of one token's regrouped activations for this weight type (0: none).
size_t nib_act_row_bytes(QType t, int64_t cols);
// Fills A.n_tok tokens' groups of A.type's kind at dst (nib_stride bytes apart) from A.act.
void build_nib_acts(const MatmulArgs& A, void* dst, size_t nib_stride);

// Rows [r0, r1) for every token. Each is defined in its own file.
void matmul_rows_scalar(const MatmulArgs& a, int64_t r0, int64_t r1);
void matmul_rows_avx2(const MatmulArgs& a, int64_t r0, int64_t r1);
void matmul_rows_avx512(const MatmulArgs& a, int64_t r0, int64_t r1);
// The grid i-quants' rows with AVX-512 VBMI where it has a kernel for A.type (false: none, the
// fused ones run).
bool iq_rows_avx512vbmi(const MatmulArgs& A, int64_t r0, int64_t r1);
// The row kernels of an instruction set, and whether they read MatmulArgs::act_nib.
using RowsFn = void (*)(const MatmulArgs&, int64_t, int64_t);
RowsFn matmul_rows_for(Isa isa);
// Rows [r0, r1) of a repacked matrix (A.rows16; r0 a multiple of 16, a range past the last whole
// group takes the tail rows too), on the active instruction set's kernels.
void matmul_r16_rows(const MatmulArgs& A, int64_t r0, int64_t r1);
// A.asum[t * cols / 32 + b] = the sum of token t's quantized block b (the repacked 32-element
// formats' offsets), over the pool where the activations are many.
void prepare_r16(const MatmulArgs& A, ThreadPool& pool);
// Whether A's repacked rows take their row kernels however many tokens (below kCpuR16RowsMax,
// off AMX, unless the pass is forced onto the batched kernels) instead of the batched ones.
bool r16_rows(const MatmulArgs& A, Isa isa);
bool matmul_rows_read_nib(Isa isa);
// Activation quantization of n elements of one token (Q8_a blocks for the 32-element
// weight formats, block_q8_K32 otherwise), per instruction set.
void quantize_act_scalar(DotFamily fam, const float* x, void* dst, int64_t n);
void quantize_act_avx2(DotFamily fam, const float* x, void* dst, int64_t n);
// The one of `isa` (identical results on every path for the 256-element formats).
void quantize_act(Isa isa, DotFamily fam, const float* x, void* dst, int64_t n);

// Batches of this many tokens or more go to a batched kernel (the GEMMs, AMX tiles). Below it
// the row kernels give a token the same product in any batch, which prefix reuse and small
// micro-batches rely on. (The GEMMs overtake the row kernels from about 16 tokens for every
// format, bench-matmul --ntok 8,12,16,20; the bound stays where attention switches too.)
// Weights repacked into 16-row groups keep the row kernels up to kCpuR16RowsMax (matmul.cpp).
constexpr int64_t kBatchMinTokens = kCpuBatchedMinTokens;
// AMX is one of those batched kernels: the same bound, or a token's product would change class
// inside one of Model::batch_bounds' ranges on an AMX CPU.
constexpr int64_t kAmxMinTokens = kBatchMinTokens;
// Whole product on AMX tiles (rows split over the pool); false when this type/shape is
// better left to the AVX-512 path.
bool matmul_amx(const MatmulArgs& a, ThreadPool& pool);
// Extra scratch the AMX path needs after the activations (its per-step activation scales).
size_t amx_scratch_extra(QType t, int64_t cols, int64_t n_tok);
// Whole product on AVX-512 VNNI with 16-row interleaved panels (matmul_gemm_avx512.cpp);
// false for the float types and small batches.
bool matmul_gemm_vnni(const MatmulArgs& a, ThreadPool& pool);
size_t gemm_scratch_extra(QType t, int64_t cols, int64_t n_tok);
// The same scheme on AVX2 with 8-row panels (matmul_gemm_avx2.cpp; same scratch); false also
// for the formats whose quants span a full byte.
bool matmul_gemm_avx2(const MatmulArgs& a, ThreadPool& pool);
// The batched kernel of `isa` (AMX, else the VNNI GEMM; on AVX2 its GEMM) for a batch of
// kBatchMinTokens or more; false when there is none and the row kernels should run. Its
// scratch after the activations: batched_scratch_extra.
bool matmul_batched(const MatmulArgs& a, Isa isa, ThreadPool& pool);
size_t batched_scratch_extra(QType t, int64_t cols, int64_t n_tok);
// Shared with mul_mat_id (matmul_id.cpp): the checks of matmul() (the bytes of one token's
// quantized activations, matmul_act_row_bytes, are in matmul.h).
void matmul_check_type_cols(QType t, int64_t cols);

namespace {

// Per-thread unpack buffer, grown (rarely) to the largest panel seen; never freed per call.
struct Panel {
    void* p = nullptr;
    size_t cap = 0;
    ~Panel() { std::free(p); }
    void* get(size_t bytes) {
        if (bytes > cap) {
            std::free(p);
            cap = (bytes + 4095) & ~(size_t)4095;
            p = std::aligned_alloc(64, cap);
            if (!p) std::abort();
        }
        return p;
    }
};

// Byte layout of one unpacked row in the panel.
struct RowLayout {
    size_t q_off, d_off, m_off, sc_off, mn_off, bytes;
};

inline RowLayout row_layout(DotFamily fam, int64_t cols) {
    RowLayout L{};
    auto up = [](size_t v) { return (v + 63) & ~(size_t)63; };
    if (fam == DotFamily::Float) {
        L.q_off = 0;
        L.bytes = up(cols * 4);
    } else if (fam == DotFamily::Q32) {
        const size_t nb = cols / QK;
        L.q_off = 0;
        L.d_off = up(cols);
        L.m_off = L.d_off + up(nb * 4);
        L.bytes = L.m_off + up(nb * 4);
    } else {
        const size_t nsb = cols / QK_K;
        L.q_off = 0;
        L.sc_off = up(cols);
        L.mn_off = L.sc_off + up(nsb * 32);
        L.d_off = L.mn_off + up(nsb * 32);
        L.m_off = L.d_off + up(nsb * 4);
        L.bytes = L.m_off + up(nsb * 4);
    }
    return L;
}

// Unpacks one quantized weight row into the panel row at `dst` (layout L).
inline void unpack_row(QType t, DotFamily fam, const uint8_t* src, int64_t cols, uint8_t* dst,
                       const RowLayout& L) {
    const QTypeInfo& info = qtype_checked((uint32_t)t);
    int8_t* q = (int8_t*)(dst + L.q_off);
    float* d = (float*)(dst + L.d_off);
    float* m = (float*)(dst + L.m_off);
    if (fam == DotFamily::Q32) {
        for (int64_t b = 0; b < cols / QK; b++)
            unpack_q32(t, src + b * info.block_bytes, q + b * QK, d + b, m + b);
    } else {
        int16_t* sc = (int16_t*)(dst + L.sc_off);
        int16_t* mn = (int16_t*)(dst + L.mn_off);
        for (int64_t b = 0; b < cols / QK_K; b++)
            unpack_qk(t, src + b * info.block_bytes, q + b * QK_K, sc + 16 * b, mn + 16 * b, d + b, m + b);
    }
}

// Steps of the batched kernels: 32 elements, or 16 for the formats with 16-element sub-scales.
inline int batched_step(QType t) {
    switch (t) {
        case QType::Q2_K: case QType::Q3_K: case QType::Q6_K: case QType::IQ2_XS: case QType::IQ2_S:
        case QType::IQ1_M: return 16;
        default: return 32;
    }
}
// The formats whose weights carry a min term (w = d q + m).
inline bool has_min_term(QType t) {
    return t == QType::Q4_1 || t == QType::Q5_1 || t == QType::Q2_K || t == QType::Q4_K || t == QType::Q5_K;
}

// The scales of one unpacked row (layout L) per step of `step` elements (32, or 16 for the
// formats with 16-element sub-scales): w = D q + M within a step. D[s * stride], M[s * stride].
inline void step_scales(DotFamily fam, const uint8_t* row, const RowLayout& L, int64_t nsteps, int step, float* D,
                        float* M, int64_t stride) {
    const float* d = (const float*)(row + L.d_off);
    const float* m = (const float*)(row + L.m_off);
    if (fam == DotFamily::Q32) {
        for (int64_t s = 0; s < nsteps; s++) D[s * stride] = d[s], M[s * stride] = m[s];
        return;
    }
    const int16_t* sc = (const int16_t*)(row + L.sc_off);
    const int16_t* mn = (const int16_t*)(row + L.mn_off);
    const int per = QK_K / step, w16 = step / 16;
    for (int64_t s = 0; s < nsteps; s++) {
        const int64_t sb = s / per, j = sb * 16 + (s % per) * w16;
        D[s * stride] = d[sb] * (float)sc[j];
        M[s * stride] = -m[sb] * (float)mn[j];
    }
}

// tile(n, t0) over all tokens (the GEMMs' register tiles, the repacked kernels' token tiles), n a compile-time count: tiles of NT tokens, then one of the rest.
template <int N, class F>
void tail_tile(int64_t rest, int64_t t0, F& tile) {
    if constexpr (N > 0) {
        if (rest == N) return tile(std::integral_constant<int, N>{}, t0);
        tail_tile<N - 1>(rest, t0, tile);
    }
}
template <int NT, class F>
void over_token_tiles(int64_t n_tok, F&& tile) {
    int64_t t = 0;
    for (; t + NT <= n_tok; t += NT) tile(std::integral_constant<int, NT>{}, t);
    tail_tile<NT - 1>(n_tok - t, t, tile);
}

// Scalar unpack, used where a file has no faster one.
struct ScalarUnpack {
    static void unpack(QType t, DotFamily fam, const uint8_t* src, int64_t cols, uint8_t* dst, const RowLayout& L) {
        unpack_row(t, fam, src, cols, dst, L);
    }
};

// The generic path: RT rows at a time are unpacked once and dotted with every token, so each
// weight byte is read from memory once per call however many tokens there are.
// Kern supplies dot_q32 / dot_qk / dot_f (one row x one token) and to_f32 (F16/BF16 rows).
template <class Kern, class Unpack = ScalarUnpack, int RT = 4>
void rows_generic(const MatmulArgs& A, int64_t r0, int64_t r1) {
    static thread_local Panel panel;
    const DotFamily fam = dot_family(A.type);
    const RowLayout L = row_layout(fam, A.cols);
    const bool direct_f32 = A.type == QType::F32;
    uint8_t* buf = direct_f32 ? nullptr : (uint8_t*)panel.get(L.bytes * RT);
    const int64_t nb = A.cols / QK, nsb = A.cols / QK_K;
    for (int64_t r = r0; r < r1; r += RT) {
        const int nr = (int)(r1 - r < RT ? r1 - r : RT);
        const uint8_t* rowp[RT];
        for (int i = 0; i < nr; i++) {
            const uint8_t* src = A.w + (r + i) * A.w_stride;
            if (direct_f32) {
                rowp[i] = src;
                continue;
            }
            uint8_t* dst = buf + i * L.bytes;
            if (fam == DotFamily::Float) Kern::to_f32(A.type, src, (float*)dst, A.cols);
            else Unpack::unpack(A.type, fam, src, A.cols, dst, L);
            rowp[i] = dst;
        }
        for (int64_t t = 0; t < A.n_tok; t++) {
            float* yt = A.y + t * A.ldy + r;
            const uint8_t* at = (const uint8_t*)A.act + t * A.act_stride;
            for (int i = 0; i < nr; i++) {
                const uint8_t* p = rowp[i];
                if (fam == DotFamily::Float) {
                    yt[i] = Kern::dot_f((const float*)p, A.x + t * A.ldx, A.cols);
                } else if (fam == DotFamily::Q32) {
                    yt[i] = Kern::dot_q32((const int8_t*)(p + L.q_off), (const float*)(p + L.d_off),
                                          (const float*)(p + L.m_off), (const block_q8_a*)at, nb);
                } else {
                    yt[i] = Kern::dot_qk((const int8_t*)(p + L.q_off), (const int16_t*)(p + L.sc_off),
                                         (const int16_t*)(p + L.mn_off), (const float*)(p + L.d_off),
                                         (const float*)(p + L.m_off), (const block_q8_K32*)at, nsb);
                }
            }
        }
    }
}

}  // namespace
}  // namespace stowlm::cpu
