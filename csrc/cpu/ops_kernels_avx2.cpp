// AVX2 + FMA + F16C inner loops of the ops; tails fall back to scalar code.
#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "common.h"
#include "cpu/ops_kernels.h"

namespace stowlm::cpu {

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline __m256 load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

float dot_f16(const float* q, const uint16_t* k, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_h(k + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load_h(k + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_h(k + i), a0);
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += q[i] * fp16_to_f32(k[i]);
    return s;
}

void axpy_f16(float* acc, float a, const uint16_t* v, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(va, load_h(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] += a * fp16_to_f32(v[i]);
}

float dot_q8_0(const float* q, const block_q8_0* k, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK; b++) {
        const float* qb = q + b * QK;
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(qb), load_i8(k[b].qs));
        t = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 8), load_i8(k[b].qs + 8), t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 16), load_i8(k[b].qs + 16), t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 24), load_i8(k[b].qs + 24), t);
        acc = _mm256_fmadd_ps(t, _mm256_set1_ps(_cvtsh_ss(k[b].d)), acc);
    }
    return hsum(acc);
}

void axpy_q8_0(float* acc, float a, const block_q8_0* v, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++) {
        float* ab = acc + b * QK;
        const __m256 ad = _mm256_set1_ps(a * _cvtsh_ss(v[b].d));
        for (int j = 0; j < QK; j += 8)
            _mm256_storeu_ps(ab + j, _mm256_fmadd_ps(ad, load_i8(v[b].qs + j), _mm256_loadu_ps(ab + j)));
    }
}

void scale(float* x, float s, int64_t n) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    for (; i < n; i++) x[i] *= s;
}

float sum_sq(const float* x, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
        a1 = _mm256_fmadd_ps(x1, x1, a1);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
    }
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

void scale_mul(const float* x, float s, const float* w, float* y, int64_t n) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    if (w) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(w + i)));
        for (; i < n; i++) y[i] = x[i] * s * w[i];
    } else {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
        for (; i < n; i++) y[i] = x[i] * s;
    }
}

void rope_head(float* x, const float* cc, const float* ss, int64_t n_rot, bool neox) {
    int64_t j = 0;
    if (!neox) {
        for (; j + 8 <= n_rot; j += 8) {
            const __m256 xv = _mm256_loadu_ps(x + j);
            const __m256 sw = _mm256_permute_ps(xv, 0xB1);  // swap adjacent pairs
            _mm256_storeu_ps(x + j, _mm256_fmadd_ps(xv, _mm256_loadu_ps(cc + j), _mm256_mul_ps(sw, _mm256_loadu_ps(ss + j))));
        }
        for (; j < n_rot; j += 2) {
            const float x0 = x[j], x1 = x[j + 1];
            x[j] = x0 * cc[j] + x1 * ss[j];
            x[j + 1] = x1 * cc[j + 1] + x0 * ss[j + 1];
        }
        return;
    }
    const int64_t half = n_rot / 2;
    for (; j + 8 <= half; j += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + half + j);
        _mm256_storeu_ps(x + j, _mm256_fmadd_ps(x0, _mm256_loadu_ps(cc + j), _mm256_mul_ps(x1, _mm256_loadu_ps(ss + j))));
        _mm256_storeu_ps(x + half + j, _mm256_fmadd_ps(x1, _mm256_loadu_ps(cc + half + j),
                                                       _mm256_mul_ps(x0, _mm256_loadu_ps(ss + half + j))));
    }
    for (; j < half; j++) {
        const float x0 = x[j], x1 = x[half + j];
        x[j] = x0 * cc[j] + x1 * ss[j];
        x[half + j] = x1 * cc[half + j] + x0 * ss[half + j];
    }
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = f32_to_fp16(x[i]);
}

// ---- attention blocks (head_dim a multiple of 8; others take the per-row path) ----------

inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

inline float max4(__m128 v, float m) {
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_movehdup_ps(v));
    const float r = _mm_cvtss_f32(v);
    return r > m ? r : m;
}

