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
#pragma once
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
// Whether dir holds a sharded optimizer checkpoint.
bool has_sharded_optimizer(const std::string& dir);

}  // namespace tessera::dist
