#include "dist/mpi.h"

#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "error.h"

namespace stowlm::dist {

namespace {

std::unique_ptr<World> g_world;
using Clock = std::chrono::steady_clock;
constexpr size_t kPiece = size_t(1) << 30;  // MPI counts are ints

int find_libmpi(struct dl_phdr_info* info, size_t, void* out) {
    const char* name = info->dlpi_name;
    if (!name || !*name) return 0;
    const char* base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (strncmp(base, "libmpi.so", 9) == 0) {
        *static_cast<std::string*>(out) = name;
        return 1;
    }
    return 0;
}

template <typename F>
F symbol(void* lib, const char* name, const std::string& path) {
    void* p = dlsym(lib, name);
    if (!p) throw Unsupported("stowlm.mpi: " + path + " has no " + name);
    return reinterpret_cast<F>(p);
}

std::string this_host() {
    char buf[256] = {0};
    if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
    return buf;
}

}  // namespace

void World::init(intptr_t comm, intptr_t byte_type, int rank, int size, const std::vector<PeerInfo>& peers,
                 const std::string& libmpi, int64_t tag_ub) {
    if (size < 1 || rank < 0 || rank >= size || (int)peers.size() != size)
        throw InvalidInput("stowlm.mpi: rank " + std::to_string(rank) + " of " + std::to_string(size) + " with " +
                           std::to_string(peers.size()) + " peers");
    std::string path = libmpi;
    if (path.empty()) dl_iterate_phdr(find_libmpi, &path);
    if (path.empty())
        throw Unsupported("stowlm.mpi: no libmpi is loaded in this process (import mpi4py.MPI first)");
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen(path.c_str(), RTLD_NOW);
    if (!lib) throw Unsupported("stowlm.mpi: cannot open " + path + ": " + dlerror());
    std::unique_ptr<World> w(new World());
    w->isend_ = symbol<decltype(w->isend_)>(lib, "MPI_Isend", path);
    w->irecv_ = symbol<decltype(w->irecv_)>(lib, "MPI_Irecv", path);
    w->test_ = symbol<decltype(w->test_)>(lib, "MPI_Test", path);
    w->abort_ = symbol<decltype(w->abort_)>(lib, "MPI_Abort", path);
    w->error_string_ = symbol<decltype(w->error_string_)>(lib, "MPI_Error_string", path);
    w->comm_ = reinterpret_cast<void*>(comm);
    w->byte_ = reinterpret_cast<void*>(byte_type);
    w->rank_ = rank;
    w->size_ = size;
    w->tag_ub_ = tag_ub;
    w->peers_ = peers;
    w->my_host_ = this_host();
    g_world = std::move(w);
}

World* World::get() { return g_world.get(); }

World::~World() {
    {
        std::lock_guard<std::mutex> lock(out_mu_);
        stop_ = true;
    }
    out_cv_.notify_all();
    if (sender_.joinable()) sender_.join();
}

void World::post(int dst, int tag, std::vector<char>&& data, const char* what) {
    auto* o = new Outgoing();
    o->dst = dst, o->tag = tag, o->data = std::move(data), o->what = what;
    const size_t bytes = o->data.size();  // o belongs to the sender thread once queued
    {
        std::lock_guard<std::mutex> lock(out_mu_);
        if (!sender_.joinable()) sender_ = std::thread([this] { sender_loop(); });
        queued_.push_back(o);
    }
    out_cv_.notify_all();
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.messages++;
    stats_.bytes += bytes;
}

void World::sender_loop() {
    std::list<std::unique_ptr<Outgoing>> pending;
    auto since = Clock::now();
    int sleep_us = 0;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(out_mu_);
            if (pending.empty()) out_cv_.wait(lock, [&] { return stop_ || !queued_.empty(); });
            if (stop_ && queued_.empty() && pending.empty()) return;
            const bool fresh = !queued_.empty();
            while (!queued_.empty()) {
                pending.emplace_back(queued_.front());
                queued_.pop_front();
            }
            if (fresh) since = Clock::now(), sleep_us = 0;
        }
        for (auto it = pending.begin(); it != pending.end();) {
            Outgoing& o = **it;
            int rc = 0, flag = 0;
            alignas(16) unsigned char status[64];
            {
                std::lock_guard<std::mutex> lock(mu_);
                if (!o.started) {
                    const size_t n = std::min(kPiece, o.data.size() - o.off);
                    rc = isend_(o.data.data() + o.off, (int)n, byte_, o.dst, o.tag, comm_, o.request);
                    o.started = true;
                } else {
                    rc = test_(o.request, &flag, status);
                }
            }
            if (rc != 0) fatal(std::string("sending ") + o.what + " to " + who(o.dst) + " failed: " + error_string(rc));
            if (flag) {
                o.off += std::min(kPiece, o.data.size() - o.off);
                o.started = false;
                memset(o.request, 0, sizeof(o.request));
                if (o.off >= o.data.size() && !o.data.empty()) {
                    it = pending.erase(it);
                    continue;
                }
                if (o.data.empty()) {
                    it = pending.erase(it);
                    continue;
                }
            }
            ++it;
        }
        if (pending.empty()) continue;
        while (aborting_) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const auto now = Clock::now();
        if (now - since > std::chrono::microseconds(50)) {
            sleep_us = std::min(std::max(2 * sleep_us, 10), 100);
            std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
        }
        if (now - since > std::chrono::milliseconds(100)) {
            since = now;
            for (const auto& o : pending)
                if (peer_gone(o->dst)) fatal(who(o->dst) + " ended while this rank was sending it " + o->what);
        }
    }
}

