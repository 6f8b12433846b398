// Tensor parallelism with CUDA devices (cuda/cuda_engine.cpp's LOCAL_IDS, ALL_GATHER and
// ALL_REDUCE, the shard weights uploaded by models/model_tp.cpp), both split modes, on the emulated device of
// tests/native/emulated_cuda.cpp, without a GPU. A split over [cuda:0, cuda:1], [cuda:0, cpu:0],
// [cpu:0, cuda:0] and three shards [cuda:0, cpu:0, cuda:1] must give the logits of the same split
// over CPU devices bit for bit: the emulation runs the CPU kernels and the collectives'
// HOST_DEVICE arithmetic, so what differs is only the plumbing (partials gathered by peer copies,
// uploads and copy_to_host into scratch, events, uploads of the shard weights), and a wrong
// pointer, size, order or a partial read before it is written shows up as different bits (device
// memory starts as NaNs). Dense, MoE and MLA models, even and uneven; gemma3, gpt-oss and
// glm4moe; partials larger than the chunk a CPU shard reads of a CUDA shard's at once. Also:
// close to one device's logits (a sanity bound: the CPU split itself is held to one device on
// the fixture prompts by tests/test_tensor_parallel.py; these prompts are random tokens, with
// more near ties, gemma3's the most), every device allocating exactly what the planner
// projected, the CUDA all-gather / all-reduce and local-ids launchers having run, and the same
// bits twice.
// Built and run by tests/test_cuda_tp_emulated.py: argv[1] is the models directory.
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#include "emulated_run.h"
#include "engine/context.h"
#include "error.h"

using namespace stowlm;
namespace stowlm::cuda {
extern int g_all_reduce_calls;
extern int g_all_gather_calls;
extern int g_local_ids_calls;
}  // namespace stowlm::cuda

