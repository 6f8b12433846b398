// Decode attention on the CPU: one query token over a KV cache of a given depth, split as a
// model context splits it (single_sequence_split_cells of the context), per ISA and thread count:
// microseconds a call and GB/s of K and V read. What `stowlm-bench -v` shows as flash_attn at
// depth, alone, for a shape (GQA heads, head dim, KV type) and a kernel change.
//   bench-attn [--depth 4096] [--heads 9/3] [--hd 64] [--kv F16,Q8_0] [--threads 1,2]
//              [--isa scalar,avx2,avx512] [--seconds S] [--calls N]
// --calls N: exactly N timed calls (for an instruction count under callgrind), not --seconds' worth.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/cpu_features.h"
#include "cpu/ops.h"
#include "cpu/threadpool.h"
#include "quant/quantize.h"
#include "quant/types.h"

using namespace stowlm;

static std::vector<std::string> split(const std::string& s, char sep = ',') {
    std::vector<std::string> v;
    std::stringstream ss(s);
    std::string t;
    while (std::getline(ss, t, sep)) if (!t.empty()) v.push_back(t);
    return v;
}

int main(int argc, char** argv) {
    int64_t depth = 4096, hd = 64, n_head = 9, n_head_kv = 3;
    std::vector<std::string> kvs = {"F16"}, threads = {"1", "2"}, isas;
    double seconds = 1.0;
    int calls = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        std::string k = argv[i], v = argv[i + 1];
        if (k == "--depth") depth = atoll(v.c_str());
        else if (k == "--hd") hd = atoll(v.c_str());
        else if (k == "--heads") {
            const auto p = split(v, '/');
            n_head = atoll(p.at(0).c_str()), n_head_kv = p.size() > 1 ? atoll(p[1].c_str()) : n_head;
        } else if (k == "--kv") kvs = split(v);
        else if (k == "--threads") threads = split(v);
        else if (k == "--isa") isas = split(v);
        else if (k == "--seconds") seconds = atof(v.c_str());
        else if (k == "--calls") calls = atoi(v.c_str());
        else { fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
    }
    if (isas.empty())
        for (cpu::Isa i : {cpu::Isa::Scalar, cpu::Isa::AVX2, cpu::Isa::AVX512_VNNI})
            if (cpu::isa_supported(i)) isas.push_back(cpu::isa_name(i));
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<float> q(n_head * hd), out(n_head * hd);
    for (auto& x : q) x = nd(rng);
    std::vector<int32_t> kv_pos(depth), q_pos = {(int32_t)depth};
    for (int64_t j = 0; j < depth; j++) kv_pos[j] = (int32_t)j;
    printf("# depth %lld, %lld query heads over %lld KV heads, head dim %lld, one query token\n", (long long)depth,
           (long long)n_head, (long long)n_head_kv, (long long)hd);
    printf("%-5s %-7s %4s %10s %8s\n", "kv", "isa", "thr", "us/call", "GB/s");
    for (auto& kvn : kvs) {
        const QType t = kvn == "Q8_0" ? QType::Q8_0 : QType::F16;
        if (kvn != "F16" && kvn != "Q8_0") { fprintf(stderr, "unknown KV type %s (F16, Q8_0)\n", kvn.c_str()); return 2; }
        const size_t rb = row_bytes(t, hd), cell = (size_t)n_head_kv * rb;
        std::vector<float> row(hd);
        std::vector<uint8_t> k(depth * cell), v(depth * cell);
        for (auto* buf : {&k, &v})
            for (int64_t j = 0; j < depth * n_head_kv; j++) {
                for (auto& x : row) x = nd(rng);
                quantize_row(t, row.data(), buf->data() + j * rb, hd);
            }
        cpu::KvView kv;
        kv.k = k.data(), kv.v = v.data(), kv.type = t, kv.n_kv = depth, kv.n_head_kv = n_head_kv;
        kv.k_cell_bytes = kv.v_cell_bytes = cell, kv.hd_k = kv.hd_v = hd;
        cpu::AttnParams p;
        p.scale = 1.0f / std::sqrt((float)hd);
        p.split_cells = cpu::single_sequence_split_cells(depth + 64);  // a context a little deeper than the cells
        for (auto& isa_s : isas) {
            cpu::set_isa(cpu::isa_from_name(isa_s));
            for (auto& th_s : threads) {
                const int nth = atoi(th_s.c_str());
                ThreadPool pool(nth);
                std::vector<uint8_t> scratch(
                    cpu::flash_attn_scratch_bytes(1, n_head, hd, hd, nth, depth, p.split_cells, false));
                auto call = [&] {
                    cpu::flash_attn(q.data(), 1, n_head, n_head * hd, kv, q_pos.data(), kv_pos.data(), p, out.data(),
                                    n_head * hd, scratch.data(), pool);
                };
                call();
                int reps = 0;
                const auto t0 = std::chrono::steady_clock::now();
                double el = 0;
                do {
                    call();
                    reps++;
                    el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                } while (calls > 0 ? reps < calls : el < seconds);
                const double per = el / reps;
                printf("%-5s %-7s %4d %10.1f %8.2f\n", kvn.c_str(), isa_s.c_str(), nth, per * 1e6,
                       2.0 * depth * cell / per / 1e9);
                fflush(stdout);
            }
        }
    }
    return 0;
}
