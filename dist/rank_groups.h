// Groups of consecutive ranks: the tensor-parallel groups and the pipelines of a world that runs
// one of them alone are the world cut into blocks [0, n), [n, 2n), ...: the innermost axis of
// the device mesh (dist/device_mesh.h), whose layout rank_groups.cpp uses.
#pragma once
#include <memory>
#include <string>

#include "tessera/dist/process_group.h"

namespace tessera::dist {

// Collective over `world`: splits it into world.size() / size groups of consecutive ranks and
// returns this rank's (its rank r of the group is world rank first + r). Refuses, before any
// communication, a size < 1 or one that does not divide the world size: "<what> 3 does not
// divide the world size 4" (`what`: "tensor parallelism: tp_size").
std::shared_ptr<ProcessGroup> consecutive_rank_group(ProcessGroup& world, int size,
                                                     const std::string& what);

}  // namespace tessera::dist
