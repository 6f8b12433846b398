// The MPI job this process belongs to, when it runs under mpirun / srun (stowlm.mpi sets it up
// from Python with mpi4py; without it, this is never initialised and nothing here runs).
//
// The MPI library is not linked: stowlm builds and runs without one. The functions the engine
// needs (Isend, Irecv, Test, Abort, Error_string) are looked up at run time in the libmpi that
// mpi4py loaded, and the communicator and MPI_BYTE arrive as mpi4py's handle values, so the
// core never depends on one MPI's header or handle types (Open MPI's pointers, MPICH's ints).
//
// Every call goes through one mutex (MPI_THREAD_SERIALIZED is enough), and waits poll
// MPI_Test with a short spin and then sleeps: a waiting rank neither burns a core (the ranks of
// one host share its cores) nor stops noticing that a peer of its host is gone.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace stowlm::dist {

struct PeerInfo {
    std::string host;
    int pid = 0;
};

// Message tags. Activations use kTagData + (copy index << kMicroBits) + micro-batch index.
constexpr int kTagCommand = 1, kTagReply = 2, kTagLogits = 16, kMicroBits = 10, kTagData = 1 << 14;

struct MessageStats {
    uint64_t messages = 0, bytes = 0;
    double send_s = 0, recv_s = 0;  // time spent in send / receive calls (waiting included)
};

class World {
public:
    // comm, byte_type: mpi4py's handle values (Comm.handle, MPI.BYTE.handle) of a communicator
    // the engine has to itself; libmpi: the library's path ("" finds the loaded libmpi).
    // tag_ub: the communicator's MPI_TAG_UB.
    static void init(intptr_t comm, intptr_t byte_type, int rank, int size, const std::vector<PeerInfo>& peers,
                     const std::string& libmpi, int64_t tag_ub);
    static World* get();  // null outside an MPI job

    int rank() const { return rank_; }
    int size() const { return size_; }
    int64_t tag_ub() const { return tag_ub_; }
    // "rank 1 (host h, pid 123)"
    std::string who(int rank) const;

    // Blocking point-to-point messages (any size: sent in pieces below 1 GiB). `what` names the
    // message in errors. A failed call or a peer of this host that ended is fatal().
    void send(int dst, int tag, const void* data, size_t bytes, const char* what);
    void recv(int src, int tag, void* data, size_t bytes, const char* what, bool idle = false);
    // Sends without waiting for the receiver, as a push into a local consumer's copy slot does:
    // the bytes are this rank's copy, and a sender thread sees the message through. (A blocking
    // send could deadlock two ranks whose one thread each sends to the other before receiving.)
    void post(int dst, int tag, std::vector<char>&& data, const char* what);

    // Prints "stowlm: rank R (host H): WHY; stopping every rank" once and aborts the whole job
    // (MPI_Abort): every other rank ends within the launcher's bounded time, none hangs.
    [[noreturn]] void fatal(const std::string& why);

    MessageStats stats() const;
    void reset_stats();

    ~World();

private:
    World() = default;
    void sender_loop();
    struct Outgoing {
        int dst, tag;
        std::vector<char> data;
        const char* what;
        size_t off = 0;  // sent up to here (pieces below 1 GiB)
        bool started = false;
        alignas(16) unsigned char request[64] = {0};
    };
    void wait(void* request, int peer, const char* what, bool idle, bool sending);
    std::string error_string(int code) const;
    bool peer_gone(int peer) const;

    int rank_ = 0, size_ = 1;
    int64_t tag_ub_ = 32767;
    std::vector<PeerInfo> peers_;
    std::string my_host_;
    void* comm_ = nullptr;
    void* byte_ = nullptr;
    // the library's functions; handle arguments pass as pointer-sized values
    int (*isend_)(const void*, int, void*, int, int, void*, void*) = nullptr;
    int (*irecv_)(void*, int, void*, int, int, void*, void*) = nullptr;
    int (*test_)(void*, int*, void*) = nullptr;
    int (*abort_)(void*, int) = nullptr;
    int (*error_string_)(int, char*, int*) = nullptr;
    mutable std::mutex mu_;
    std::atomic<bool> aborting_{false};
    mutable std::mutex stats_mu_;
    MessageStats stats_;
    std::mutex out_mu_;
    std::condition_variable out_cv_;
    std::deque<Outgoing*> queued_;
    bool stop_ = false;
    std::thread sender_;
};

}  // namespace stowlm::dist
