// CausalLM: what the trainer, evaluation and sampling need from a decoder-only language
// model, whatever its architecture (nn::GPT, nn::Llama): the loss of a batch, incremental
// decoding on a KV cache, sampling, its vocabulary and context, and its Hugging Face model
// directory. load_causal_lm opens a directory by its config.json's model_type.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/nn/checkpoint_policy.h"
#include "tessera/nn/module.h"

namespace tessera::nn {

// Keys and values of every layer for incremental decoding: k/v of layer l are
// [B, H_kv, capacity, D], positions [0, length) filled.
struct KVCache {
  struct Layer {
    Tensor k, v;
    // Writes k_new/v_new [B, H_kv, T, D] at positions [past, past + T) and returns the keys and
    // values of positions [0, past + T), views of the cache. Tape-free (the cache is state).
    std::pair<Tensor, Tensor> append(const Tensor& k_new, const Tensor& v_new, int64_t past);
  };
  std::vector<Layer> layers;
  int64_t batch = 0;
  int64_t length = 0;
  int64_t capacity() const { return layers.empty() ? 0 : layers.front().k.size(2); }
};

// An empty cache of `layers` layers, each k and v zeros of `shape` [B, H_kv, capacity, D].
KVCache make_kv_cache(int64_t layers, const Shape& shape, TensorOptions opts);

struct GenerateOptions {
  double temperature = 1.0;  // 0 = greedy (argmax)
  int64_t top_k = 0;         // 0 = no truncation
  Generator* gen = nullptr;  // default generator when null
};

// Which implementation of its blocks a model runs. Both read and train the same parameters
// (same names, same state dict). `reference` is the block as nanoGPT and Hugging Face write
// it (nn/gpt.cpp, nn/llama.cpp: x = x + attn(norm_1(x)); x = x + mlp(norm_2(x))); `fast` is
// the same block with its adds, biases and projections fused into fewer kernels
// (nn/gpt_fast.cpp, nn/llama_fast.cpp). `automatic` leaves the choice to
// chosen_block_implementation.
enum class BlockImplementation { automatic, reference, fast };
const char* block_implementation_name(BlockImplementation implementation);
// "automatic" | "reference" | "fast"; anything else is refused, naming it.
BlockImplementation parse_block_implementation(const std::string& name);
// The one place deciding which blocks a model runs: an explicit request is kept; automatic is
// fast on every device (each fused op of the fast blocks has a CPU entry as well, where it is
// the composition or a fused loop, so CPU training runs them too). The fast blocks' own
// switches (TESSERA_FUSED_MLP, TESSERA_FUSED_QKV_PROJECTION, TESSERA_DEFERRED_BIASES) act
// inside the fast blocks.
BlockImplementation chosen_block_implementation(BlockImplementation requested);

class CausalLM : public Module {
 public:
  // forward(idx [B, T]) -> logits [B, T, vocab_size] is Module's.
  // Mean cross-entropy of the logits of idx against targets [B, T].
  virtual Tensor loss(const Tensor& idx, const Tensor& targets) = 0;
  // Incremental decoding: an empty cache for `batch` rows; forward_incremental feeds the next
  // tokens idx [B, Tn] (positions cache.length ...) and returns their logits [B, Tn, V],
  // advancing cache.length. Tape-free.
  virtual KVCache make_kv_cache(int64_t batch) const = 0;
  virtual Tensor forward_incremental(const Tensor& idx, KVCache& cache) = 0;
  // Appends max_new_tokens tokens to idx [B, T]; returns [B, T + max_new_tokens] (i64, CPU).
  // Tape-free, with a KV cache: each new token costs one single-position forward; past
  // context_length() the model sees the last context_length() tokens (recomputed each step,
  // as nanoGPT does). Tokens are drawn on the model's device by ops::sample_logits
  // (temperature 0: greedy; top_k 0: the whole vocabulary). The same model, device, prompt and
  // generator seed give the same tokens; greedy decoding is the argmax of the full forward.
  Tensor generate(const Tensor& idx, int64_t max_new_tokens, const GenerateOptions& opts = {});
  virtual int64_t vocab_size() const = 0;
  // The most positions one forward can see (GPT-2's n_positions, Llama's
  // max_position_embeddings).
  virtual int64_t context_length() const = 0;
  // Decoder blocks (GPT-2's n_layer, Llama's num_hidden_layers).
  virtual int64_t num_blocks() const = 0;
  // Hugging Face's gradient_checkpointing_enable(): which activations backward recomputes while
  // training (nn/checkpoint_policy.h); `full` (every block) by default. A policy that cannot
  // apply to this model (every_k:K with K > num_blocks()) is refused, naming it, and the
  // model keeps the policy it had. Losses and gradients stay bit for bit the same.
  void gradient_checkpointing_enable(const CheckpointPolicy& policy = CheckpointPolicy::full());
  // transformers' gradient_checkpointing_enable(gradient_checkpointing_kwargs): {"policy":
  // "every_k:2"}, {"use_reentrant": false} (CheckpointPolicy::from_kwargs reads them).
  void gradient_checkpointing_enable(const nlohmann::json& gradient_checkpointing_kwargs) {
    gradient_checkpointing_enable(CheckpointPolicy::from_kwargs(gradient_checkpointing_kwargs));
  }
  // true = full, false = none (the switch gradient checkpointing was before policies).
  void gradient_checkpointing_enable(bool on) {
    gradient_checkpointing_enable(on ? CheckpointPolicy::full() : CheckpointPolicy());
  }
  // A policy's name would convert to bool (and mean full) here: say CheckpointPolicy::parse.
  void gradient_checkpointing_enable(const char*) = delete;
  void gradient_checkpointing_disable() { checkpointing_ = CheckpointPolicy(); }
  bool is_gradient_checkpointing() const { return checkpointing_.enabled(); }
  const CheckpointPolicy& gradient_checkpointing_policy() const { return checkpointing_; }
  // What block `index` recomputes in this forward: the policy's region while `body` (the
  // module whose mode counts: a classification model registers only the body) trains with
  // grad mode on, else none (evaluation and tape-free passes keep nothing to recompute).
  CheckpointRegion checkpoint_region(int64_t index, const Module& body) const;
  // Model directory: config.json + model.safetensors in the architecture's HF layout.
  virtual void save_pretrained(const std::string& dir) const = 0;
  virtual void save_config(const std::string& path) const = 0;
  virtual void load_safetensors_weights(const std::string& path) = 0;
  // One line for logs: the architecture and its shape.
  virtual std::string describe() const = 0;

  // The blocks this model runs (see BlockImplementation); automatic by default.
  void set_block_implementation(BlockImplementation requested) { requested_blocks_ = requested; }
  // What forward runs now: chosen_block_implementation of the request (never automatic).
  BlockImplementation block_implementation() const {
    return chosen_block_implementation(requested_blocks_);
  }
  bool runs_fast_blocks() const { return block_implementation() == BlockImplementation::fast; }

 private:
  BlockImplementation requested_blocks_ = BlockImplementation::automatic;
  CheckpointPolicy checkpointing_;
};

// The model_type of a config.json ("gpt2", "llama", ...); errors name the file.
std::string model_type_of(const std::string& config_path);
// A model directory (config.json + model.safetensors) as the architecture its model_type
// names: "gpt2" -> GPT, "llama" -> Llama; any other type is refused, naming it.
std::unique_ptr<CausalLM> load_causal_lm(const std::string& dir, TensorOptions opts = {});

}  // namespace tessera::nn
