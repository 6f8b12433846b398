#include "cpu/threadpool.h"

#include <chrono>
#include <cstdlib>

#if defined(__linux__)
#include <sched.h>
#endif

#include "spin.h"

namespace stowlm {

namespace {
// Some tens of microseconds of spinning before a worker sleeps: they cover the gaps between a
// graph's ops. Between a server's decode steps the engine runs Python for a few hundred
// microseconds, and a worker spinning through them (20000 looks) kept a core from the event
// loop (serve_bench, 3 alternating rounds: 694 -> 712 tok/s under load; decode alone 1% slower).
constexpr int kSpinIters = 2000;
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
    threads_.reserve(n_threads_ - 1);
    for (int i = 1; i < n_threads_; i++) threads_.emplace_back([this] { worker(); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_.store(true);
        generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
}

void ThreadPool::take_parts() {
    for (;;) {
        const int part = next_part_.fetch_add(1);
        if (part >= n_threads_) return;
        job_fn_(job_ctx_, part, n_threads_);
        parts_done_.fetch_add(1);
    }
}

void ThreadPool::run_raw(JobFn fn, void* ctx) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (n_threads_ == 1) {
        fn(ctx, 0, 1);
        return;
    }
    job_fn_ = fn;
    job_ctx_ = ctx;
    next_part_.store(0);
    parts_done_.store(0);
    {
        std::lock_guard<std::mutex> lk(mu_);
        open_.store(generation_.load() + 1);  // before the workers can see the new generation
        generation_.fetch_add(1);
    }
    if (sleepers_.load() > 0) cv_.notify_all();
    take_parts();
    // (the others finish within microseconds on an idle machine)
    spin_until([&] { return parts_done_.load() == n_threads_; });
    // No worker may join from now on; one that joined already finds no part left and leaves.
    // (seq_cst on both sides: a worker either sees the job closed or is counted here.)
    open_.store(0);
    spin_until([&] { return joined_.load() == 0; });
}

void ThreadPool::worker() {
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = generation_.load(std::memory_order_acquire);
        for (int i = 1; g == seen && i < kSpinIters; i++) {
            if (i % kSpinYieldEvery == 0) std::this_thread::yield();
            else cpu_pause();
            g = generation_.load(std::memory_order_acquire);
        }
        if (g == seen) {
            std::unique_lock<std::mutex> lk(mu_);
            sleepers_.fetch_add(1);
            cv_.wait(lk, [&] { return generation_.load() != seen; });
            sleepers_.fetch_sub(1);
            g = generation_.load();
        }
        seen = g;
        if (stop_.load()) return;
        joined_.fetch_add(1);
        if (open_.load() == g) take_parts();  // else the job ended without this thread
        joined_.fetch_sub(1);
    }
}

int default_threads() {
    if (const char* s = std::getenv("STOWLM_THREADS")) {
        const int n = std::atoi(s);
        if (n > 0) return n;
    }
#if defined(__linux__)
    // The cores this process may run on: a launcher (mpirun binds each rank by default, taskset,
    // a container's cpuset) may allow fewer than the machine has, and more threads would share them.
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    const unsigned n = std::thread::hardware_concurrency();
    return n ? (int)n : 1;
}

ThreadPool& ThreadPool::global() {
    static ThreadPool pool(default_threads());
    return pool;
}

}  // namespace stowlm
