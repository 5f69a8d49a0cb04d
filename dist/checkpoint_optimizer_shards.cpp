#include "tessera/dist/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessera/core/safetensors.h"
#include "tessera/core/file_io.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

namespace fs = std::filesystem;

namespace {

constexpr const char* kIndex = "optimizer_shards.json";
const std::vector<std::string> kFields = {"exp_avg", "exp_avg_sq", "master"};

std::string shard_name(int rank) {
  return "optimizer_shard_" + std::to_string(rank) + ".safetensors";
}

// One saved slice: elements [begin, begin + numel) of a parameter, with its step count.
struct SavedSlice {
  int64_t begin = 0, numel = 0, step = 0;
};

SavedSlice parse_slice(const std::string& text, const std::string& file, const std::string& name) {
  SavedSlice s;
  std::istringstream is(text);
  TESSERA_CHECK(
      static_cast<bool>(is >> s.begin >> s.numel >> s.step) && s.begin >= 0 && s.numel > 0,
      "load_sharded_optimizer: ", file, ": the slice of '", name, "' reads '", text,
      "', not 'begin numel step'");
  return s;
}

}  // namespace

std::string shard_entry_key(const std::string& name, int repeat) {
  return repeat == 0 ? name : name + "#" + std::to_string(repeat);
}

std::string shard_entry_name(const std::string& key) { return key.substr(0, key.find('#')); }

bool has_sharded_optimizer(const std::string& dir) { return fs::exists(fs::path(dir) / kIndex); }

void save_sharded_optimizer(const std::string& dir, const DataParallelStrategy& strategy,
                            const optim::Optimizer& optimizer, ProcessGroup& group) {
  const auto slices = strategy.optimizer_slices(optimizer);
  const optim::OptimizerStateDict state = optimizer.state_dict();
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata{{"format", "tessera.optimizer_shard"}};
  std::map<std::string, int> repeats;  // a parameter's pieces on this rank so far (hybrid: several)
  for (size_t k = 0; k < slices.size(); ++k) {
    auto step = state.scalars.find(optim::optimizer_state_key(k, "step"));
    if (step == state.scalars.end()) continue;  // never updated
    const std::string key = shard_entry_key(slices[k].name, repeats[slices[k].name]++);
    for (const std::string& field : kFields)
      if (auto it = state.tensors.find(optim::optimizer_state_key(k, field));
          it != state.tensors.end())
        tensors.emplace_back(key + "/" + field,
                             ops::view(ops::contiguous(it->second), {slices[k].numel}));
    metadata[key] = std::to_string(slices[k].begin) + " " + std::to_string(slices[k].numel) + " " +
                    std::to_string(static_cast<int64_t>(step->second));
  }
  fs::create_directories(dir);
  save_safetensors((fs::path(dir) / shard_name(group.rank())).string(), tensors, metadata);
  group.barrier()->wait();
  if (group.rank() == 0) {
    // The layout, read back from the files (the checkpoint folder is shared by the ranks).
    nlohmann::json index;
    index["world_size"] = group.size();
    index["strategy"] = strategy.name();
    for (const auto& [key, value] : state.scalars)
      if (key.rfind("group.", 0) == 0) index["scalars"][key] = value;
    for (int r = 0; r < group.size(); ++r) {
      const fs::path path = fs::path(dir) / shard_name(r);
      const SafetensorsContents file = load_safetensors(path.string(), {.memory_map = true});
      nlohmann::json entry{{"name", shard_name(r)}, {"crc32", crc32(read_file(path))}};
      for (const auto& [key, text] : file.metadata)
        if (key != "format") entry["slices"][key] = text;
      index["files"].push_back(entry);
    }
    write_file_atomically(fs::path(dir) / kIndex, index.dump(2));
  }
  group.barrier()->wait();
}

