// AVX-512 inner loops of the ops (F16C conversions, masked tails so any length works).
// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_* placeholders).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>

#include "cpu/ops_kernels.h"
#include "cpu/vec_exp.h"

namespace stowlm::cpu {

namespace {

inline __mmask16 tail_mask(int64_t r) { return (__mmask16)((1u << r) - 1u); }

inline __m512 load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load_h_mask(const uint16_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

float dot_f16(const float* q, const uint16_t* k, int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load_h(k + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), load_h(k + i + 16), a1);
    }
    for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load_h(k + i), a0);
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), load_h_mask(k + i, m), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void axpy_f16(float* acc, float a, const uint16_t* v, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(va, load_h(v + i), _mm512_loadu_ps(acc + i)));
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(acc + i, m, _mm512_fmadd_ps(va, load_h_mask(v + i, m), _mm512_maskz_loadu_ps(m, acc + i)));
    }
}

float dot_q8_0(const float* q, const block_q8_0* k, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / QK; b++) {
        const float* qb = q + b * QK;
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(qb), load_i8(k[b].qs));
        t = _mm512_fmadd_ps(_mm512_loadu_ps(qb + 16), load_i8(k[b].qs + 16), t);
        acc = _mm512_fmadd_ps(t, _mm512_set1_ps(_cvtsh_ss(k[b].d)), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

void axpy_q8_0(float* acc, float a, const block_q8_0* v, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++) {
        float* ab = acc + b * QK;
        const __m512 ad = _mm512_set1_ps(a * _cvtsh_ss(v[b].d));
        _mm512_storeu_ps(ab, _mm512_fmadd_ps(ad, load_i8(v[b].qs), _mm512_loadu_ps(ab)));
        _mm512_storeu_ps(ab + 16, _mm512_fmadd_ps(ad, load_i8(v[b].qs + 16), _mm512_loadu_ps(ab + 16)));
    }
}

void scale(float* x, float s, int64_t n) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
    }
}

float sum_sq(const float* x, int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(x0, x0, a0);
        a1 = _mm512_fmadd_ps(x1, x1, a1);
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 x0 = _mm512_loadu_ps(x + i);
        a0 = _mm512_fmadd_ps(x0, x0, a0);
    }
    if (i < n) {
        const __m512 x0 = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        a1 = _mm512_fmadd_ps(x0, x0, a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void scale_mul(const float* x, float s, const float* w, float* y, int64_t n) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    if (w) {
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vs), _mm512_loadu_ps(w + i)));
        if (i < n) {
            const __mmask16 m = tail_mask(n - i);
            _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs),
                                                          _mm512_maskz_loadu_ps(m, w + i)));
        }
    } else {
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
        if (i < n) {
            const __mmask16 m = tail_mask(n - i);
            _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
        }
    }
}