float scores_f16(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, int64_t hd,
                 float scale, float* out) {
    const __m128 vs = _mm_set1_ps(scale);
    __m128 mx4 = _mm_set1_ps(-INFINITY);
    float mx = -INFINITY;
    int j = 0;
    if (hd % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            const uint16_t* r0 = (const uint16_t*)(base + idx[j] * stride);
            const uint16_t* r1 = (const uint16_t*)(base + idx[j + 1] * stride);
            const uint16_t* r2 = (const uint16_t*)(base + idx[j + 2] * stride);
            const uint16_t* r3 = (const uint16_t*)(base + idx[j + 3] * stride);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < hd; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(qv, load_h(r0 + i), a0);
                a1 = _mm256_fmadd_ps(qv, load_h(r1 + i), a1);
                a2 = _mm256_fmadd_ps(qv, load_h(r2 + i), a2);
                a3 = _mm256_fmadd_ps(qv, load_h(r3 + i), a3);
            }
            const __m128 s4 = _mm_mul_ps(reduce4(a0, a1, a2, a3), vs);
            mx4 = _mm_max_ps(mx4, s4);
            _mm_storeu_ps(out + j, s4);
        }
    }
    for (; j < n; j++) {
        out[j] = scale * dot_f16(q, (const uint16_t*)(base + idx[j] * stride), hd);
        mx = out[j] > mx ? out[j] : mx;
    }
    return max4(mx4, mx);
}

float scores_q8_0(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, int64_t hd,
                  float scale, float* out) {
    const __m128 vs = _mm_set1_ps(scale);
    __m128 mx4 = _mm_set1_ps(-INFINITY);
    float mx = -INFINITY;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const block_q8_0* r[4];
        for (int c = 0; c < 4; c++) r[c] = (const block_q8_0*)(base + idx[j + c] * stride);
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < hd / QK; b++) {
            const float* qb = q + b * QK;
            const __m256 q0 = _mm256_loadu_ps(qb), q1 = _mm256_loadu_ps(qb + 8), q2 = _mm256_loadu_ps(qb + 16),
                         q3 = _mm256_loadu_ps(qb + 24);
            for (int c = 0; c < 4; c++) {
                const int8_t* qs = r[c][b].qs;
                __m256 t = _mm256_mul_ps(q0, load_i8(qs));
                t = _mm256_fmadd_ps(q1, load_i8(qs + 8), t);
                t = _mm256_fmadd_ps(q2, load_i8(qs + 16), t);
                t = _mm256_fmadd_ps(q3, load_i8(qs + 24), t);
                a[c] = _mm256_fmadd_ps(t, _mm256_set1_ps(_cvtsh_ss(r[c][b].d)), a[c]);
            }
        }
        const __m128 s4 = _mm_mul_ps(reduce4(a[0], a[1], a[2], a[3]), vs);
        mx4 = _mm_max_ps(mx4, s4);
        _mm_storeu_ps(out + j, s4);
    }
    for (; j < n; j++) {
        out[j] = scale * dot_q8_0(q, (const block_q8_0*)(base + idx[j] * stride), hd);
        mx = out[j] > mx ? out[j] : mx;
    }
    return max4(mx4, mx);
}

template <int NV>
void accum_f16_t(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n) {
    __m256 a[NV];
    for (int i = 0; i < NV; i++) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int j = 0; j < n; j++) {
        const uint16_t* r = (const uint16_t*)(base + idx[j] * stride);
        const __m256 wj = _mm256_set1_ps(w[j]);
        for (int i = 0; i < NV; i++) a[i] = _mm256_fmadd_ps(wj, load_h(r + 8 * i), a[i]);
    }
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