std::string World::who(int r) const {
    if (r < 0 || r >= size_) return "rank " + std::to_string(r);
    return "rank " + std::to_string(r) + " (host " + peers_[r].host + ", pid " + std::to_string(peers_[r].pid) + ")";
}

std::string World::error_string(int code) const {
    char buf[1024] = {0};
    int len = 0;
    if (error_string_ && error_string_(code, buf, &len) == 0) return std::string(buf, std::min(len, 1023));
    return "MPI error " + std::to_string(code);
}

bool World::peer_gone(int peer) const {
    if (peer < 0 || peer >= size_ || peers_[peer].pid <= 0 || peers_[peer].host != my_host_) return false;
    const int pid = peers_[peer].pid;
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    // A killed process stays a zombie until the launcher reaps it.
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return false;
    const size_t close = line.rfind(')');
    return close != std::string::npos && close + 2 < line.size() && (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

void World::wait(void* request, int peer, const char* what, bool idle, bool sending) {
    const auto t0 = Clock::now();
    auto checked = t0;
    int sleep_us = 0;
    for (;;) {
        int flag = 0, rc;
        alignas(16) unsigned char status[64];
        {
            std::lock_guard<std::mutex> lock(mu_);
            rc = test_(request, &flag, status);
        }
        if (rc != 0)
            fatal(std::string(sending ? "sending " : "receiving ") + what + (sending ? " to " : " from ") + who(peer) +
                  " failed: " + error_string(rc));
        if (flag) return;
        while (aborting_) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // fatal() ends the job
        const auto now = Clock::now();
        if (now - t0 < std::chrono::microseconds(50)) continue;  // a reply due at once: spin briefly
        // at most 100 us late while messages flow; an idle rank (no command for a second) 2 ms
        const bool long_idle = idle && now - t0 > std::chrono::seconds(1);
        sleep_us = std::min(std::max(2 * sleep_us, 10), long_idle ? 2000 : 100);
        std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
        if (now - checked > std::chrono::milliseconds(100)) {
            checked = now;
            if (peer_gone(peer))
                fatal(who(peer) + " ended while this rank was " + (sending ? "sending it " : "waiting for ") + what);
        }
    }
}

void World::send(int dst, int tag, const void* data, size_t bytes, const char* what) {
    const auto t0 = Clock::now();
    size_t off = 0;
    do {
        const size_t n = std::min(kPiece, bytes - off);
        alignas(16) unsigned char request[64] = {0};
        int rc;
        {
            std::lock_guard<std::mutex> lock(mu_);
            rc = isend_((const char*)data + off, (int)n, byte_, dst, tag, comm_, request);
        }
        if (rc != 0) fatal(std::string("sending ") + what + " to " + who(dst) + " failed: " + error_string(rc));
        wait(request, dst, what, false, true);
        off += n;
    } while (off < bytes);
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.messages++;
    stats_.bytes += bytes;
    stats_.send_s += std::chrono::duration<double>(Clock::now() - t0).count();
}

void World::recv(int src, int tag, void* data, size_t bytes, const char* what, bool idle) {
    const auto t0 = Clock::now();
    size_t off = 0;
    do {
        const size_t n = std::min(kPiece, bytes - off);
        alignas(16) unsigned char request[64] = {0};
        int rc;
        {
            std::lock_guard<std::mutex> lock(mu_);
            rc = irecv_((char*)data + off, (int)n, byte_, src, tag, comm_, request);
        }
        if (rc != 0) fatal(std::string("receiving ") + what + " from " + who(src) + " failed: " + error_string(rc));
        wait(request, src, what, idle, false);
        off += n;
    } while (off < bytes);
    if (idle) return;  // waiting for the next command is not time spent in messages
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.recv_s += std::chrono::duration<double>(Clock::now() - t0).count();
}

void World::fatal(const std::string& why) {
    bool first = false;
    if (aborting_.compare_exchange_strong(first, true)) {
        fprintf(stderr, "stowlm: %s: %s; stopping every rank\n", who(rank_).c_str(), why.c_str());
        fflush(stderr);
        fflush(stdout);
        std::lock_guard<std::mutex> lock(mu_);
        abort_(comm_, 1);
    }
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

MessageStats World::stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
}

void World::reset_stats() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = MessageStats();
}

}  // namespace stowlm::dist
