// stowlm-bench: prompt-processing and token-generation throughput of GGUF models through the
// native engine (the same Context::eval the Python API calls), reported like llama-bench so
// that the two can be compared run for run (bench/compare.py).
//
//   stowlm-bench -m MODEL [-p 512] [-n 128] [-pg 512,128] [-d 0] [-t THREADS] [-r 5]
//                [-ub 512] [-ctk f16|q8_0] [-o md|json|csv] [-v] [--no-warmup]
//                [-dev cpu:0[threads=1],cpu:1[threads=1]] [--layer-split 15,15] [--n-copies 1,4]
//                [--interleave N]
//                [-sm tensor|tensor-sum [-ts 1,1]]
//
// Each test runs once as warm-up, then -r times; the table gives mean ± standard deviation of
// tokens per second over the repetitions. Token ids are random but valid (seeded).
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backend/device_spec.h"
#include "cpu/threadpool.h"
#include "engine/context.h"
#include "error.h"
#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "models/model.h"

using namespace stowlm;

namespace {

// ---- command line -------------------------------------------------------------------

struct Options {
    std::vector<std::string> models;
    std::vector<int64_t> n_prompt{512}, n_gen{128}, n_depth{0}, threads, n_ubatch{512}, n_copies{4};
    std::vector<std::pair<int64_t, int64_t>> pg;
    std::vector<std::string> type_k{"f16"};
    int reps = 5;
    bool warmup = true;
    bool verbose = false;
    std::string output = "md";
    std::vector<DeviceSpec> devices{DeviceSpec()};  // cpu (default), cuda:N, or a list the layers are split over
    std::vector<int> layer_split;                   // layers per device (default: even)
    int interleave = 0;                             // chunks per device's layers (0: auto)
    std::string split_mode = "layer";               // or "tensor" / "tensor-sum": every layer cut over the devices
    std::vector<double> tensor_split;               // shares per device (tensor; default equal)
    std::vector<std::pair<std::string, std::string>> overrides;  // -ot REGEX=DEVICE, first match wins
    int n_cpu_moe = -1;                             // experts of the first N layers on the CPU (-1: none)
    int64_t moe_offload_min = kMoeOffloadMin;       // prompts' experts in RAM multiplied on the GPU from here
    std::string dump_logits;  // hidden: last logits of every test's last repetition (tests)
    uint64_t seed = 1234;
};

struct UsageError : std::runtime_error {
    using std::runtime_error::runtime_error;
};


void print_usage(FILE* f) {
    fprintf(f,
            "usage: stowlm-bench [options]\n"
            "\n"
            "Measures prompt processing (ppN: one prompt of N tokens) and token generation (tgN: N tokens\n"
            "decoded one at a time) of GGUF models through the stowlm engine, like llama-bench.\n"
            "List options take comma-separated values and may be repeated; every combination is run.\n"
            "\n"
            "options:\n"
            "  -h, --help               show this help and exit\n"
            "  -m, --model FILE         GGUF model (required; repeatable or comma list)\n"
            "  -p, --n-prompt N         prompt tokens of a pp test (default 512; 0: no pp test)\n"
            "  -n, --n-gen N            generated tokens of a tg test (default 128; 0: no tg test)\n"
            "  -pg P,G                  a prompt of P tokens then G generated tokens, timed together\n"
            "  -d, --n-depth N          tokens already in the KV cache before each test (default 0)\n"
            "  -t, --threads N          CPU threads (default %d: the machine's cores or STOWLM_THREADS)\n"
            "  -dev, --device LIST      the devices the model runs on: cpu (default), cuda:N, or a list such\n"
            "                           as cpu:0[threads=1],cpu:1[threads=1,mem=512MiB] (layers split over them;\n"
            "                           -t sets the threads of a CPU device that does not say)\n"
            "  --layer-split N,N,...    layers per device of -dev (default: even)\n"
            "  --interleave N           each device's layers in N chunks, the devices taking turns (shorter\n"
            "                           pipeline stages; default 2 over CPU devices only, 1 = contiguous)\n"
            "  -sm, --split-mode M      layer (default), or tensor: every layer cut over the devices of -dev,\n"
            "                           which all work on every token (tensor parallelism; rows gathered, the\n"
            "                           logits one device's bit for bit), or tensor-sum: the same with partial\n"
            "                           products summed (half the meetings, results within float rounding)\n"
            "  -ts, --tensor-split N,.. shares of the devices for -sm tensor[-sum] (default equal)\n"
            "  --n-copies N             with several devices: copies of the tensors that cross them, one per\n"
            "                           micro-batch in flight (pipeline parallelism; default 4, 1 = off)\n"
            "  -ot REGEX=DEVICE         the weights whose names match REGEX on DEVICE of -dev (cpu:0, cuda:0;\n"
            "                           CPU: the first CPU device, as llama-bench writes it); repeatable, first\n"
            "                           match wins\n"
            "  --cpu-moe, --n-cpu-moe N every expert tensor (of the first N layers) on the first CPU device\n"
            "  --moe-offload-min N      experts on the CPU, their layers on a GPU: micro-batches of N tokens\n"
            "                           or more multiply them on the GPU, copying them in (default %lld, 0 =\n"
            "                           never)\n"
            "  -ub, --ubatch-size N     tokens per micro-batch of prompt processing (default 512)\n"
            "  -ctk, --cache-type-k T   KV cache type: f16 or q8_0 (default f16)\n"
            "  -r, --repetitions N      timed repetitions per test (default 5)\n"
            "  --no-warmup              skip the warm-up run of each test\n"
            "  -o, --output FMT         md (default), json or csv on stdout\n"
            "  -v, --verbose            memory per device (weights, KV, compute) and the process's peak\n"
            "                           RSS against model file + KV + compute, for generation the weight\n"
            "                           bytes read per token and their rate, and for a prompt over several\n"
            "                           devices whether it ran as a pipeline and each device's idle share,\n"
            "                           and on a CUDA device the kernels per generated token and the time\n"
            "                           per token outside them (from one more run with the kernels timed),\n"
            "                           on stderr\n",
            default_threads(), (long long)kMoeOffloadMin);
}

int64_t parse_int(const std::string& flag, const std::string& s, int64_t min) {
    size_t used = 0;
    long long v = 0;
    try {
        v = std::stoll(s, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (s.empty() || used != s.size()) throw UsageError(flag + ": expected an integer, got '" + s + "'");
    if (v < min) throw UsageError(flag + ": must be >= " + std::to_string(min) + ", got " + s);
    return v;
}

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    std::string item;
    std::stringstream ss(s);
    while (std::getline(ss, item, sep)) out.push_back(item);
    if (!s.empty() && s.back() == sep) out.push_back("");
    return out;
}

// A device list in the core's grammar (backend/device_spec.h, as stowlm/devices.py reads it).
std::vector<DeviceSpec> parse_devices(const std::string& flag, const std::string& text) {
    try {
        return parse_device_list(text);
    } catch (const InvalidInput& e) {
        throw UsageError(flag + ": " + e.what());
    }
}

Options parse_args(int argc, char** argv) {
    Options o;
    // A list option given on the command line replaces its default; repeating it appends.
    std::vector<std::string> seen;
    auto first_use = [&](const std::string& key) {
        if (std::find(seen.begin(), seen.end(), key) != seen.end()) return false;
        seen.push_back(key);
        return true;
    };
    auto int_list = [&](const std::string& flag, const std::string& key, const std::string& value,
                        std::vector<int64_t>& dst, int64_t min) {
        if (first_use(key)) dst.clear();
        for (const std::string& item : split(value, ',')) dst.push_back(parse_int(flag, item, min));
    };
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw UsageError(a + ": missing value");
            return argv[++i];
        };
        if (a == "-h" || a == "--help") {
            print_usage(stdout);
            exit(0);
        } else if (a == "-m" || a == "--model") {
            for (const std::string& m : split(value(), ',')) {
                if (m.empty()) throw UsageError(a + ": empty model path");
                o.models.push_back(m);
            }
        } else if (a == "-p" || a == "--n-prompt") {
            int_list(a, "p", value(), o.n_prompt, 0);
        } else if (a == "-n" || a == "--n-gen") {
            int_list(a, "n", value(), o.n_gen, 0);
        } else if (a == "-d" || a == "--n-depth") {
            int_list(a, "d", value(), o.n_depth, 0);
        } else if (a == "-t" || a == "--threads") {
            int_list(a, "t", value(), o.threads, 1);
        } else if (a == "-dev" || a == "--device") {
            o.devices = parse_devices(a, value());
        } else if (a == "--layer-split") {
            o.layer_split.clear();
            for (const std::string& n : split(value(), ',')) o.layer_split.push_back((int)parse_int(a, n, 0));
        } else if (a == "--interleave") {
            o.interleave = (int)parse_int(a, value(), 0);
        } else if (a == "-sm" || a == "--split-mode") {
            o.split_mode = value();
            if (o.split_mode != "layer" && o.split_mode != "tensor" && o.split_mode != "tensor-sum")
                throw UsageError(a + ": unknown split mode '" + o.split_mode + "' (use layer, tensor or tensor-sum)");
        } else if (a == "-ts" || a == "--tensor-split") {
            o.tensor_split.clear();
            for (const std::string& n : split(value(), ',')) {
                char* end = nullptr;
                const double v = std::strtod(n.c_str(), &end);
                if (n.empty() || *end || !(v >= 0)) throw UsageError(a + ": '" + n + "' is not a share >= 0");
                o.tensor_split.push_back(v);
            }
        } else if (a == "--n-copies") {
            int_list(a, "nc", value(), o.n_copies, 1);
        } else if (a == "-ot" || a == "--override-tensor") {
            const std::string v = value();
            const size_t eq = v.rfind('=');
            if (eq == std::string::npos || eq == 0 || eq + 1 == v.size())
                throw UsageError(a + ": expected REGEX=DEVICE, got '" + v + "'");
            o.overrides.emplace_back(v.substr(0, eq), v.substr(eq + 1));
        } else if (a == "--cpu-moe") {
            o.n_cpu_moe = std::numeric_limits<int>::max();
        } else if (a == "--n-cpu-moe") {
            o.n_cpu_moe = (int)parse_int(a, value(), 0);
        } else if (a == "--moe-offload-min") {
            o.moe_offload_min = parse_int(a, value(), 0);
        } else if (a == "-ub" || a == "--ubatch-size") {
            int_list(a, "ub", value(), o.n_ubatch, 1);
        } else if (a == "-pg") {
            const auto parts = split(value(), ',');
            if (parts.size() != 2) throw UsageError("-pg: expected P,G (e.g. 512,128)");
            o.pg.emplace_back(parse_int(a, parts[0], 1), parse_int(a, parts[1], 1));
        } else if (a == "-ctk" || a == "--cache-type-k") {
            if (first_use("ctk")) o.type_k.clear();
            for (const std::string& t : split(value(), ',')) {
                try {
                    parse_kv_type(t);
                } catch (const InvalidInput&) {
                    throw UsageError(a + ": unknown KV cache type '" + t + "' (use f16 or q8_0)");
                }
                o.type_k.push_back(t);
            }
        } else if (a == "-r" || a == "--repetitions") {
            o.reps = (int)parse_int(a, value(), 1);
        } else if (a == "--no-warmup") {
            o.warmup = false;
        } else if (a == "-o" || a == "--output") {
            o.output = value();
            if (o.output != "md" && o.output != "json" && o.output != "csv")
                throw UsageError(a + ": unknown format '" + o.output + "' (use md, json or csv)");
        } else if (a == "-v" || a == "--verbose") {
            o.verbose = true;
        } else if (a == "--dump-logits") {
            o.dump_logits = value();
        } else if (a == "--seed") {
            o.seed = (uint64_t)parse_int(a, value(), 0);
        } else {
            throw UsageError("unknown argument '" + a + "'");
        }
    }
    if (o.models.empty()) throw UsageError("no model given (-m FILE)");
    if (!o.layer_split.empty() && o.layer_split.size() != o.devices.size())
        throw UsageError("--layer-split: " + std::to_string(o.layer_split.size()) + " counts for " +
                         std::to_string(o.devices.size()) + " devices");
    if (o.split_mode != "layer") {
        if (!o.layer_split.empty()) throw UsageError("--layer-split and -sm " + o.split_mode + " exclude each other");
        if (o.tensor_split.empty()) o.tensor_split.assign(o.devices.size(), 1.0);
        if (o.tensor_split.size() != o.devices.size())
            throw UsageError("-ts: " + std::to_string(o.tensor_split.size()) + " shares for " +
                             std::to_string(o.devices.size()) + " devices");
    } else if (!o.tensor_split.empty()) {
        throw UsageError("-ts needs -sm tensor or tensor-sum");
    }
    if (o.threads.empty()) o.threads.push_back(default_threads());
    for (const std::string& m : o.models) {
        struct stat st;
        if (stat(m.c_str(), &st) != 0) throw std::runtime_error("model file '" + m + "' does not exist");
        if (!S_ISREG(st.st_mode)) throw std::runtime_error("model file '" + m + "' is not a regular file");
    }
    return o;
}

