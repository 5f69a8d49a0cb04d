#include "tessera/train/checkpoint_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"

#include <nlohmann/json.hpp>

namespace tessera::train {

namespace fs = std::filesystem;

std::string checkpoint_name(int64_t step) { return "checkpoint-" + std::to_string(step); }

std::optional<int64_t> checkpoint_step(const fs::path& dir) {
  const std::string name = dir.filename().string();
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() ||
      name.size() > prefix.size() + 18)
    return {};
  if (name.find_first_not_of("0123456789", prefix.size()) != std::string::npos) return {};
  return std::stoll(name.substr(prefix.size()));
}

std::vector<fs::path> list_checkpoints(const fs::path& output_dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (fs::is_directory(output_dir))
    for (const auto& entry : fs::directory_iterator(output_dir))
      if (auto step = checkpoint_step(entry.path()); step && entry.is_directory())
        found.emplace_back(*step, entry.path());
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [step, path] : found) out.push_back(path);
  return out;
}

void drop_training_state(const fs::path& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("optimizer") || name == "accelerator_state.json") fs::remove_all(entry.path());
  }
}

void verify_checkpoint(const fs::path& dir) {
  TESSERA_CHECK(fs::is_directory(dir), "checkpoint '", dir.string(), "': not a directory");
  if (!fs::exists(dir / "accelerator_state.json") && fs::exists(dir / kTrainingArgsFile)) {
    const auto saved = nlohmann::json::parse(read_file(dir / kTrainingArgsFile), nullptr, false);
    TESSERA_CHECK(!(saved.is_object() && saved.value("save_only_model", false)), "checkpoint '",
                  dir.string(), "' holds the model only (save_only_model) and cannot be resumed; "
                  "start a new run from it with --init");
  }
  // Under ZeRO the optimizer is one shard per rank plus their index (dist/checkpoint.h).
  const char* optimizer =
      fs::exists(dir / "optimizer_shards.json") ? "optimizer_shards.json" : "optimizer.safetensors";
  try {
    verify_folder_checksums(dir, {"config.json", "model.safetensors", optimizer,
                                  "accelerator_state.json", kTrainerStateFile, kTrainingArgsFile});
  } catch (const Error& e) {
    TESSERA_FAIL("checkpoint ", e.what());
  }
}

namespace {

// A file this user may not read is no sign of damage: falling back past it would later
// overwrite a checkpoint that is intact. Refused naming the file (root reads everything).
void check_readable(const fs::path& dir) {
  std::error_code ec;
  TESSERA_CHECK(::access(dir.c_str(), R_OK | X_OK) == 0, "checkpoint '", dir.string(),
                "': permission denied (", std::strerror(errno), "); fix its permissions to resume from it");
  for (const auto& entry : fs::directory_iterator(dir, ec))
    TESSERA_CHECK(::access(entry.path().c_str(), R_OK) == 0, "checkpoint '", dir.string(), "': cannot read '",
                  entry.path().filename().string(), "': ", std::strerror(errno),
                  "; fix its permissions to resume from it (it is not treated as damaged)");
}

}  // namespace

std::optional<fs::path> latest_valid_checkpoint(const fs::path& output_dir,
                                                std::vector<std::string>& warnings,
                                                int64_t before_step) {
  const std::vector<fs::path> all = list_checkpoints(output_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (*checkpoint_step(*it) >= before_step) continue;
    check_readable(*it);
    try {
      verify_checkpoint(*it);
      return *it;
    } catch (const Error& e) {
      warnings.push_back(std::string("skipping damaged checkpoint: ") + e.what());
    }
  }
  return std::nullopt;
}

fs::path resolve_checkpoint(const fs::path& target, std::vector<std::string>& warnings) {
  TESSERA_CHECK(fs::is_directory(target), "--resume: '", target.string(), "' is not a directory");
  const auto step =
      checkpoint_step(fs::absolute(target).lexically_normal().parent_path() / target.filename());
  if (!step && !fs::exists(target / kTrainerStateFile)) {  // a run folder
    auto latest = latest_valid_checkpoint(target, warnings);
    TESSERA_CHECK(latest.has_value(), "--resume: no valid checkpoint-N folder in '",
                  target.string(), "'");
    return *latest;
  }
  check_readable(target);
  try {
    verify_checkpoint(target);
    return target;
  } catch (const Error& e) {
    const fs::path run = fs::absolute(target).lexically_normal().parent_path();
    auto previous = latest_valid_checkpoint(run, warnings, step.value_or(INT64_MAX));
    if (!previous) {
      std::string skipped;
      for (const std::string& w : warnings) skipped += "; " + w;
      TESSERA_FAIL(e.what(), "; no earlier valid checkpoint to fall back to", skipped);
    }
    warnings.push_back(std::string(e.what()) + "; falling back to the previous valid checkpoint " +
                       previous->string());
    return *previous;
  }
}

std::pair<int64_t, int64_t> saved_world_and_global_batch(const fs::path& checkpoint) {
  if (!fs::exists(checkpoint / "accelerator_state.json")) return {0, 0};
  const auto file =
      nlohmann::json::parse(read_file(checkpoint / "accelerator_state.json"), nullptr, false);
  if (!file.is_object() || !file.contains("state") || !file["state"].is_object()) return {0, 0};
  const nlohmann::json& state = file["state"];
  const nlohmann::json global = state.value("loader_global_batch", nlohmann::json::array());
  const bool has_rows = global.is_array() && !global.empty() && global[0].is_number_integer();
  return {state.value("num_processes", int64_t(0)), has_rows ? global[0].get<int64_t>() : 0};
}

void rotate_checkpoints(const fs::path& output_dir, int64_t limit, const std::string& keep) {
  std::vector<fs::path> complete = list_checkpoints(output_dir);
  // A checkpoint-N/ folder without its checksums is the rest of one a killed rotation was
  // removing (one being written is still named .partial): it can never be resumed.
  std::erase_if(complete, [&](const fs::path& d) {
    if (fs::exists(d / kFolderChecksumFile)) return false;
    if (d.filename() != keep) fs::remove_all(d);
    return true;
  });
  int64_t excess = static_cast<int64_t>(complete.size()) - limit;
  // The oldest go first; the best and the newest always stay (so with limit 1 and an older
  // best, two remain, as in Hugging Face's Trainer).
  for (size_t i = 0; i + 1 < complete.size() && excess > 0; ++i) {
    if (complete[i].filename() == keep) continue;
    fs::remove_all(complete[i]);
    --excess;
  }
}

TrainerState read_trainer_state(const fs::path& checkpoint) {
  const fs::path path = checkpoint / kTrainerStateFile;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("checkpoint '", checkpoint.string(), "': ", kTrainerStateFile,
                 " is not valid JSON: ", e.what());
  }
  return TrainerState::from_json(j, path.string());
}

// trainer_state.json grows with the log history, so it is streamed to disk rather than
// built as one string (the resident memory of a long run stays flat). It is written inside
// checkpoint-N.partial/, renamed into place only when complete, and flushed to disk like
// the checkpoint's other files.
void write_trainer_state(const fs::path& path, const TrainerState& state) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(out.good(), "cannot create '", path.string(), "': ", std::strerror(errno));
    state.write(out);
    out.flush();
    TESSERA_CHECK(out.good(), "error writing '", path.string(), "': ", std::strerror(errno));
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  const bool synced = fd >= 0 && ::fsync(fd) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  TESSERA_CHECK(synced, "error flushing '", path.string(), "': ", std::strerror(err));
}

}  // namespace tessera::train