void accum_f16(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n,
               int64_t hd) {
    if (hd % 8 != 0) {
        for (int j = 0; j < n; j++) axpy_f16(acc, w[j], (const uint16_t*)(base + idx[j] * stride), hd);
        return;
    }
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {  // 8 vectors of accumulators per pass
        const int nv = (int)((hd - d0 < 64 ? hd - d0 : 64) / 8);
        const unsigned char* b = base + d0 * 2;
        switch (nv) {
#define CASE(N) \
    case N: accum_f16_t<N>(acc + d0, w, b, stride, idx, n); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
    }
}

template <int NB>
void accum_q8_0_t(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n) {
    __m256 a[4 * NB];
    for (int i = 0; i < 4 * NB; i++) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int j = 0; j < n; j++) {
        const block_q8_0* r = (const block_q8_0*)(base + idx[j] * stride);
        for (int b = 0; b < NB; b++) {
            const __m256 ad = _mm256_set1_ps(w[j] * _cvtsh_ss(r[b].d));
            for (int i = 0; i < 4; i++) a[4 * b + i] = _mm256_fmadd_ps(ad, load_i8(r[b].qs + 8 * i), a[4 * b + i]);
        }
    }
    for (int i = 0; i < 4 * NB; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

void accum_q8_0(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                int64_t hd) {
    for (int64_t b0 = 0; b0 < hd / QK; b0 += 2) {  // 2 blocks (8 vectors) of accumulators per pass
        const unsigned char* b = base + b0 * sizeof(block_q8_0);
        if (hd / QK - b0 >= 2) accum_q8_0_t<2>(acc + b0 * QK, w, b, stride, idx, n);
        else accum_q8_0_t<1>(acc + b0 * QK, w, b, stride, idx, n);
    }
}

// exp(x), Cephes-style reduction and polynomial; x is clamped at -87 so 2^n stays normal
// (the result there, ~1e-38, is as good as zero for softmax weights).
inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

float exp_sum(float* s, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

// ---- GQA: up to 3 query heads per pass over the rows (16 ymm registers allow no more) ------

struct F16Row {
    const uint16_t* r;
    F16Row(const unsigned char* p) : r((const uint16_t*)p) {}
    __m256 load(int64_t i) const { return load_h(r + 8 * i); }
    static constexpr double kElemBytes = 2;
};
struct Q8Row {
    const block_q8_0* r;
    Q8Row(const unsigned char* p) : r((const block_q8_0*)p) {}
    static constexpr double kElemBytes = sizeof(block_q8_0) / 32.0;
    __m256 load(int64_t i) const {
        return _mm256_mul_ps(load_i8(r[i / 4].qs + 8 * (i % 4)), _mm256_set1_ps(_cvtsh_ss(r[i / 4].d)));
    }
};

// The rows ahead in the index list, fetched while these compute (see the AVX-512 file: the
// hardware prefetchers miss a head's strided slices of the cells).
constexpr int kPfCells = 24;
inline void prefetch_ahead(const unsigned char* base, size_t stride, const int32_t* idx, int j, int n, int bytes) {
    const int jj = j + kPfCells < n ? j + kPfCells : n - 1;
    const char* p = (const char*)base + (size_t)idx[jj] * stride;
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// H heads (1 to 3) at a time; nv vectors of 8 cover head_dim (a multiple of 8). A head's
// arithmetic is the same whatever H, so its output does not depend on how many heads share the
// call (a tensor split by query heads attends part of a KV head's group).
// NV > 0: nv fixed at compile time (head dims 64 and 128), the loop over a row unrolled.
template <class Row, int H, int NV = 0>
void scores_mhn(const float* q, int64_t ldq, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                int64_t nv_, float scale, float* out, int64_t ldo, float* mx,
                float (*one)(const float*, const unsigned char*, size_t, const int32_t*, int, int64_t, float, float*)) {
    const int64_t nv = NV > 0 ? NV : nv_;
    const __m128 vs = _mm_set1_ps(scale);
    __m128 m[H];
    for (int h = 0; h < H; h++) m[h] = _mm_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        for (int c = 0; c < 4; c++) prefetch_ahead(base, stride, idx, j + c, n, (int)(nv * 8 * Row::kElemBytes));
        const Row r0(base + idx[j] * stride), r1(base + idx[j + 1] * stride), r2(base + idx[j + 2] * stride),
            r3(base + idx[j + 3] * stride);
        __m256 a[H][4];
        for (int h = 0; h < H; h++)
            for (int c = 0; c < 4; c++) a[h][c] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int64_t i = 0; i < nv; i++) {
            const __m256 k0 = r0.load(i), k1 = r1.load(i), k2 = r2.load(i), k3 = r3.load(i);
            for (int h = 0; h < H; h++) {
                const __m256 qv = _mm256_loadu_ps(q + h * ldq + 8 * i);
                a[h][0] = _mm256_fmadd_ps(qv, k0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(qv, k1, a[h][1]);
                a[h][2] = _mm256_fmadd_ps(qv, k2, a[h][2]);
                a[h][3] = _mm256_fmadd_ps(qv, k3, a[h][3]);
            }
        }
        for (int h = 0; h < H; h++) {
            const __m128 sv = _mm_mul_ps(reduce4(a[h][0], a[h][1], a[h][2], a[h][3]), vs);
            m[h] = _mm_max_ps(m[h], sv);
            _mm_storeu_ps(out + h * ldo + j, sv);
        }
    }
    for (int h = 0; h < H; h++) {
        const float t = j < n ? one(q + h * ldq, base, stride, idx + j, n - j, 8 * nv, scale, out + h * ldo + j)
                              : -INFINITY;
        mx[h] = max4(m[h], t);
    }
}

// acc[0:32) of H heads (1 to 3) += sum_j w[j] * row_j[0:32)
template <class Row, int H>
void accum_mhn(float* acc, int64_t lda, const float* w, int64_t ldw, const unsigned char* base, size_t stride,
               const int32_t* idx, int n) {
    __m256 a[H][4];
    for (int h = 0; h < H; h++)
        for (int i = 0; i < 4; i++) a[h][i] = _mm256_loadu_ps(acc + h * lda + 8 * i);
    for (int j = 0; j < n; j++) {
        prefetch_ahead(base, stride, idx, j, n, (int)(32 * Row::kElemBytes));
        const Row r(base + idx[j] * stride);
        __m256 wv[H];
        for (int h = 0; h < H; h++) wv[h] = _mm256_set1_ps(w[h * ldw + j]);
        for (int i = 0; i < 4; i++) {
            const __m256 v = r.load(i);
            for (int h = 0; h < H; h++) a[h][i] = _mm256_fmadd_ps(wv[h], v, a[h][i]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + h * lda + 8 * i, a[h][i]);
}

template <class Row>
void scores_mh(const float* q, int64_t ldq, int nq, const unsigned char* base, size_t stride, const int32_t* idx,
               int n, int64_t hd, float scale, float* out, int64_t ldo, float* mx,
               float (*one)(const float*, const unsigned char*, size_t, const int32_t*, int, int64_t, float, float*)) {
    int h = 0;
    if (hd % 8 == 0) {
        auto run = [&](auto nv) {
            for (; h + 3 <= nq; h += 3)
                scores_mhn<Row, 3, nv()>(q + h * ldq, ldq, base, stride, idx, n, hd / 8, scale, out + h * ldo, ldo, mx + h, one);
            for (; h + 2 <= nq; h += 2)
                scores_mhn<Row, 2, nv()>(q + h * ldq, ldq, base, stride, idx, n, hd / 8, scale, out + h * ldo, ldo, mx + h, one);
            if (h < nq) scores_mhn<Row, 1, nv()>(q + h * ldq, ldq, base, stride, idx, n, hd / 8, scale, out + h * ldo, ldo, mx + h, one);
        };
        if (hd == 64) run(std::integral_constant<int, 8>{});
        else if (hd == 128) run(std::integral_constant<int, 16>{});
        else run(std::integral_constant<int, 0>{});
        return;
    }
    for (; h < nq; h++) mx[h] = one(q + h * ldq, base, stride, idx, n, hd, scale, out + h * ldo);
}

// elem_bytes_x32: bytes of 32 elements of the row type.
template <class Row>
void accum_mh(float* acc, int64_t lda, int nq, const float* w, int64_t ldw, const unsigned char* base, size_t stride,
              const int32_t* idx, int n, int64_t hd, size_t elem_bytes_x32,
              void (*one)(float*, const float*, const unsigned char*, size_t, const int32_t*, int, int64_t)) {
    const int64_t hd32 = hd / 32 * 32;
    for (int h = 0; h < nq;) {
        const int k = nq - h >= 3 ? 3 : nq - h;  // heads this pass
        for (int64_t d0 = 0; d0 < hd32; d0 += 32) {
            float* a = acc + h * lda + d0;
            const unsigned char* b = base + d0 / 32 * elem_bytes_x32;
            if (k == 3) accum_mhn<Row, 3>(a, lda, w + h * ldw, ldw, b, stride, idx, n);
            else if (k == 2) accum_mhn<Row, 2>(a, lda, w + h * ldw, ldw, b, stride, idx, n);
            else accum_mhn<Row, 1>(a, lda, w + h * ldw, ldw, b, stride, idx, n);
        }
        h += k;
    }
    if (hd32 < hd)  // F16 rows whose length is not a multiple of 32: the rest one head at a time
        for (int h = 0; h < nq; h++) one(acc + h * lda + hd32, w + h * ldw, base + hd32 * 2, stride, idx, n, hd - hd32);
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

const OpsKernels kAvx2 = {"avx2",       dot_f16,      axpy_f16,      dot_q8_0,     axpy_q8_0,      scale,
                          sum_sq,       scale_mul,    rope_head,     to_f16,       scores_f16,     scores_q8_0,
                          accum_f16,    accum_q8_0,   exp_sum,       scores_f16_mh, accum_f16_mh,  scores_q8_0_mh,
                          accum_q8_0_mh};

}  // namespace

const OpsKernels& ops_kernels_avx2() { return kAvx2; }

}  // namespace stowlm::cpu
