#include "tessera/train/model_dir.h"

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"

namespace tessera::train {

namespace fs = std::filesystem;

std::unique_ptr<data::Tokenizer> find_tokenizer(const fs::path& dir) {
  fs::path d = fs::absolute(dir);
  for (int level = 0; level < 3 && !d.empty(); ++level, d = d.parent_path()) {
    if (auto tok = data::load_tokenizer_from(d)) return tok;
    if (d == d.parent_path()) break;
  }
  return nullptr;
}

std::unique_ptr<nn::CausalLM> load_model(const fs::path& dir, Device device) {
  TESSERA_CHECK(fs::exists(dir / "config.json"), "model directory '", dir.string(),
                "': config.json is missing");
  // Tessera's exports and checkpoints carry checksums; a folder from another tool may not.
  if (fs::exists(dir / kFolderChecksumFile))
    verify_folder_checksums(dir, {"config.json", "model.safetensors"});
  return nn::load_causal_lm(dir.string(), {.device = device});
}

}  // namespace tessera::train