void rope_head(float* x, const float* cc, const float* ss, int64_t n_rot, bool neox) {
    if (!neox) {
        for (int64_t j = 0; j < n_rot; j += 16) {
            const __mmask16 m = n_rot - j >= 16 ? (__mmask16)0xFFFF : tail_mask(n_rot - j);  // n_rot is even
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + j);
            const __m512 sw = _mm512_permute_ps(xv, 0xB1);  // swap adjacent pairs
            _mm512_mask_storeu_ps(x + j, m, _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, cc + j),
                                                            _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(m, ss + j))));
        }
        return;
    }
    const int64_t half = n_rot / 2;
    for (int64_t j = 0; j < half; j += 16) {
        const __mmask16 m = half - j >= 16 ? (__mmask16)0xFFFF : tail_mask(half - j);
        const __m512 x0 = _mm512_maskz_loadu_ps(m, x + j), x1 = _mm512_maskz_loadu_ps(m, x + half + j);
        _mm512_mask_storeu_ps(x + j, m, _mm512_fmadd_ps(x0, _mm512_maskz_loadu_ps(m, cc + j),
                                                        _mm512_mul_ps(x1, _mm512_maskz_loadu_ps(m, ss + j))));
        _mm512_mask_storeu_ps(x + half + j, m, _mm512_fmadd_ps(x1, _mm512_maskz_loadu_ps(m, cc + half + j),
                                                               _mm512_mul_ps(x0, _mm512_maskz_loadu_ps(m, ss + half + j))));
    }
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i*)(y + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        _mm256_mask_storeu_epi16(y + i, m,
                                 _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

// ---- attention blocks ----------------------------------------------------------------

// Sums of a0..a3 as one __m128 (a transposing reduction, cheaper than four reduce_add).
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline float max4(__m128 v, float m) {
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_movehdup_ps(v));
    const float r = _mm_cvtss_f32(v);
    return r > m ? r : m;
}

// NV vectors of 16 lanes cover head_dim; the last one is masked by `last`.
template <int NV>
float scores_f16_t(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, __mmask16 last,
                   float scale, float* out) {
    const __m128 vs = _mm_set1_ps(scale);
    __m128 mx4 = _mm_set1_ps(-INFINITY);
    float mx = -INFINITY;
    __m512 qv[NV];
    for (int i = 0; i < NV; i++) qv[i] = _mm512_maskz_loadu_ps(i == NV - 1 ? last : (__mmask16)0xFFFF, q + 16 * i);
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const uint16_t* r0 = (const uint16_t*)(base + idx[j] * stride);
        const uint16_t* r1 = (const uint16_t*)(base + idx[j + 1] * stride);
        const uint16_t* r2 = (const uint16_t*)(base + idx[j + 2] * stride);
        const uint16_t* r3 = (const uint16_t*)(base + idx[j + 3] * stride);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < NV; i++) {
            const __mmask16 m = i == NV - 1 ? last : (__mmask16)0xFFFF;
            a0 = _mm512_fmadd_ps(qv[i], load_h_mask(r0 + 16 * i, m), a0);
            a1 = _mm512_fmadd_ps(qv[i], load_h_mask(r1 + 16 * i, m), a1);
            a2 = _mm512_fmadd_ps(qv[i], load_h_mask(r2 + 16 * i, m), a2);
            a3 = _mm512_fmadd_ps(qv[i], load_h_mask(r3 + 16 * i, m), a3);
        }
        const __m128 s4 = _mm_mul_ps(reduce4(a0, a1, a2, a3), vs);
        mx4 = _mm_max_ps(mx4, s4);
        _mm_storeu_ps(out + j, s4);
    }
    for (; j < n; j++) {
        const uint16_t* r0 = (const uint16_t*)(base + idx[j] * stride);
        __m512 a0 = _mm512_setzero_ps();
        for (int i = 0; i < NV; i++)
            a0 = _mm512_fmadd_ps(qv[i], load_h_mask(r0 + 16 * i, i == NV - 1 ? last : (__mmask16)0xFFFF), a0);
        out[j] = _mm512_reduce_add_ps(a0) * scale;
        mx = out[j] > mx ? out[j] : mx;
    }
    return max4(mx4, mx);
}

float scores_f16(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, int64_t hd,
                 float scale, float* out) {
    const int nv = (int)((hd + 15) / 16);
    const __mmask16 last = (hd % 16) ? tail_mask(hd % 16) : (__mmask16)0xFFFF;
    switch (nv) {
#define CASE(N) \
    case N: return scores_f16_t<N>(q, base, stride, idx, n, last, scale, out);
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        default: {
            float mx = -INFINITY;
            for (int j = 0; j < n; j++) {
                out[j] = scale * dot_f16(q, (const uint16_t*)(base + idx[j] * stride), hd);
                mx = out[j] > mx ? out[j] : mx;
            }
            return mx;
        }
    }
}

// NB blocks of 32 cover head_dim.
template <int NB>
float scores_q8_0_t(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, float scale,
                    float* out) {
    const __m128 vs = _mm_set1_ps(scale);
    __m128 mx4 = _mm_set1_ps(-INFINITY);
    float mx = -INFINITY;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const block_q8_0* r[4];
        for (int c = 0; c < 4; c++) r[c] = (const block_q8_0*)(base + idx[j + c] * stride);
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int b = 0; b < NB; b++) {
            const __m512 q0 = _mm512_loadu_ps(q + 32 * b), q1 = _mm512_loadu_ps(q + 32 * b + 16);
            for (int c = 0; c < 4; c++) {
                const __m512 t = _mm512_fmadd_ps(q1, load_i8(r[c][b].qs + 16), _mm512_mul_ps(q0, load_i8(r[c][b].qs)));
                a[c] = _mm512_fmadd_ps(t, _mm512_set1_ps(_cvtsh_ss(r[c][b].d)), a[c]);
            }
        }
        const __m128 s4 = _mm_mul_ps(reduce4(a[0], a[1], a[2], a[3]), vs);
        mx4 = _mm_max_ps(mx4, s4);
        _mm_storeu_ps(out + j, s4);
    }
    for (; j < n; j++) {
        out[j] = scale * dot_q8_0(q, (const block_q8_0*)(base + idx[j] * stride), 32 * NB);
        mx = out[j] > mx ? out[j] : mx;
    }
    return max4(mx4, mx);
}

