// One pool of worker threads per CPU device, created once and reused by every op, so no
// op ever creates a thread. Workers spin briefly after a job (the next op of a token comes
// within microseconds) and then sleep. A job's parts (its ith values) go to whichever thread
// asks first, and a job is done when its parts are: a worker that the OS has not run yet
// (another process on its core, or still waking) does not hold the others up, since the caller
// takes its part too.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace stowlm {

// Threads a pool or CPU device gets when none are asked for: $STOWLM_THREADS, else the
// machine's hardware threads.
int default_threads();

class ThreadPool {
public:
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return n_threads_; }

    // Runs fn(ith, nth) for every ith in [0, nth) (nth = size()), each once, on whichever
    // threads of the pool take them first (the caller included), and returns when all are done;
    // parts may run one after another on one thread. Jobs must not call run() on the same pool.
    template <class F>
    void run(F&& fn) {
        run_raw(&invoke<F>, (void*)&fn);
    }

    // Splits [0, n) into contiguous chunks, one per thread: fn(begin, end, ith).
    template <class F>
    void parallel_for(int64_t n, F&& fn) {
        run([&](int ith, int nth) {
            const int64_t per = (n + nth - 1) / nth;
            const int64_t b = per * ith, e = b + per < n ? b + per : n;
            if (b < e) fn(b, e, ith);
        });
    }

    // Work stealing over n items in chunks of `chunk`: fn(begin, end, ith). Good when items
    // cost different amounts (rows of different experts, tiles at the matrix edge).
    template <class F>
    void parallel_for_dynamic(int64_t n, int64_t chunk, F&& fn) {
        std::atomic<int64_t> next{0};
        run([&](int ith, int) {
            for (;;) {
                const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
                if (b >= n) break;
                fn(b, b + chunk < n ? b + chunk : n, ith);
            }
        });
    }

    // The process-wide default pool, of default_threads() threads.
    static ThreadPool& global();

private:
    using JobFn = void (*)(void*, int, int);
    template <class F>
    static void invoke(void* ctx, int ith, int nth) {
        (*(F*)ctx)(ith, nth);
    }
    void run_raw(JobFn fn, void* ctx);
    void take_parts();
    void worker();

    int n_threads_;
    std::vector<std::thread> threads_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<uint64_t> open_{0};       // the generation workers may still join (0: none)
    std::atomic<int> joined_{0};          // workers inside the open job
    std::atomic<int> next_part_{0}, parts_done_{0};
    JobFn job_fn_ = nullptr;
    void* job_ctx_ = nullptr;
    std::atomic<bool> stop_{false};
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<int> sleepers_{0};
    std::mutex run_mu_;  // one job at a time per pool, whoever calls
};

}  // namespace stowlm
