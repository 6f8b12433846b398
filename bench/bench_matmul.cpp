// Throughput of the CPU matmul per weight type, kernel path and thread count:
// matrix-vector (n_tok=1: GOP/s and GB/s of weights streamed) and matrix-matrix
// (n_tok=512: GOP/s and % of the INT8 peak given with --peak-vnni / --peak-amx, in TOPS).
// x1tok: the call's wall time over the same type, path and threads at n_tok 1 (when in --ntok):
// what a few tokens decoded together cost against one (the row kernels below 24 tokens).
//   bench-matmul [--rows N] [--cols N] [--ntok 1,512] [--threads 1,2] [--types Q4_0,Q4_K,Q8_0,Q6_K]
//                [--isa scalar,avx2,avx512,amx] [--seconds S] [--peak-vnni 1.9] [--peak-amx 15]
//                [--layouts gguf,r16]   (r16: the weights repacked into 16-row groups, cpu/repack.h)
#include <chrono>
#include <map>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common.h"
#include "cpu/cpu_features.h"
#include "cpu/matmul.h"
#include "cpu/repack.h"
#include "quant/blocks.h"
#include "quant/types.h"

using namespace stowlm;

static double cpu_seconds() {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> v;
    std::stringstream ss(s);
    std::string t;
    while (std::getline(ss, t, ',')) if (!t.empty()) v.push_back(t);
    return v;
}

// Random blocks with sane scales (random bytes elsewhere): timing does not depend on values.
static std::vector<uint8_t> make_weights(QType t, int64_t rows, int64_t cols) {
    const QTypeInfo& info = qtype_checked((uint32_t)t);
    const size_t nb = rows * cols / info.block_elems;
    std::vector<uint8_t> w(nb * info.block_bytes);
    std::mt19937 rng(1);
    for (auto& b : w) b = (uint8_t)rng();
    std::vector<int> f16_fields;
    switch (t) {
        case QType::Q4_K: case QType::Q5_K: case QType::Q4_1: case QType::Q5_1: f16_fields = {0, 2}; break;
        case QType::Q6_K: f16_fields = {208}; break;
        case QType::Q2_K: f16_fields = {80, 82}; break;
        case QType::Q3_K: f16_fields = {108}; break;
        case QType::MXFP4: case QType::IQ1_M: break;  // below
        default: f16_fields = {0};
    }
    const uint16_t h = f32_to_fp16(0.01f);
    for (size_t i = 0; i < nb; i++) {
        uint8_t* blk = &w[i * info.block_bytes];
        for (int off : f16_fields) memcpy(blk + off, &h, 2);
        if (t == QType::MXFP4) blk[0] = 121;  // E8M0 exponent: scale 2^-7
        if (t == QType::IQ1_M)  // the fp16 scale in the top nibbles of the four scale words
            for (int k = 0; k < 4; k++) blk[49 + 2 * k] = (uint8_t)((blk[49 + 2 * k] & 0x0F) | (((h >> (4 * k)) & 0xF) << 4));
    }
    return w;
}

