// _core.dist: this process's place in an MPI job (stowlm/mpi.py sets it up with mpi4py).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "dist/mpi.h"
#include "dist/context_link.h"

namespace nb = nanobind;
using namespace stowlm;

STOWLM_BIND(dist) {
    nb::module_ d = stowlm::bind::submodule(m, "dist");
    d.def(
        "init",
        [](intptr_t comm, intptr_t byte_type, int rank, int size, const std::vector<std::string>& hosts,
           const std::vector<int>& pids, const std::string& libmpi, int64_t tag_ub) {
            std::vector<dist::PeerInfo> peers;
            for (size_t i = 0; i < hosts.size() && i < pids.size(); i++) peers.push_back({hosts[i], pids[i]});
            dist::World::init(comm, byte_type, rank, size, peers, libmpi, tag_ub);
        },
        nb::arg("comm"), nb::arg("byte_type"), nb::arg("rank"), nb::arg("size"), nb::arg("hosts"), nb::arg("pids"),
        nb::arg("libmpi") = "", nb::arg("tag_ub") = 32767,
        "binds the engine to an MPI communicator (mpi4py handle values) of its own");
    d.def("initialized", [] { return dist::World::get() != nullptr; });
    d.def("rank", [] { return dist::World::get() ? dist::World::get()->rank() : 0; });
    d.def("size", [] { return dist::World::get() ? dist::World::get()->size() : 1; });
    d.def(
        "end_job",
        [](int status) {
            nb::gil_scoped_release nogil;
            dist::end_job(status);
        },
        nb::arg("status") = 0, "rank 0: every other rank leaves serve_ranks() with this status");
    d.def(
        "fatal",
        [](const std::string& why) {
            nb::gil_scoped_release nogil;
            dist::World::get()->fatal(why);
        },
        nb::arg("why"), "prints WHY naming this rank and host, and aborts every rank");
    d.def("stats", [] {
        nb::dict r;
        dist::MessageStats s = dist::World::get() ? dist::World::get()->stats() : dist::MessageStats();
        r["messages"] = s.messages;
        r["bytes"] = s.bytes;
        r["send_s"] = s.send_s;
        r["recv_s"] = s.recv_s;
        return r;
    }, "messages and bytes sent, and the seconds spent in sends and receives, since reset_stats()");
    d.def("reset_stats", [] {
        if (dist::World::get()) dist::World::get()->reset_stats();
    });
}