// ---- model description (llama-bench's model, size and params columns) ------------------

const char* ftype_name(int64_t ftype) {
    // llama.cpp's general.file_type ids (the "mostly" type of the big matrices).
    switch (ftype) {
        case 0: return "all F32";
        case 1: return "F16";
        case 2: return "Q4_0";
        case 3: return "Q4_1";
        case 7: return "Q8_0";
        case 8: return "Q5_0";
        case 9: return "Q5_1";
        case 10: return "Q2_K - Medium";
        case 11: return "Q3_K - Small";
        case 12: return "Q3_K - Medium";
        case 13: return "Q3_K - Large";
        case 14: return "Q4_K - Small";
        case 15: return "Q4_K - Medium";
        case 16: return "Q5_K - Small";
        case 17: return "Q5_K - Medium";
        case 18: return "Q6_K";
        case 19: return "IQ2_XXS - 2.0625 bpw";
        case 20: return "IQ2_XS - 2.3125 bpw";
        case 21: return "Q2_K - Small";
        case 22: return "IQ3_XS - 3.3 bpw";
        case 23: return "IQ3_XXS - 3.0625 bpw";
        case 24: return "IQ1_S - 1.5625 bpw";
        case 25: return "IQ4_NL - 4.5 bpw";
        case 26: return "IQ3_S - 3.4375 bpw";
        case 27: return "IQ3_M - 3.7 bpw";
        case 28: return "IQ2_S - 2.5 bpw";
        case 29: return "IQ2_M - 2.7 bpw";
        case 30: return "IQ4_XS - 4.25 bpw";
        case 31: return "IQ1_M - 1.75 bpw";
        case 32: return "BF16";
        case 36: return "TQ1_0 - 1.69 bpw ternary";
        case 37: return "TQ2_0 - 2.06 bpw ternary";
        case 38: return "MXFP4 MoE";
        default: return nullptr;
    }
}

