#include "tessera/dist/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "tessera/autograd/autograd.h"
#include "tessera/core/safetensors.h"
#include "tessera/core/file_io.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "tessera.model_shards";

std::string shard_folder(size_t model_index) {
  return model_index == 0 ? "model_shards" : "model_" + std::to_string(model_index) + "_shards";
}

std::string shard_file(size_t model_index, int rank) {
  return shard_folder(model_index) + "/rank_" + std::to_string(rank) + ".safetensors";
}

uint32_t crc_of(const Tensor& host_contiguous) {
  return crc32(std::span<const std::byte>(static_cast<const std::byte*>(host_contiguous.raw_data()),
                                                host_contiguous.nbytes()));
}

// Where each tensor's bytes begin in a safetensors file (its header read back, nothing more).
std::map<std::string, uint64_t> data_starts(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char length_bytes[8] = {};
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  std::string header(header_length, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_length));
  TESSERA_CHECK(in.good(), "save_sharded_model: cannot read back the header of ", path.string());
  std::map<std::string, uint64_t> starts;
  const nlohmann::json parsed = nlohmann::json::parse(header);
  for (const auto& [name, entry] : parsed.items())
    if (name != "__metadata__")
      starts[name] = 8 + header_length + entry.at("data_offsets")[0].get<uint64_t>();
  return starts;
}

// What a rank writes: its parameter shards, and (rank 0) every other state_dict tensor whole.
struct Written {
  std::vector<std::pair<std::string, Tensor>> tensors;  // 1-D, on the CPU, contiguous
  std::vector<int64_t> begins;
};

// Trainable parameters are written by the ranks that hold their pieces (stage 3 keeps no
// whole copy); rank 0 writes the model's other tensors whole.
std::set<std::string> trainable_names(const nn::Module& model) {
  std::set<std::string> names;
  for (auto& [name, p] : model.named_parameters())
    if (p.requires_grad()) names.insert(name);
  return names;
}

Written tensors_to_write(DataParallelStrategy& strategy, bool with_unsharded) {
  Written w;
  std::set<std::string> sharded = trainable_names(strategy.module());
  std::map<std::string, int> repeats;  // a parameter's pieces on this rank so far (hybrid: several)
  for (auto& shard : strategy.parameter_shards()) {
    sharded.insert(shard.name);
    w.tensors.emplace_back(
        shard_entry_key(shard.name, repeats[shard.name]++),
        ops::contiguous(ops::to(shard.values, Device::cpu(), shard.values.dtype())));
    w.begins.push_back(shard.begin);
  }
  if (!with_unsharded) return w;
  for (auto& [name, t] : strategy.module().state_dict()) {
    if (sharded.count(name)) continue;
    TESSERA_CHECK(t.storage() && t.storage()->nbytes() >= t.nbytes(), "save_sharded_model: tensor '", name,
                  "' holds no values on this rank (a second name for a sharded parameter?)");
    w.tensors.emplace_back(name, ops::contiguous(ops::to(ops::reshape(t, {t.numel()}), Device::cpu(), t.dtype())));
    w.begins.push_back(0);
  }
  return w;
}

nlohmann::json describe_tensors(const nn::Module& model) {
  nlohmann::json tensors = nlohmann::json::object();
  for (auto& [name, t] : model.state_dict())
    tensors[name] = {{"dtype", safetensors_dtype_name(t.dtype())}, {"shape", t.shape()}};
  return tensors;
}

}  // namespace

std::string sharded_model_index_name(size_t model_index) { return shard_folder(model_index) + ".json"; }

bool has_sharded_model(const std::string& dir, size_t model_index) {
  return fs::exists(fs::path(dir) / sharded_model_index_name(model_index));
}