float scores_q8_0(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, int64_t hd,
                  float scale, float* out) {
    switch (hd / 32) {
#define CASE(N) \
    case N: return scores_q8_0_t<N>(q, base, stride, idx, n, scale, out);
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default: {
            float mx = -INFINITY;
            for (int j = 0; j < n; j++) {
                out[j] = scale * dot_q8_0(q, (const block_q8_0*)(base + idx[j] * stride), hd);
                mx = out[j] > mx ? out[j] : mx;
            }
            return mx;
        }
    }
}

// acc[0 : 16*NV) (last vector masked) += sum_j w[j] * row_j; the accumulators stay in registers.
template <int NV>
void accum_f16_t(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                 __mmask16 last) {
    // Short rows get a second set of accumulators (even/odd cells) so FMA latency, not the
    // chain through one register per lane group, sets the pace.
    constexpr int NS = NV <= 4 ? 2 : 1;
    __m512 a[NS][NV];
    for (int i = 0; i < NV; i++) {
        a[0][i] = _mm512_maskz_loadu_ps(i == NV - 1 ? last : (__mmask16)0xFFFF, acc + 16 * i);
        if (NS == 2) a[NS - 1][i] = _mm512_setzero_ps();
    }
    int j = 0;
    for (; j + NS <= n; j += NS)
        for (int s = 0; s < NS; s++) {
            const uint16_t* r = (const uint16_t*)(base + idx[j + s] * stride);
            const __m512 wj = _mm512_set1_ps(w[j + s]);
            for (int i = 0; i < NV; i++)
                a[s][i] = _mm512_fmadd_ps(wj, load_h_mask(r + 16 * i, i == NV - 1 ? last : (__mmask16)0xFFFF), a[s][i]);
        }
    for (; j < n; j++) {
        const uint16_t* r = (const uint16_t*)(base + idx[j] * stride);
        const __m512 wj = _mm512_set1_ps(w[j]);
        for (int i = 0; i < NV; i++)
            a[0][i] = _mm512_fmadd_ps(wj, load_h_mask(r + 16 * i, i == NV - 1 ? last : (__mmask16)0xFFFF), a[0][i]);
    }
    for (int i = 0; i < NV; i++) {
        const __m512 t = NS == 2 ? _mm512_add_ps(a[0][i], a[NS - 1][i]) : a[0][i];
        _mm512_mask_storeu_ps(acc + 16 * i, i == NV - 1 ? last : (__mmask16)0xFFFF, t);
    }
}

