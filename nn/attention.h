// GPT-2 attention, MLP and the pre-LayerNorm transformer block.
#pragma once
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
  // Training only: each Block's activations are recomputed in backward instead of kept
  // (autograd::checkpoint), trading one more forward for memory. Not saved in config.json.
  bool gradient_checkpointing = false;
  // Throws naming the field when the configuration cannot build a model.
  void validate() const;
};

// Keys and values of every layer for incremental decoding: k/v of layer l are
// [B, H, block_size, D], positions [0, length) filled.
struct KVCache {
  struct Layer {
    Tensor k, v;
  };
  std::vector<Layer> layers;
  int64_t batch = 0;
  int64_t length = 0;
  int64_t capacity() const { return layers.empty() ? 0 : layers.front().k.size(2); }
};

// Multi-head causal self-attention with the fused projection c_attn [C, 3C]
// (q | k | v along the output dimension) and the output projection c_proj [C, C].
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;  // x [B, T, C]
  // forward(x) without c_proj's bias and without resid_dropout (which must be inactive), and
  // without any module's hooks: the bias is added by the norm after it
  // (LayerNorm::forward_residual's x_bias; Block::forward_deferred).
  Tensor forward_without_output_bias(const Tensor& x);
  // x [B, Tn, C] at positions [cache.length, cache.length + Tn): appends its keys and values
  // to `layer` and attends over all of them. Tape-free.
  Tensor forward_cached(const Tensor& x, KVCache::Layer& layer, int64_t past);
  std::string type_name() const override { return "CausalSelfAttention"; }

  Linear c_attn, c_proj;
  Dropout attn_dropout, resid_dropout;
  int64_t n_head, n_embd;
  // Use the fused CUDA attention kernels (flash or cuDNN: see set_attention_backend) where
  // they apply (bf16/f16 on a GPU, head size 64 or 128; with attention dropout the flash
  // kernels that draw it, whichever backend is chosen): forward runs
  // them straight on c_attn's output (causal_attention_qkv), forward_cached on the cache's
  // heads; otherwise the scores are materialised.
  bool use_fused_attention = true;
  // How many forward/forward_cached calls took the fused path (to check it is really used).
  int64_t fused_attention_calls() const { return fused_calls_; }
  // Run c_attn and the fused attention as one node where it applies
  // (causal_attention_qkv_projection: the attention backward also sums c_attn's bias gradient)
  // unless c_attn has hooks. On unless TESSERA_FUSED_QKV_PROJECTION=0.
  bool use_fused_projection = fused_projection_by_default();
  static bool fused_projection_by_default();
  // How many forward calls took that one-node route.
  int64_t fused_projection_calls() const { return fused_projection_calls_; }

 private:
  // softmax(q kᵀ / sqrt(D) masked) v for q [B,H,Tq,D], k/v [B,H,Tk,D], queries at
  // positions [Tk - Tq, Tk).
  Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v);
  // [B, T, C] -> [B, H, T, D]
  Tensor split_heads(const Tensor& t) const;
  // The heads' output [B, T, C] before c_proj.
  Tensor attention_heads(const Tensor& x);
  int64_t fused_calls_ = 0;
  int64_t fused_projection_calls_ = 0;
  int64_t block_size_;  // longest sequence (keys) attended over
};

class MLP : public Module {
 public:
  MLP(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  // forward(x) without c_proj's bias, dropout (which must be inactive) and hooks, as
  // CausalSelfAttention::forward_without_output_bias.
  Tensor forward_without_output_bias(const Tensor& x);
  std::string type_name() const override { return "MLP"; }

  Linear c_fc, c_proj;
  GELU act;
  Dropout dropout;
  // Run c_fc -> act -> c_proj as one mlp_gelu node (on a GPU: the GELU's backward and c_fc's
  // bias gradient in one pass, kernels/cuda/linear.h) unless one of the three carries hooks,
  // which must see their module's own call; the MLP's own hooks run either way. On unless
  // TESSERA_FUSED_MLP=0 (where the device has no fused entries it is the composition).
  bool use_fused_mlp = fused_mlp_by_default();
  static bool fused_mlp_by_default();
  // How many forward calls went through mlp_gelu (one fused node where the device has the
  // kernels, the composition elsewhere), to check the path is really taken.
  int64_t fused_mlp_calls() const { return fused_calls_; }

 private:
  int64_t fused_calls_ = 0;
};

// A block's output as three terms, its sum residual + delta + delta_bias: the last add of the
// block (and the bias of its MLP's output projection, delta_bias, when that is deferred too;
// else undefined) left to the next layer norm.
struct BlockOutput {
  Tensor residual, delta, delta_bias;
};

// x + attn(ln_1(x)), then + mlp(ln_2(·)).
class Block : public Module {
 public:
  Block(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward_cached(const Tensor& x, KVCache::Layer& layer, int64_t past);
  // The block with its residual adds fused into the layer norms after them (GPT's stack):
  // the input is residual + delta + delta_bias (delta undefined: residual alone; delta_bias
  // undefined: no bias term), added inside ln_1, and the output is the terms of BlockOutput,
  // its last add left to the next layer norm (the next block's ln_1 or ln_f). With
  // defer_biases (only where no module has hooks and no dropout is active:
  // GPT::output_biases_deferrable) the output projections' biases stay out of their GEMMs
  // too: attn.c_proj's is added inside ln_2, mlp.c_proj's is returned as delta_bias, and
  // their gradients come out of those norms' backward passes (no column-sum pass of their
  // own). With a cache, attention appends to it at positions [past, past + T) as
  // forward_cached does. forward(x) is the sum of the terms for (x, {}).
  BlockOutput forward_deferred(const Tensor& residual, const Tensor& delta,
                               const Tensor& delta_bias = Tensor(), bool defer_biases = false,
                               KVCache::Layer* cache = nullptr, int64_t past = 0);
  // forward_deferred(residual, delta, delta_bias, defer_biases) between the block's hooks, as
  // operator() runs forward: they see residual as the input and the delta term as the output,
  // so the backward pre-hooks fire when its gradient arrives, before any of the block's own
  // ops run backward (ZeRO-3 gathers the block's parameters there).
  BlockOutput call_deferred(const Tensor& residual, const Tensor& delta, const Tensor& delta_bias,
                            bool defer_biases);
  std::string type_name() const override { return "Block"; }

  LayerNorm ln_1;
  CausalSelfAttention attn;
  LayerNorm ln_2;
  MLP mlp;
};

}  // namespace tessera::nn
