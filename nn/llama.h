// Llama: token embeddings, pre-RMSNorm decoder layers (rotary-embedded grouped-query
// attention and a SwiGLU MLP), a final RMSNorm and the output projection (tied to the
// embeddings or not). Parameter names and layouts are Hugging Face LlamaForCausalLM's, so a
// model directory (config.json + model.safetensors) moves between Tessera and
// `transformers`: projections are stored [out, in] as torch.nn.Linear stores them. The layers
// here are the reference; the fast layers (nn/llama_fast.h) run by default on the same
// parameters.
#pragma once
#include <memory>
#include <string>
#include <utility>

#include "tessera/kernels/ops.h"
#include "tessera/nn/causal_lm.h"
#include "tessera/nn/layers.h"

namespace tessera::nn {

struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // < num_attention_heads: grouped-query attention
  int64_t head_dim = 0;              // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  // Throws naming the field when the configuration cannot build a model.
  void validate() const;
  int64_t attention_head_dim() const {
    return head_dim > 0 ? head_dim : hidden_size / num_attention_heads;
  }
};

// x * rsqrt(mean(x^2) + eps) * weight over the last dim; weight 1 at init.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "RMSNorm"; }
  Tensor weight;
  double eps;
};

// Causal self-attention with rotary embeddings and num_key_value_heads key/value heads, as
// Hugging Face's LlamaAttention: q, k, v projections, rotary embeddings on q and k,
// grouped-query scaled_dot_product_attention, o_proj.
class LlamaAttention : public Module {
 public:
  LlamaAttention(const LlamaConfig& cfg, Generator* gen, TensorOptions opts);
  // x [B, T, C] at positions [past, past + T) with their rotary tables. With a cache layer
  // (tape-free decoding) the keys and values are appended there and all past ones attended.
  Tensor forward(const Tensor& x, const ops::RopeTables& rope, int64_t past,
                 KVCache::Layer* cache);
  std::string type_name() const override { return "LlamaAttention"; }

  TorchLinear q_proj, k_proj, v_proj, o_proj;
  int64_t n_head, n_kv_head, head_dim;
};

// down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMLP : public Module {
 public:
  LlamaMLP(const LlamaConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LlamaMLP"; }
  TorchLinear gate_proj, up_proj, down_proj;
};

// x = x + self_attn(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x)). The fast
// layer (nn/llama_fast.h) computes the same with fewer kernels.
class LlamaDecoderLayer : public Module {
 public:
  LlamaDecoderLayer(const LlamaConfig& cfg, Generator* gen, TensorOptions opts);
  // `recompute` attention or mlp (training: CausalLM::checkpoint_region) runs that sub-layer
  // under activation checkpointing; a whole layer's checkpoint is the caller's.
  Tensor forward(const Tensor& x, const ops::RopeTables& rope, int64_t past,
                 KVCache::Layer* cache, CheckpointRegion recompute = CheckpointRegion::none);
  std::string type_name() const override { return "LlamaDecoderLayer"; }
  LlamaAttention self_attn;
  LlamaMLP mlp;
  RMSNorm input_layernorm, post_attention_layernorm;
};

// HF's LlamaModel ("model."): embed_tokens, layers.{i}, norm.
class LlamaModel : public Module {
 public:
  LlamaModel(const LlamaConfig& cfg, Generator* gen, TensorOptions opts);
  std::string type_name() const override { return "LlamaModel"; }
  Embedding embed_tokens;
  ModuleList layers;
  RMSNorm norm;
  std::vector<LlamaDecoderLayer*> decoder_layers;
};

// config.json <-> LlamaConfig (HF keys; model_type must be "llama"; unknown keys ignored,
// rope_scaling other than null or {"rope_type": "default"} refused). The rotary base is read
// from "rope_theta" or from transformers 5's "rope_parameters": {"rope_theta": ...}; both
// are written, so transformers 4 and 5 read the same base.
LlamaConfig llama_config_from_json_file(const std::string& path);
void save_llama_config(const LlamaConfig& cfg, const std::string& path);

class Llama : public CausalLM {
 public:
  explicit Llama(const LlamaConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  std::string type_name() const override { return "Llama"; }

  // idx [B, T] (i32/i64, T <= max_position_embeddings) -> logits [B, T, vocab_size].
  Tensor forward(const Tensor& idx) override;
  // Mean cross-entropy of the logits of idx against targets [B, T].
  Tensor loss(const Tensor& idx, const Tensor& targets) override;
  // idx [B, T] -> the final RMSNorm's output [B, T, hidden_size], what the head reads.
  Tensor hidden_states(const Tensor& idx) { return hidden_states(idx, 0, nullptr); }

  // Incremental decoding (CausalLM's): k/v of layer l are [B, n_kv_head, max_positions, D].
  KVCache make_kv_cache(int64_t batch) const override;
  Tensor forward_incremental(const Tensor& idx, KVCache& cache) override;

  const LlamaConfig& config() const { return cfg_; }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t context_length() const override { return cfg_.max_position_embeddings; }
  std::string describe() const override;
  int64_t num_blocks() const override { return cfg_.num_hidden_layers; }
  // The [V, C] matrix the logits are computed with (embed_tokens.weight when tied).
  Tensor output_weight() const;

  // Model directory: config.json (HF Llama keys) + model.safetensors (HF tensor names).
  void save_pretrained(const std::string& dir) const override;
  void save_config(const std::string& path) const override { save_llama_config(cfg_, path); }
  static std::unique_ptr<Llama> from_pretrained(const std::string& dir, TensorOptions opts = {});
  // Loads weights from a safetensors file in HF LlamaForCausalLM layout (a tied
  // lm_head.weight and rotary inv_freq buffers of older files are ignored).
  void load_safetensors_weights(const std::string& path) override;

  LlamaModel model;

 private:
  Tensor hidden_states(const Tensor& idx, int64_t past, KVCache* cache);
  // Layer `index` on x at positions [0, T), with what the checkpointing policy recomputes.
  Tensor run_layer(size_t index, const Tensor& x, const ops::RopeTables& rope);
  LlamaConfig cfg_;
  std::unique_ptr<TorchLinear> lm_head_;
};

}  // namespace tessera::nn
