#include "tessera/kernels/ops.h"
#include "tessera/train/consolidate.h"

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/core/safetensors.h"
#include "tessera/dist/checkpoint.h"
#include "tessera/train/checkpoint_files.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {

// World size and strategy as the checkpoint records them.
void describe_checkpoint(const fs::path& checkpoint, ConsolidateReport& report) {
  report.strategy = "DDP";
  if (fs::exists(checkpoint / "optimizer_shards.json")) {
    const auto index = nlohmann::json::parse(read_file(checkpoint / "optimizer_shards.json"));
    report.saved_world_size = index.value("world_size", 1);
    report.strategy = index.value("strategy", std::string("ZeRO"));
  } else if (fs::exists(checkpoint / "accelerator_state.json")) {
    const auto state = nlohmann::json::parse(read_file(checkpoint / "accelerator_state.json"));
    report.saved_world_size = state.at("state").value("num_processes", 1);
  }
}

void check_output_folder(const fs::path& out) {
  TESSERA_CHECK(!fs::exists(out) || (fs::is_directory(out) && fs::is_empty(out)), "consolidate: '",
                out.string(), "' already exists and is not an empty folder");
}

// A run folder holds checkpoint-N/ folders rather than being one.
void check_not_run_folder(const fs::path& checkpoint) {
  if (fs::exists(checkpoint / kFolderChecksumFile)) return;
  const std::vector<fs::path> checkpoints = list_checkpoints(checkpoint);
  TESSERA_CHECK(checkpoints.empty(), "consolidate: '", checkpoint.string(),
                "' is a run folder, not a checkpoint; its newest checkpoint is '",
                checkpoints.back().string(), "' (pass that, or the run's model/ is already a model directory)");
}

// Writes the model directory into `partial`, model.safetensors one tensor at a time
// (write_tensor passes each entry's bytes on); a failure removes what it wrote.
void write_model_directory(
    const fs::path& checkpoint, const fs::path& partial, const std::vector<SafetensorsEntry>& entries,
    const std::function<void(const SafetensorsEntry&, const ByteWriter&)>& write_tensor) {
  try {
    fs::create_directories(partial);
    write_file_atomically(partial / "config.json", read_file(checkpoint / "config.json"));
    save_safetensors_streamed((partial / "model.safetensors").string(), entries, write_tensor, {{"format", "pt"}});
    if (fs::exists(checkpoint / "tokenizer.json"))
      write_file_atomically(partial / "tokenizer.json", read_file(checkpoint / "tokenizer.json"));
    write_folder_checksums(partial);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(partial, ignored);
    throw;
  }
}

}  // namespace

ConsolidateReport consolidate_checkpoint(const fs::path& checkpoint, const fs::path& out,
                                         ConsolidateOptions options) {
  TESSERA_CHECK(fs::is_directory(checkpoint), "consolidate: '", checkpoint.string(),
                "' is not a directory");
  check_not_run_folder(checkpoint);
  check_output_folder(out);
  const fs::path partial = out.string() + ".partial";
  TESSERA_CHECK(!fs::exists(partial), "consolidate: '", partial.string(),
                "' exists (left by an interrupted consolidate?); remove it or choose another --out");
  try {
    verify_folder_checksums(checkpoint, {"config.json", "model.safetensors"});
  } catch (const Error& e) {
    TESSERA_FAIL("consolidate: checkpoint ", e.what());
  }
  ConsolidateReport report;
  describe_checkpoint(checkpoint, report);
  // Memory-mapped, and the masters assembled one at a time: the process holds one tensor.
  const SafetensorsContents model =
      load_safetensors((checkpoint / "model.safetensors").string(), {.memory_map = true});
  std::optional<dist::ShardedFieldReader> masters;
  if (options.from_masters && fs::exists(checkpoint / "optimizer_shards.json"))
    masters.emplace(checkpoint.string(), "master");
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, stored] : model.tensors) {
    const bool from_master = masters && masters->holds(name);
    entries.push_back({name, from_master ? DType::f32 : stored.dtype(), stored.shape()});
    report.from_masters += from_master;
  }
  report.tensors = static_cast<int64_t>(entries.size());
  auto write_tensor = [&](const SafetensorsEntry& entry, const ByteWriter& write) {
    const Tensor& stored = model.at(entry.name);
    if (!masters || !masters->holds(entry.name)) {
      const Tensor bytes = ops::contiguous(stored);
      write({bytes.raw_data(), bytes.nbytes()});
      return;
    }
    const Tensor master = masters->assemble(entry.name);
    TESSERA_CHECK(master.numel() == stored.numel(), "consolidate: ", checkpoint.string(), ": the f32 master of '",
                  entry.name, "' has ", master.numel(), " elements but model.safetensors holds ", stored.numel());
    write({master.raw_data(), master.nbytes()});
  };

  // Written beside the target and renamed into place, so a crash leaves no half folder.
  write_model_directory(checkpoint, partial, entries, write_tensor);
  if (fs::exists(out)) fs::remove(out);  // empty (checked above)
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  fs::rename(partial, out);
  return report;
}

}  // namespace tessera::train
