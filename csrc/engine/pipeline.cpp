#include "engine/pipeline.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "error.h"
#include "spin.h"

namespace stowlm {

namespace {

// Threads kept for the devices between calls: a generated token is one micro-batch, and new
// threads for each (created, placed on a core, joined) cost more than its all-reduces. Between
// calls they look for work for ~2 ms (a token's host work fits in that), then sleep.
class DeviceThreads {
  public:
    static DeviceThreads& get() {
        static DeviceThreads t;
        return t;
    }
    // Runs fn(k) for every k in [0, n): k = 0 on the calling thread, the others on kept threads.
    // False (nothing run) when another call is using them: the caller then starts its own.
    bool run(int n, const std::function<void(int)>& fn) {
        std::unique_lock<std::mutex> busy(call_mu_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            while ((int)threads_.size() < n - 1) {
                const int k = (int)threads_.size() + 1;
                const uint64_t now = generation_.load();  // the job posted below is new to it
                threads_.emplace_back([this, k, now] { loop(k, now); });
            }
            job_ = &fn;
            n_job_ = n;
            pending_.store(n - 1, std::memory_order_relaxed);
            generation_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        fn(0);
        // A short look (after a token the others end within microseconds), then sleep: during a
        // long prompt the caller only released the micro-batches, and its core is the devices'.
        if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; }, std::chrono::microseconds(100))) {
            std::unique_lock<std::mutex> lock(mu_);
            done_cv_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
        }
        return true;
    }
    ~DeviceThreads() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
            generation_.fetch_add(1);
        }
        cv_.notify_all();
        for (std::thread& t : threads_) t.join();
    }

  private:
    void loop(int k, uint64_t seen) {
        for (;;) {
            const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
            while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
                std::this_thread::yield();
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
            seen = generation_.load(std::memory_order_acquire);
            if (stop_) return;
            const std::function<void(int)>* fn = k < n_job_ ? job_ : nullptr;
            lock.unlock();
            if (fn) {
                (*fn)(k);
                if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                    std::lock_guard<std::mutex> lock(mu_);  // (the caller checks under it before sleeping)
                    done_cv_.notify_all();
                }
            }
        }
    }
    std::mutex call_mu_, mu_;
    std::condition_variable cv_, done_cv_;
    std::vector<std::thread> threads_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    const std::function<void(int)>* job_ = nullptr;
    int n_job_ = 0;
    bool stop_ = false;
};

}  // namespace

std::string pipeline_blocker(const Graph& g, const std::vector<Backend*>& backends) {
    const auto at = g.split_of();
    for (int j = 0; j < (int)g.splits.size(); j++)
        for (const Tensor* n : g.splits[j].nodes)
            for (int k = 0; k < n->n_src(); k++) {
                if (!n->src[k]) continue;
                const Tensor* r = n->src[k]->storage_root();
                // (a copy has a slot per micro-batch in flight: a device may read it in each of its
                // splits, e.g. the positions copied to a GPU holding two ranges of layers)
                if (r->role != TensorRole::COMPUTE || r->op == Op::COPY) continue;
                auto it = at.find(r);
                if (it == at.end() || it->second == j) continue;
                if (r->device == g.splits[j].device)
                    return backends[g.splits[j].device]->name() + " keeps " + r->name + " from one of its splits of " +
                           "a micro-batch to another (" + n->name + " reads it): tensor overrides interleave the devices "
                           "inside a layer, and pipelining would need that device's compute buffer once per "
                           "micro-batch in flight";
            }
    return "";
}

