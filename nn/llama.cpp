#include "tessera/nn/llama.h"

#include <cmath>
#include <sstream>
#include <tuple>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"

namespace tessera::nn {

void LlamaConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    TESSERA_CHECK(v > 0, "LlamaConfig: ", name, " must be positive, got ", v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(max_position_embeddings, "max_position_embeddings");
  TESSERA_CHECK(num_attention_heads % num_key_value_heads == 0,
                "LlamaConfig: num_attention_heads (", num_attention_heads,
                ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  TESSERA_CHECK(head_dim > 0 || hidden_size % num_attention_heads == 0,
                "LlamaConfig: hidden_size (", hidden_size,
                ") must be a multiple of num_attention_heads (", num_attention_heads,
                ") unless head_dim is given");
  TESSERA_CHECK(attention_head_dim() % 2 == 0, "LlamaConfig: the head dim (", attention_head_dim(),
                ") must be even for rotary embeddings");
  TESSERA_CHECK(rms_norm_eps >= 0 && rope_theta > 0, "LlamaConfig: rms_norm_eps (", rms_norm_eps,
                ") must be >= 0 and rope_theta (", rope_theta, ") > 0");
}

namespace {
const LlamaConfig& validated(const LlamaConfig& cfg) {
  cfg.validate();
  return cfg;
}
}  // namespace

RMSNorm::RMSNorm(int64_t dim, double eps_in, TensorOptions opts) : eps(eps_in) {
  weight = register_parameter("weight", ones({dim}, {.dtype = opts.dtype, .device = opts.device}));
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, weight, eps); }

std::pair<Tensor, Tensor> RMSNorm::forward_residual(const Tensor& x, const Tensor& residual) {
  return residual_rms_norm(x, residual, weight, eps);
}

LlamaAttention::LlamaAttention(const LlamaConfig& cfg, Generator* gen, TensorOptions opts)
    : q_proj(cfg.hidden_size, cfg.num_attention_heads * cfg.attention_head_dim(),
             cfg.initializer_range, gen, opts),
      k_proj(cfg.hidden_size, cfg.num_key_value_heads * cfg.attention_head_dim(),
             cfg.initializer_range, gen, opts),
      v_proj(cfg.hidden_size, cfg.num_key_value_heads * cfg.attention_head_dim(),
             cfg.initializer_range, gen, opts),
      o_proj(cfg.num_attention_heads * cfg.attention_head_dim(), cfg.hidden_size,
             cfg.initializer_range, gen, opts),
      n_head(cfg.num_attention_heads),
      n_kv_head(cfg.num_key_value_heads),
      head_dim(cfg.attention_head_dim()) {
  register_module("q_proj", q_proj);
  register_module("k_proj", k_proj);
  register_module("v_proj", v_proj);
  register_module("o_proj", o_proj);
}

Tensor LlamaAttention::forward_at(const Tensor& x, const ops::RopeTables& rope, int64_t past,
                                  KVCache::Layer* cache) {
  if (!cache) {
    // Training and full forwards: one GEMM for q | k | v (the three weights stacked), then
    // rotary attention straight from that projection (one gradient flows back into it).
    const Tensor w_qkv = cat({q_proj.weight, k_proj.weight, v_proj.weight}, 0);
    return o_proj(rotary_causal_attention_qkv(linear(x, w_qkv.t()), n_head, n_kv_head, rope));
  }
  const int64_t B = x.size(0), T = x.size(1);
  // [B, T, heads, D]: rotary embeddings act per position, then heads move to dim 1.
  auto heads = [&](TorchLinear& proj, int64_t n) { return proj(x).view({B, T, n, head_dim}); };
  Tensor q = rotary_embedding(heads(q_proj, n_head), rope).transpose(1, 2);
  Tensor k = rotary_embedding(heads(k_proj, n_kv_head), rope).transpose(1, 2);
  Tensor v = heads(v_proj, n_kv_head).transpose(1, 2);
  raw::copy_(raw::narrow(cache->k, 2, past, T), k);
  raw::copy_(raw::narrow(cache->v, 2, past, T), v);
  k = raw::narrow(cache->k, 2, 0, past + T);
  v = raw::narrow(cache->v, 2, 0, past + T);
  // Queries at the last T of the past + T key positions; GQA shares each kv head.
  const Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true);
  return o_proj(y.transpose(1, 2).reshape({B, T, n_head * head_dim}));
}

LlamaMLP::LlamaMLP(const LlamaConfig& cfg, Generator* gen, TensorOptions opts)
    : gate_proj(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range, gen, opts),
      up_proj(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range, gen, opts),
      down_proj(cfg.intermediate_size, cfg.hidden_size, cfg.initializer_range, gen, opts) {
  register_module("gate_proj", gate_proj);
  register_module("up_proj", up_proj);
  register_module("down_proj", down_proj);
}

