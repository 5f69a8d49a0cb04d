#include "tessera/cli/model_dir.h"

#include "tessera/autograd/autograd.h"
#include "tessera/cli/checkpoint.h"
#include "tessera/core/error.h"
#include "tessera/data/dataloader.h"

namespace tessera::cli {

namespace fs = std::filesystem;

std::unique_ptr<data::Tokenizer> find_tokenizer(const fs::path& dir) {
  fs::path d = fs::absolute(dir);
  for (int level = 0; level < 3 && !d.empty(); ++level, d = d.parent_path()) {
    if (fs::exists(d / "tokenizer.json")) return data::load_tokenizer(d / "tokenizer.json");
    if (d == d.parent_path()) break;
  }
  return nullptr;
}

std::unique_ptr<nn::GPT> load_model(const fs::path& dir, Device device) {
  TESSERA_CHECK(fs::exists(dir / "config.json"), "model directory '", dir.string(),
                "': config.json is missing");
  if (fs::exists(dir / "checksums.json")) verify_checkpoint(dir);
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

}  // namespace tessera::cli
