// Checks `tessera train` makes before any work, each refusing with a message that names the
// setting or file and the numbers involved: the training file holds at least one micro-batch,
// the model from --init agrees with the shape flags given, the model's estimated memory fits
// the machine, and weights are finite when loaded from --init or exported.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "tessera/data/token_file.h"
#include "tessera/nn/causal_lm.h"
#include "tessera/train/training_args.h"

namespace tessera::train {

// The training file must hold one micro-batch (batch x seq tokens and the next one's target):
// a shorter file would be tiled into rows that repeat it; an empty one has no vocabulary.
void check_training_file_size(const data::TokenFile& file, const TrainingArguments& args);

// The model-shape settings the user gave (n_layer, n_head, ...) must match the --init model
// directory's config.json, as --resume requires of a checkpoint.
void check_init_shape(const TrainingArguments& args);

// Parameters of the model a fresh run builds (GPT-2 or Llama, with `vocab_size`).
int64_t estimated_parameters(const TrainingArguments& args, int64_t vocab_size);

// Bytes a training step needs at the least: f32 weights, gradients and AdamW's two moments
// (16 bytes a parameter) plus one micro-batch's logits; an overflow counts as infinite.
double estimated_training_bytes(const TrainingArguments& args, int64_t parameters, int64_t vocab_size);

// Refuses a run whose estimate exceeds this machine's memory, before anything is allocated.
void check_fits_in_memory(const TrainingArguments& args, int64_t parameters, int64_t vocab_size);

// The training file's size and CRC-32 as a checkpoint records them (data_fingerprint.json),
// and the warning a resume gives when the file is no longer the one trained on.
inline constexpr const char* kDataFingerprintFile = "data_fingerprint.json";
std::string data_fingerprint(const data::TokenFile& file);
void warn_if_data_replaced(const std::filesystem::path& checkpoint, const std::string& fingerprint);

// Every parameter of `model` must be finite; the error names the first tensor that is not
// and `what` says whose weights they are ("the initial weights from --init 'DIR'").
void check_weights_finite(const nn::CausalLM& model, const std::string& what);
// The same for the tensors of a safetensors file, read one at a time (memory-mapped).
void check_weights_finite(const std::filesystem::path& weights_file, const std::string& what);

}  // namespace tessera::train
