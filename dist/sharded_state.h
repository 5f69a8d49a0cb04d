// Sharded optimizer checkpoints: every rank writes the optimizer state of the slices it
// updates, and rank 0 an index with the world size and the flat layout (which rank holds
// which element range of which parameter). Loading re-slices: a rank reads, for each of
// its own slices, the overlapping ranges of whatever files hold them, so a checkpoint
// written by W ranks at one ZeRO stage loads on any number of ranks at any stage (DDP
// included: its slices are whole parameters).
//
//   optimizer_shard_{r}.safetensors  "{parameter}/{exp_avg|exp_avg_sq|master}" 1-D slices;
//                                    metadata "{parameter}" = "begin numel step"
//   optimizer_shards.json            {"world_size", "strategy", "scalars" (lr, ...),
//                                     "files": [{"name", "crc32", "slices": {...}}]}
// Every file is written atomically; a shard whose checksum differs from the index is
// refused naming the file.
//
// A whole (DDP) optimizer state loads into a sharding strategy the same way once the name
// of each of its parameters is known: every saved tensor is then the slice [0, numel) of
// its parameter (reslice_whole_optimizer).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/dist/strategy.h"
#include "tessera/optim/optimizer.h"

namespace tessera::dist {

// Collective: every rank of `group` calls it with its own strategy and optimizer.
void save_sharded_optimizer(const std::string& dir, const DataParallelStrategy& strategy,
                            const optim::Optimizer& optimizer, ProcessGroup& group);
void load_sharded_optimizer(const std::string& dir, const DataParallelStrategy& strategy,
                            optim::Optimizer& optimizer, ProcessGroup& group);
// The state this rank's optimizer gets from the shards in dir (load_sharded_optimizer
// without the load): read and checked before anything changes.
optim::OptimizerStateDict read_sharded_optimizer(const std::string& dir,
                                                 const DataParallelStrategy& strategy,
                                                 const optim::Optimizer& optimizer);
// The state this rank's optimizer gets from a whole optimizer state whose parameter k was
// the model parameter saved_names[k] (a DDP checkpoint loaded under a ZeRO stage).
optim::OptimizerStateDict reslice_whole_optimizer(const optim::OptimizerStateDict& saved,
                                                  const std::vector<std::string>& saved_names,
                                                  const DataParallelStrategy& strategy,
                                                  const optim::Optimizer& optimizer,
                                                  const std::string& where);
// Offline, on the CPU: one optimizer field ("master", "exp_avg", "exp_avg_sq") of a
// parameter, assembled whole (1-D, f32) from the shards of dir, one parameter at a time: the
// shards are memory-mapped (checksums verified when opened), so only what is assembled is
// held. A parameter whose saved slices leave a gap is an error naming it; the shards hold no
// field for some parameters (no masters without mixed precision).
class ShardedFieldReader {
 public:
  ShardedFieldReader(const std::string& dir, std::string field);
  ~ShardedFieldReader();
  bool holds(const std::string& parameter) const;
  Tensor assemble(const std::string& parameter) const;

 private:
  struct SlicesByName;
  std::unique_ptr<SlicesByName> slices_;
  std::string dir_, field_;
};
// The key of a rank's pieces of parameter `name` in its shard files: the name for the first,
// "name#1", "name#2", ... for more (hybrid sharding keeps several non-contiguous slices of one
// parameter on a rank), and back to the parameter's name.
std::string shard_entry_key(const std::string& name, int repeat);
std::string shard_entry_name(const std::string& key);
// Whether dir holds a sharded optimizer checkpoint.
bool has_sharded_optimizer(const std::string& dir);

}  // namespace tessera::dist
