// The in-process communicator: N tensor-parallel ranks as N threads of one process, over host memory
// (model/comm.h's contract). Each collective is two barriers around shared pointers: every rank posts its buffer,
// rank r sums element range r of all buffers in rank order and writes the sum into every buffer, and nobody leaves
// before all sums are written. Deterministic (the order of each element's additions is fixed) and lock-free in the
// data path.
#pragma once
#include <memory>
#include <vector>

#include "model/comm.h"

namespace kiln::backend {

class LocalGroup;

// One communicator per rank of a new group of `size` ranks (index = rank); they share the group's state.
// `timeout`: the initial time-out of every collective (0 = none).
std::vector<std::unique_ptr<model::Communicator>> make_local_group(
    int size, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

}  // namespace kiln::backend
