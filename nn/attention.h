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
  // x [B, Tn, C] at positions [cache.length, cache.length + Tn): appends its keys and values
  // to `layer` and attends over all of them. Tape-free.
  Tensor forward_cached(const Tensor& x, KVCache::Layer& layer, int64_t past);
  std::string type_name() const override { return "CausalSelfAttention"; }

  Linear c_attn, c_proj;
  Dropout attn_dropout, resid_dropout;
  int64_t n_head, n_embd;
  // Use the fused CUDA attention kernels (flash or cuDNN: see set_attention_backend) where
  // they apply (bf16/f16 on a GPU, head size 64 or 128, no attention dropout): forward runs
  // them straight on c_attn's output (causal_attention_qkv), forward_cached on the cache's
  // heads; otherwise the scores are materialised.
  bool use_fused_attention = true;
  // How many forward/forward_cached calls took the fused path (to check it is really used).
  int64_t fused_attention_calls() const { return fused_calls_; }

 private:
  // softmax(q kᵀ / sqrt(D) masked) v for q [B,H,Tq,D], k/v [B,H,Tk,D], queries at
  // positions [Tk - Tq, Tk).
  Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v);
  // [B, T, C] -> [B, H, T, D]
  Tensor split_heads(const Tensor& t) const;
  int64_t fused_calls_ = 0;
  int64_t block_size_;  // longest sequence (keys) attended over
};

class MLP : public Module {
 public:
  MLP(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
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

// x + attn(ln_1(x)), then + mlp(ln_2(·)).
class Block : public Module {
 public:
  Block(const GPTConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward_cached(const Tensor& x, KVCache::Layer& layer, int64_t past);
  // The block with its residual adds fused into the layer norms after them (GPT's stack):
  // the input is residual + delta (delta undefined: residual alone), added inside ln_1, and
  // the result is {h, mlp_out} whose sum is the block's output, that last add left to the
  // next layer norm (the next block's ln_1 or ln_f). With a cache, attention appends to it at
  // positions [past, past + T) as forward_cached does. forward(x) is h + mlp_out of (x, {}).
  std::pair<Tensor, Tensor> forward_deferred(const Tensor& residual, const Tensor& delta,
                                             KVCache::Layer* cache = nullptr, int64_t past = 0);
  // forward_deferred(residual, delta) between the block's hooks, as operator() runs forward:
  // they see residual as the input and mlp_out as the output, so the backward pre-hooks fire
  // when mlp_out's gradient arrives, before any of the block's own ops run backward (ZeRO-3
  // gathers the block's parameters there).
  std::pair<Tensor, Tensor> call_deferred(const Tensor& residual, const Tensor& delta);
  std::string type_name() const override { return "Block"; }

  LayerNorm ln_1;
  CausalSelfAttention attn;
  LayerNorm ln_2;
  MLP mlp;
};

}  // namespace tessera::nn
