// What the train, eval and sample commands share: finding a model directory's tokenizer,
// loading a model (verifying a checkpoint's checksums first), and measuring the loss.
#pragma once
#include <filesystem>
#include <memory>

#include "tessera/data/token_file.h"
#include "tessera/data/tokenizer.h"
#include "tessera/nn/gpt.h"

namespace tessera::cli {

// tokenizer.json in `dir` or, failing that, in its parent folders up to two levels
// (a checkpoint sits in run/checkpoints/step_N); nullptr when there is none.
std::unique_ptr<data::Tokenizer> find_tokenizer(const std::filesystem::path& dir);

// A model directory (config.json + model.safetensors); when it holds checksums.json
// (a training checkpoint) the files are verified first.
std::unique_ptr<nn::GPT> load_model(const std::filesystem::path& dir, Device device);

struct EvalResult {
  double loss = 0;     // mean cross-entropy per target token
  int64_t tokens = 0;  // target tokens scored
};

// Mean loss over the first `batches` sequential micro-batches [batch, seq] of `file`
// (eval mode, no gradients).
EvalResult evaluate_loss(nn::GPT& model, const data::TokenFile& file, int64_t batch, int64_t seq,
                         int64_t batches, Device device);

}  // namespace tessera::cli