struct ModelInfo {
    std::string path, filename, type;
    uint64_t size = 0, n_params = 0;  // tensor bytes and elements, as llama-bench counts them
    size_t file_bytes = 0;
};

std::string basename_of(const std::string& p) {
    const size_t s = p.find_last_of('/');
    return s == std::string::npos ? p : p.substr(s + 1);
}

ModelInfo describe(const GGUFFile& f) {
    ModelInfo m;
    m.path = f.path();
    m.filename = basename_of(f.path());
    m.file_bytes = f.total_file_bytes();
    for (const GGUFTensor& t : f.tensors()) {
        m.size += t.nbytes;
        m.n_params += (uint64_t)t.n_elements();
    }
    std::string size_label = f.get_str("general.size_label", "");
    if (size_label.empty()) {
        char buf[32];
        if (m.n_params >= 1000000000ull)
            snprintf(buf, sizeof buf, "%.1fB", m.n_params / 1e9);
        else
            snprintf(buf, sizeof buf, "%.0fM", m.n_params / 1e6);
        size_label = buf;
    }
    const char* ft = ftype_name(f.get_int("general.file_type", -1));
    m.type = f.get_str("general.architecture", "?") + " " + size_label + " " + (ft ? ft : "?");
    return m;
}

// ---- memory ---------------------------------------------------------------------------

size_t peak_rss_bytes() {
    // VmHWM is the kernel's high-water mark of the resident set; ru_maxrss is the same figure
    // in KiB and serves where /proc is missing.
    std::ifstream st("/proc/self/status");
    std::string line;
    while (std::getline(st, line))
        if (line.rfind("VmHWM:", 0) == 0) return (size_t)std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return (size_t)ru.ru_maxrss * 1024;
}