Tensor LlamaMLP::forward(const Tensor& x) { return down_proj(swiglu(gate_proj(x), up_proj(x))); }

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& cfg, Generator* gen, TensorOptions opts)
    : self_attn(cfg, gen, opts),
      mlp(cfg, gen, opts),
      input_layernorm(cfg.hidden_size, cfg.rms_norm_eps, opts),
      post_attention_layernorm(cfg.hidden_size, cfg.rms_norm_eps, opts) {
  register_module("self_attn", self_attn);
  register_module("mlp", mlp);
  register_module("input_layernorm", input_layernorm);
  register_module("post_attention_layernorm", post_attention_layernorm);
}

Tensor LlamaDecoderLayer::forward_at(const Tensor& x, const ops::RopeTables& rope, int64_t past,
                                     KVCache::Layer* cache) {
  const auto [h, mlp_out] = forward_deferred(x, Tensor(), rope, past, cache);
  return h + mlp_out;
}

std::pair<Tensor, Tensor> LlamaDecoderLayer::forward_deferred(const Tensor& residual,
                                                              const Tensor& delta,
                                                              const ops::RopeTables& rope,
                                                              int64_t past, KVCache::Layer* cache) {
  // x = residual + delta; h = x + attn(input_layernorm(x)); out = h + mlp(post_norm(h)).
  const auto [x, x_normed] = delta.defined() ? input_layernorm.forward_residual(residual, delta)
                                             : std::pair{residual, input_layernorm(residual)};
  const Tensor attn_out = self_attn.forward_at(x_normed, rope, past, cache);
  const auto [h, h_normed] = post_attention_layernorm.forward_residual(x, attn_out);
  return {h, mlp(h_normed)};
}

LlamaModel::LlamaModel(const LlamaConfig& cfg, Generator* gen, TensorOptions opts)
    : embed_tokens(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range, gen, opts),
      norm(cfg.hidden_size, cfg.rms_norm_eps, opts) {
  register_module("embed_tokens", embed_tokens);
  register_module("layers", layers);
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i)
    decoder_layers.push_back(
        &layers.push_back(std::make_unique<LlamaDecoderLayer>(cfg, gen, opts)));
  register_module("norm", norm);
}

Llama::Llama(const LlamaConfig& cfg, Generator* gen, TensorOptions opts)
    : model(validated(cfg), gen, opts), cfg_(cfg) {
  register_module("model", model);
  if (!cfg.tie_word_embeddings) {
    lm_head_ = std::make_unique<TorchLinear>(cfg.hidden_size, cfg.vocab_size, cfg.initializer_range,
                                             gen, opts);
    register_module("lm_head", *lm_head_);
  }
}

Tensor Llama::output_weight() const {
  return lm_head_ ? lm_head_->weight : model.embed_tokens.weight;
}

Tensor Llama::hidden_states(const Tensor& idx, int64_t past, KVCache* cache) {
  TESSERA_CHECK(idx.dim() == 2 && is_integral(idx.dtype()) && idx.dtype() != DType::boolean,
                "Llama: idx must be integer [B, T], got ", dtype_name(idx.dtype()), " ",
                shape_str(idx.shape()));
  const int64_t T = idx.size(1);
  TESSERA_CHECK(past + T <= cfg_.max_position_embeddings, "Llama: sequence of ", past + T,
                " tokens exceeds max_position_embeddings ", cfg_.max_position_embeddings);
  const Tensor w = model.embed_tokens.weight;
  // One table for every layer: the angles of positions [past, past + T).
  const ops::RopeTables rope =
      ops::rope_tables(past, T, cfg_.attention_head_dim(), cfg_.rope_theta, w.dtype(), w.device());
  // The residual stream as residual + delta, the add left to the next RMSNorm (fused there).
  Tensor residual = model.embed_tokens(idx.contiguous()), delta;
  for (size_t i = 0; i < model.decoder_layers.size(); ++i) {
    LlamaDecoderLayer& layer = *model.decoder_layers[i];
    std::tie(residual, delta) =
        cache ? layer.forward_deferred(residual, delta, rope, past, &cache->layers[i])
              : run_layer(layer, residual, delta, rope);
  }
  return delta.defined() ? model.norm.forward_residual(residual, delta).second
                         : model.norm(residual);
}

