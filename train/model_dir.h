// What the train, eval and sample commands share: finding a model directory's tokenizer
// and loading a model (verifying its checksums first when it has them).
#pragma once
#include <filesystem>
#include <memory>

#include "tessera/data/tokenizer.h"
#include "tessera/nn/causal_lm.h"

namespace tessera::train {

// tokenizer.json in `dir` or, failing that, in its parent folders up to two levels
// (a checkpoint sits in run/checkpoint-N); nullptr when there is none.
std::unique_ptr<data::Tokenizer> find_tokenizer(const std::filesystem::path& dir);

// A model directory (config.json + model.safetensors) as the architecture its model_type
// names (GPT-2 or Llama); when it holds checksums.json (a training checkpoint or an export)
// the files are verified first.
std::unique_ptr<nn::CausalLM> load_model(const std::filesystem::path& dir, Device device);

}  // namespace tessera::train