double mib(size_t b) { return b / 1048576.0; }

std::string cpu_info() {
    std::ifstream f("/proc/cpuinfo");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind("model name", 0) == 0) {
            const size_t c = line.find(':');
            if (c != std::string::npos) return line.substr(line.find_first_not_of(" \t", c + 1));
        }
    return "unknown";
}

// ---- one test ---------------------------------------------------------------------------

struct Test {
    int64_t n_prompt = 0, n_gen = 0, n_depth = 0;
    std::string name() const {
        std::string s;
        if (n_prompt > 0 && n_gen > 0)
            s = "pp" + std::to_string(n_prompt) + "+tg" + std::to_string(n_gen);
        else if (n_prompt > 0)
            s = "pp" + std::to_string(n_prompt);
        else
            s = "tg" + std::to_string(n_gen);
        if (n_depth > 0) s += " @ d" + std::to_string(n_depth);
        return s;
    }
};

struct Result {
    const ModelInfo* model = nullptr;
    std::string backend, type_k, test_time, devices;
    int64_t threads = 0, n_ubatch = 0, n_copies = 1;
    Test test;
    std::vector<uint64_t> samples_ns;

    std::vector<double> samples_ts() const {
        std::vector<double> ts;
        for (uint64_t ns : samples_ns) ts.push_back((test.n_prompt + test.n_gen) * 1e9 / (double)ns);
        return ts;
    }
};

double mean(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0 : s / v.size();
}

// Sample standard deviation (n-1), as llama-bench reports it; 0 for one sample.
double stddev(const std::vector<double>& v) {
    if (v.size() < 2) return 0;
    const double m = mean(v);
    double s = 0;
    for (double x : v) s += (x - m) * (x - m);
    return std::sqrt(s / (v.size() - 1));
}

std::string now_iso() {
    const std::time_t t = std::time(nullptr);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
    return buf;
}

struct LastLogits {
    std::vector<int32_t> depth_tokens, tokens;
    std::vector<float> logits;
};

// Runs the timed part of a test once on a context holding exactly the depth tokens; returns
// nanoseconds. The prompt goes in one eval call (split into micro-batches by the context), the
// generated tokens one call each, as a decoding loop would.
uint64_t run_once(Context& ctx, const Test& t, const std::vector<int32_t>& prompt, const std::vector<int32_t>& gen,
                  std::vector<float>* last) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    std::vector<float> logits;
    if (t.n_prompt > 0) logits = ctx.eval(prompt, {}, false);
    for (int64_t i = 0; i < t.n_gen; i++) logits = ctx.eval({gen[i]}, {}, false);
    const auto t1 = clock::now();
    if (last) *last = std::move(logits);
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}

// ---- output -----------------------------------------------------------------------------

std::string json_escape(const std::string& s) {
    std::string o;
    for (char c : s) {
        if (c == '"' || c == '\\') {
            o += '\\';
            o += c;
        } else if ((unsigned char)c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof buf, "\\u%04x", c);
            o += buf;
        } else {
            o += c;
        }
    }
    return o;
}

std::string csv_quote(const std::string& s) {
    std::string o = "\"";
    for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
    return o + "\"";
}

// The fields of one result, in llama-bench's JSON/CSV names. Values are JSON literals.
std::vector<std::pair<std::string, std::string>> fields(const Result& r, const std::string& cpu) {
    auto str = [](const std::string& s) { return "\"" + json_escape(s) + "\""; };
    auto num = [](double x) {
        char buf[48];
        snprintf(buf, sizeof buf, "%.6f", x);
        return std::string(buf);
    };
    const auto ts = r.samples_ts();
    std::vector<double> ns(r.samples_ns.begin(), r.samples_ns.end());
    std::string s_ns = "[", s_ts = "[";
    for (size_t i = 0; i < ns.size(); i++) {
        s_ns += (i ? ", " : "") + std::to_string(r.samples_ns[i]);
        s_ts += (i ? ", " : "") + num(ts[i]);
    }
    s_ns += "]";
    s_ts += "]";
    return {
        {"build_commit", str("stowlm")},
        {"cpu_info", str(cpu)},
        {"backends", str(r.backend)},
        {"model_filename", str(r.model->path)},
        {"model_type", str(r.model->type)},
        {"model_size", std::to_string(r.model->size)},
        {"model_n_params", std::to_string(r.model->n_params)},
        {"n_ubatch", std::to_string(r.n_ubatch)},
        {"devices", str(r.devices)},
        {"n_copies", std::to_string(r.n_copies)},
        {"n_threads", std::to_string(r.threads)},
        {"type_k", str(r.type_k)},
        {"type_v", str(r.type_k)},
        {"n_prompt", std::to_string(r.test.n_prompt)},
        {"n_gen", std::to_string(r.test.n_gen)},
        {"n_depth", std::to_string(r.test.n_depth)},
        {"test_time", str(r.test_time)},
        {"avg_ns", std::to_string((uint64_t)std::llround(mean(ns)))},
        {"stddev_ns", std::to_string((uint64_t)std::llround(stddev(ns)))},
        {"avg_ts", num(mean(ts))},
        {"stddev_ts", num(stddev(ts))},
        {"samples_ns", s_ns},
        {"samples_ts", s_ts},
    };
}

