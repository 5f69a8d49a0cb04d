#include "train/model_dir.h"

#include "autograd/autograd.h"
#include "core/error.h"
#include "data/dataloader.h"
#include "data/file_io.h"
#include "train/checkpoint.h"

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

std::unique_ptr<nn::GPT> load_model(const fs::path& dir, Device device) {
  TESSERA_CHECK(fs::exists(dir / "config.json"), "model directory '", dir.string(),
                "': config.json is missing");
  // Tessera's exports and checkpoints carry checksums; a folder from another tool may not.
  if (fs::exists(dir / data::kFolderChecksumFile))
    data::verify_folder_checksums(dir, {"config.json", "model.safetensors"});
  return nn::GPT::from_pretrained(dir.string(), {.device = device});
}

EvalResult evaluate_loss(nn::GPT& model, const data::TokenFile& file, int64_t batch, int64_t seq,
                         int64_t batches, Device device) {
  TESSERA_CHECK(seq <= model.config().block_size, "evaluate: seq ", seq,
                " is longer than the model context ", model.config().block_size);
  autograd::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  data::DataLoader loader(file, {.batch = batch, .seq = seq, .device = device});
  double total = 0;
  for (int64_t k = 0; k < batches; ++k) {
    const data::Batch b = loader.next();
    total += model.loss(b.x, b.y).item();
  }
  model.train(was_training);
  return {total / static_cast<double>(batches), batches * batch * seq};
}

}  // namespace tessera::train