void run_pipeline(int n_micro, int n_slots, const std::vector<Backend*>& backends,
                  const std::function<Graph*(int)>& prepare,
                  const std::function<void(const Graph&, const Split&)>& run_split,
                  const std::function<void(int, const Graph&)>& finish, PipelineStats* stats,
                  const PipelineLink* link) {
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<uint64_t> progress{0};  // bumped under mu at every change a waiting device looks for
    std::vector<Graph*> graphs(n_micro, nullptr);
    std::vector<std::vector<char>> done(n_micro);
    std::vector<int> remaining(n_micro, 0);
    std::exception_ptr error;
    std::vector<double> busy(backends.size(), 0.0);

    auto release = [&](int i, Graph* g) {  // under mu
        for (const auto& c : g->collectives()) c->reset();
        graphs[i] = g;
        done[i].assign(g->splits.size(), 0);
        remaining[i] = (int)g->splits.size();
        progress.fetch_add(1, std::memory_order_release);
    };
    Graph* first = prepare(0);
    if (first->output_split < 0) throw InvalidInput("pipeline: no split computes the graph's output");
    std::vector<int> split_device;
    for (const Split& s : first->splits) split_device.push_back(s.device);
    release(0, first);

    auto worker = [&](int device) {
        struct Task {
            int micro, split;
        };
        std::vector<Task> tasks;
        for (int i = 0; i < n_micro; i++)
            for (int j = 0; j < (int)split_device.size(); j++)
                if (split_device[j] == device) tasks.push_back({i, j});
        std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
            return a.micro + a.split != b.micro + b.split ? a.micro + a.split < b.micro + b.split : a.micro < b.micro;
        });
        std::vector<char> taken(tasks.size(), 0);
        size_t left = tasks.size(), first_open = 0;  // tasks before first_open are all taken
        while (left) {
            int pick = -1;
            Graph* g = nullptr;
            {
                auto can_go = [&] {  // under mu
                    if (error) return true;
                    while (first_open < tasks.size() && taken[first_open]) first_open++;
                    for (size_t t = first_open; t < tasks.size(); t++) {
                        if (taken[t]) continue;
                        const Task& k = tasks[t];
                        if (!graphs[k.micro]) continue;
                        bool ready = true;
                        for (int d : graphs[k.micro]->splits[k.split].deps) ready = ready && done[k.micro][d];
                        if (ready) {
                            pick = (int)t;
                            return true;
                        }
                    }
                    return false;
                };
                std::unique_lock<std::mutex> lock(mu);
                while (!can_go()) {
                    // Look for ~100 us before sleeping: in a generated token the split this one
                    // waits for is usually microseconds from done, and a sleep costs a wake-up.
                    const uint64_t seen = progress.load(std::memory_order_relaxed);
                    lock.unlock();
                    const bool moved = spin_until([&] { return progress.load(std::memory_order_acquire) != seen; },
                                                  std::chrono::microseconds(100));
                    lock.lock();
                    if (!moved) cv.wait(lock, [&] { return progress.load(std::memory_order_relaxed) != seen; });
                }
                if (error) return;
                g = graphs[tasks[pick].micro];
            }
            taken[pick] = 1;
            left--;
            const Task k = tasks[pick];
            const auto start = Clock::now();
            try {
                const Split& s = g->splits[k.split];
                if (!link || !link->remote[device]) {  // (another rank runs a remote device's splits)
                    if (link) link->receive(k.micro, *g, s);
                    run_split(*g, s);
                    // Into the consumers' copy slots of this micro-batch, before this device's next
                    // split may overwrite what they copy.
                    for (Tensor* c : s.pushes)
                        if (link && link->remote[c->device]) link->send(k.micro, *g, *c);
                        else backends[c->device]->copy_from_peer(*c, *c->src[0], *backends[device]);
                }
                if (k.split == g->output_split) finish(k.micro, *g);
            } catch (...) {
                std::lock_guard<std::mutex> lock(mu);
                if (!error) error = std::current_exception();
                progress.fetch_add(1, std::memory_order_release);
                // devices waiting in an all-reduce for this one give up too
                for (Graph* gr : graphs)
                    if (gr)
                        for (const auto& c : gr->collectives()) c->abort();
                cv.notify_all();
                return;
            }
            std::lock_guard<std::mutex> lock(mu);
            busy[device] += std::chrono::duration<double>(Clock::now() - start).count();
            done[k.micro][k.split] = 1;
            remaining[k.micro]--;
            progress.fetch_add(1, std::memory_order_release);
            cv.notify_all();
        }
    };

    std::vector<char> has_work(backends.size(), 0);
    for (int d : split_device) has_work[d] = 1;
    std::vector<int> working;
    for (int d = 0; d < (int)backends.size(); d++)
        if (has_work[d]) working.push_back(d);
    // Release the micro-batches in order, each once the one n_slots before it is done.
    auto release_rest = [&] {
        for (int i = 1; i < n_micro; i++) {
            {
                std::unique_lock<std::mutex> lock(mu);
                cv.wait(lock, [&] { return error || i < n_slots || remaining[i - n_slots] == 0; });
                if (error) break;
            }
            Graph* g = nullptr;
            try {
                g = prepare(i);
                std::vector<int> devs;
                for (const Split& s : g->splits) devs.push_back(s.device);
                if (devs != split_device || g->output_split != first->output_split)
                    throw InvalidInput("pipeline: micro-batch graphs differ in their splits");
            } catch (...) {
                std::lock_guard<std::mutex> lock(mu);
                if (!error) error = std::current_exception();
                progress.fetch_add(1, std::memory_order_release);
                cv.notify_all();
                break;
            }
            std::lock_guard<std::mutex> lock(mu);
            release(i, g);
            cv.notify_all();
        }
    };
    // One micro-batch (a generated token): the calling thread runs one of the devices. Several: it
    // releases them (release_rest) while the devices run on the kept threads.
    const bool inline_first = n_micro == 1;
    const int n_run = (int)working.size() + (inline_first ? 0 : 1);
    const std::function<void(int)> device_job = [&](int k) {
        if (!inline_first && k == 0) return release_rest();
        worker(working[inline_first ? k : k - 1]);
    };

    if (!DeviceThreads::get().run(n_run, device_job)) {  // another context's pipeline has them
        std::vector<std::thread> threads;
        for (int k = 1; k < n_run; k++) threads.emplace_back(device_job, k);
        device_job(0);
        for (std::thread& t : threads) t.join();
    }
    for (Backend* b : backends) b->synchronize();
    if (error) std::rethrow_exception(error);
    if (stats) {
        stats->wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
        stats->busy_s = busy;
        stats->micro_batches = n_micro;
    }
}

}  // namespace stowlm