void accum_f16(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n,
               int64_t hd) {
    for (int64_t d0 = 0; d0 < hd; d0 += 128) {  // 8 vectors of accumulators per pass
        const int64_t len = hd - d0 < 128 ? hd - d0 : 128;
        const int nv = (int)((len + 15) / 16);
        const __mmask16 last = (len % 16) ? tail_mask(len % 16) : (__mmask16)0xFFFF;
        const unsigned char* b = base + d0 * 2;
        switch (nv) {
#define CASE(N) \
    case N: accum_f16_t<N>(acc + d0, w, b, stride, idx, n, last); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
    }
}

template <int NB>
void accum_q8_0_t(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n) {
    __m512 a[2 * NB];
    for (int i = 0; i < 2 * NB; i++) a[i] = _mm512_loadu_ps(acc + 16 * i);
    for (int j = 0; j < n; j++) {
        const block_q8_0* r = (const block_q8_0*)(base + idx[j] * stride);
        for (int b = 0; b < NB; b++) {
            const __m512 ad = _mm512_set1_ps(w[j] * _cvtsh_ss(r[b].d));
            a[2 * b] = _mm512_fmadd_ps(ad, load_i8(r[b].qs), a[2 * b]);
            a[2 * b + 1] = _mm512_fmadd_ps(ad, load_i8(r[b].qs + 16), a[2 * b + 1]);
        }
    }
    for (int i = 0; i < 2 * NB; i++) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

void accum_q8_0(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                int64_t hd) {
    for (int64_t b0 = 0; b0 < hd / 32; b0 += 4) {  // 4 blocks (8 vectors) of accumulators per pass
        const int64_t nb = hd / 32 - b0 < 4 ? hd / 32 - b0 : 4;
        float* a = acc + b0 * 32;
        const unsigned char* b = base + b0 * sizeof(block_q8_0);
        switch (nb) {
            case 1: accum_q8_0_t<1>(a, w, b, stride, idx, n); break;
            case 2: accum_q8_0_t<2>(a, w, b, stride, idx, n); break;
            case 3: accum_q8_0_t<3>(a, w, b, stride, idx, n); break;
            case 4: accum_q8_0_t<4>(a, w, b, stride, idx, n); break;
        }
    }
}

float exp_sum(float* s, int n, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
        const __mmask16 mk = tail_mask(n - j);
        const __m512 e = _mm512_maskz_mov_ps(mk, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), vm)));
        _mm512_mask_storeu_ps(s + j, mk, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

// ---- GQA: G query heads per pass over the rows (NV vectors of 16 cover head_dim) -------------

// Vector i of a row as 16 floats, for each KV type.
struct F16Row {
    const uint16_t* r;
    F16Row(const unsigned char* p) : r((const uint16_t*)p) {}
    __m512 load(int i, __mmask16 m) const { return load_h_mask(r + 16 * i, m); }
    static constexpr int bytes(int nv) { return nv * 32; }
};
struct Q8Row {  // head_dim is a multiple of 32, so no vector is partial
    const block_q8_0* r;
    Q8Row(const unsigned char* p) : r((const block_q8_0*)p) {}
    static constexpr int bytes(int nv) { return nv / 2 * (int)sizeof(block_q8_0); }
    __m512 load(int i, __mmask16) const {
        return _mm512_mul_ps(load_i8(r[i / 2].qs + 16 * (i % 2)), _mm512_set1_ps(_cvtsh_ss(r[i / 2].d)));
    }
};

// KV rows are a head's slice of each cell (a stride of all heads' bytes), visited through an
// index list: the hardware prefetchers miss them and the loop waits on memory (decoding at
// depth is a pass over the whole cache). Rows kPfCells ahead are fetched into L2 while these
// compute (into L1 they crowded it: qwen2.5-coder-0.5b at depth 4096, flash_attn 5.5-5.6 -> 4.2-5.3 ms a token).
constexpr int kPfCells = 24;
template <class Row, int NV>
inline void prefetch_rows(const unsigned char* base, size_t stride, const int32_t* idx, int j, int cnt, int n) {
    for (int c = 0; c < cnt; c++) {
        const int jj = j + kPfCells + c < n ? j + kPfCells + c : n - 1;
        const char* p = (const char*)base + (size_t)idx[jj] * stride;
        for (int off = 0; off < Row::bytes(NV); off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
    }
}

template <class Row, int NV, int G>
void scores_mh_t(const float* q, int64_t ldq, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                 __mmask16 last, float scale, float* out, int64_t ldo, float* mx) {
    const __m128 vs = _mm_set1_ps(scale);
    __m128 mx4[G];
    float mx1[G];
    for (int h = 0; h < G; h++) {
        mx4[h] = _mm_set1_ps(-INFINITY);
        mx1[h] = -INFINITY;
    }
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch_rows<Row, NV>(base, stride, idx, j, 4, n);
        const Row r0(base + idx[j] * stride), r1(base + idx[j + 1] * stride), r2(base + idx[j + 2] * stride),
            r3(base + idx[j + 3] * stride);
        __m512 a[G][4];  // registers only if every loop over them is unrolled
#pragma GCC unroll 4
        for (int h = 0; h < G; h++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) a[h][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int i = 0; i < NV; i++) {
            const __mmask16 m = i == NV - 1 ? last : (__mmask16)0xFFFF;
            const __m512 k0 = r0.load(i, m), k1 = r1.load(i, m), k2 = r2.load(i, m), k3 = r3.load(i, m);
#pragma GCC unroll 4
            for (int h = 0; h < G; h++) {
                const __m512 qv = _mm512_maskz_loadu_ps(m, q + h * ldq + 16 * i);
                a[h][0] = _mm512_fmadd_ps(qv, k0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(qv, k1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(qv, k2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(qv, k3, a[h][3]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < G; h++) {
            const __m128 s4 = _mm_mul_ps(reduce4(a[h][0], a[h][1], a[h][2], a[h][3]), vs);
            mx4[h] = _mm_max_ps(mx4[h], s4);
            _mm_storeu_ps(out + h * ldo + j, s4);
        }
    }
    for (; j < n; j++) {
        const Row r(base + idx[j] * stride);
        for (int h = 0; h < G; h++) {
            __m512 a = _mm512_setzero_ps();
            for (int i = 0; i < NV; i++) {
                const __mmask16 m = i == NV - 1 ? last : (__mmask16)0xFFFF;
                a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + h * ldq + 16 * i), r.load(i, m), a);
            }
            const float sv = _mm512_reduce_add_ps(a) * scale;
            out[h * ldo + j] = sv;
            mx1[h] = sv > mx1[h] ? sv : mx1[h];
        }
    }
    for (int h = 0; h < G; h++) mx[h] = max4(mx4[h], mx1[h]);
}

template <class Row, int NV, int G>
void accum_mh_t(float* acc, int64_t lda, const float* w, int64_t ldw, const unsigned char* base, size_t stride,
                const int32_t* idx, int n, __mmask16 last) {
    __m512 a[G][NV];  // registers only if every loop over them is unrolled (else GCC stores them each cell)
#pragma GCC unroll 4
    for (int h = 0; h < G; h++)
#pragma GCC unroll 16
        for (int i = 0; i < NV; i++)
            a[h][i] = _mm512_maskz_loadu_ps(i == NV - 1 ? last : (__mmask16)0xFFFF, acc + h * lda + 16 * i);
    for (int j = 0; j < n; j++) {
        prefetch_rows<Row, NV>(base, stride, idx, j, 1, n);
        const Row r(base + idx[j] * stride);
        __m512 wv[G];
#pragma GCC unroll 4
        for (int h = 0; h < G; h++) wv[h] = _mm512_set1_ps(w[h * ldw + j]);
#pragma GCC unroll 16
        for (int i = 0; i < NV; i++) {
            const __m512 vv = r.load(i, i == NV - 1 ? last : (__mmask16)0xFFFF);
#pragma GCC unroll 4
            for (int h = 0; h < G; h++) a[h][i] = _mm512_fmadd_ps(wv[h], vv, a[h][i]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < G; h++)
#pragma GCC unroll 16
        for (int i = 0; i < NV; i++)
            _mm512_mask_storeu_ps(acc + h * lda + 16 * i, i == NV - 1 ? last : (__mmask16)0xFFFF, a[h][i]);
}

// Heads in groups of up to 4 (3 when a row needs more than 4 vectors: registers). Shapes without
// an instance take the one-head kernels. A head's arithmetic is the same in any group (a group
// of 1 included), so its output does not depend on how many heads share the call (a tensor
// split by query heads attends part of a KV head's group).
template <class Row>
void scores_mh(const float* q, int64_t ldq, int nq, const unsigned char* base, size_t stride, const int32_t* idx,
               int n, int64_t hd, float scale, float* out, int64_t ldo, float* mx,
               float (*one)(const float*, const unsigned char*, size_t, const int32_t*, int, int64_t, float, float*)) {
    const int nv = (int)((hd + 15) / 16);
    const __mmask16 last = (hd % 16) ? tail_mask(hd % 16) : (__mmask16)0xFFFF;
    // 4 heads x 4 cells of accumulators whatever head_dim (its vectors stream through one
    // register), so every shape takes groups of 4
    const int gmax = 4;
    for (int h0 = 0; h0 < nq;) {
        const int g = nq - h0 < gmax ? nq - h0 : gmax;
        // CASE chain: the first matching instance runs; the else of the last is the fallback loop.
        const float* qh = q + h0 * ldq;
        float* oh = out + h0 * ldo;
#define CASE(NV_, G_) \
    if (nv == NV_ && g == G_) scores_mh_t<Row, NV_, G_>(qh, ldq, base, stride, idx, n, last, scale, oh, ldo, mx + h0); else
        CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4) CASE(5, 1) CASE(5, 2) CASE(5, 3) CASE(5, 4)
        CASE(8, 1) CASE(8, 2) CASE(8, 3) CASE(8, 4) CASE(16, 1) CASE(16, 2) CASE(16, 3) CASE(16, 4)
#undef CASE
        for (int h = 0; h < g; h++) mx[h0 + h] = one(qh + h * ldq, base, stride, idx, n, hd, scale, oh + h * ldo);
        h0 += g;
    }
}

template <class Row>
void accum_mh(float* acc, int64_t lda, int nq, const float* w, int64_t ldw, const unsigned char* base, size_t stride,
              const int32_t* idx, int n, int64_t hd, size_t elem_bytes_x32,
              void (*one)(float*, const float*, const unsigned char*, size_t, const int32_t*, int, int64_t)) {
    for (int64_t d0 = 0; d0 < hd; d0 += 128) {
        const int64_t len = hd - d0 < 128 ? hd - d0 : 128;
        const int nv = (int)((len + 15) / 16);
        const __mmask16 last = (len % 16) ? tail_mask(len % 16) : (__mmask16)0xFFFF;
        const int gmax = nv <= 4 ? 4 : 3;
        const unsigned char* b = base + d0 / 32 * elem_bytes_x32 + (d0 % 32) * (elem_bytes_x32 / 32);
        for (int h0 = 0; h0 < nq;) {
            const int g = nq - h0 < gmax ? nq - h0 : gmax;
            float* ah = acc + h0 * lda + d0;
            const float* wh = w + h0 * ldw;
#define CASE(NV_, G_) \
    if (nv == NV_ && g == G_) accum_mh_t<Row, NV_, G_>(ah, lda, wh, ldw, b, stride, idx, n, last); else
            CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4) CASE(5, 1) CASE(5, 2) CASE(5, 3)
            CASE(8, 1) CASE(8, 2) CASE(8, 3)
#undef CASE
            for (int h = 0; h < g; h++) one(ah + h * lda, wh + h * ldw, b, stride, idx, n, len);
            h0 += g;
        }
    }
}

void scores_f16_mh(const float* q, int64_t ldq, int nq, const unsigned char* base, size_t stride, const int32_t* idx,
                   int n, int64_t hd, float scale, float* out, int64_t ldo, float* mx) {
    scores_mh<F16Row>(q, ldq, nq, base, stride, idx, n, hd, scale, out, ldo, mx, scores_f16);
}
void accum_f16_mh(float* acc, int64_t lda, int nq, const float* w, int64_t ldw, const unsigned char* base,
                  size_t stride, const int32_t* idx, int n, int64_t hd) {
    accum_mh<F16Row>(acc, lda, nq, w, ldw, base, stride, idx, n, hd, 64, accum_f16);
}
void scores_q8_0_mh(const float* q, int64_t ldq, int nq, const unsigned char* base, size_t stride, const int32_t* idx,
                    int n, int64_t hd, float scale, float* out, int64_t ldo, float* mx) {
    scores_mh<Q8Row>(q, ldq, nq, base, stride, idx, n, hd, scale, out, ldo, mx, scores_q8_0);
}
void accum_q8_0_mh(float* acc, int64_t lda, int nq, const float* w, int64_t ldw, const unsigned char* base,
                   size_t stride, const int32_t* idx, int n, int64_t hd) {
    accum_mh<Q8Row>(acc, lda, nq, w, ldw, base, stride, idx, n, hd, sizeof(block_q8_0), accum_q8_0);
}

const OpsKernels kAvx512 = {"avx512",      dot_f16,       axpy_f16,    dot_q8_0,       axpy_q8_0,    scale,
                            sum_sq,        scale_mul,     rope_head,   to_f16,      scores_f16,     scores_q8_0,  accum_f16,
                            accum_q8_0,    exp_sum,       scores_f16_mh, accum_f16_mh, scores_q8_0_mh, accum_q8_0_mh};

}  // namespace

const OpsKernels& ops_kernels_avx512() { return kAvx512; }

}  // namespace stowlm::cpu