void save_sharded_model(const std::string& dir, size_t model_index, DataParallelStrategy& strategy,
                        ProcessGroup& group) {
  const fs::path root(dir);
  const int rank = group.rank();
  const Written w = tensors_to_write(strategy, rank == 0);
  fs::create_directories(root / shard_folder(model_index));
  const fs::path path = root / shard_file(model_index, rank);
  save_safetensors(path.string(), w.tensors, {{"format", "tessera.model_shard"}});
  // Each rank describes its own file (offsets and checksums of what it holds in memory
  // anyway), so rank 0 never reads another rank's bytes.
  const std::map<std::string, uint64_t> starts = data_starts(path);
  nlohmann::json entry{{"name", shard_file(model_index, rank)}, {"bytes", fs::file_size(path)}};
  entry["ranges"] = nlohmann::json::object();
  for (size_t i = 0; i < w.tensors.size(); ++i) {
    const auto& [name, t] = w.tensors[i];
    entry["ranges"][name] = {{"begin", w.begins[i]}, {"numel", t.numel()}, {"offset", starts.at(name)},
                             {"crc32", crc_of(t)}};
  }
  const fs::path description = path.string() + ".json";
  write_file_atomically(description, entry.dump());
  group.barrier()->wait();
  if (rank == 0) {
    nlohmann::json index{{"format", kFormat},
                         {"world_size", group.size()},
                         {"strategy", strategy.name()},
                         {"tensors", describe_tensors(strategy.module())}};
    index["files"] = nlohmann::json::array();
    for (int r = 0; r < group.size(); ++r) {
      const fs::path other = root / (shard_file(model_index, r) + ".json");
      index["files"].push_back(nlohmann::json::parse(read_file(other)));
      fs::remove(other);
    }
    write_file_atomically(root / sharded_model_index_name(model_index), index.dump(1));
  }
  group.barrier()->wait();
}

namespace {

int64_t json_count(const nlohmann::json& j, const char* key, const std::string& where) {
  TESSERA_CHECK(j.is_object() && j.contains(key) && j[key].is_number_integer() && j[key].get<int64_t>() >= 0,
                where, ": \"", key, "\" must be a non-negative integer, got ",
                j.is_object() && j.contains(key) ? j[key].dump() : "nothing");
  return j[key].get<int64_t>();
}

// Every range of every file, checked against the file's recorded and actual size.
void read_files(const nlohmann::json& files, ShardedModelIndex& index, const std::string& where) {
  TESSERA_CHECK(files.is_array() && !files.empty(), where, ": \"files\" must be a non-empty array");
  for (const nlohmann::json& file : files) {
    TESSERA_CHECK(file.is_object() && file.contains("name") && file["name"].is_string(), where,
                  ": a \"files\" entry has no \"name\": ", file.dump().substr(0, 200));
    const std::string name = file["name"].get<std::string>();
    const std::string at = where + ": shard " + name;
    TESSERA_CHECK(name.find("..") == std::string::npos && !fs::path(name).is_absolute(), at,
                  ": the name leaves the checkpoint folder");
    const fs::path path = fs::path(index.dir) / name;
    TESSERA_CHECK(fs::is_regular_file(path), at, " is missing (", path.string(), ")");
    const uint64_t bytes = static_cast<uint64_t>(json_count(file, "bytes", at));
    TESSERA_CHECK(fs::file_size(path) == bytes, at, " has ", fs::file_size(path), " bytes but the index says ",
                  bytes, " (truncated, or from another save?)");
    TESSERA_CHECK(file.contains("ranges") && file["ranges"].is_object(), at, ": \"ranges\" is missing");
    for (const auto& [key, r] : file["ranges"].items()) {
      const std::string tensor = shard_entry_name(key);
      auto it = index.tensors.find(tensor);
      TESSERA_CHECK(it != index.tensors.end(), at, ": tensor '", tensor, "' is not in the index's \"tensors\"");
      const std::string range_at = at + ": tensor '" + tensor + "'";
      ShardedModelIndex::Range range{name, json_count(r, "begin", range_at), json_count(r, "numel", range_at),
                                     static_cast<uint64_t>(json_count(r, "offset", range_at)),
                                     static_cast<uint32_t>(json_count(r, "crc32", range_at))};
      const uint64_t length = static_cast<uint64_t>(range.numel) * dtype_size(it->second.dtype);
      TESSERA_CHECK(range.offset + length <= bytes, range_at, ": bytes [", range.offset, ", ",
                    range.offset + length, ") run past the end of the ", bytes, "-byte file");
      it->second.ranges.push_back(range);
    }
  }
}

// Each tensor's ranges must tile it: no element twice, none missing.
void check_tiling(const ShardedModelIndex& index, const std::string& where) {
  for (const auto& [name, entry] : index.tensors) {
    int64_t next = 0;
    const ShardedModelIndex::Range* previous = nullptr;
    for (const auto& range : entry.ranges) {
      TESSERA_CHECK(range.begin >= next, where, ": tensor '", name, "': elements [", range.begin, ", ",
                    std::min(next, range.begin + range.numel), ") are in both ", previous ? previous->file : "",
                    " and ", range.file, " (overlapping ranges)");
      TESSERA_CHECK(range.begin == next, where, ": tensor '", name, "': elements [", next, ", ", range.begin,
                    ") are in no shard (a gap before ", range.file, ")");
      next = range.begin + range.numel;
      previous = &range;
    }
    TESSERA_CHECK(next == entry.numel, where, ": tensor '", name, "': elements [", next, ", ", entry.numel,
                  ") are in no shard", previous ? " (after " + previous->file + ")" : std::string());
  }
}

}  // namespace