namespace {

int failures = 0;
bool g_sum = false;  // the shards meet by summing partial products (tensor-sum) instead of gathering rows

DeviceSpec spec(const std::string& kind, int index) {
    DeviceSpec s;
    s.kind = kind, s.index = index, s.threads = kind == "cpu" ? 2 : 0;
    return s;
}

// All-position logits of the prompt, then n_decode greedy steps (tokens from `forced` when it
// has them, so every layout decodes the same sequence).
std::vector<float> run(const std::string& path, const std::vector<DeviceSpec>& devices, const std::vector<double>& shares,
                       const std::vector<int32_t>& prompt, int n_decode, std::vector<int32_t>* forced,
                       int64_t n_ubatch = 16, std::vector<size_t>* weights = nullptr) {
    auto m = Model::load(path, devices, {}, true, {}, shares, 0, g_sum);
    if (weights) *weights = m->weight_bytes();
    ContextParams p;
    p.n_ctx = ((int64_t)prompt.size() + n_decode + 127) / 128 * 128, p.n_ubatch = n_ubatch, p.kv_type = QType::F16;
    Context c(*m, p);
    return emulated::prompt_then_greedy(*m, c, prompt, n_decode, forced, failures);
}

std::string describe(const std::vector<DeviceSpec>& devs, const std::vector<double>& shares) {
    std::string s;
    for (size_t i = 0; i < devs.size(); i++) s += (i ? " + " : "") + devs[i].name();
    s += " [";
    for (size_t i = 0; i < shares.size(); i++) s += (i ? ", " : "") + std::to_string((int)shares[i]);
    return s + "]";
}

double max_rel(const std::vector<float>& ref, const std::vector<float>& got) {
    double maxd = 0, maxr = 0;
    for (size_t i = 0; i < ref.size() && i < got.size(); i++) {
        maxd = std::max(maxd, (double)std::fabs(ref[i] - got[i]));
        maxr = std::max(maxr, (double)std::fabs(ref[i]));
    }
    return maxr > 0 ? maxd / maxr : maxd;
}

// Against one device, as tests/test_tensor_parallel.py judges real (quantized) models: the mean
// KL of the rows' distributions, and the share of rows whose top-1 agrees or is a near tie.
struct Agreement {
    double kl = 0, top1 = 0;
};
Agreement agreement(const std::vector<float>& ref, const std::vector<float>& got, int64_t nv) {
    Agreement a;
    const int64_t rows = (int64_t)ref.size() / nv;
    for (int64_t r = 0; r < rows; r++) {
        const float* p = ref.data() + r * nv;
        const float* q = got.data() + r * nv;
        double mp = p[0], mq = q[0];
        int64_t bp = 0, bq = 0;
        for (int64_t j = 1; j < nv; j++) {
            if (p[j] > mp) mp = p[j], bp = j;
            if (q[j] > mq) mq = q[j], bq = j;
        }
        double sp = 0, sq = 0, second = -INFINITY;
        for (int64_t j = 0; j < nv; j++) {
            sp += std::exp(p[j] - mp), sq += std::exp(q[j] - mq);
            if (j != bp) second = std::max(second, (double)p[j]);
        }
        const double lp = mp + std::log(sp), lq = mq + std::log(sq);
        double kl = 0;
        for (int64_t j = 0; j < nv; j++) kl += std::exp(p[j] - lp) * ((p[j] - lp) - (q[j] - lq));
        a.kl += kl / rows;
        a.top1 += (bp == bq || mp - second < 0.1) / (double)rows;
    }
    return a;
}

void check(const std::string& dir, const std::string& name, const std::vector<std::vector<DeviceSpec>>& layouts,
           const std::vector<double>& shares, int n_prompt = 40, int64_t n_ubatch = 16) {
    const std::string path = dir + "/" + name + ".gguf";
    std::vector<int32_t> prompt;
    for (int i = 0; i < n_prompt; i++) prompt.push_back(1 + (i * 7919) % 2000);
    std::vector<int32_t> tokens;
    const std::vector<float> one = run(path, {spec("cpu", 0)}, {}, prompt, 3, &tokens, n_ubatch);
    std::vector<DeviceSpec> cpus;
    for (size_t i = 0; i < shares.size(); i++) cpus.push_back(spec("cpu", (int)i));
    const int64_t nv = Model::load(path, {spec("cpu", 0)}, {}, false)->hp().n_vocab;
    for (bool sum : {false, true}) {
        g_sum = sum;
        std::vector<size_t> cpu_weights;
        const std::vector<float> ref = run(path, cpus, shares, prompt, 3, &tokens, n_ubatch, &cpu_weights);
        for (const auto& devs : layouts) {
            int& calls = sum ? cuda::g_all_reduce_calls : cuda::g_all_gather_calls;
            const int before = calls;
            std::vector<size_t> weights;
            const std::vector<float> got = run(path, devs, shares, prompt, 3, &tokens, n_ubatch, &weights);
            // a CUDA device holds what a CPU device of the same shard holds, its tensors padded to 256
            // bytes (a tied head's rows read the uploaded embedding: no second copy)
            for (size_t d = 0; d < devs.size(); d++)
                if (devs[d].kind == "cuda" && weights[d] > cpu_weights[d] + (cpu_weights[d] >> 8) + (64 << 10)) {
                    printf("FAIL %s %s: %s holds %zu weight bytes, a CPU device of that shard %zu\n", name.c_str(),
                           describe(devs, shares).c_str(), devs[d].name().c_str(), weights[d], cpu_weights[d]);
                    failures++;
                }
            const std::vector<float> again = run(path, devs, shares, prompt, 3, &tokens, n_ubatch);
            const bool same = got.size() == ref.size() && std::equal(got.begin(), got.end(), ref.begin());
            const bool twice = again.size() == got.size() && std::equal(got.begin(), got.end(), again.begin());
            const Agreement a = agreement(one, got, nv);
            const bool ran = calls > before;
            const bool ok = same && twice && a.kl < 0.1 && a.top1 >= 0.85 && ran;
            printf("%s %-15s %-10s %-46s = CPU split's bits: %s, twice: %s; vs one device: KL %.2e, top-1 %.3f%s\n",
                   ok ? "ok  " : "FAIL", name.c_str(), sum ? "tensor-sum" : "tensor",
                   (describe(devs, shares) + (n_prompt != 40 ? ", " + std::to_string(n_prompt) + " tokens" : "")).c_str(),
                   same ? "yes" : "NO", twice ? "yes" : "NO", a.kl, a.top1,
                   ran ? "" : sum ? ", the CUDA all-reduce never ran" : ", the CUDA all-gather never ran");
            if (!same) printf("     max rel diff from the CPU split %.3g\n", max_rel(ref, got));
            if (!ok) failures++;
        }
    }
    g_sum = false;
}

// Whether a [1, 1] split gives some layer's shards whole experts each (then LOCAL_IDS
// renumbers the routed ids; experts cut by rows need none).
bool whole_experts_split(const std::string& path) {
    auto m = Model::load(path, {spec("cpu", 0), spec("cpu", 1)}, {}, false, {}, {1, 1}, 0, /*tp_sum*/ true);
    for (int il = 0; il < m->hp().n_layer; il++)
        for (int s = 0; s < m->n_shards(); s++) {
            const ShardGeometry& g = m->shard_geometry(s, il);
            if (g.experts > 0 && g.experts < m->hp().n_expert) return true;
        }
    return false;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODELS_DIR\n", argv[0]);
        return 2;
    }
    const std::string dir = argv[1];
    setenv("STOWLM_REPACK", "0", 1);  // CPU shards in the GGUF layout, as the CUDA kernels sum (cpu/repack.h)
    try {
        const std::vector<std::vector<DeviceSpec>> two = {{spec("cuda", 0), spec("cuda", 1)},
                                                          {spec("cuda", 0), spec("cpu", 0)},
                                                          {spec("cpu", 0), spec("cuda", 0)}};
        const std::vector<std::vector<DeviceSpec>> three = {{spec("cuda", 0), spec("cpu", 0), spec("cuda", 1)}};
        // dense (attention by KV heads, FFN rows, vocabulary rows of a tied head), MoE (routed
        // experts whole: LOCAL_IDS and id -1 in the expert products) and MLA + MoE with a shared
        // expert and grouped sigmoid selection
        for (const char* name : {"smollm2-135m", "qwen3moe-tiny", "deepseek2-tiny"}) {
            const int local_before = cuda::g_local_ids_calls;
            check(dir, name, two, {1, 1});
            check(dir, name, two, {3, 1});
            check(dir, name, three, {1, 1, 1});
            const bool whole = whole_experts_split(dir + "/" + name + ".gguf");
            const int local = cuda::g_local_ids_calls - local_before;
            if (whole && local == 0) printf("FAIL %s: LOCAL_IDS never ran on a CUDA device\n", name), failures++;
            else printf("ok   %s: LOCAL_IDS ran %d times on CUDA devices%s\n", name, local,
                        whole ? "" : " (no shard holds a part of the experts whole)");
        }
        // partials of 512 tokens: more than the 1 MiB a CPU shard reads of a CUDA partial at once
        check(dir, "smollm2-135m", {{spec("cpu", 0), spec("cuda", 0)}}, {1, 1}, 600, 512);
        // gemma3 (post norms, GELU), gpt-oss (sinks by query heads, expert biases with id -1,
        // the output bias after the sum), glm4moe (sigmoid gates with a bias, a shared expert)
        for (const char* name : {"gemma3-270m", "gptoss-tiny", "glm4moe-tiny"}) check(dir, name, two, {1, 1});
    } catch (const std::exception& e) {
        printf("FAIL exception: %s\n", e.what());
        return 1;
    }
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
