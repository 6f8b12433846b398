// AVX-512 prefill attention unit (attn_prefill.h).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "cpu/attn_math.h"
#include "cpu/attn_prefill.h"
#include "cpu/vec_exp.h"

namespace stowlm::cpu {

namespace {

constexpr int BK = (int)kPrefillBlock;
constexpr int NC = BK / 16;  // 16-cell vectors per block

inline float* align_up(unsigned char*& p, size_t bytes) {
    float* r = (float*)p;
    p += (bytes + 63) & ~(size_t)63;
    return r;
}

// S[r][j] = sum_d Q[r][d] * Kt[d][j] for 4 rows from r0, all BK cells.
inline void scores4(const float* Q, int64_t hd, const float* Kt, float* S) {
    __m512 a[4][NC];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NC; c++) a[i][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        __m512 k[NC];
        for (int c = 0; c < NC; c++) k[c] = _mm512_load_ps(Kt + d * BK + 16 * c);
        for (int i = 0; i < 4; i++) {
            const __m512 qb = _mm512_set1_ps(Q[i * hd + d]);
            for (int c = 0; c < NC; c++) a[i][c] = _mm512_fmadd_ps(qb, k[c], a[i][c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NC; c++) _mm512_store_ps(S + i * BK + 16 * c, a[i][c]);
}

// O[i] += sum_{j < n} P[i][j] * V[j] for 4 rows (O rows at o[i]), 64 dims from d0.
inline void pv4(float* const* o, int64_t d0, const float* P, const float* V, int64_t hd, int n) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(o[i] + d0 + 16 * c);
    for (int j = 0; j < n; j++) {
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = _mm512_load_ps(V + j * hd + d0 + 16 * c);
        for (int i = 0; i < 4; i++) {
            const __m512 pb = _mm512_set1_ps(P[i * BK + j]);
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(pb, v[c], a[i][c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[i] + d0 + 16 * c, a[i][c]);
}
// The same for the last 16-dim vectors when hd is not a multiple of 64.
inline void pv4_1(float* const* o, int64_t d0, const float* P, const float* V, int64_t hd, int n) {
    __m512 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm512_loadu_ps(o[i] + d0);
    for (int j = 0; j < n; j++) {
        const __m512 v = _mm512_load_ps(V + j * hd + d0);
        for (int i = 0; i < 4; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(P[i * BK + j]), v, a[i]);
    }
    for (int i = 0; i < 4; i++) _mm512_storeu_ps(o[i] + d0, a[i]);
}

inline float reduce_max(const __m512* v) {
    __m512 m = v[0];
    for (int c = 1; c < NC; c++) m = _mm512_max_ps(m, v[c]);
    return _mm512_reduce_max_ps(m);
}

}  // namespace

void flash_prefill_unit_avx512(const PrefillArgs& a, int64_t t0, int64_t t1, int64_t g, void* ws) {
    const int64_t hd_k = a.hd_k, hd_v = a.hd_v, n_rep = a.n_rep;
    const int nt = (int)(t1 - t0);
    const int R = (int)(nt * n_rep), Rp = (R + 3) & ~3;
    unsigned char* p = (unsigned char*)ws;
    float* Q = align_up(p, (size_t)kPrefillRows * hd_k * 4);
    float* Kt = align_up(p, (size_t)hd_k * BK * 4);
    float* V = align_up(p, (size_t)BK * hd_v * 4);
    float* P = align_up(p, (size_t)kPrefillRows * BK * 4);
    float* ml = align_up(p, 2 * kPrefillRows * 4);
    float* sink = align_up(p, 4 * hd_v * 4);
    uint64_t* tmask = (uint64_t*)align_up(p, kPrefillRows * 8);

    // Rows r = token * n_rep + head: queries pre-scaled, outputs (padding rows go to the sink).
    float* orow[kPrefillRows];
    for (int r = 0; r < Rp; r++) {
        float* qd = Q + r * hd_k;
        if (r < R) {
            const int64_t t = t0 + r / n_rep, h = g * n_rep + r % n_rep;
            const float* qs = a.q + t * a.ld_q + h * hd_k;
            for (int64_t d = 0; d < hd_k; d += 16)
                _mm512_storeu_ps(qd + d, _mm512_mul_ps(_mm512_loadu_ps(qs + d), _mm512_set1_ps(a.scale)));
            orow[r] = a.out + t * a.ld_out + h * hd_v;
        } else {
            memset(qd, 0, hd_k * 4);
            orow[r] = sink + (r - R) * hd_v;
        }
        memset(orow[r], 0, hd_v * 4);
        ml[2 * r] = -INFINITY;
        ml[2 * r + 1] = 0.0f;
    }

    const unsigned char* kb0 = a.k + g * a.rb_k;
    const unsigned char* vb0 = a.v + g * a.rb_v;
    const __m512i cell_off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32((int)a.k_cell_bytes));
    // with sequence regions, the cells the tile's tokens can see lie in [lo, hi)
    int64_t lo = 0, hi = a.n_kv;
    if (a.q_seq && a.seq_cells > 0) {
        lo = INT64_MAX, hi = 0;
        for (int t = 0; t < nt; t++) {
            int64_t l, h;
            attn_seq_region(a.q_seq[t0 + t], (int32_t)a.seq_cells, a.n_kv, &l, &h, a.seq_end);
            lo = std::min(lo, l), hi = std::max(hi, h);
        }
    }
    for (int64_t jb = lo / BK * BK; jb < std::min(hi, a.n_kv); jb += BK) {
        const int nb = (int)std::min<int64_t>(BK, a.n_kv - jb);
        // visibility per token: kp >= 0, causal kp <= qp, window qp - kp < window
        uint64_t any = 0;
        for (int t = 0; t < nt; t++) {
            const int32_t qp = a.q_pos[t0 + t];
            const __m512i vq = _mm512_set1_epi32(qp);
            const int64_t lo = a.window > 0 ? (int64_t)qp - a.window : (int64_t)INT_MIN;
            const __m512i vlo = _mm512_set1_epi32((int32_t)std::max<int64_t>(lo, INT_MIN));
            uint64_t m = 0;
            for (int c = 0; c < NC && 16 * c < nb; c++) {
                const int left = nb - 16 * c;
                const __mmask16 in = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
                const __m512i kp = _mm512_maskz_loadu_epi32(in, a.kv_pos + jb + 16 * c);
                __mmask16 ok = _mm512_mask_cmpge_epi32_mask(in, kp, _mm512_setzero_si512());
                if (a.causal) ok = _mm512_mask_cmple_epi32_mask(ok, kp, vq);
                if (a.window > 0 && lo > INT_MIN) ok = _mm512_mask_cmpgt_epi32_mask(ok, kp, vlo);
                if (a.q_seq)
                    ok = _mm512_mask_cmpeq_epi32_mask(ok, _mm512_maskz_loadu_epi32(in, a.kv_seq + jb + 16 * c),
                                                      _mm512_set1_epi32(a.q_seq[t0 + t]));
                m |= (uint64_t)ok << (16 * c);
            }
            tmask[t] = m;
            any |= m;
        }
        if (!any) continue;

        // K^T and V of the block in float; cells no row sees are zero (they may be unwritten)
        for (int c = 0; c < NC; c++) {
            const __mmask16 cm = (__mmask16)(any >> (16 * c));
            const unsigned char* kc = kb0 + (size_t)(jb + 16 * c) * a.k_cell_bytes;
            for (int64_t e = 0; e < hd_k / 2; e++) {
                const __m512i w = cm ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), cm, cell_off, kc + 4 * e, 1)
                                     : _mm512_setzero_si512();
                _mm512_store_ps(Kt + (2 * e) * BK + 16 * c, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w)));
                _mm512_store_ps(Kt + (2 * e + 1) * BK + 16 * c,
                                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16))));
            }
        }
        for (int j = 0; j < nb; j++) {
            float* vd = V + j * hd_v;
            if (any >> j & 1) {
                const uint16_t* vs = (const uint16_t*)(vb0 + (size_t)(jb + j) * a.v_cell_bytes);
                for (int64_t d = 0; d < hd_v; d += 16)
                    _mm512_store_ps(vd + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(vs + d))));
            } else {
                memset(vd, 0, hd_v * 4);
            }
        }

        for (int r0 = 0; r0 < Rp; r0 += 4) scores4(Q + r0 * hd_k, hd_k, Kt, P + r0 * BK);

        // online softmax per row; P becomes the weights (0 where masked)
        for (int r = 0; r < Rp; r++) {
            float* pr = P + r * BK;
            const uint64_t m = r < R ? tmask[r / n_rep] : 0;
            if (!m) {
                for (int c = 0; c < NC; c++) _mm512_store_ps(pr + 16 * c, _mm512_setzero_ps());
                continue;
            }
            if (a.softcap != 0.0f)
                for (int j = 0; j < BK; j++) pr[j] = apply_softcap(pr[j], a.softcap);
            __m512 s[NC];
            for (int c = 0; c < NC; c++)
                s[c] = _mm512_mask_blend_ps((__mmask16)(m >> (16 * c)), _mm512_set1_ps(-INFINITY), _mm512_load_ps(pr + 16 * c));
            float* st = ml + 2 * r;
            const float f = online_softmax_rescale(st[0], st[1], reduce_max(s));
            if (f != 1.0f) {
                float* o = orow[r];
                for (int64_t d = 0; d < hd_v; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(f)));
            }
            const __m512 vm = _mm512_set1_ps(st[0]);
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < NC; c++) {
                const __m512 e = _mm512_maskz_mov_ps((__mmask16)(m >> (16 * c)), exp_ps(_mm512_sub_ps(s[c], vm)));
                _mm512_store_ps(pr + 16 * c, e);
                sum = _mm512_add_ps(sum, e);
            }
            st[1] += _mm512_reduce_add_ps(sum);
        }

        // last visible cell + 1: the P V loop stops there
        const int n_used = 64 - __builtin_clzll(any);
        for (int r0 = 0; r0 < Rp; r0 += 4) {
            float* const* o = orow + r0;
            const float* pr = P + r0 * BK;
            int64_t d0 = 0;
            for (; d0 + 64 <= hd_v; d0 += 64) pv4(o, d0, pr, V, hd_v, n_used);
            for (; d0 < hd_v; d0 += 16) pv4_1(o, d0, pr, V, hd_v, n_used);
        }
    }
    for (int r = 0; r < R; r++) {
        float f = 1.0f;
        if (a.sinks) f = attn_sink(ml[2 * r], ml[2 * r + 1], a.sinks[g * n_rep + r % n_rep]);
        const float l = ml[2 * r + 1];
        const __m512 inv = _mm512_set1_ps(l > 0 ? f / l : 0.0f);  // no visible cell: zeros
        float* o = orow[r];
        for (int64_t d = 0; d < hd_v; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
    }
}

}  // namespace stowlm::cpu
