#include "tessera/cli/checkpoint.h"

#include <algorithm>
#include <cstdio>

#include "tessera/core/error.h"
#include "tessera/core/safetensors.h"
#include "tessera/data/file_io.h"

namespace tessera::cli {

namespace fs = std::filesystem;

namespace {
constexpr const char* kStateFile = "training_state.safetensors";
constexpr const char* kChecksumFile = "checksums.json";
constexpr const char* kStateMetadataKey = "tessera_training_state";

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

nlohmann::json to_json(const std::map<std::string, double>& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : m) j[k] = v;
  return j;
}

std::map<std::string, double> doubles_from_json(const nlohmann::json& j) {
  std::map<std::string, double> m;
  for (const auto& [k, v] : j.items()) m[k] = v.get<double>();
  return m;
}
}  // namespace

fs::path save_checkpoint(const fs::path& checkpoints_dir, const nn::GPT& model, const TrainingState& state,
                         const std::map<std::string, std::string>& extra_files, int64_t keep_last) {
  const fs::path final_dir = checkpoints_dir / step_dir_name(state.step);
  const fs::path partial = fs::path(final_dir.string() + ".partial");
  fs::remove_all(partial);
  fs::create_directories(partial);

  model.save_pretrained(partial.string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, t] : state.optimizer.tensors) tensors.emplace_back("optimizer." + name, t);
  const nlohmann::json meta = {{"step", state.step},
                               {"data_position", state.data_position},
                               {"rng_seed", state.rng_seed},
                               {"rng_offset", state.rng_offset},
                               {"optimizer_scalars", to_json(state.optimizer.scalars)},
                               {"schedule", to_json(state.schedule)},
                               {"loss_scaler", to_json(state.loss_scaler)},
                               {"config", state.config}};
  save_safetensors((partial / kStateFile).string(), tensors, {{kStateMetadataKey, meta.dump()}});
  for (const auto& [name, contents] : extra_files) data::write_file_atomically(partial / name, contents);

  // Checksums last: their presence marks every other file as complete.
  nlohmann::json files = nlohmann::json::object();
  for (const auto& entry : fs::directory_iterator(partial)) {
    const std::string bytes = data::read_file(entry.path());
    files[entry.path().filename().string()] = {{"bytes", bytes.size()}, {"crc32", data::crc32(bytes)}};
  }
  data::write_file_atomically(partial / kChecksumFile,
                              nlohmann::json{{"step", state.step}, {"files", files}}.dump(1));
  fs::remove_all(final_dir);
  fs::rename(partial, final_dir);

  // Rotation counts only complete checkpoints, so a stray incomplete folder can never
  // push the last good ones out.
  std::vector<fs::path> complete = list_checkpoints(checkpoints_dir);
  std::erase_if(complete, [](const fs::path& dir) { return !fs::exists(dir / kChecksumFile); });
  for (size_t i = 0; i + keep_last < complete.size(); ++i) fs::remove_all(complete[i]);
  return final_dir;
}

void verify_checkpoint(const fs::path& dir) {
  const std::string where = "checkpoint '" + dir.string() + "'";
  TESSERA_CHECK(fs::is_directory(dir), where, ": not a directory");
  const fs::path sums_path = dir / kChecksumFile;
  TESSERA_CHECK(fs::exists(sums_path), where, ": ", kChecksumFile,
                " is missing (the write was interrupted, or this is not a checkpoint)");
  nlohmann::json sums;
  try {
    sums = nlohmann::json::parse(data::read_file(sums_path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(where, ": ", kChecksumFile, " is damaged: ", e.what());
  }
  TESSERA_CHECK(sums.is_object() && sums.contains("files") && sums["files"].is_object(), where, ": ",
                kChecksumFile, " is damaged: no \"files\" object");
  for (const char* required : {"config.json", "model.safetensors", kStateFile})
    TESSERA_CHECK(sums["files"].contains(required), where, ": ", kChecksumFile, " does not list ", required);
  for (const auto& [name, expected] : sums["files"].items()) {
    const fs::path file = dir / name;
    TESSERA_CHECK(fs::exists(file), where, ": file ", name, " is missing");
    const std::string bytes = data::read_file(file);
    const uint64_t want_bytes = expected.at("bytes").get<uint64_t>();
    TESSERA_CHECK(bytes.size() == want_bytes, where, ": file ", file.string(), " is damaged: ",
                  bytes.size(), " bytes, expected ", want_bytes,
                  bytes.size() < want_bytes ? " (truncated at offset " : " (extra bytes from offset ",
                  std::min<uint64_t>(bytes.size(), want_bytes), ")");
    const uint32_t crc = data::crc32(bytes);
    TESSERA_CHECK(crc == expected.at("crc32").get<uint32_t>(), where, ": file ", file.string(),
                  " is damaged: CRC-32 ", crc, " does not match the recorded ",
                  expected.at("crc32").get<uint32_t>());
  }
}

TrainingState load_training_state(const fs::path& dir) {
  verify_checkpoint(dir);
  const SafetensorsContents file = load_safetensors((dir / kStateFile).string(), {.memory_map = false});
  auto meta_it = file.metadata.find(kStateMetadataKey);
  TESSERA_CHECK(meta_it != file.metadata.end(), "checkpoint '", dir.string(), "': ", kStateFile,
                " has no \"", kStateMetadataKey, "\" metadata");
  const nlohmann::json meta = nlohmann::json::parse(meta_it->second);
  TrainingState s;
  s.step = meta.at("step").get<int64_t>();
  s.data_position = meta.at("data_position").get<uint64_t>();
  s.rng_seed = meta.at("rng_seed").get<uint64_t>();
  s.rng_offset = meta.at("rng_offset").get<uint64_t>();
  s.optimizer.scalars = doubles_from_json(meta.at("optimizer_scalars"));
  s.schedule = doubles_from_json(meta.at("schedule"));
  s.loss_scaler = doubles_from_json(meta.at("loss_scaler"));
  s.config = meta.at("config");
  const std::string prefix = "optimizer.";
  for (const auto& [name, t] : file.tensors)
    if (name.rfind(prefix, 0) == 0) s.optimizer.tensors[name.substr(prefix.size())] = t;
  return s;
}

std::vector<fs::path> list_checkpoints(const fs::path& checkpoints_dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(checkpoints_dir)) return out;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind("step_", 0) == 0 && !name.ends_with(".partial"))
      out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());  // zero-padded step numbers sort by step
  return out;
}

std::optional<fs::path> latest_valid_checkpoint(const fs::path& checkpoints_dir,
                                                std::vector<std::string>& warnings) {
  std::vector<fs::path> all = list_checkpoints(checkpoints_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      verify_checkpoint(*it);
      return *it;
    } catch (const Error& e) {
      warnings.push_back(std::string("skipping damaged checkpoint: ") + e.what());
    }
  }
  return std::nullopt;
}

}  // namespace tessera::cli