class Printer {
public:
    Printer(const Options& o) : o_(o), cpu_(cpu_info()) {
        show_ubatch_ = o.n_ubatch != std::vector<int64_t>{512};
        show_devices_ = o.devices.size() > 1;
        show_type_k_ = o.type_k != std::vector<std::string>{"f16"};
    }

    void add(const Result& r) {
        if (o_.output == "json") {
            printf("%s\n  {\n", n_ ? "," : "[");
            const auto f = fields(r, cpu_);
            for (size_t i = 0; i < f.size(); i++)
                printf("    \"%s\": %s%s\n", f[i].first.c_str(), f[i].second.c_str(), i + 1 < f.size() ? "," : "");
            printf("  }");
        } else if (o_.output == "csv") {
            const auto f = fields(r, cpu_);
            if (n_ == 0)
                for (size_t i = 0; i < f.size(); i++) printf("%s%s", f[i].first.c_str(), i + 1 < f.size() ? "," : "\n");
            for (size_t i = 0; i < f.size(); i++) {
                std::string v = f[i].second;
                if (!v.empty() && (v[0] == '"' || v[0] == '[')) {
                    // strings and sample lists: the raw text, quoted for CSV
                    if (v[0] == '"') v = v.substr(1, v.size() - 2);
                    v = csv_quote(v);
                }
                printf("%s%s", v.c_str(), i + 1 < f.size() ? "," : "\n");
            }
        } else {
            markdown(r);
        }
        n_++;
        fflush(stdout);
    }

    void finish() {
        if (o_.output == "json") printf(n_ ? "\n]\n" : "[]\n");
        fflush(stdout);
    }

private:
    void markdown(const Result& r) {
        std::vector<std::string> head{"model", "size", "params", "backend", "threads"};
        std::vector<bool> right{false, true, true, false, true};
        if (show_devices_) head.push_back("devices"), right.push_back(false);
        if (show_devices_) head.push_back("copies"), right.push_back(true);
        if (show_ubatch_) head.push_back("n_ubatch"), right.push_back(true);
        if (show_type_k_) head.push_back("type_k"), right.push_back(false);
        head.push_back("test"), right.push_back(true);
        head.push_back("t/s"), right.push_back(true);
        const std::vector<int> width_min{30, 10, 10, 8, 7};

        char buf[64];
        std::vector<std::string> row{r.model->type};
        if (r.model->size >= (1ull << 30))
            snprintf(buf, sizeof buf, "%.2f GiB", r.model->size / 1073741824.0);
        else
            snprintf(buf, sizeof buf, "%.2f MiB", mib(r.model->size));
        row.push_back(buf);
        if (r.model->n_params >= 1000000000ull)
            snprintf(buf, sizeof buf, "%.2f B", r.model->n_params / 1e9);
        else
            snprintf(buf, sizeof buf, "%.2f M", r.model->n_params / 1e6);
        row.push_back(buf);
        row.push_back(r.backend);
        row.push_back(std::to_string(r.threads));
        if (show_devices_) row.push_back(r.devices), row.push_back(std::to_string(r.n_copies));
        if (show_ubatch_) row.push_back(std::to_string(r.n_ubatch));
        if (show_type_k_) row.push_back(r.type_k);
        row.push_back(r.test.name());
        const auto ts = r.samples_ts();
        snprintf(buf, sizeof buf, "%.2f ± %.2f", mean(ts), stddev(ts));
        row.push_back(buf);

        auto width = [&](size_t i) {
            size_t w = i < width_min.size() ? (size_t)width_min[i] : 0;
            if (head[i] == "test") w = 16;
            if (head[i] == "t/s") w = 20;
            return std::max(w, head[i].size());
        };
        if (n_ == 0) {
            std::string h = "|", sep = "|";
            for (size_t i = 0; i < head.size(); i++) {
                snprintf(buf, sizeof buf, right[i] ? " %*s |" : " %-*s |", (int)width(i), head[i].c_str());
                h += buf;
                sep += " " + std::string(width(i) - 1, '-') + (right[i] ? ":" : "-") + " |";
            }
            printf("%s\n%s\n", h.c_str(), sep.c_str());
        }
        std::string line = "|";
        for (size_t i = 0; i < row.size(); i++) {
            // "±" is two bytes but one column: pad by display width
            const size_t extra = row[i].find("±") != std::string::npos ? 1 : 0;
            const int w = (int)(width(i) + extra);
            char cell[256];
            snprintf(cell, sizeof cell, right[i] ? " %*s |" : " %-*s |", w, row[i].c_str());
            line += cell;
        }
        printf("%s\n", line.c_str());
    }

    const Options& o_;
    std::string cpu_;
    bool show_ubatch_ = false, show_type_k_ = false, show_devices_ = false;
    int n_ = 0;
};

void write_floats(FILE* f, const std::vector<float>& v) {
    fputc('[', f);
    for (size_t i = 0; i < v.size(); i++) fprintf(f, "%s%.9g", i ? "," : "", v[i]);
    fputc(']', f);
}

void write_ints(FILE* f, const std::vector<int32_t>& v) {
    fputc('[', f);
    for (size_t i = 0; i < v.size(); i++) fprintf(f, "%s%d", i ? "," : "", v[i]);
    fputc(']', f);
}

struct MemoryCheck {
    size_t expected = 0;  // largest model file + KV + compute of any context run
    std::string what;
};

