#include "tessera/dist/rank_groups.h"

#include <vector>

namespace tessera::dist {

std::shared_ptr<ProcessGroup> consecutive_rank_group(ProcessGroup& world, int size,
                                                     const std::string& what) {
  TESSERA_CHECK(size >= 1 && world.size() % size == 0, what, " ", size,
                " does not divide the world size ", world.size());
  std::shared_ptr<ProcessGroup> mine;
  // new_group is collective over the world: every rank creates every group, in order.
  for (int first = 0; first < world.size(); first += size) {
    std::vector<int> ranks;
    for (int r = first; r < first + size; ++r) ranks.push_back(r);
    std::shared_ptr<ProcessGroup> group = world.new_group(ranks);
    if (group) mine = group;
  }
  return mine;
}

}  // namespace tessera::dist
