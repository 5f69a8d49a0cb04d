#include "tessera/nn/llama.h"

#include <cmath>
#include <sstream>
#include <tuple>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/deferred_init.h"
#include "tessera/nn/llama_fast.h"

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
  weight = register_parameter("weight", init_constant({dim}, 1.0, opts));
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, weight, eps); }

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

Tensor LlamaAttention::forward(const Tensor& x, const ops::RopeTables& rope, int64_t past,
                               KVCache::Layer* cache) {
  const int64_t B = x.size(0), T = x.size(1);
  // [B, T, heads, D]: rotary embeddings act per position, then heads move to dim 1.
  auto heads = [&](TorchLinear& proj, int64_t n) { return proj(x).view({B, T, n, head_dim}); };
  const Tensor q = rotary_embedding(heads(q_proj, n_head), rope).transpose(1, 2);
  Tensor k = rotary_embedding(heads(k_proj, n_kv_head), rope).transpose(1, 2);
  Tensor v = heads(v_proj, n_kv_head).transpose(1, 2);
  if (cache) std::tie(k, v) = cache->append(k, v, past);
  // Queries at the last T of the keys' positions; GQA shares each kv head.
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

Tensor LlamaDecoderLayer::forward(const Tensor& input, const ops::RopeTables& rope, int64_t past,
                                  KVCache::Layer* cache, CheckpointRegion recompute) {
  // The rotary tables are constants of this forward, captured as they are.
  const Tensor x =
      input + checkpointed(recompute == CheckpointRegion::attention,
                           [this, rope, past, cache](const Tensor& t) {
                             return self_attn.forward(t, rope, past, cache);
                           },
                           input_layernorm(input));
  return x + checkpointed(recompute == CheckpointRegion::mlp,
                          [this](const Tensor& t) { return mlp(t); }, post_attention_layernorm(x));
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
  Tensor x = model.embed_tokens(idx.contiguous());
  if (runs_fast_blocks()) return llama_fast_hidden_states(*this, x, rope, past, cache);
  for (size_t i = 0; i < model.decoder_layers.size(); ++i) {
    LlamaDecoderLayer& layer = *model.decoder_layers[i];
    x = cache ? layer.forward(x, rope, past, &cache->layers[i]) : run_layer(i, x, rope);
  }
  return model.norm(x);
}

Tensor Llama::run_layer(size_t index, const Tensor& x, const ops::RopeTables& rope) {
  LlamaDecoderLayer& layer = *model.decoder_layers[index];
  // The layer's hooks run around it (ZeRO-3 gathers its parameters there), in both passes
  // under checkpointing, as GPT's blocks do.
  auto call = [&layer, rope](const Tensor& in, CheckpointRegion region) {
    return layer.call_with_hooks(in, [&] { return layer.forward(in, rope, 0, nullptr, region); });
  };
  // The mode of the body (a classification model registers only it: nn/classification.h).
  const CheckpointRegion region = checkpoint_region(static_cast<int64_t>(index), model);
  if (region != CheckpointRegion::block) return call(x, region);
  // The recompute replays the autocast policy; the layer has no randomness to replay. The
  // rotary tables are constants of this forward, captured as they are.
  return checkpointed(true, [call](const Tensor& in) { return call(in, CheckpointRegion::none); }, x);
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
  const Tensor w = model.embed_tokens.weight;
  return nn::make_kv_cache(cfg_.num_hidden_layers,
                           {batch, cfg_.num_key_value_heads, cfg_.max_position_embeddings,
                            cfg_.attention_head_dim()},
                           {.dtype = w.dtype(), .device = w.device()});
}

Tensor Llama::forward_incremental(const Tensor& idx, KVCache& cache) {
  NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(0) == cache.batch, "Llama::forward_incremental: idx ",
                shape_str(idx.shape()), " does not match the cache's batch of ", cache.batch);
  const Tensor x = hidden_states(idx, cache.length, &cache);
  cache.length += idx.size(1);
  return matmul(x, output_weight().t());
}

}  // namespace tessera::nn
