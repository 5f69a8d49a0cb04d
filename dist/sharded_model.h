// Sharded model checkpoints (ZeRO): every rank writes the parameter values it keeps between
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
#include <string>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/dist/strategy.h"

namespace tessera::dist {

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

// Reads and checks what `strategy`'s model keeps on this rank (names, shapes, floating-ness
// against the model; every range's checksum) and returns what loads it: nothing in the model
// changes until that is called.
std::function<void()> stage_sharded_model(const ShardedModelIndex& index,
                                          DataParallelStrategy& strategy, const std::string& where);

}  // namespace tessera::dist
