// The Accelerator's checkpoint module (Accelerator::save_state, load_state, save_model in
// dist/checkpoint.cpp; the folder's layout is described there): the optimizer state and,
// under ZeRO, the model as one shard per rank plus an index (checkpoint_optimizer_shards.cpp,
// checkpoint_model_shards.cpp). The Trainer's checkpoint folders are train/checkpoint_files.h.
//
// ---- Sharded optimizer checkpoints ----
// Every rank writes the optimizer state of the slices it
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
//
// ---- Sharded model checkpoints (ZeRO) ----
//
// Every rank writes the parameter values it keeps between
// steps (DataParallelStrategy::parameter_shards: its slices, never the gathered model), rank 0
// also the model's other tensors (buffers, frozen parameters) whole, and an index.
//
//   model_shards/rank_{r}.safetensors  "{tensor}": a 1-D slice of the flattened tensor
//   model_shards.json                  {"format": "tessera.model_shards", "world_size",
//        "strategy", "tensors": {name: {"dtype", "shape"}},
//        "files": [{"name", "bytes", "ranges": {tensor: {"begin", "numel", "offset", "crc32"}}}]}
// (model_1_shards.json and model_1_shards/ for a second prepared model). `offset` is the
// range's first byte in its file and crc32 covers the range's bytes, so a reader verifies
// exactly what it reads: each rank reads only the ranges that overlap what it keeps, at
// whatever world size and stage it runs (DDP: everything). The main process then streams the
// shards into model.safetensors as well (write_whole_model), one range in memory at a time, so
// the folder stays a model directory for every other reader. The shard folder is not in the
// checkpoint's checksums.json (which every rank verifies whole); the index is.
//
// The index is checked against its shards before anything is read: a missing shard file, a
// file of another size, a range outside its file, ranges of a tensor with a gap or an overlap
// are refused naming the file and the tensor; a range whose bytes differ from its checksum
// is refused when it is read, before anything is loaded.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/dist/device_mesh.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/strategy.h"
#include "tessera/dist/zero.h"
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

// ---- checkpoints of a device mesh's split models (dist/checkpoint_mesh.cpp) ----
// A model split over tp or pp (a MeshParallelModel) is saved in the full model's format:
// model.safetensors holds the full model's state_dict and optimizer.safetensors the full
// moments, parameter j being the full model's trainable parameter j, so that a one-process run
// loads it as its own and a run at another mesh takes its pieces of it.
//
// Collective over the model's group: the full-format state of `optimizer`, whose parameter k is
// the model parameter names[k]; full_names: the full model's trainable parameters, in order.
// Each moment is gathered as its parameter is cut (MeshParallelModel::gather_full).
optim::OptimizerStateDict gather_full_optimizer_state(const optim::Optimizer& optimizer,
                                                      const std::vector<std::string>& names,
                                                      const MeshParallelModel& model,
                                                      const std::vector<std::string>& full_names);
// The same from a state already read (parameter k: names[k]).
optim::OptimizerStateDict gather_full_optimizer_state(const optim::OptimizerStateDict& local,
                                                      const std::vector<std::string>& names,
                                                      const MeshParallelModel& model,
                                                      const std::vector<std::string>& full_names);
// Collective over `group` (the dp axis of a ZeRO-1/2 strategy): the state of an optimizer that
// steps `slices` (DataParallelStrategy::optimizer_slices: parameter k is elements
// [begin, begin + numel) of the flattened parameter slices[k].name), made whole per parameter of
// `module`: parameter k of the result is the trainable parameter names[k] (set here), its
// moments the sum over the group of every rank's slices (they tile each parameter once).
optim::OptimizerStateDict whole_state_of_slices(
    const optim::OptimizerStateDict& local,
    const std::vector<DataParallelStrategy::OptimizerSlice>& slices, const nn::Module& module,
    ProcessGroup& group, std::vector<std::string>& names);
// The state of an optimizer whose parameter k is names[k], out of a full-format (or any whole)
// state whose parameter j was saved_names[j]: each moment is `model`'s piece of the saved one
// (whole when model is null). A name missing from the saved ones is an error naming it.
optim::OptimizerStateDict pieces_of_whole_optimizer_state(
    const optim::OptimizerStateDict& saved, const std::vector<std::string>& saved_names,
    const std::vector<std::string>& names, const MeshParallelModel* model,
    const std::string& where);

// ---- sharded model checkpoints ----
struct ShardedModelIndex {
  struct Range {
    std::string file;  // relative to the checkpoint folder
    int64_t begin = 0, numel = 0;
    uint64_t offset = 0;
    uint32_t crc32 = 0;
  };
  struct Entry {
    DType dtype = DType::f32;
    Shape shape;
    int64_t numel = 0;
    std::vector<Range> ranges;  // sorted by begin; they tile [0, numel) exactly
  };
  std::string dir;
  int world_size = 1;
  std::string strategy;
  std::map<std::string, Entry> tensors;
};

// "model_shards.json" for model 0, "model_1_shards.json", ...
std::string sharded_model_index_name(size_t model_index);
bool has_sharded_model(const std::string& dir, size_t model_index);

// Collective: every rank of `group` calls it with the strategy of the same model.
void save_sharded_model(const std::string& dir, size_t model_index, DataParallelStrategy& strategy,
                        ProcessGroup& group);

// The index of model `model_index` in dir, checked against its shard files (see above).
ShardedModelIndex read_sharded_model_index(const std::string& dir, size_t model_index);

// Elements [begin, begin + numel) of tensor `name`, 1-D on the CPU in its saved dtype, read
// from the byte ranges that hold them (each range's checksum verified).
Tensor read_sharded_range(const ShardedModelIndex& index, const std::string& name, int64_t begin,
                          int64_t numel);

// The whole model as one safetensors file (Hugging Face names, "format": "pt"), written one
// saved range at a time: what keeps a sharded checkpoint a model directory for every reader of
// model.safetensors, and what consolidation streams.
void write_whole_model(const ShardedModelIndex& index, const std::string& path);

// Removes model `model_index`'s shards and index from dir (once they were streamed elsewhere).
void remove_sharded_model(const std::string& dir, size_t model_index);

// The largest buffer write_whole_model holds at once (bytes) when the main process streams a
// sharded save of `strategy`'s model: one range of a writer's shard file per piece that
// parameter_shards() returns on that writer (ZeroStrategy::parameter_shard_layout), and each
// tensor rank 0 writes whole. For `tessera plan`'s dry run of the save (dist/memory_plan.h).
int64_t largest_streamed_range_bytes(const ZeroStrategy& strategy);

// Reads and checks what `strategy`'s model keeps on this rank (names, shapes, floating-ness
// against the model; every range's checksum) and returns what loads it: nothing in the model
// changes until that is called.
std::function<void()> stage_sharded_model(const ShardedModelIndex& index,
                                          DataParallelStrategy& strategy, const std::string& where);

}  // namespace tessera::dist
