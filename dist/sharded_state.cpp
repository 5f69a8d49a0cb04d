#include "tessera/dist/sharded_state.h"

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessera/core/safetensors.h"
#include "tessera/data/file_io.h"

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

bool has_sharded_optimizer(const std::string& dir) { return fs::exists(fs::path(dir) / kIndex); }

void save_sharded_optimizer(const std::string& dir, const DataParallelStrategy& strategy,
                            const optim::Optimizer& optimizer, ProcessGroup& group) {
  const auto slices = strategy.optimizer_slices(optimizer);
  const optim::OptimizerStateDict state = optimizer.state_dict();
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata{{"format", "tessera.optimizer_shard"}};
  for (size_t k = 0; k < slices.size(); ++k) {
    const std::string prefix = "state." + std::to_string(k) + ".";
    auto step = state.scalars.find(prefix + "step");
    if (step == state.scalars.end()) continue;  // never updated
    for (const std::string& field : kFields)
      if (auto it = state.tensors.find(prefix + field); it != state.tensors.end())
        tensors.emplace_back(slices[k].name + "/" + field,
                             raw::view(raw::contiguous(it->second), {slices[k].numel}));
    metadata[slices[k].name] = std::to_string(slices[k].begin) + " " +
                               std::to_string(slices[k].numel) + " " +
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
      nlohmann::json entry{{"name", shard_name(r)}, {"crc32", data::crc32(data::read_file(path))}};
      for (const auto& [key, text] : file.metadata)
        if (key != "format") entry["slices"][key] = text;
      index["files"].push_back(entry);
    }
    data::write_file_atomically(fs::path(dir) / kIndex, index.dump(2));
  }
  group.barrier()->wait();
}

void load_sharded_optimizer(const std::string& dir, const DataParallelStrategy& strategy,
                            optim::Optimizer& optimizer, ProcessGroup& group) {
  const fs::path index_path = fs::path(dir) / kIndex;
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(data::read_file(index_path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("load_sharded_optimizer: ", index_path.string(), " is not valid JSON: ", e.what());
  }
  // Every saved slice of every parameter, with the file that holds it.
  struct Source {
    std::shared_ptr<SafetensorsContents> file;
    SavedSlice slice;
  };
  std::map<std::string, std::vector<Source>> sources;
  for (const auto& entry : index.at("files")) {
    const fs::path path = fs::path(dir) / entry.at("name").get<std::string>();
    TESSERA_CHECK(data::crc32(data::read_file(path)) == entry.at("crc32").get<uint32_t>(),
                  "load_sharded_optimizer: ", path.string(),
                  " is damaged (checksum differs from the index); refusing to load it");
    auto file = std::make_shared<SafetensorsContents>(
        load_safetensors(path.string(), {.memory_map = false}));
    if (!entry.contains("slices")) continue;
    for (auto& [name, text] : entry.at("slices").items())
      sources[name].push_back({file, parse_slice(text.get<std::string>(), path.string(), name)});
  }
  optim::OptimizerStateDict state;
  for (auto& [key, value] : index.at("scalars").items()) state.scalars[key] = value.get<double>();
  const auto slices = strategy.optimizer_slices(optimizer);
  const std::vector<Tensor> params = optimizer.parameters();
  for (size_t k = 0; k < slices.size(); ++k) {
    const auto& want = slices[k];
    auto it = sources.find(want.name);
    if (it == sources.end()) continue;  // not updated when saved
    const std::string prefix = "state." + std::to_string(k) + ".";
    int64_t covered = 0, step = 0;
    for (const std::string& field : kFields) {
      Tensor out;
      int64_t field_covered = 0;
      for (const Source& src : it->second) {
        const std::string key = want.name + "/" + field;
        if (!src.file->contains(key)) continue;
        const int64_t lo = std::max(want.begin, src.slice.begin);
        const int64_t hi = std::min(want.begin + want.numel, src.slice.begin + src.slice.numel);
        if (lo >= hi) continue;
        const Tensor& saved = src.file->at(key);
        if (!out.defined()) out = zeros({want.numel}, {.dtype = saved.dtype()});
        raw::copy_(raw::narrow(out, 0, lo - want.begin, hi - lo),
                   raw::narrow(saved, 0, lo - src.slice.begin, hi - lo));
        field_covered += hi - lo;
        step = src.slice.step;
      }
      if (!out.defined()) continue;
      TESSERA_CHECK(field_covered == want.numel, "load_sharded_optimizer: ", dir, " holds ",
                    field_covered, " of the ", want.numel, " elements of '", want.name, "' [",
                    want.begin, ", ", want.begin + want.numel, ") for ", field);
      state.tensors[prefix + field] =
          raw::to(raw::view(out, params[k].shape()), params[k].device(), out.dtype());
      covered = field_covered;
    }
    if (covered > 0) state.scalars[prefix + "step"] = static_cast<double>(step);
  }
  optimizer.load_state_dict(state);
  group.barrier()->wait();
}

}  // namespace tessera::dist
