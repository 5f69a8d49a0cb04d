#include "tessera/nn/attention.h"

#include <cmath>
#include <tuple>

#include "tessera/autograd/functions.h"

namespace tessera::nn {

void GPTConfig::validate() const {
  TESSERA_CHECK(vocab_size > 0, "GPTConfig: vocab_size must be > 0, got ", vocab_size);
  TESSERA_CHECK(block_size > 0, "GPTConfig: block_size must be > 0, got ", block_size);
  TESSERA_CHECK(n_layer > 0, "GPTConfig: n_layer must be > 0, got ", n_layer);
  TESSERA_CHECK(n_head > 0 && n_embd > 0 && n_embd % n_head == 0, "GPTConfig: n_embd (", n_embd,
                ") must be a positive multiple of n_head (", n_head, ")");
  TESSERA_CHECK(dropout >= 0 && dropout < 1, "GPTConfig: dropout must lie in [0, 1), got ",
                dropout);
  TESSERA_CHECK(layer_norm_epsilon > 0, "GPTConfig: layer_norm_epsilon must be > 0");
}

namespace {
double residual_std(const GPTConfig& cfg) {
  return 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
}
}  // namespace

CausalSelfAttention::CausalSelfAttention(const GPTConfig& cfg, Generator* gen, TensorOptions opts)
    : c_attn(cfg.n_embd, 3 * cfg.n_embd, cfg.bias, 0.02, gen, opts),
      c_proj(cfg.n_embd, cfg.n_embd, cfg.bias, residual_std(cfg), gen, opts),
      attn_dropout(cfg.dropout),
      resid_dropout(cfg.dropout),
      n_head(cfg.n_head),
      n_embd(cfg.n_embd),
      block_size(cfg.block_size) {
  register_module("c_attn", c_attn);
  register_module("c_proj", c_proj);
  register_module("attn_dropout", attn_dropout);
  register_module("resid_dropout", resid_dropout);
}

Tensor CausalSelfAttention::split_heads(const Tensor& t) const {
  const int64_t B = t.size(0), T = t.size(1);
  return t.reshape({B, T, n_head, n_embd / n_head}).transpose(1, 2);
}

Tensor CausalSelfAttention::merge_heads(const Tensor& t) const {
  return t.transpose(1, 2).reshape({t.size(0), t.size(2), n_embd});
}

double CausalSelfAttention::attention_dropout_p() const {
  return attn_dropout.is_training() ? attn_dropout.p : 0.0;
}

void CausalSelfAttention::check_input(const Tensor& x, int64_t past) const {
  TESSERA_CHECK(x.dim() == 3 && x.size(2) == n_embd, "CausalSelfAttention: input must be [B, T, ",
                n_embd, "], got ", shape_str(x.shape()));
  TESSERA_CHECK(past + x.size(1) <= block_size, "CausalSelfAttention: ", past + x.size(1),
                " positions exceed block_size ", block_size);
}

Tensor CausalSelfAttention::forward(const Tensor& x, KVCache::Layer* cache, int64_t past) {
  check_input(x, past);
  const std::vector<Tensor> qkv = split(c_attn(x), n_embd, -1);
  Tensor q = split_heads(qkv[0]), k = split_heads(qkv[1]), v = split_heads(qkv[2]);
  if (cache) std::tie(k, v) = cache->append(k, v, past);
  // Queries at the last T of the keys' positions (all of them without a cache).
  const Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true, attention_dropout_p());
  return resid_dropout(c_proj(merge_heads(y)));
}

MLP::MLP(const GPTConfig& cfg, Generator* gen, TensorOptions opts)
    : c_fc(cfg.n_embd, 4 * cfg.n_embd, cfg.bias, 0.02, gen, opts),
      c_proj(4 * cfg.n_embd, cfg.n_embd, cfg.bias, residual_std(cfg), gen, opts),
      dropout(cfg.dropout) {
  register_module("c_fc", c_fc);
  register_module("act", act);
  register_module("c_proj", c_proj);
  register_module("dropout", dropout);
}

Tensor MLP::forward(const Tensor& x) { return dropout(c_proj(act(c_fc(x)))); }

Block::Block(const GPTConfig& cfg, Generator* gen, TensorOptions opts)
    : ln_1(cfg.n_embd, cfg.layer_norm_epsilon, cfg.bias, opts),
      attn(cfg, gen, opts),
      ln_2(cfg.n_embd, cfg.layer_norm_epsilon, cfg.bias, opts),
      mlp(cfg, gen, opts) {
  register_module("ln_1", ln_1);
  register_module("attn", attn);
  register_module("ln_2", ln_2);
  register_module("mlp", mlp);
}

Tensor Block::forward(const Tensor& input, KVCache::Layer* cache, int64_t past,
                      CheckpointRegion recompute) {
  const Tensor normed = ln_1(input);
  const Tensor x =
      input + (cache ? attn.forward(normed, cache, past)
                     : checkpointed(recompute == CheckpointRegion::attention,
                                    [this](const Tensor& t) { return attn(t); }, normed));
  return x + checkpointed(recompute == CheckpointRegion::mlp,
                          [this](const Tensor& t) { return mlp(t); }, ln_2(x));
}

}  // namespace tessera::nn
