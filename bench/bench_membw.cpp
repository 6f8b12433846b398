// Read bandwidth of this machine, the ceiling of token generation (every weight byte is read
// once per generated token): each thread sums its own slice of one buffer, again and again.
//   bench-membw [--mib 32,100,256,1024] [--threads 1,2] [--seconds S]
// Prints GB/s (1e9 bytes per second) per buffer size and thread count.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

static std::vector<long> parse_list(const char* s) {
    std::vector<long> v;
    std::stringstream ss(s);
    std::string t;
    while (std::getline(ss, t, ','))
        if (!t.empty()) v.push_back(std::atol(t.c_str()));
    return v;
}

// Four independent sums so the loop is bound by loads, not by one add chain.
static uint64_t sum_slice(const uint64_t* p, size_t n) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= n; i += 4) a += p[i], b += p[i + 1], c += p[i + 2], d += p[i + 3];
    return a ^ b ^ c ^ d;
}

int main(int argc, char** argv) {
    std::vector<long> mibs = {32, 100, 256, 1024}, threads = {1, 2};
    double seconds = 1.0;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        if (a == "--mib" && i + 1 < argc) mibs = parse_list(argv[++i]);
        else if (a == "--threads" && i + 1 < argc) threads = parse_list(argv[++i]);
        else if (a == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
        else {
            std::fprintf(stderr, "usage: bench-membw [--mib 32,100,256,1024] [--threads 1,2] [--seconds S]\n");
            return 2;
        }
    }
    std::printf("| buffer MiB | threads | read GB/s |\n| ---: | ---: | ---: |\n");
    for (long mib : mibs) {
        const size_t n = (size_t)mib * (1 << 20) / sizeof(uint64_t);
        std::vector<uint64_t> buf(n, 1);  // touched: every page resident before timing
        for (long nth : threads) {
            if (nth < 1) continue;
            std::vector<std::thread> pool;
            std::vector<uint64_t> bytes(nth, 0), sink(nth, 0);
            const auto t0 = std::chrono::steady_clock::now();
            for (long t = 0; t < nth; t++)
                pool.emplace_back([&, t] {
                    const size_t per = n / nth, off = per * t;
                    do {
                        sink[t] += sum_slice(buf.data() + off, per);
                        bytes[t] += per * sizeof(uint64_t);
                    } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds);
                });
            for (auto& th : pool) th.join();
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            uint64_t total = 0, s = 0;
            for (long t = 0; t < nth; t++) total += bytes[t], s ^= sink[t];
            std::printf("| %ld | %ld | %.1f |%s\n", mib, nth, total / dt / 1e9, s == 42 ? " " : "");
        }
    }
    return 0;
}
