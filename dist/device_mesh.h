// The device mesh (Megatron-LM's, Accelerate's ParallelismConfig): the world's ranks laid out
// as dp x pp x tp, with tensor parallelism innermost (the ranks of one tp group are
// consecutive, so on a node they share the fastest links), then the pipeline stages, then
// data parallelism outermost:
//
//   rank = (d·pp + p)·tp + t        d in [0, dp), p in [0, pp), t in [0, tp)
//
// Each rank belongs to one group along each axis: its tp group (the same d and p: the ranks
// that split one layer), its pp group (the same d and t: one pipeline, stage p = its rank
// there) and its dp group (the same p and t: the replicas whose gradients are averaged). With
// 8 ranks as dp 2 x tp 2 x pp 2, rank 5 = (1·2 + 0)·2 + 1 is in tp group {4, 5}, pp group
// {5, 7} and dp group {1, 5}. The Accelerator builds one from its options (tp_size, pp_size,
// dp_size) and hands its data-parallel strategies the dp group; dist::parallelize
// (dist/parallelize.h) splits a model over the tp group, the pp group or both at once.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/nn/causal_lm.h"

namespace tessera::dist {

using GroupPtr = std::shared_ptr<ProcessGroup>;

// The sizes along the three axes; dp -1: what the world leaves, world / (tp·pp).
struct MeshShape {
  int dp = -1, tp = 1, pp = 1;
  // "dp 2 x tp 2 x pp 1"
  std::string str() const;
  bool operator==(const MeshShape& o) const = default;
};

// The shape with dp filled in. Refuses, naming the numbers: a tp or pp size < 1, a dp size that
// is neither -1 nor >= 1, dp·tp·pp that is not the world size ("dp_size 2 x tp_size 2 x
// pp_size 2 = 8 is not the world size 4"), and for dp -1 a tp·pp that does not divide it.
// Needs no group: callers check before any communication.
MeshShape resolve_mesh_shape(const MeshShape& requested, int world_size);

enum class MeshAxis { dp, tp, pp };
const char* mesh_axis_name(MeshAxis axis);

// A rank's place on the mesh.
struct MeshCoordinate {
  int dp = 0, tp = 0, pp = 0;
};
int mesh_rank(const MeshShape& shape, const MeshCoordinate& at);
MeshCoordinate mesh_coordinate(const MeshShape& shape, int rank);
// The world ranks (ascending) of the group along `axis` that `rank` belongs to.
std::vector<int> mesh_group_ranks(const MeshShape& shape, MeshAxis axis, int rank);
// The tp x pp ranks (ascending) of `rank`'s replica: the same dp coordinate, the ranks one split
// model spans ([d·tp·pp, (d+1)·tp·pp)).
std::vector<int> mesh_replica_ranks(const MeshShape& shape, int rank);

// Collective over `world`: creates every group ranks_of(r) names for the world's ranks r, each
// once, in the order of its lowest rank (new_group is collective over the world), and returns
// this rank's. The layout comes from ranks_of alone (mesh_group_ranks, mesh_replica_ranks).
GroupPtr new_partition_group(ProcessGroup& world,
                             const std::function<std::vector<int>(int)>& ranks_of);

class DeviceMesh {
 public:
  // Collective over `world`: checks the shape (resolve_mesh_shape) before any communication,
  // then creates the groups of every axis, in the same order on every rank. An axis that spans
  // the world uses the world group itself; an axis of size 1 a group of one process.
  DeviceMesh(GroupPtr world, const MeshShape& shape);

  const MeshShape& shape() const { return shape_; }
  const MeshCoordinate& coordinate() const { return coordinate_; }
  int dp_size() const { return shape_.dp; }
  int tp_size() const { return shape_.tp; }
  int pp_size() const { return shape_.pp; }
  int dp_rank() const { return coordinate_.dp; }
  int tp_rank() const { return coordinate_.tp; }
  int pp_rank() const { return coordinate_.pp; }
  // Only data parallelism (tp = pp = 1): the dp group is the world.
  bool data_parallel_only() const { return shape_.tp == 1 && shape_.pp == 1; }

  const GroupPtr& world_group() const { return world_; }
  const GroupPtr& dp_group() const { return dp_; }
  const GroupPtr& tp_group() const { return tp_; }
  const GroupPtr& pp_group() const { return pp_; }
  const GroupPtr& group(MeshAxis axis) const;
  // The tp x pp ranks of this rank's replica (mesh_replica_ranks): what a model split over tp
  // and pp at once spans (a norm over the whole model sums over it).
  const GroupPtr& model_group() const { return model_; }

  // "dp 2 x tp 2 x pp 1; rank 3: dp 1, tp 1, pp 0"
  std::string describe() const;

 private:
  GroupPtr make_axis_group(MeshAxis axis);
  GroupPtr make_replica_group();
  // Collective over the world: the groups of ranks_of(r) for every r, each made once; this
  // rank's.
  GroupPtr make_group(const std::string& name,
                      const std::function<std::vector<int>(int)>& ranks_of);
  GroupPtr world_;
  MeshShape shape_;
  MeshCoordinate coordinate_;
  GroupPtr dp_, tp_, pp_, model_;
};

// A model split over a tp or a pp group or both (TensorParallelCausalLM,
// PipelineParallelCausalLM, a pipeline of tensor-parallel stages):
// what a checkpoint of a mesh run asks of it, so that it is written in the full model's format
// (every tensor whole, under the full model's names) and read back at any mesh.
class MeshParallelModel {
 public:
  virtual ~MeshParallelModel() = default;
  // Collective over the model's group: a full model holding every parameter whole.
  virtual std::unique_ptr<nn::CausalLM> gather_full_model() const = 0;
  // Collective over the model's group: for every parameter of the full model, the whole of
  // the tensor `pieces` holds for it on the ranks that keep it (this rank's slice of the
  // parameter, or of something cut as the parameter is: an optimizer moment), on every rank.
  // `pieces` holds an entry for each parameter this rank keeps.
  virtual std::map<std::string, Tensor> gather_full(
      const std::map<std::string, Tensor>& pieces) const = 0;
  // This rank's piece of `full`, the whole of parameter `name` (or of a tensor cut as it is).
  virtual Tensor piece_of(const std::string& name, const Tensor& full) const = 0;
  // The group the model is split over (a tp group, a pipeline, or the tp x pp ranks of a
  // replica).
  virtual ProcessGroup& model_group() const = 0;
  // Whether this rank's piece of parameter `name` counts in a sum over the model (a gradient
  // norm): false where another rank of the group holds the same values and counts them (a
  // parameter kept whole on every tp rank counts on tp rank 0; a tied embedding's copy on the
  // stage that holds it first).
  virtual bool counts_in_model_sums(const std::string& name) const = 0;
};

}  // namespace tessera::dist
