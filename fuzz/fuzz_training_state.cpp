// libFuzzer target: the checkpoint training-state reader. The input becomes a
// checkpoint's training_state.safetensors; checksums.json is written to match it (a real
// checkpoint's checksums would pass too), so the fuzzer reaches the contents checks past
// the checksum gate. Bad contents must be a tessera::Error.
#include <nlohmann/json.hpp>
#include <string>

#include "tessera/core/error.h"
#include "tessera/data/file_io.h"
#include "fuzz/fuzz_input.h"
#include TESSERA_FUZZ_CHECKPOINT_HEADER

namespace checkpoint = TESSERA_FUZZ_CHECKPOINT_NAMESPACE;
namespace fs = std::filesystem;

namespace {

void write_text(const fs::path& path, const std::string& text) {
  tessera::fuzz::write_input(path.filename().string(),
                             reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path dir = tessera::fuzz::scratch_dir();
  write_text(dir / "config.json", R"({"model_type": "gpt2"})");
  write_text(dir / "model.safetensors", "");
  tessera::fuzz::write_input("training_state.safetensors", data, size);
  nlohmann::json files = nlohmann::json::object();
  for (const char* name : {"config.json", "model.safetensors", "training_state.safetensors"}) {
    const std::string bytes = tessera::data::read_file(dir / name);
    files[name] = {{"bytes", bytes.size()}, {"crc32", tessera::data::crc32(bytes)}};
  }
  write_text(dir / "checksums.json", nlohmann::json{{"files", files}}.dump());
  tessera::fuzz::expect_clean_error([&] {
    const checkpoint::TrainingState state = checkpoint::load_training_state(dir);
    (void)state.config.dump();
  });
  return 0;
}