// Whether the last prompt ran as a pipeline, each device's idle share of it (the bubble and
// the waits), and the bytes its copies of the crossing tensors take beyond one copy.
void report_pipeline(const Context& ctx, const Model& model, const Test& t) {
    const PipelineMode& mode = ctx.pipeline();
    if (mode.n_copies == 1) {
        fprintf(stderr, "  %s: not pipelined: %s\n", t.name().c_str(), mode.reason.c_str());
        return;
    }
    const PipelineStats& st = ctx.pipeline_stats();
    size_t copies = 0;
    for (const DeviceMemory& d : ctx.memory_report()) copies += d.copies;
    fprintf(stderr, "  %s: pipelined, %d micro-batches, layers in %d chunk(s) per device, %d copies of the crossing "
                    "tensors (%.2f MiB, %.2f MiB more than one copy); idle:",
            t.name().c_str(), st.micro_batches, model.interleave(), mode.n_copies, mib(copies),
            mib(copies - copies / (size_t)mode.n_copies));
    const auto backends = model.backends();
    for (size_t d = 0; d < st.busy_s.size(); d++)
        fprintf(stderr, " %s %.1f%%", backends[d]->name().c_str(),
                st.wall_s > 0 ? 100.0 * (1.0 - st.busy_s[d] / st.wall_s) : 0.0);
    fprintf(stderr, "\n");
}

// A device's timed ops, the dearest first: ms per token (or run), calls, and the share of the
// repetitions' mean wall time.
void print_ops(std::vector<KernelStats::Op> ops, double wall_ms, double steps) {
    std::sort(ops.begin(), ops.end(), [](const auto& x, const auto& y) { return x.seconds > y.seconds; });
    double sum_ms = 0;
    for (const auto& o : ops) sum_ms += o.seconds * 1e3 / steps;
    for (const auto& o : ops) {
        const double ms = o.seconds * 1e3 / steps;
        if (ms < 0.005 * sum_ms) continue;
        fprintf(stderr, "    %-52s %8.3f ms %5.1f%%  %6.1f calls\n", o.label.c_str(), ms,
                wall_ms > 0 ? 100.0 * ms / wall_ms : 0.0, o.calls / steps);
    }
}

// A CPU device's ops of the timed run: what no op took is the host's part (graph set-up, logits
// copies) and, with several devices, the others' turns.
void report_ops(const Test& t, Backend& b, const KernelStats& k, double wall_ms, double steps, const char* unit) {
    double sum_ms = 0;
    for (const auto& o : k.ops) sum_ms += o.seconds * 1e3 / steps;
    fprintf(stderr, "  %s on %s: %.3f ms per %s (timed run: %.3f ms in ops)\n", t.name().c_str(), b.name().c_str(),
            wall_ms, unit, sum_ms);
    print_ops(k.ops, wall_ms, steps);
}

// -v: one more run of the test with the devices' work timed (CUDA: kernels; CPU: ops)
// (held until enqueued, which serialises host and device: not a timed repetition), then per
// generated token (per run for a prompt) the kernels launched, the device time of those kernels
// run back to back, and the rest of the repetitions' mean wall time: launch gaps and host work.
void report_kernels(Context& ctx, const Model& model, const Test& t, const Result& r, const std::vector<int32_t>& prompt,
                    const std::vector<int32_t>& gen) {
    std::vector<Backend*> counted, cpus;  // devices launching kernels; CPU devices (their ops timed)
    for (Backend* b : model.backends()) {
        if (b->take_kernel_stats().counted) counted.push_back(b);
        else if (b->host_accessible()) cpus.push_back(b);
    }
    counted.insert(counted.end(), cpus.begin(), cpus.end());
    if (counted.empty()) return;
    for (Backend* b : counted) b->set_kernel_timing(true);
    try {
        run_once(ctx, t, prompt, gen, nullptr);
    } catch (...) {
        for (Backend* b : counted) b->set_kernel_timing(false);
        throw;
    }
    for (Backend* b : counted) b->set_kernel_timing(false);
    ctx.kv_truncate(t.n_depth);
    const bool per_token = t.n_prompt == 0;
    const double steps = per_token ? (double)t.n_gen : 1.0;
    std::vector<double> ns(r.samples_ns.begin(), r.samples_ns.end());
    const double wall_ms = mean(ns) / 1e6 / steps;
    for (Backend* b : counted) {
        const KernelStats k = b->take_kernel_stats();
        const double kernel_ms = k.kernel_s * 1e3 / steps;
        const char* unit = per_token ? "token" : "run";
        if (!k.counted) {
            report_ops(t, *b, k, wall_ms, steps, unit);
            continue;
        }
        fprintf(stderr,
                "  %s on %s: %.1f kernels per %s; %.3f ms per %s, of which %.3f ms in kernels (run back to back) and "
                "%.3f ms (%.0f%%) outside them (launch gaps, host work); host launches per %s: %.1f CUDA graphs and "
                "%.1f kernels\n",
                t.name().c_str(), b->name().c_str(), k.launches / steps, unit, wall_ms, unit, kernel_ms,
                wall_ms - kernel_ms, wall_ms > 0 ? 100.0 * (wall_ms - kernel_ms) / wall_ms : 0.0, unit,
                k.graph_launches / steps, (k.launches - k.graph_kernels) / steps);
        print_ops(k.ops, wall_ms, steps);  // each op's kernels (or a replayed graph) back to back
        if (k.late_splits)
            fprintf(stderr, "  %s on %s: %llu of %llu timed splits waited for the host past the hold: their kernel "
                            "time includes launch gaps\n",
                    t.name().c_str(), b->name().c_str(), (unsigned long long)k.late_splits,
                    (unsigned long long)k.timed_splits);
    }
}