int main(int argc, char** argv) {
    int64_t rows = 4096, cols = 4096;
    std::vector<std::string> ntoks = {"1", "512"}, threads = {"1", "2"}, types = {"Q4_0", "Q4_K", "Q8_0", "Q6_K"};
    std::vector<std::string> isas, layouts = {"gguf"};
    double seconds = 1.0, peak_vnni = 1.9, peak_amx = 15;
    for (int i = 1; i + 1 < argc; i += 2) {
        std::string k = argv[i], v = argv[i + 1];
        if (k == "--rows") rows = atoll(v.c_str());
        else if (k == "--cols") cols = atoll(v.c_str());
        else if (k == "--ntok") ntoks = split(v);
        else if (k == "--threads") threads = split(v);
        else if (k == "--types") types = split(v);
        else if (k == "--isa") isas = split(v);
        else if (k == "--seconds") seconds = atof(v.c_str());
        else if (k == "--peak-vnni") peak_vnni = atof(v.c_str());
        else if (k == "--peak-amx") peak_amx = atof(v.c_str());
        else if (k == "--layouts") layouts = split(v);
        else { fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
    }
    if (isas.empty())
        for (cpu::Isa i : {cpu::Isa::Scalar, cpu::Isa::AVX2, cpu::Isa::AVX512_VNNI, cpu::Isa::AMX})
            if (cpu::isa_supported(i)) isas.push_back(cpu::isa_name(i));

    std::vector<std::pair<std::string, QType>> names;
    for (auto& tn : types) {
        bool found = false;
        for (uint32_t id = 0; id < 64; id++) {
            const QTypeInfo* in = qtype_info(id);
            if (in && tn == in->name) names.push_back({tn, (QType)id}), found = true;
        }
        if (!found) { fprintf(stderr, "unknown type %s\n", tn.c_str()); return 2; }
    }
    printf("# %lld x %lld weights; peaks: VNNI %.2f TOPS, AMX %.1f TOPS (2 threads)\n", (long long)rows,
           (long long)cols, peak_vnni, peak_amx);
    printf("# left: wall clock; right: per-thread CPU time (what a dedicated core would give)\n");
    printf("%-7s %-7s %4s %5s %9s %8s %7s %7s | %9s %8s %7s %7s | %6s\n", "type", "isa", "thr", "n_tok", "ms/call", "GOP/s",
           "GB/s", "%peak", "cpu-ms", "GOP/s", "GB/s", "%peak", "x1tok");
    std::vector<std::pair<std::string, QType>> runs;  // (label, type) per layout
    for (auto& [tn, t] : names)
        for (auto& l : layouts) {
            if (l != "gguf" && l != "r16") { fprintf(stderr, "unknown layout %s (gguf, r16)\n", l.c_str()); return 2; }
            if (l == "r16" && !cpu::repack_supported(t, rows, cols)) continue;
            runs.push_back({l == "r16" ? tn + "/r16" : tn, t});
        }
    for (auto& [tn, t] : runs) {
        const bool r16 = tn.size() > 4 && tn.substr(tn.size() - 4) == "/r16";
        std::vector<uint8_t> w = make_weights(t, rows, cols);
        if (r16) {
            std::vector<uint8_t> p(w.size());
            cpu::repack_rows16(t, rows, cols, w.data(), p.data());
            w.swap(p);
        }
        std::map<std::pair<std::string, int>, double> one_tok;  // (isa, threads) -> ms at n_tok 1
        for (auto& nt_s : ntoks) {
            const int64_t n_tok = atoll(nt_s.c_str());
            std::vector<float> x(n_tok * cols), y(n_tok * rows);
            std::mt19937 rng(2);
            std::normal_distribution<float> nd;
            for (auto& v : x) v = nd(rng);
            std::vector<uint8_t> scratch(cpu::matmul_scratch_bytes(t, cols, n_tok));
            for (auto& isa_s : isas) {
                cpu::set_isa(cpu::isa_from_name(isa_s));
                for (auto& th_s : threads) {
                    const int nth = atoi(th_s.c_str());
                    ThreadPool pool(nth);
                    cpu::WeightRef wr{w.data(), t, rows, cols, r16};
                    auto call = [&] { cpu::matmul(wr, x.data(), n_tok, cols, y.data(), rows, scratch.data(), pool); };
                    // warm-up call (skipped when one call is long anyway: the scalar path)
                    const auto w0 = std::chrono::steady_clock::now();
                    call();
                    const double first = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
                    int reps = 0;
                    const double c0 = cpu_seconds();
                    auto t0 = std::chrono::steady_clock::now();
                    double el = 0;
                    do {
                        if (reps == 0 && first > seconds) {
                            // the warm-up call already took longer than the budget: time it alone
                            call();
                            reps = 1;
                            el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                            break;
                        }
                        call();
                        reps++;
                        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                    } while (el < seconds);
                    const double per = el / reps;
                    // CPU seconds per call per thread: the time the threads were actually on a
                    // core (this machine is shared; wall time includes waiting for one).
                    const double cper = (cpu_seconds() - c0) / reps / nth;
                    const double gops = 2.0 * rows * cols * n_tok / per / 1e9;
                    const double gbs = (double)w.size() / per / 1e9;
                    const double gops_c = 2.0 * rows * cols * n_tok / cper / 1e9;
                    const double gbs_c = (double)w.size() / cper / 1e9;
                    const double peak = (isa_s == "amx" ? peak_amx : peak_vnni) * 1000 * nth / 2;
                    if (n_tok == 1) one_tok[{isa_s, nth}] = per;
                    const auto it = one_tok.find({isa_s, nth});
                    char x1[16] = "-";
                    if (it != one_tok.end()) snprintf(x1, sizeof x1, "%.2f", per / it->second);
                    printf("%-7s %-7s %4d %5lld %9.3f %8.1f %7.1f %6.1f%% | %9.3f %8.1f %7.1f %6.1f%% | %6s\n", tn.c_str(),
                           isa_s.c_str(), nth, (long long)n_tok, per * 1e3, gops, gbs, 100 * gops / peak, cper * 1e3,
                           gops_c, gbs_c, 100 * gops_c / peak, x1);
                    fflush(stdout);
                }
            }
        }
    }
    return 0;
}
