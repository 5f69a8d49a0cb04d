// GPT-2: token + position embeddings, n_layer pre-LN blocks, a final LayerNorm and
// the output projection (tied to the token embedding unless configured otherwise), as nanoGPT
// writes it; the fast blocks (nn/gpt_fast.h) run by default on the same parameters.
// Parameter names and layouts are Hugging Face GPT-2's, so a model directory
// (config.json + model.safetensors) moves between Tessera and `transformers`.
#pragma once
#include <memory>
#include <string>

#include "tessera/nn/attention.h"
#include "tessera/nn/causal_lm.h"
#include "tessera/nn/gpt_fast.h"

namespace tessera::nn {

// The "transformer" part: wte, wpe, drop, h.{i}, ln_f.
class GPTTransformer : public Module {
 public:
  GPTTransformer(const GPTConfig& cfg, Generator* gen, TensorOptions opts);
  std::string type_name() const override { return "GPTTransformer"; }

  Embedding wte, wpe;
  Dropout drop;
  ModuleList h;
  LayerNorm ln_f;
  std::vector<Block*> blocks;
};

// The untied output projection: logits = x · weightᵀ with weight [V, C]
// (HF's lm_head is a torch Linear, so its layout is [out, in]).
class LMHead : public Module {
 public:
  LMHead(int64_t vocab_size, int64_t n_embd, Generator* gen, TensorOptions opts);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LMHead"; }
  Tensor weight;
};

// config.json <-> GPTConfig (HF GPT-2 keys; unknown keys are ignored).
GPTConfig gpt_config_from_json_file(const std::string& path);
void save_gpt_config(const GPTConfig& cfg, const std::string& path);

class GPT : public CausalLM {
 public:
  explicit GPT(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  std::string type_name() const override { return "GPT"; }

  // idx [B, T] (i32/i64, T <= block_size) -> logits [B, T, vocab_size].
  Tensor forward(const Tensor& idx) override;
  // Mean cross-entropy of the logits of idx against targets [B, T].
  Tensor loss(const Tensor& idx, const Tensor& targets) override;
  // idx [B, T] -> the final LayerNorm's output [B, T, n_embd], what the head reads (a
  // sequence-classification head reads it too: nn/classification.h).
  Tensor hidden_states(const Tensor& idx) { return hidden_states(idx, 0, nullptr); }

  // Incremental decoding (CausalLM's): k/v of layer l are [B, n_head, block_size, D].
  KVCache make_kv_cache(int64_t batch) const override;
  Tensor forward_incremental(const Tensor& idx, KVCache& cache) override;

  const GPTConfig& config() const { return cfg_; }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t context_length() const override { return cfg_.block_size; }
  std::string describe() const override;
  int64_t num_blocks() const override { return cfg_.n_layer; }
  // Sets the probability of every dropout site (a model loaded from a directory brings the
  // dropout of its config.json; training may ask for another). Throws outside [0, 1).
  void set_dropout(double p);
  // The [V, C] matrix the logits are computed with (wte.weight when tied).
  Tensor output_weight() const;

  // Model directory: config.json (HF GPT-2 keys) + model.safetensors.
  void save_pretrained(const std::string& dir) const override;
  void save_config(const std::string& path) const override { save_gpt_config(cfg_, path); }
  static std::unique_ptr<GPT> from_pretrained(const std::string& dir, TensorOptions opts = {});
  // Loads weights from a safetensors file in HF GPT-2 layout (with or without the
  // "transformer." prefix; mask buffers and a tied lm_head.weight are ignored).
  void load_safetensors_weights(const std::string& path) override;

  GPTTransformer transformer;
  // The fast implementation of transformer.blocks[i] (runs_fast_blocks): its switches and
  // counters.
  std::vector<GPTFastBlock> fast_blocks;

 private:
  Tensor hidden_states(const Tensor& idx, int64_t past, KVCache* cache);
  // Block `index` on x, with what the checkpointing policy recomputes in backward.
  Tensor run_block(size_t index, const Tensor& x);

  GPTConfig cfg_;
  std::unique_ptr<LMHead> lm_head_;
};

}  // namespace tessera::nn
