// GPT-2 attention, MLP and the pre-LayerNorm transformer block: the reference implementation.
#pragma once
#include "tessera/nn/causal_lm.h"  // KVCache
#include "tessera/nn/layers.h"

namespace tessera::nn {

struct GPTConfig {
  int64_t vocab_size = 50257;
  int64_t block_size = 1024;  // n_positions
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  double layer_norm_epsilon = 1e-5;
  bool tie_word_embeddings = true;
  bool bias = true;      // biases in Linear and LayerNorm
  double dropout = 0.0;  // embedding, attention and residual dropout
  // Throws naming the field when the configuration cannot build a model.
  void validate() const;
};

// Multi-head causal self-attention as nanoGPT writes it: the projection c_attn [C, 3C]
// (q | k | v along the output dimension), heads, scaled_dot_product_attention (causal, with
// attention dropout while training), the heads merged, the output projection c_proj [C, C] and
// the residual dropout. The fast GPT-2 block (nn/gpt_fast.h) runs the same parameters through
// fewer kernels.
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override { return forward(x, nullptr, 0); }  // x [B, T, C]
  // x [B, T, C] at positions [past, past + T). With a cache layer (tape-free decoding) its
  // keys and values are appended there and the queries attend over all past + T of them.
  Tensor forward(const Tensor& x, KVCache::Layer* cache, int64_t past);
  std::string type_name() const override { return "CausalSelfAttention"; }
  // [B, T, C] -> [B, H, T, D] and back.
  Tensor split_heads(const Tensor& t) const;
  Tensor merge_heads(const Tensor& t) const;
  // attn_dropout's probability now (0 outside training).
  double attention_dropout_p() const;
  // Refuses x that is not [B, T, n_embd] or longer than block_size.
  void check_input(const Tensor& x, int64_t past) const;

  Linear c_attn, c_proj;
  Dropout attn_dropout, resid_dropout;
  int64_t n_head, n_embd, block_size;
};

// c_proj(gelu(c_fc(x))), then dropout.
class MLP : public Module {
 public:
  MLP(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "MLP"; }

  Linear c_fc, c_proj;
  GELU act;
  Dropout dropout;
};

// The pre-LayerNorm transformer block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)).
class Block : public Module {
 public:
  Block(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override { return forward(x, nullptr, 0); }
  // With a cache layer, attention appends to it at positions [past, past + T). `recompute`
  // attention or mlp (training: CausalLM::checkpoint_region) runs that sub-layer under
  // activation checkpointing; a whole block's checkpoint is the caller's (GPT::run_block).
  Tensor forward(const Tensor& x, KVCache::Layer* cache, int64_t past,
                 CheckpointRegion recompute = CheckpointRegion::none);
  std::string type_name() const override { return "Block"; }

  LayerNorm ln_1;
  CausalSelfAttention attn;
  LayerNorm ln_2;
  MLP mlp;
};

}  // namespace tessera::nn
