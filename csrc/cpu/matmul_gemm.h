// Shared by the GEMM paths for batches (matmul_gemm_avx512.cpp: 16-row panels on VNNI,
// matmul_gemm_avx2.cpp: 8-row panels on AVX2): each token's quantized activations laid out
// once per call (bytes in element order, per step an integer start and the scales), and the
// driver that packs the tokens in parallel, then hands panels of weight rows to the threads.
// Anonymous namespace: each ISA file compiles its own copy.
#pragma once
#include <immintrin.h>

#include <type_traits>

#include "cpu/matmul_impl.h"
#include "cpu/matmul_unpack_simd.h"

namespace stowlm::cpu {
namespace {

// A token's step: the integer start of its sum (-off * sum of its activations, taking off the
// offset that made the weights unsigned), its activation scale, and scale * sum (for the
// formats with a min term).
struct TokStep {
    int32_t c;
    float d, s;
};

struct GemmLayout {
    int step;
    int64_t nsteps;
    int8_t* qa;   // [token][cols] activation bytes, steps contiguous
    TokStep* ts;  // [token][step]
};

// In the scratch after the activations (gemm_scratch_extra bytes).
GemmLayout gemm_layout(const MatmulArgs& A) {
    GemmLayout l;
    l.step = batched_step(A.type);
    l.nsteps = A.cols / l.step;
    uintptr_t p = ((uintptr_t)A.act + A.act_stride * A.n_tok + 63) & ~(uintptr_t)63;
    l.qa = (int8_t*)p;
    l.ts = (TokStep*)((p + (size_t)A.n_tok * A.cols + 63) & ~(uintptr_t)63);
    return l;
}

// One token's activations into the layout, for weights stored as q + off.
void pack_token(const MatmulArgs& A, const GemmLayout& lo, int64_t t, int off) {
    const uint8_t* ap = (const uint8_t*)A.act + t * A.act_stride;
    int8_t* dst = lo.qa + t * A.cols;
    TokStep* ts = lo.ts + t * lo.nsteps;
    if (dot_family(A.type) == DotFamily::Q32) {
        const block_q8_a* b = (const block_q8_a*)ap;
        for (int64_t s = 0; s < lo.nsteps; s++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)b[s].qs);
            _mm256_storeu_si256((__m256i*)(dst + s * QK), q);
            const __m256i s16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
            ts[s] = TokStep{-off * _mm_cvtsi128_si32(h), b[s].d, b[s].s};
        }
        return;
    }
    const block_q8_K32* b = (const block_q8_K32*)ap;
    const int step = lo.step, per = QK_K / step;
    for (int64_t s = 0; s < lo.nsteps; s++) {
        const block_q8_K32& blk = b[s / per];
        const int j = (int)(s % per) * (step / 16);  // first 16-group of the step
        memcpy(dst + s * step, blk.qs + (s % per) * step, step);
        int sum = blk.bsums[j];
        if (step == 32) sum += blk.bsums[j + 1];
        const float d = blk.d[j / 2];
        ts[s] = TokStep{-off * sum, d, d * (float)sum};
    }
}

// Per-thread panel: the unpacked rows, the interleaved bytes [step][dword k][row] and the
// scales D, M [step][row] (w = D q + M per step).
struct PanelBufs {
    Panel unpack, wp, dm;
};

// fn(step, min) with the format's step (32 or 16) and min term as compile-time constants.
template <class F>
void with_step_min(QType t, F&& fn) {
    using S32 = std::integral_constant<int, 32>;
    using S16 = std::integral_constant<int, 16>;
    const bool m = has_min_term(t);
    if (batched_step(t) == 32) {
        if (m) fn(S32{}, std::true_type{});
        else fn(S32{}, std::false_type{});
    } else {
        if (m) fn(S16{}, std::true_type{});
        else fn(S16{}, std::false_type{});
    }
}

// Tokens laid out in parallel, then panels of PR rows shared out: panel(bufs, r0) per panel.
template <int PR, class F>
void gemm_drive(const MatmulArgs& A, const GemmLayout& lo, int off, ThreadPool& pool, F&& panel) {
    pool.parallel_for(A.n_tok, [&](int64_t t0, int64_t t1, int) {
        for (int64_t t = t0; t < t1; t++) pack_token(A, lo, t, off);
    });
    pool.parallel_for_dynamic((A.rows + PR - 1) / PR, 1, [&](int64_t p0, int64_t p1, int) {
        static thread_local PanelBufs bufs;
        for (int64_t p = p0; p < p1; p++) {
            // the weights of the next panels (this thread's or the other's) on their way from
            // memory while this panel's products run: unpacking them would otherwise wait on it
            const uint8_t* next = A.w + (p + 1) * PR * A.w_stride;
            const uint8_t* end = A.w + A.rows * A.w_stride;
            for (const uint8_t* q = next; q < next + 2 * PR * A.w_stride && q < end; q += 64)
                _mm_prefetch((const char*)q, _MM_HINT_T2);
            panel(bufs, p * PR);
        }
    });
}

}  // namespace
}  // namespace stowlm::cpu
