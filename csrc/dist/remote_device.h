// A device of another MPI rank as this process sees it (see dist/context_link.h for how ranks
// run one model): the lowest floor of dist/, below the engine, so models can build their
// backends without knowing about contexts.
#pragma once
#include <memory>

#include "backend/backend.h"

namespace stowlm::dist {

// The backend of device `id` as this rank sees it: the real one when spec is this rank's
// (or names no rank), else a RemoteBackend standing for the device of rank spec.rank.
std::unique_ptr<Backend> make_device(int id, const DeviceSpec& spec);
bool is_remote(const Backend* b);
int owner_rank(const Backend* b);  // the rank of a remote backend, this rank's otherwise
int this_rank();                   // 0 outside an MPI job

}  // namespace stowlm::dist
