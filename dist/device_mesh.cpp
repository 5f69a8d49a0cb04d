#include "tessera/dist/device_mesh.h"

#include <functional>
#include <sstream>

#include "tessera/dist/single_process_group.h"

namespace tessera::dist {

std::string MeshShape::str() const {
  std::ostringstream out;
  out << "dp " << dp << " x tp " << tp << " x pp " << pp;
  return out.str();
}

MeshShape resolve_mesh_shape(const MeshShape& requested, int world_size) {
  MeshShape s = requested;
  TESSERA_CHECK(s.tp >= 1, "device mesh: tp_size must be >= 1, got ", s.tp);
  TESSERA_CHECK(s.pp >= 1, "device mesh: pp_size must be >= 1, got ", s.pp);
  TESSERA_CHECK(s.dp >= 1 || s.dp == -1,
                "device mesh: dp_size must be >= 1 (or -1: the world "
                "size over tp_size x pp_size), got ",
                s.dp);
  const long long model_ranks = static_cast<long long>(s.tp) * s.pp;
  if (s.dp == -1) {
    TESSERA_CHECK(world_size % model_ranks == 0, "device mesh: tp_size ", s.tp, " x pp_size ", s.pp,
                  " = ", model_ranks, " does not divide the world size ", world_size);
    s.dp = static_cast<int>(world_size / model_ranks);
  }
  const long long product = model_ranks * s.dp;
  TESSERA_CHECK(product == world_size, "device mesh: dp_size ", s.dp, " x tp_size ", s.tp,
                " x pp_size ", s.pp, " = ", product, " is not the world size ", world_size);
  return s;
}

const char* mesh_axis_name(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::dp:
      return "dp";
    case MeshAxis::tp:
      return "tp";
    case MeshAxis::pp:
      return "pp";
  }
  return "?";
}

int mesh_rank(const MeshShape& s, const MeshCoordinate& at) {
  return (at.dp * s.pp + at.pp) * s.tp + at.tp;
}

MeshCoordinate mesh_coordinate(const MeshShape& s, int rank) {
  TESSERA_CHECK(rank >= 0 && rank < s.dp * s.tp * s.pp, "device mesh: rank ", rank,
                " is outside the mesh ", s.str());
  return {.dp = rank / (s.tp * s.pp), .tp = rank % s.tp, .pp = rank / s.tp % s.pp};
}

std::vector<int> mesh_group_ranks(const MeshShape& s, MeshAxis axis, int rank) {
  MeshCoordinate at = mesh_coordinate(s, rank);
  int& moving = axis == MeshAxis::dp ? at.dp : axis == MeshAxis::tp ? at.tp : at.pp;
  const int size = axis == MeshAxis::dp ? s.dp : axis == MeshAxis::tp ? s.tp : s.pp;
  std::vector<int> ranks;
  for (moving = 0; moving < size; ++moving) ranks.push_back(mesh_rank(s, at));
  return ranks;  // ascending: the rank grows with every coordinate
}

std::vector<int> mesh_replica_ranks(const MeshShape& s, int rank) {
  const int first = mesh_coordinate(s, rank).dp * s.tp * s.pp;
  std::vector<int> ranks;
  for (int r = first; r < first + s.tp * s.pp; ++r) ranks.push_back(r);
  return ranks;
}

DeviceMesh::DeviceMesh(GroupPtr world, const MeshShape& shape) : world_(std::move(world)) {
  TESSERA_CHECK(world_ != nullptr, "device mesh: no world group");
  shape_ = resolve_mesh_shape(shape, world_->size());
  coordinate_ = mesh_coordinate(shape_, world_->rank());
  // The same axes in the same order on every rank: new_group is collective over the world.
  tp_ = make_axis_group(MeshAxis::tp);
  pp_ = make_axis_group(MeshAxis::pp);
  dp_ = make_axis_group(MeshAxis::dp);
  // Only a mesh that splits over both axes needs a group of its own for the replica's ranks.
  model_ = shape_.tp == 1 ? pp_ : shape_.pp == 1 ? tp_ : make_replica_group();
}

GroupPtr DeviceMesh::make_axis_group(MeshAxis axis) {
  return make_group(mesh_axis_name(axis),
                    [this, axis](int rank) { return mesh_group_ranks(shape_, axis, rank); });
}

GroupPtr DeviceMesh::make_replica_group() {
  return make_group("model", [this](int rank) { return mesh_replica_ranks(shape_, rank); });
}

GroupPtr DeviceMesh::make_group(const std::string& name,
                                const std::function<std::vector<int>(int)>& ranks_of) {
  const std::vector<int> mine = ranks_of(world_->rank());
  const int size = static_cast<int>(mine.size());
  if (size == world_->size()) return world_;
  ProcessGroupOptions options = world_->options();
  options.name = world_->options().name + "/" + name;
  if (size == 1) return std::make_shared<SingleProcessGroup>(options);
  GroupPtr group = new_partition_group(*world_, ranks_of);
  TESSERA_CHECK(group != nullptr, "device mesh: rank ", world_->rank(), " is in no ", name,
                " group");
  return group;
}

GroupPtr new_partition_group(ProcessGroup& world,
                             const std::function<std::vector<int>(int)>& ranks_of) {
  GroupPtr group;
  for (int r = 0; r < world.size(); ++r) {
    const std::vector<int> ranks = ranks_of(r);
    if (ranks.front() != r) continue;
    GroupPtr created = world.new_group(ranks);
    if (created) group = std::move(created);
  }
  return group;
}

const GroupPtr& DeviceMesh::group(MeshAxis axis) const {
  return axis == MeshAxis::dp ? dp_ : axis == MeshAxis::tp ? tp_ : pp_;
}

std::string DeviceMesh::describe() const {
  std::ostringstream out;
  out << shape_.str() << "; rank " << world_->rank() << ": dp " << coordinate_.dp << ", tp "
      << coordinate_.tp << ", pp " << coordinate_.pp;
  return out.str();
}

}  // namespace tessera::dist
