#include "tessera/nn/attention.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>

#include "tessera/autograd/functions.h"
#include "tessera/core/settings.h"

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
      block_size_(cfg.block_size) {
  register_module("c_attn", c_attn);
  register_module("c_proj", c_proj);
  register_module("attn_dropout", attn_dropout);
  register_module("resid_dropout", resid_dropout);
}

Tensor CausalSelfAttention::split_heads(const Tensor& t) const {
  const int64_t B = t.size(0), T = t.size(1);
  return t.reshape({B, T, n_head, n_embd / n_head}).transpose(1, 2);
}

Tensor CausalSelfAttention::attend(const Tensor& q, const Tensor& k, const Tensor& v) {
  TESSERA_CHECK(k.size(2) <= block_size_, "CausalSelfAttention: ", k.size(2),
                " positions exceed block_size ", block_size_);
  const double dropout_p = attn_dropout.is_training() ? attn_dropout.p : 0.0;
  if (use_fused_attention && flash_attention_applies(q, k, v, /*causal=*/true, dropout_p))
    ++fused_calls_;
  return scaled_dot_product_attention(q, k, v, /*causal=*/true, dropout_p, nullptr,
                                      use_fused_attention);
}

Tensor CausalSelfAttention::attention_heads(const Tensor& x) {
  TESSERA_CHECK(x.dim() == 3 && x.size(2) == n_embd, "CausalSelfAttention: input must be [B, T, ",
                n_embd, "], got ", shape_str(x.shape()));
  TESSERA_CHECK(x.size(1) <= block_size_, "CausalSelfAttention: ", x.size(1),
                " positions exceed block_size ", block_size_);
  const double dropout_p = attn_dropout.is_training() ? attn_dropout.p : 0.0;
  // The fused path reads q, k, v out of c_attn's output and writes y [B, T, C] in place:
  // no split, head transposes or merge copies in either direction. While training with
  // dropout > 0 the attention takes the flash kernels that drop probabilities (the mask the
  // composition would draw from the default generator) through causal_attention_qkv's
  // reference route. With c_attn and the attention as one node (no dropout), the attention
  // backward also sums c_attn's bias gradient (causal_attention_qkv_projection); c_attn's
  // hooks need its own call.
  if (use_fused_attention && use_fused_projection && dropout_p == 0 && !c_attn.has_hooks() &&
      causal_attention_qkv_projection_fused_applies(x, c_attn.weight, c_attn.bias, n_head)) {
    ++fused_calls_;
    ++fused_projection_calls_;
    return causal_attention_qkv_projection(x, c_attn.weight, c_attn.bias, n_head);
  }
  const Tensor qkv = c_attn(x);
  if (use_fused_attention && causal_attention_qkv_fused_applies(qkv, n_head, dropout_p))
    ++fused_calls_;
  return causal_attention_qkv(qkv, n_head, dropout_p, nullptr, use_fused_attention);
}

bool CausalSelfAttention::fused_projection_by_default() {
  return setting_enabled(Setting::FusedQkvProjection);
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  return resid_dropout(c_proj(attention_heads(x)));
}

Tensor CausalSelfAttention::forward_without_output_bias(const Tensor& x) {
  TESSERA_CHECK(!resid_dropout.is_training() || resid_dropout.p == 0,
                "CausalSelfAttention: the output bias cannot be deferred past an active dropout");
  return linear(attention_heads(x), c_proj.weight, Tensor());
}

Tensor CausalSelfAttention::forward_cached(const Tensor& x, KVCache::Layer& layer, int64_t past) {
  NoGradGuard no_grad;
  const int64_t B = x.size(0), T = x.size(1);
  TESSERA_CHECK(past + T <= layer.k.size(2), "CausalSelfAttention: cache holds ", layer.k.size(2),
                " positions; cannot add ", T, " after ", past);
  auto qkv = split(c_attn(x), n_embd, -1);
  raw::copy_(raw::narrow(layer.k, 2, past, T), split_heads(qkv[1]));
  raw::copy_(raw::narrow(layer.v, 2, past, T), split_heads(qkv[2]));
  Tensor y = attend(split_heads(qkv[0]), raw::narrow(layer.k, 2, 0, past + T),
                    raw::narrow(layer.v, 2, 0, past + T));
  y = y.transpose(1, 2).reshape({B, T, n_embd});
  return resid_dropout(c_proj(y));
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

bool MLP::fused_mlp_by_default() {
  return setting_enabled(Setting::FusedMlp);
}

Tensor MLP::forward(const Tensor& x) {
  if (!use_fused_mlp || c_fc.has_hooks() || act.has_hooks() || c_proj.has_hooks())
    return dropout(c_proj(act(c_fc(x))));
  TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == c_fc.weight.size(0), "MLP: input shape ",
                shape_str(x.shape()), " does not end in n_embd = ", c_fc.weight.size(0));
  ++fused_calls_;
  return dropout(mlp_gelu(x, c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias));
}

Tensor MLP::forward_without_output_bias(const Tensor& x) {
  TESSERA_CHECK(!dropout.is_training() || dropout.p == 0,
                "MLP: the output bias cannot be deferred past an active dropout");
  if (!use_fused_mlp) return linear(act(c_fc(x)), c_proj.weight, Tensor());
  ++fused_calls_;
  return mlp_gelu(x, c_fc.weight, c_fc.bias, c_proj.weight, Tensor());
}

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

Tensor Block::forward(const Tensor& x) {
  const BlockOutput out = forward_deferred(x, Tensor());
  return out.residual + out.delta;
}

Tensor Block::forward_cached(const Tensor& x, KVCache::Layer& layer, int64_t past) {
  const BlockOutput out = forward_deferred(x, Tensor(), Tensor(), false, &layer, past);
  return out.residual + out.delta;
}

BlockOutput Block::call_deferred(const Tensor& residual, const Tensor& delta,
                                 const Tensor& delta_bias, bool defer_biases) {
  BlockOutput out;
  out.delta = call_with_hooks(residual, [&] {
    out = forward_deferred(residual, delta, delta_bias, defer_biases);
    return out.delta;
  });
  return out;
}

BlockOutput Block::forward_deferred(const Tensor& residual, const Tensor& delta,
                                    const Tensor& delta_bias, bool defer_biases,
                                    KVCache::Layer* cache, int64_t past) {
  TESSERA_CHECK(delta.defined() || !delta_bias.defined(),
                "Block: a delta bias needs the delta it belongs to");
  TESSERA_CHECK(!(defer_biases && cache), "Block: biases are not deferred with a KV cache");
  // x = residual + delta (+ delta_bias); h = x + attn(ln_1(x)); the output h + mlp(ln_2(h))
  // stays two (or three) terms.
  const auto [x, x_normed] = delta.defined() ? ln_1.forward_residual(residual, delta, delta_bias)
                                             : std::pair{residual, ln_1(residual)};
  if (defer_biases) {
    const auto [h, h_normed] =
        ln_2.forward_residual(x, attn.forward_without_output_bias(x_normed), attn.c_proj.bias);
    return {h, mlp.forward_without_output_bias(h_normed), mlp.c_proj.bias};
  }
  const Tensor attn_out = cache ? attn.forward_cached(x_normed, *cache, past) : attn(x_normed);
  const auto [h, h_normed] = ln_2.forward_residual(x, attn_out);
  return {h, mlp(h_normed), Tensor()};
}

}  // namespace tessera::nn