namespace {

// A saved slice of one parameter with its state tensors ("exp_avg", ...), 1-D.
struct Source {
  std::map<std::string, Tensor> fields;
  SavedSlice slice;
};
using Sources = std::map<std::string, std::vector<Source>>;  // by parameter name

// The state of this rank's optimizer: for each of its slices, the overlapping ranges of
// every saved slice of the same parameter. A slice covered only in part is an error.
optim::OptimizerStateDict reslice(const Sources& sources, std::map<std::string, double> scalars,
                                  const DataParallelStrategy& strategy,
                                  const optim::Optimizer& optimizer, const std::string& where) {
  optim::OptimizerStateDict state;
  state.scalars = std::move(scalars);
  const auto slices = strategy.optimizer_slices(optimizer);
  const std::vector<Tensor> params = optimizer.parameters();
  for (size_t k = 0; k < slices.size(); ++k) {
    const auto& want = slices[k];
    auto it = sources.find(want.name);
    if (it == sources.end()) continue;  // not updated when saved
    int64_t covered = 0, step = 0;
    for (const std::string& field : kFields) {
      Tensor out;
      int64_t field_covered = 0;
      for (const Source& src : it->second) {
        auto saved = src.fields.find(field);
        if (saved == src.fields.end()) continue;
        const int64_t lo = std::max(want.begin, src.slice.begin);
        const int64_t hi = std::min(want.begin + want.numel, src.slice.begin + src.slice.numel);
        if (lo >= hi) continue;
        if (!out.defined()) out = zeros({want.numel}, {.dtype = saved->second.dtype()});
        ops::copy_(ops::narrow(out, 0, lo - want.begin, hi - lo),
                   ops::narrow(saved->second, 0, lo - src.slice.begin, hi - lo));
        field_covered += hi - lo;
        step = src.slice.step;
      }
      if (!out.defined()) continue;
      TESSERA_CHECK(field_covered == want.numel, where, " holds ", field_covered, " of the ",
                    want.numel, " elements of '", want.name, "' [", want.begin, ", ",
                    want.begin + want.numel, ") for ", field);
      state.tensors[optim::optimizer_state_key(k, field)] =
          ops::to(ops::view(out, params[k].shape()), params[k].device(), out.dtype());
      covered = field_covered;
    }
    if (covered > 0)
      state.scalars[optim::optimizer_state_key(k, "step")] = static_cast<double>(step);
  }
  return state;
}

nlohmann::json read_index(const std::string& dir) {
  const fs::path index_path = fs::path(dir) / kIndex;
  try {
    return nlohmann::json::parse(read_file(index_path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("load_sharded_optimizer: ", index_path.string(), " is not valid JSON: ", e.what());
  }
}

// Every saved slice of every parameter in dir's shards (checksums verified first); mapped
// rather than read in with memory_map.
Sources read_sources(const std::string& dir, const nlohmann::json& index, bool memory_map = false) {
  Sources sources;
  for (const auto& entry : index.at("files")) {
    const fs::path path = fs::path(dir) / entry.at("name").get<std::string>();
    TESSERA_CHECK(crc32(read_file(path)) == entry.at("crc32").get<uint32_t>(),
                  "load_sharded_optimizer: ", path.string(),
                  " is damaged (checksum differs from the index); refusing to load it");
    if (!entry.contains("slices")) continue;
    const SafetensorsContents file = load_safetensors(path.string(), {.memory_map = memory_map});
    for (auto& [key, text] : entry.at("slices").items()) {
      const std::string name = shard_entry_name(key);
      Source src{{}, parse_slice(text.get<std::string>(), path.string(), name)};
      for (const std::string& field : kFields)
        if (file.contains(key + "/" + field)) src.fields[field] = file.at(key + "/" + field);
      sources[name].push_back(std::move(src));
    }
  }
  return sources;
}

}  // namespace

optim::OptimizerStateDict read_sharded_optimizer(const std::string& dir,
                                                 const DataParallelStrategy& strategy,
                                                 const optim::Optimizer& optimizer) {
  const nlohmann::json index = read_index(dir);
  const Sources sources = read_sources(dir, index);
  std::map<std::string, double> scalars;
  if (index.contains("scalars"))
    for (auto& [key, value] : index.at("scalars").items()) scalars[key] = value.get<double>();
  return reslice(sources, std::move(scalars), strategy, optimizer, "load_sharded_optimizer: " + dir);
}

void load_sharded_optimizer(const std::string& dir, const DataParallelStrategy& strategy,
                            optim::Optimizer& optimizer, ProcessGroup& group) {
  optimizer.load_state_dict(read_sharded_optimizer(dir, strategy, optimizer));
  group.barrier()->wait();
}

optim::OptimizerStateDict reslice_whole_optimizer(const optim::OptimizerStateDict& saved,
                                                  const std::vector<std::string>& saved_names,
                                                  const DataParallelStrategy& strategy,
                                                  const optim::Optimizer& optimizer,
                                                  const std::string& where) {
  Sources sources;
  std::map<std::string, double> scalars;
  for (const auto& [key, value] : saved.scalars) {
    if (key.rfind("group.", 0) == 0) scalars[key] = value;
    const auto parsed = optim::parse_optimizer_state_key(key);
    if (!parsed || parsed->second != "step") continue;
    const size_t k = parsed->first;
    TESSERA_CHECK(k < saved_names.size(), where, ": \"", key, "\" names parameter ", k,
                  " but the checkpoint names ", saved_names.size());
    Source src;
    for (const std::string& field : kFields)
      if (auto it = saved.tensors.find(optim::optimizer_state_key(k, field));
          it != saved.tensors.end())
        src.fields[field] = ops::reshape(ops::contiguous(it->second), {it->second.numel()});
    TESSERA_CHECK(!src.fields.empty(), where, ": parameter ", k, " ('", saved_names[k],
                  "') has a step count but no state tensors");
    src.slice = {0, src.fields.begin()->second.numel(), static_cast<int64_t>(value)};
    sources[saved_names[k]].push_back(std::move(src));
  }
  return reslice(sources, std::move(scalars), strategy, optimizer, where);
}

struct ShardedFieldReader::SlicesByName {
  Sources sources;
};

ShardedFieldReader::ShardedFieldReader(const std::string& dir, std::string field)
    : slices_(std::make_unique<SlicesByName>(SlicesByName{read_sources(dir, read_index(dir), true)})),
      dir_(dir),
      field_(std::move(field)) {}

ShardedFieldReader::~ShardedFieldReader() = default;

bool ShardedFieldReader::holds(const std::string& parameter) const {
  auto it = slices_->sources.find(parameter);
  if (it == slices_->sources.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(),
                     [&](const Source& src) { return src.fields.count(field_) != 0; });
}

Tensor ShardedFieldReader::assemble(const std::string& parameter) const {
  TESSERA_CHECK(holds(parameter), dir_, ": the shards hold no ", field_, " of '", parameter, "'");
  const std::vector<Source>& slices = slices_->sources.at(parameter);
  int64_t numel = 0;
  for (const Source& src : slices)
    if (src.fields.count(field_)) numel = std::max(numel, src.slice.begin + src.slice.numel);
  Tensor out = zeros({numel}, {.dtype = DType::f32});
  int64_t covered = 0;
  for (const Source& src : slices) {
    auto it = src.fields.find(field_);
    if (it == src.fields.end()) continue;
    ops::copy_(ops::narrow(out, 0, src.slice.begin, src.slice.numel), it->second);
    covered += src.slice.numel;
  }
  TESSERA_CHECK(covered == numel, dir_, ": the shards hold ", covered, " of the ", numel, " elements of '", parameter,
                "' for ", field_, " (a shard file is missing from the index?)");
  return out;
}

}  // namespace tessera::dist