ShardedModelIndex read_sharded_model_index(const std::string& dir, size_t model_index) {
  const std::string where = "sharded checkpoint '" + dir + "': " + sharded_model_index_name(model_index);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(fs::path(dir) / sharded_model_index_name(model_index)));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(where, " is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(j.is_object() && j.value("format", "") == kFormat, where, ": not a ", kFormat, " index");
  ShardedModelIndex index;
  index.dir = dir;
  index.world_size = static_cast<int>(json_count(j, "world_size", where));
  index.strategy = j.value("strategy", "");
  TESSERA_CHECK(j.contains("tensors") && j["tensors"].is_object(), where, ": \"tensors\" is missing");
  for (const auto& [name, t] : j["tensors"].items()) {
    TESSERA_CHECK(t.is_object() && t.contains("dtype") && t["dtype"].is_string() && t.contains("shape") &&
                      t["shape"].is_array(),
                  where, ": tensor '", name, "' needs a \"dtype\" and a \"shape\"");
    ShardedModelIndex::Entry entry;
    entry.dtype = safetensors_dtype_from_name(t["dtype"].get<std::string>(), where + ": tensor '" + name + "'");
    entry.numel = 1;
    for (const auto& d : t["shape"]) {
      TESSERA_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, where, ": tensor '", name, "': bad shape ",
                    t["shape"].dump());
      entry.shape.push_back(d.get<int64_t>());
      entry.numel *= entry.shape.back();
    }
    index.tensors[name] = std::move(entry);
  }
  read_files(j.value("files", nlohmann::json()), index, where);
  for (auto& [name, entry] : index.tensors)
    std::sort(entry.ranges.begin(), entry.ranges.end(),
              [](const auto& a, const auto& b) { return a.begin < b.begin; });
  check_tiling(index, where);
  return index;
}

namespace {

// One saved range whole (its checksum covers it whole), 1-D on the CPU.
Tensor read_saved_range(const ShardedModelIndex& index, const std::string& name, DType dtype,
                        const ShardedModelIndex::Range& range) {
  Tensor saved = empty({range.numel}, {.dtype = dtype});
  const fs::path path = fs::path(index.dir) / range.file;
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(range.offset));
  in.read(static_cast<char*>(saved.raw_data()), static_cast<std::streamsize>(saved.nbytes()));
  TESSERA_CHECK(in.good(), "sharded checkpoint: ", path.string(), ": cannot read tensor '", name, "' at byte ",
                range.offset);
  TESSERA_CHECK(crc_of(saved) == range.crc32, "sharded checkpoint: ", path.string(), ": the bytes of tensor '",
                name, "' [", range.begin, ", ", range.begin + range.numel,
                ") differ from their checksum in the index (damaged); refusing to load");
  return saved;
}

}  // namespace

void write_whole_model(const ShardedModelIndex& index, const std::string& path) {
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, entry] : index.tensors) entries.push_back({name, entry.dtype, entry.shape});
  save_safetensors_streamed(
      path, entries,
      [&](const SafetensorsEntry& e, const ByteWriter& write) {
        // The ranges tile the tensor in order: their bytes one after the other are its bytes.
        for (const auto& range : index.tensors.at(e.name).ranges) {
          const Tensor saved = read_saved_range(index, e.name, e.dtype, range);
          write({saved.raw_data(), saved.nbytes()});
        }
      },
      {{"format", "pt"}});
}