// -ot and --n-cpu-moe as the core's overrides over the devices of -dev (by name; CPU: the
// first CPU device).
std::vector<TensorOverride> tensor_overrides(const Options& o, const std::vector<DeviceSpec>& specs) {
    auto device_of = [&](const std::string& name, const std::string& what) {
        for (size_t d = 0; d < specs.size(); d++)
            if (specs[d].name() == name || (name == "CPU" && specs[d].kind == "cpu")) return (int)d;
        throw UsageError(what + ": no device '" + name + "' in -dev (" + std::to_string(specs.size()) + " devices)");
    };
    std::vector<TensorOverride> out;
    // the core matches a whole name; -ot, as llama-bench's, matches anywhere in it
    for (const auto& [rx, dev] : o.overrides)
        out.push_back({".*(?:" + rx + ").*", device_of(dev, "-ot " + rx + "=" + dev), rx});
    if (o.n_cpu_moe > 0) {
        std::string layers = "[0-9]+";
        if (o.n_cpu_moe != std::numeric_limits<int>::max()) {
            layers = "(?:";
            for (int l = 0; l < o.n_cpu_moe; l++) layers += (l ? "|" : "") + std::to_string(l);
            layers += ")";
        }
        out.push_back({"blk\\." + layers + "\\.ffn_.*_exps.*", device_of("CPU", "--n-cpu-moe"), "--n-cpu-moe"});
    }
    return out;
}

std::string backend_label(const Model& model) {
    std::string s;
    for (Backend* b : model.backends()) {
        std::string kind = b->name().substr(0, b->name().find(':'));
        for (char& c : kind) c = (char)toupper((unsigned char)c);
        if (s.find(kind) == std::string::npos) s += (s.empty() ? "" : ",") + kind;
    }
    return s;
}

