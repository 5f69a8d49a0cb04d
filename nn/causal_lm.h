// CausalLM: what the trainer, evaluation and sampling need from a decoder-only language
// model, whatever its architecture (nn::GPT, nn::Llama): the loss of a batch, sampling, its
// vocabulary and context, and its Hugging Face model directory. load_causal_lm opens a
// directory by its config.json's model_type.
#pragma once
#include <memory>
#include <string>

#include "tessera/core/random.h"
#include "tessera/nn/module.h"

namespace tessera::nn {

struct GenerateOptions {
  double temperature = 1.0;  // 0 = greedy (argmax)
  int64_t top_k = 0;         // 0 = no truncation
  Generator* gen = nullptr;  // default generator when null
};

class CausalLM : public Module {
 public:
  // forward(idx [B, T]) -> logits [B, T, vocab_size] is Module's.
  // Mean cross-entropy of the logits of idx against targets [B, T].
  virtual Tensor loss(const Tensor& idx, const Tensor& targets) = 0;
  // Appends max_new_tokens sampled tokens to idx [B, T]; returns [B, T + max_new_tokens]
  // (i64, CPU). Tape-free, with a KV cache.
  virtual Tensor generate(const Tensor& idx, int64_t max_new_tokens,
                          const GenerateOptions& opts = {}) = 0;
  virtual int64_t vocab_size() const = 0;
  // The most positions one forward can see (GPT-2's n_positions, Llama's
  // max_position_embeddings).
  virtual int64_t context_length() const = 0;
  // Hugging Face's gradient_checkpointing_enable(): recompute every layer in backward.
  virtual void gradient_checkpointing_enable(bool on = true) = 0;
  // Model directory: config.json + model.safetensors in the architecture's HF layout.
  virtual void save_pretrained(const std::string& dir) const = 0;
  virtual void save_config(const std::string& path) const = 0;
  virtual void load_safetensors_weights(const std::string& path) = 0;
  // One line for logs: the architecture and its shape.
  virtual std::string describe() const = 0;
};

// The model_type of a config.json ("gpt2", "llama", ...); errors name the file.
std::string model_type_of(const std::string& config_path);
// A model directory (config.json + model.safetensors) as the architecture its model_type
// names: "gpt2" -> GPT, "llama" -> Llama; any other type is refused, naming it.
std::unique_ptr<CausalLM> load_causal_lm(const std::string& dir, TensorOptions opts = {});

}  // namespace tessera::nn
