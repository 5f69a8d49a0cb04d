#include "tessera/dist/rank_groups.h"

#include "tessera/dist/device_mesh.h"

namespace tessera::dist {

// The world as a mesh of `size` ranks along its innermost axis (tp), so that the layout is the
// mesh's (dist/device_mesh.h: mesh_rank) whoever asks: blocks [0, size), [size, 2 size), ...
std::shared_ptr<ProcessGroup> consecutive_rank_group(ProcessGroup& world, int size,
                                                     const std::string& what) {
  TESSERA_CHECK(size >= 1 && world.size() % size == 0, what, " ", size,
                " does not divide the world size ", world.size());
  const MeshShape shape{.dp = world.size() / size, .tp = size, .pp = 1};
  return new_partition_group(world,
                             [&](int rank) { return mesh_group_ranks(shape, MeshAxis::tp, rank); });
}

}  // namespace tessera::dist