int run(const Options& o) {
    Printer printer(o);
    MemoryCheck mem;
    FILE* dump = nullptr;
    if (!o.dump_logits.empty()) {
        dump = fopen(o.dump_logits.c_str(), "w");
        if (!dump) throw std::runtime_error("--dump-logits: cannot write '" + o.dump_logits + "': " + strerror(errno));
        fprintf(dump, "{\"seed\": %llu, \"runs\": [", (unsigned long long)o.seed);
    }
    int n_dumped = 0;

    std::vector<Test> tests;
    for (int64_t d : o.n_depth) {
        for (int64_t p : o.n_prompt)
            if (p > 0) tests.push_back({p, 0, d});
        for (int64_t n : o.n_gen)
            if (n > 0) tests.push_back({0, n, d});
        for (const auto& pg : o.pg) tests.push_back({pg.first, pg.second, d});
    }
    if (tests.empty()) throw UsageError("nothing to run: every -p and -n is 0 and no -pg given");

    for (const std::string& path : o.models) {
        for (int64_t threads : o.threads) {
            std::vector<DeviceSpec> specs = o.devices;
            std::string devices;
            for (DeviceSpec& spec : specs) {
                if (spec.kind == "cpu" && spec.threads == 0) spec.threads = (int)threads;
                devices += (devices.empty() ? "" : "+") + spec.name();
            }
            std::unique_ptr<Model> model = Model::load(path, specs, o.layer_split, true, tensor_overrides(o, specs), o.tensor_split,
                                                       o.interleave, o.split_mode == "tensor-sum");
            if (o.split_mode != "layer") {
                std::string ts;
                for (double s : o.tensor_split) {
                    char b[32];
                    snprintf(b, sizeof b, "%g", s);
                    ts += (ts.empty() ? "" : ":") + std::string(b);
                }
                devices += " (" + o.split_mode + " " + ts + ")";
            }
            const ModelInfo info = describe(model->file());
            const std::string backend = backend_label(*model);
            const int64_t n_vocab = model->hp().n_vocab;
            for (int64_t ub : o.n_ubatch) {
              for (int64_t n_copies : o.n_copies) {
                for (const std::string& tk : o.type_k) {
                    for (const Test& t : tests) {
                        ContextParams cp;
                        cp.n_ctx = t.n_depth + t.n_prompt + t.n_gen;
                        cp.n_ubatch = ub;
                        cp.n_copies = (int)n_copies;
                        cp.moe_offload_min = o.moe_offload_min;
                        cp.kv_type = parse_kv_type(tk);
                        // Only the last token's logits are ever read: one row keeps the
                        // compute buffer as small as a generation loop needs.
                        cp.n_outputs = 1;
                        auto ctx = std::make_unique<Context>(*model, cp);
                        if (o.verbose) {
                            size_t kv = 0, compute = 0;
                            fprintf(stderr, "%s, %s, n_ctx %lld, n_ubatch %lld, type_k %s:\n", info.filename.c_str(),
                                    t.name().c_str(), (long long)cp.n_ctx, (long long)ub, tk.c_str());
                            for (const DeviceMemory& d : ctx->memory_report()) {
                                fprintf(stderr,
                                        "  %-8s weights %9.2f MiB  kv %8.2f MiB  compute %8.2f MiB  copies %8.2f MiB  "
                                        "total %9.2f MiB\n",
                                        d.name.c_str(), mib(d.weights), mib(d.kv), mib(d.compute), mib(d.copies),
                                        mib(d.total));
                                kv += d.kv;
                                compute += d.compute;
                            }
                            if (const size_t n16 = model->repacked_weights().size())
                                fprintf(stderr, "  %zu matrices repacked into 16-row groups (STOWLM_REPACK=0: the GGUF layout)\n", n16);
                            if (ctx->staging_from() > 0)
                                fprintf(stderr, "  micro-batches of %lld+ tokens copy host-resident experts to the GPU: %.2f MiB "
                                        "of them pinned%s\n", (long long)ctx->staging_from(), mib(ctx->pinned_host_bytes()),
                                        ctx->pinned_host_bytes() ? " (STOWLM_PIN_EXPERTS=0: copied through bounce buffers)"
                                                                 : " (refused by the driver, over half the RAM, or "
                                                                   "STOWLM_PIN_EXPERTS=0)");
                            if (ctx->staging_from() > 0 && cp.moe_cpu_share > 0)
                                fprintf(stderr, "  of each staged layer's experts the host computes %.0f%% itself "
                                        "(STOWLM_MOE_CPU_SHARE)\n", 100.0 * cp.moe_cpu_share);
                            const size_t expected = info.file_bytes + kv + compute;
                            if (expected > mem.expected) {
                                mem.expected = expected;
                                char buf[256];
                                snprintf(buf, sizeof buf, "file %.2f + kv %.2f + compute %.2f = %.2f MiB (%s, %s)",
                                         mib(info.file_bytes), mib(kv), mib(compute), mib(expected),
                                         info.filename.c_str(), t.name().c_str());
                                mem.what = buf;
                            }
                        }

                        std::mt19937_64 rng(o.seed);
                        std::uniform_int_distribution<int32_t> tok(0, (int32_t)n_vocab - 1);
                        LastLogits last;
                        for (int64_t i = 0; i < t.n_depth; i++) last.depth_tokens.push_back(tok(rng));
                        std::vector<int32_t> prompt, gen;
                        for (int64_t i = 0; i < t.n_prompt; i++) prompt.push_back(tok(rng));
                        for (int64_t i = 0; i < t.n_gen; i++) gen.push_back(tok(rng));

                        // The depth is filled once; each run then truncates the cache back to it,
                        // which leaves the same cells as refilling would.
                        if (t.n_depth > 0) ctx->eval(last.depth_tokens, {}, false);
                        Result r;
                        r.model = &info;
                        r.backend = backend;
                        r.type_k = tk;
                        r.threads = threads;
                        r.n_ubatch = ub;
                        r.devices = devices;
                        r.n_copies = ctx->pipeline().n_copies;
                        r.test = t;
                        r.test_time = now_iso();
                        if (o.warmup) {
                            run_once(*ctx, t, prompt, gen, nullptr);
                            ctx->kv_truncate(t.n_depth);
                        }
                        for (int rep = 0; rep < o.reps; rep++) {
                            const bool final_rep = rep + 1 == o.reps;
                            r.samples_ns.push_back(run_once(*ctx, t, prompt, gen, final_rep ? &last.logits : nullptr));
                            ctx->kv_truncate(t.n_depth);
                        }
                        printer.add(r);
                        if (o.verbose && specs.size() > 1 && t.n_prompt > 0) report_pipeline(*ctx, *model, t);
                        if (o.verbose) report_kernels(*ctx, *model, t, r, prompt, gen);
                        if (o.verbose && t.n_gen > 0 && t.n_prompt == 0) {
                            double ts = 0;
                            for (uint64_t ns : r.samples_ns) ts += (double)t.n_gen * 1e9 / (double)ns;
                            ts /= (double)r.samples_ns.size();
                            const double bpt = model->weight_bytes_per_token();
                            fprintf(stderr, "  %s: %.1f MB of weights per token, read at %.1f GB/s\n", t.name().c_str(),
                                    bpt / 1e6, bpt * ts / 1e9);
                        }
                        if (dump) {
                            last.tokens = prompt;
                            last.tokens.insert(last.tokens.end(), gen.begin(), gen.end());
                            fprintf(dump, "%s\n{\"model\": \"%s\", \"test\": \"%s\", \"n_threads\": %lld, ",
                                    n_dumped++ ? "," : "", json_escape(path).c_str(), t.name().c_str(),
                                    (long long)threads);
                            fprintf(dump, "\"n_ubatch\": %lld, \"type_k\": \"%s\", \"n_prompt\": %lld, \"n_gen\": %lld, ",
                                    (long long)ub, tk.c_str(), (long long)t.n_prompt, (long long)t.n_gen);
                            fprintf(dump, "\"depth_tokens\": ");
                            write_ints(dump, last.depth_tokens);
                            fprintf(dump, ", \"tokens\": ");
                            write_ints(dump, last.tokens);
                            fprintf(dump, ", \"logits\": ");
                            write_floats(dump, last.logits);
                            fprintf(dump, "}");
                        }
                    }
                }
              }
            }
        }
    }
    printer.finish();
    if (dump) {
        fprintf(dump, "\n]}\n");
        if (fclose(dump) != 0) throw std::runtime_error("--dump-logits: cannot write '" + o.dump_logits + "'");
    }
    if (o.verbose) {
        const size_t rss = peak_rss_bytes();
        fprintf(stderr, "peak RSS %.2f MiB; largest expected: %s; ratio %.3f\n", mib(rss), mem.what.c_str(),
                mem.expected ? (double)rss / mem.expected : 0.0);
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    try {
        o = parse_args(argc, argv);
    } catch (const UsageError& e) {
        fprintf(stderr, "stowlm-bench: error: %s\n(see stowlm-bench --help)\n", e.what());
        return 2;
    } catch (const std::exception& e) {
        fprintf(stderr, "stowlm-bench: error: %s\n", e.what());
        return 1;
    }
    try {
        return run(o);
    } catch (const UsageError& e) {
        fprintf(stderr, "stowlm-bench: error: %s\n", e.what());
        return 2;
    } catch (const std::exception& e) {
        fflush(stdout);
        fprintf(stderr, "stowlm-bench: error: %s\n", e.what());
        return 1;
    }
}