int64_t largest_streamed_range_bytes(const ZeroStrategy& strategy) {
  const std::set<std::string> sharded = trainable_names(strategy.module());
  std::map<std::string, DType> dtype;  // as describe_tensors records it, and the reader reads
  int64_t largest = 0;
  for (auto& [name, t] : strategy.module().state_dict()) {
    dtype[name] = t.dtype();
    if (!sharded.count(name)) largest = std::max<int64_t>(largest, t.nbytes());
  }
  const std::shared_ptr<ProcessGroup> writers = strategy.checkpoint_group();
  TESSERA_CHECK(writers,
                "largest_streamed_range_bytes: this rank writes no shard (under hybrid "
                "sharding the ranks of shard group 0 do)");
  for (int index = 0; index < writers->size(); ++index)
    for (const auto& piece : strategy.parameter_shard_layout(index))
      largest = std::max<int64_t>(
          largest, piece.numel * static_cast<int64_t>(dtype_size(dtype.at(piece.name))));
  return largest;
}

void remove_sharded_model(const std::string& dir, size_t model_index) {
  fs::remove_all(fs::path(dir) / shard_folder(model_index));
  fs::remove(fs::path(dir) / sharded_model_index_name(model_index));
}

Tensor read_sharded_range(const ShardedModelIndex& index, const std::string& name, int64_t begin, int64_t numel) {
  auto it = index.tensors.find(name);
  TESSERA_CHECK(it != index.tensors.end(), "sharded checkpoint '", index.dir, "': tensor '", name,
                "' is not in the index");
  const ShardedModelIndex::Entry& entry = it->second;
  TESSERA_CHECK(begin >= 0 && begin + numel <= entry.numel, "sharded checkpoint '", index.dir, "': tensor '", name,
                "' has ", entry.numel, " elements; [", begin, ", ", begin + numel, ") was asked for");
  Tensor out = empty({numel}, {.dtype = entry.dtype});
  for (const auto& range : entry.ranges) {
    const int64_t lo = std::max(begin, range.begin), hi = std::min(begin + numel, range.begin + range.numel);
    if (lo >= hi) continue;
    const Tensor saved = read_saved_range(index, name, entry.dtype, range);
    ops::copy_(ops::narrow(out, 0, lo - begin, hi - lo), ops::narrow(saved, 0, lo - range.begin, hi - lo));
  }
  return out;
}

std::function<void()> stage_sharded_model(const ShardedModelIndex& index, DataParallelStrategy& strategy,
                                          const std::string& where) {
  nn::Module& model = strategy.module();
  for (const auto& [name, t] : model.state_dict()) {
    auto it = index.tensors.find(name);
    TESSERA_CHECK(it != index.tensors.end(), where, ": tensor \"", name, "\" is missing");
    TESSERA_CHECK(it->second.shape == t.shape(), where, ": tensor \"", name, "\" has shape ",
                  shape_str(it->second.shape), " but the model's is ", shape_str(t.shape()));
    TESSERA_CHECK(is_floating(it->second.dtype) == is_floating(t.dtype()), where, ": tensor \"", name,
                  "\" has dtype ", dtype_name(it->second.dtype), " but the model's is ", dtype_name(t.dtype()));
  }
  // Destination views and their values, read in full before anything is written.
  std::vector<std::pair<Tensor, Tensor>> staged;
  std::set<std::string> sharded;
  for (auto& shard : strategy.parameter_shards()) {
    sharded.insert(shard.name);
    staged.emplace_back(shard.values, read_sharded_range(index, shard.name, shard.begin, shard.numel));
  }
  for (auto& [name, p] : model.named_parameters())
    if (p.requires_grad()) sharded.insert(name);
  for (auto& [name, t] : model.state_dict())
    if (!sharded.count(name)) staged.emplace_back(t, read_sharded_range(index, name, 0, t.numel()));
  return [staged = std::move(staged), &strategy] {
    autograd::NoGradGuard no_grad;
    for (const auto& [destination, values] : staged)
      ops::copy_(destination, ops::view(ops::to(values, destination.device(), destination.dtype()),
                                        destination.shape()));
    strategy.after_parameter_shards_loaded();
  };
}

}  // namespace tessera::dist