std::pair<Tensor, Tensor> Llama::run_layer(LlamaDecoderLayer& layer, const Tensor& residual,
                                           const Tensor& delta, const ops::RopeTables& rope) {
  // The mode of the body (a classification model registers only it: nn/classification.h).
  if (!checkpointing_ || !model.is_training() || !autograd::is_grad_enabled())
    return layer.forward_deferred(residual, delta, rope, 0, nullptr);
  // The recompute replays the autocast policy; the layer has no randomness to replay. The
  // rotary tables are constants of this forward, captured as they are.
  std::vector<Tensor> inputs{residual};
  if (delta.defined()) inputs.push_back(delta);
  const std::vector<Tensor> out = autograd::checkpoint(
      [&layer, rope](const std::vector<Tensor>& in) {
        const auto [h, mlp_out] =
            layer.forward_deferred(in[0], in.size() > 1 ? in[1] : Tensor(), rope, 0, nullptr);
        return std::vector<Tensor>{h, mlp_out};
      },
      inputs);
  return {out[0], out[1]};
}

std::string Llama::describe() const {
  std::ostringstream out;
  out << "Llama: " << cfg_.num_hidden_layers << " layers, " << cfg_.num_attention_heads
      << " heads (" << cfg_.num_key_value_heads << " key/value), " << cfg_.hidden_size
      << " channels, MLP " << cfg_.intermediate_size << ", context " << cfg_.max_position_embeddings
      << ", vocab " << cfg_.vocab_size << ", rope_theta " << cfg_.rope_theta
      << (cfg_.tie_word_embeddings ? ", tied head" : ", untied head");
  return out.str();
}

Tensor Llama::forward(const Tensor& idx) {
  const Tensor x = hidden_states(idx, 0, nullptr);
  return matmul(autograd::autocast(x), autograd::autocast(output_weight()).t());
}

Tensor Llama::loss(const Tensor& idx, const Tensor& targets) {
  TESSERA_CHECK(targets.shape() == idx.shape(), "Llama::loss: targets ", shape_str(targets.shape()),
                " must have idx's shape ", shape_str(idx.shape()));
  return call_with_hooks(idx, [&] { return language_model_loss(forward(idx), targets); });
}

KVCache Llama::make_kv_cache(int64_t batch) const {
  TESSERA_CHECK(batch > 0, "Llama::make_kv_cache: batch must be > 0, got ", batch);
  KVCache cache;
  cache.batch = batch;
  const Tensor w = model.embed_tokens.weight;
  const Shape shape{batch, cfg_.num_key_value_heads, cfg_.max_position_embeddings,
                    cfg_.attention_head_dim()};
  for (int64_t i = 0; i < cfg_.num_hidden_layers; ++i)
    cache.layers.push_back({zeros(shape, {.dtype = w.dtype(), .device = w.device()}),
                            zeros(shape, {.dtype = w.dtype(), .device = w.device()})});
  return cache;
}

Tensor Llama::forward_incremental(const Tensor& idx, KVCache& cache) {
  NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(0) == cache.batch, "Llama::forward_incremental: idx ",
                shape_str(idx.shape()), " does not match the cache's batch of ", cache.batch);
  const Tensor x = hidden_states(idx, cache.length, &cache);
  cache.length += idx.size(1);
  return matmul(x, output_weight().t());
}

Tensor Llama::generate(const Tensor& idx, int64_t max_new_tokens, const GenerateOptions& opts) {
  NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(1) > 0 && max_new_tokens >= 0,
                "Llama::generate: idx must be [B, T] with T > 0 (got ", shape_str(idx.shape()),
                ") and max_new_tokens >= 0 (got ", max_new_tokens, ")");
  const Device device = model.embed_tokens.weight.device();
  const int64_t context = cfg_.max_position_embeddings;
  KVCache cache = make_kv_cache(idx.size(0));
  // Sampled where the logits are: the tokens stay on the device until the end.
  Tensor tokens = raw::to(idx, device, DType::i64);
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    const int64_t length = tokens.size(1);
    // Within the context each new token costs one single-position forward on the cache;
    // past it the positions shift every step, so the last window is recomputed (as
    // GPT::generate does).
    const Tensor logits =
        length <= context ? forward_incremental(
                                raw::narrow(tokens, 1, cache.length, length - cache.length), cache)
                          : forward(raw::narrow(tokens, 1, length - context, context));
    const Tensor last = raw::select(logits, 1, logits.size(1) - 1);
    const Tensor next = ops::sample_logits(last, opts.temperature, opts.top_k, opts.gen);
    tokens = ops::cat({tokens, raw::unsqueeze(next, 1)}, 1);
  }
  return raw::to(tokens, Device::cpu(), DType::i64);
}

}  // namespace tessera::nn
