// AVX-512 VNNI products of weights repacked into 16-row groups (repack.h): per block, 8
// vpdpbusd of the group's 4-element columns with broadcasts of a token's activations give the
// block's exact integer dots of all 16 rows, one conversion and one FMA scale them. The same
// float operations as matmul_r16_scalar, in the same order, for any number of tokens.
// GCC 12 reports its own _mm512_undefined_*() inside AVX-512 intrinsics as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "cpu/repack.h"

namespace stowlm::cpu {

namespace {

// Each format's 8 vectors of unsigned values: u[k] holds elements 4k..4k+3 of the 16 rows.
struct R8_0 {
    using G = block_q8_0x16;
    static constexpr int OFF = 128;
    static void unpack(const G& x, __m512i (&u)[8]) {
        for (int k = 0; k < 8; k++) u[k] = _mm512_loadu_si512(x.qs[k]);
    }
};
struct R4_0 {
    using G = block_q4_0x16;
    static constexpr int OFF = 8;
    static void unpack(const G& x, __m512i (&u)[8]) {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        for (int k = 0; k < 4; k++) {
            const __m512i z = _mm512_loadu_si512(x.qs[k]);
            u[k] = _mm512_and_si512(z, m4);
            u[4 + k] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
        }
    }
};
struct R5_0 {
    using G = block_q5_0x16;
    static constexpr int OFF = 16;
    static void unpack(const G& x, __m512i (&u)[8]) {
        R4_0::unpack((const block_q4_0x16&)x, u);  // the same d and qs up front
        const __m512i b4 = _mm512_set1_epi8(0x10);
        for (int k = 0; k < 8; k++) u[k] = _mm512_mask_add_epi8(u[k], _cvtu64_mask64(x.qh[k]), u[k], b4);
    }
};

inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Group g x tokens [t0, t0 + TT).
template <class R, int TT>
void r16_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = typename R::G;
    const int64_t nb = A.cols / QK;
    const G* w = (const G*)(A.w + g * kRepackRows * A.w_stride);
    const block_q8_a* a[TT];
    const int32_t* sum[TT];
    __m512 acc[TT];
    for (int j = 0; j < TT; j++) {
        a[j] = (const block_q8_a*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
        sum[j] = A.asum + (t0 + j) * nb;
        acc[j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const G& x = w[b];
        for (size_t off = 0; off < sizeof(G); off += 64) _mm_prefetch((const char*)&x + 2048 + off, _MM_HINT_T0);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        __m512i u[8];
        R::unpack(x, u);
#pragma GCC unroll 8
        for (int j = 0; j < TT; j++) {
            const int8_t* q = a[j][b].qs;
            // two chains for latency; integer sums, exact in any order
            __m512i s0 = _mm512_set1_epi32(-R::OFF * sum[j][b]), s1 = _mm512_setzero_si512();
            s0 = _mm512_dpbusd_epi32(s0, u[0], bcast4(q + 0));
            s1 = _mm512_dpbusd_epi32(s1, u[1], bcast4(q + 4));
            s0 = _mm512_dpbusd_epi32(s0, u[2], bcast4(q + 8));
            s1 = _mm512_dpbusd_epi32(s1, u[3], bcast4(q + 12));
            s0 = _mm512_dpbusd_epi32(s0, u[4], bcast4(q + 16));
            s1 = _mm512_dpbusd_epi32(s1, u[5], bcast4(q + 20));
            s0 = _mm512_dpbusd_epi32(s0, u[6], bcast4(q + 24));
            s1 = _mm512_dpbusd_epi32(s1, u[7], bcast4(q + 28));
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(a[j][b].d));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), s, acc[j]);
        }
    }
    for (int j = 0; j < TT; j++) _mm512_storeu_ps(A.y + (t0 + j) * A.ldy + g * kRepackRows, acc[j]);
}

// Groups [g0, g1) x all tokens, 8 tokens a tile (a group's blocks stay in L1/L2 between tiles).
template <class R>
void r16_groups(const MatmulArgs& A, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        int64_t t = 0;
        for (; t + 8 <= A.n_tok; t += 8) r16_tile<R, 8>(A, g, t);
        switch (A.n_tok - t) {
            case 7: r16_tile<R, 7>(A, g, t); break;
            case 6: r16_tile<R, 6>(A, g, t); break;
            case 5: r16_tile<R, 5>(A, g, t); break;
            case 4: r16_tile<R, 4>(A, g, t); break;
            case 3: r16_tile<R, 3>(A, g, t); break;
            case 2: r16_tile<R, 2>(A, g, t); break;
            case 1: r16_tile<R, 1>(A, g, t); break;
            default: break;
        }
    }
}

}  // namespace

void matmul_r16_avx512(const MatmulArgs& A, int64_t g0, int64_t g1) {
    switch (A.type) {
        case QType::Q8_0: return r16_groups<R8_0>(A, g0, g1);
        case QType::Q4_0: return r16_groups<R4_0>(A, g0, g1);
        case QType::Q5_0: return r16_groups<R5_0>(A, g0, g1);
        default: return matmul_r16_scalar(A, g0, g1);
    }
}

}  // namespace stowlm::cpu
