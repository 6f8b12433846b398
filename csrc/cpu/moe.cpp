#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "error.h"

namespace stowlm::cpu {

namespace {

// Routing work is tiny for a few tokens: below this many elements it runs on the caller, as
// waking the pool would cost more than the work.
constexpr int64_t kInlineWork = 1 << 14;

template <class F>
void split(ThreadPool& pool, int64_t count, int64_t work, F&& fn) {
    if (work < kInlineWork) fn(0, count, 0);
    else pool.parallel_for(count, fn);
}

}  // namespace

void top_k(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const TopKParams& p, int32_t* ids,
           ThreadPool& pool) {
    const int64_t k = p.k;
    if (k < 1 || k > n) throw InvalidInput("top_k: k must be in [1, n]");
    const bool grouped = p.n_groups > 1;
    if (grouped && (n % p.n_groups || p.n_group_used < 1 || p.n_group_used > p.n_groups ||
                    k > n / p.n_groups * p.n_group_used))
        throw InvalidInput("top_k: the groups must divide the experts and the kept groups hold at least k");
    const bool plain = !p.bias && !grouped && p.gating != Gating::Sigmoid;  // select on the logits as they are
    split(pool, n_rows, n_rows * n * 8, [&](int64_t r0, int64_t r1, int) {
        std::vector<int32_t> idx((size_t)n);
        std::vector<float> score(plain ? 0 : (size_t)n);
        std::vector<int32_t> gidx(grouped ? (size_t)p.n_groups : 0);
        std::vector<float> gscore(grouped ? (size_t)p.n_groups : 0);
        for (int64_t r = r0; r < r1; r++) {
            const float* xr = x + r * ldx;
            if (!plain) {
                for (int64_t e = 0; e < n; e++) {
                    const float v = p.gating == Gating::Sigmoid ? 1.0f / (1.0f + std::exp(-xr[e])) : xr[e];
                    score[e] = p.bias ? v + p.bias[e] : v;
                }
                if (grouped) {
                    // A group's score is the sum of its two best; the others are masked out.
                    const int64_t per = n / p.n_groups;
                    for (int64_t gi = 0; gi < p.n_groups; gi++) {
                        float b1 = -INFINITY, b2 = -INFINITY;
                        for (int64_t e = gi * per; e < (gi + 1) * per; e++) {
                            if (score[e] > b1) b2 = b1, b1 = score[e];
                            else if (score[e] > b2) b2 = score[e];
                        }
                        gscore[gi] = per > 1 ? b1 + b2 : b1;
                        gidx[gi] = (int32_t)gi;
                    }
                    std::partial_sort(gidx.begin(), gidx.begin() + p.n_group_used, gidx.end(), [&](int32_t a, int32_t b) {
                        return gscore[a] > gscore[b] || (gscore[a] == gscore[b] && a < b);
                    });
                    for (int64_t gi = p.n_group_used; gi < p.n_groups; gi++)
                        std::fill(score.begin() + gidx[gi] * per, score.begin() + (gidx[gi] + 1) * per, -INFINITY);
                }
                xr = score.data();
            }
            for (int64_t i = 0; i < n; i++) idx[i] = (int32_t)i;
            std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [xr](int32_t a, int32_t b) {
                return xr[a] > xr[b] || (xr[a] == xr[b] && a < b);
            });
            std::copy(idx.begin(), idx.begin() + k, ids + r * k);
        }
    });
}

void moe_weights(const float* logits, int64_t n_tok, int64_t n_expert, const int32_t* ids, int64_t k, Gating gating,
                 bool normalize, float scale, float* w, ThreadPool& pool) {
    split(pool, n_tok, n_tok * n_expert * 8, [&](int64_t t0, int64_t t1, int) {
        for (int64_t t = t0; t < t1; t++) {
            const float* l = logits + t * n_expert;
            const int32_t* id = ids + t * k;
            float* wt = w + t * k;
            if (gating == Gating::Softmax) {
                float mx = l[0];
                for (int64_t e = 1; e < n_expert; e++) mx = std::max(mx, l[e]);
                double sum = 0;
                for (int64_t e = 0; e < n_expert; e++) sum += std::exp((double)(l[e] - mx));
                for (int64_t j = 0; j < k; j++) wt[j] = (float)(std::exp((double)(l[id[j]] - mx)) / sum);
            } else if (gating == Gating::SoftmaxSelected) {
                float mx = l[id[0]];
                for (int64_t j = 1; j < k; j++) mx = std::max(mx, l[id[j]]);
                double sum = 0;
                for (int64_t j = 0; j < k; j++) sum += std::exp((double)(l[id[j]] - mx));
                for (int64_t j = 0; j < k; j++) wt[j] = (float)(std::exp((double)(l[id[j]] - mx)) / sum);
            } else {
                for (int64_t j = 0; j < k; j++) wt[j] = 1.0f / (1.0f + std::exp(-l[id[j]]));
            }
            if (normalize) {
                float s = 0;
                for (int64_t j = 0; j < k; j++) s += wt[j];
                s = std::max(s, 6.103515625e-5f);
                for (int64_t j = 0; j < k; j++) wt[j] /= s;
            }
            if (scale != 0.0f && scale != 1.0f)
                for (int64_t j = 0; j < k; j++) wt[j] *= scale;
        }
    });
}

void add_id(float* x, const float* bias, int64_t n_expert, const int32_t* ids, int64_t n_tok, int64_t k, int64_t d,
            ThreadPool& pool) {
    for (int64_t i = 0; i < n_tok * k; i++)
        if (ids[i] < -1 || ids[i] >= n_expert)
            throw InvalidInput("add_id: expert id " + std::to_string(ids[i]) + " is outside [-1, " +
                               std::to_string(n_expert) + ")");
    split(pool, n_tok * k, n_tok * k * d, [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; i++) {
            if (ids[i] < 0) continue;  // no expert here (tensor parallelism): nothing to add
            const float* bi = bias + (int64_t)ids[i] * d;
            float* xi = x + i * d;
            for (int64_t c = 0; c < d; c++) xi[c] += bi[c];
        }
    });
}

void moe_sum(const float* e, const float* w, int64_t n_tok, int64_t k, int64_t d, float* y, ThreadPool& pool) {
    split(pool, n_tok * d, n_tok * d * k, [&](int64_t b, int64_t end, int) {
        // contiguous ranges of (token, column)
        while (b < end) {
            const int64_t t = b / d, c0 = b % d, c1 = std::min(d, c0 + (end - b));
            float* yt = y + t * d;
            for (int64_t c = c0; c < c1; c++) yt[c] = 0;
            for (int64_t j = 0; j < k; j++) {
                const float wj = w[t * k + j];
                const float* ej = e + (t * k + j) * d;
                for (int64_t c = c0; c < c1; c++) yt[c] += wj * ej[c];
            }
            b += c1 - c0;
        }
    });
}

}  // namespace stowlm::cpu
