#include "tessera/nn/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <tuple>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/settings.h"

namespace tessera::nn {

namespace {
const GPTConfig& validated(const GPTConfig& cfg) {
  cfg.validate();
  return cfg;
}
}  // namespace

GPTTransformer::GPTTransformer(const GPTConfig& cfg, Generator* gen, TensorOptions opts)
    : wte(cfg.vocab_size, cfg.n_embd, 0.02, gen, opts),
      wpe(cfg.block_size, cfg.n_embd, 0.02, gen, opts),
      drop(cfg.dropout),
      ln_f(cfg.n_embd, cfg.layer_norm_epsilon, cfg.bias, opts) {
  register_module("wte", wte);
  register_module("wpe", wpe);
  register_module("drop", drop);
  register_module("h", h);
  for (int64_t i = 0; i < cfg.n_layer; ++i)
    blocks.push_back(&h.push_back(std::make_unique<Block>(cfg, gen, opts)));
  register_module("ln_f", ln_f);
}

LMHead::LMHead(int64_t vocab_size, int64_t n_embd, Generator* gen, TensorOptions opts) {
  Tensor w = empty({vocab_size, n_embd}, {.dtype = opts.dtype, .device = opts.device});
  normal_(w, 0.0, 0.02, gen);
  weight = register_parameter("weight", w);
}

Tensor LMHead::forward(const Tensor& x) {
  return matmul(autograd::autocast(x), autograd::autocast(weight).t());
}

GPT::GPT(const GPTConfig& cfg, Generator* gen, TensorOptions opts)
    : transformer(validated(cfg), gen, opts), cfg_(cfg) {
  register_module("transformer", transformer);
  if (!cfg.tie_word_embeddings) {
    lm_head_ = std::make_unique<LMHead>(cfg.vocab_size, cfg.n_embd, gen, opts);
    register_module("lm_head", *lm_head_);
  }
}

Tensor GPT::output_weight() const { return lm_head_ ? lm_head_->weight : transformer.wte.weight; }

Tensor GPT::hidden_states(const Tensor& idx, int64_t past, KVCache* cache) {
  TESSERA_CHECK(idx.dim() == 2 && is_integral(idx.dtype()) && idx.dtype() != DType::boolean,
                "GPT: idx must be integer [B, T], got ", dtype_name(idx.dtype()), " ",
                shape_str(idx.shape()));
  const int64_t T = idx.size(1);
  const Tensor tokens = idx.contiguous();
  TESSERA_CHECK(past + T <= cfg_.block_size, "GPT: sequence of ", past + T,
                " tokens exceeds block_size ", cfg_.block_size);
  const Tensor pos = arange(static_cast<double>(past), static_cast<double>(past + T), 1.0,
                            {.dtype = DType::i64, .device = idx.device()});
  // nanoGPT's dropout sites: here on the embeddings, then in every block on the attention
  // probabilities and after attn.c_proj and mlp.c_proj (all off in eval()).
  // The residual stream is carried as residual + delta, each block's last add left to the
  // next layer norm (fused there: the next block's ln_1, then ln_f).
  // Where nothing needs to see a projection's complete output (output_biases_deferrable),
  // the output projections' biases are added inside the norms after them as well.
  BlockOutput out{transformer.drop(transformer.wte(tokens) + transformer.wpe(pos)), {}, {}};
  const bool defer_biases = !cache && output_biases_deferrable();
  for (size_t i = 0; i < transformer.blocks.size(); ++i) {
    Block& block = *transformer.blocks[i];
    out = cache ? block.forward_deferred(out.residual, out.delta, out.delta_bias, false,
                                         &cache->layers[i], past)
                : run_block(block, out, defer_biases);
  }
  return out.delta.defined()
             ? transformer.ln_f.forward_residual(out.residual, out.delta, out.delta_bias).second
             : transformer.ln_f(out.residual);
}

bool GPT::output_biases_deferrable() const {
  static const bool enabled = setting_enabled(Setting::DeferredBiases);
  if (!enabled || !cfg_.bias || any_hooks()) return false;
  if (cfg_.gradient_checkpointing && transformer.is_training() && autograd::is_grad_enabled())
    return false;
  for (const Block* block : transformer.blocks)
    for (const Dropout* d : {&block->attn.resid_dropout, &block->mlp.dropout})
      if (d->is_training() && d->p > 0) return false;
  return true;
}

void GPT::set_dropout(double p) {
  TESSERA_CHECK(p >= 0 && p < 1, "GPT::set_dropout: dropout must lie in [0, 1), got ", p);
  for (auto& [name, module] : named_modules())
    if (auto* drop = dynamic_cast<Dropout*>(module)) drop->p = p;
  cfg_.dropout = p;
}

std::string GPT::describe() const {
  std::ostringstream out;
  out << "GPT-2: " << cfg_.n_layer << " layers, " << cfg_.n_head << " heads, " << cfg_.n_embd
      << " channels, context " << cfg_.block_size << ", vocab " << cfg_.vocab_size
      << (cfg_.tie_word_embeddings ? ", tied head" : ", untied head");
  return out.str();
}

BlockOutput GPT::run_block(Block& block, const BlockOutput& in, bool defer_biases) {
  const Tensor &residual = in.residual, &delta = in.delta;
  // The mode of the transformer (a classification model registers only it: nn/classification.h).
  if (!cfg_.gradient_checkpointing || !transformer.is_training() || !autograd::is_grad_enabled())
    return block.call_deferred(residual, delta, in.delta_bias, defer_biases);
  TESSERA_CHECK(!in.delta_bias.defined() && !defer_biases,
                "GPT: biases are not deferred under gradient checkpointing");
  // Checkpointed, the graph keeps each block's input for the recompute: one tensor, the
  // stream summed (two terms would keep twice the memory that checkpointing exists to save),
  // so the add between blocks stays a separate op here; ln_2's add is still fused inside.
  // The recompute replays the default generator and the autocast policy of this run, so
  // the block's dropout masks and dtypes are the same twice. The block's forward hooks run
  // in both passes, so a hook that gathers the block's parameters does so for the recompute.
  const Tensor x = delta.defined() ? residual + delta : residual;
  const Tensor out = autograd::checkpoint(
      [&block](const std::vector<Tensor>& in) { return std::vector<Tensor>{block(in[0])}; },
      {x})[0];
  return {out, Tensor(), Tensor()};
}

Tensor GPT::forward(const Tensor& idx) {
  Tensor x = hidden_states(idx, 0, nullptr);
  // Under autocast the head (the largest matmul) runs in the compute dtype.
  return lm_head_ ? (*lm_head_)(x)
                  : matmul(autograd::autocast(x), autograd::autocast(transformer.wte.weight).t());
}

Tensor GPT::loss(const Tensor& idx, const Tensor& targets) {
  TESSERA_CHECK(targets.shape() == idx.shape(), "GPT::loss: targets ", shape_str(targets.shape()),
                " must have idx's shape ", shape_str(idx.shape()));
  return call_with_hooks(idx, [&] { return language_model_loss(forward(idx), targets); });
}

KVCache GPT::make_kv_cache(int64_t batch) const {
  TESSERA_CHECK(batch > 0, "GPT::make_kv_cache: batch must be > 0, got ", batch);
  KVCache cache;
  cache.batch = batch;
  const Tensor w = transformer.wte.weight;
  const Shape shape{batch, cfg_.n_head, cfg_.block_size, cfg_.n_embd / cfg_.n_head};
  for (int64_t i = 0; i < cfg_.n_layer; ++i)
    cache.layers.push_back({zeros(shape, {.dtype = w.dtype(), .device = w.device()}),
                            zeros(shape, {.dtype = w.dtype(), .device = w.device()})});
  return cache;
}

Tensor GPT::forward_incremental(const Tensor& idx, KVCache& cache) {
  NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(0) == cache.batch, "GPT::forward_incremental: idx ",
                shape_str(idx.shape()), " does not match the cache's batch of ", cache.batch);
  Tensor x = hidden_states(idx, cache.length, &cache);
  cache.length += idx.size(1);
  return matmul(x, output_weight().t());
}

namespace {
// Picks one token per row of logits [B, V] (host floats).
std::vector<int64_t> sample_rows(const Tensor& logits, const GenerateOptions& opts) {
  const Tensor host = raw::contiguous(raw::to(logits, Device::cpu(), DType::f64));
  const int64_t B = host.size(0), V = host.size(1);
  const double* data = host.data<double>();
  std::vector<int64_t> picked(B);
  std::vector<double> uniforms;
  if (opts.temperature > 0)
    uniforms = rand({B}, {.dtype = DType::f64}, opts.gen).to_vector<double>();
  for (int64_t b = 0; b < B; ++b) {
    const double* row = data + b * V;
    if (opts.temperature <= 0) {
      picked[b] = std::max_element(row, row + V) - row;
      continue;
    }
    std::vector<double> z(row, row + V);
    for (auto& v : z) v /= opts.temperature;
    if (opts.top_k > 0 && opts.top_k < V) {
      std::vector<double> sorted = z;
      std::nth_element(sorted.begin(), sorted.begin() + (opts.top_k - 1), sorted.end(),
                       std::greater<>());
      const double kth = sorted[opts.top_k - 1];
      for (auto& v : z)
        if (v < kth) v = -INFINITY;
    }
    const double mx = *std::max_element(z.begin(), z.end());
    double total = 0;
    for (auto& v : z) total += (v = std::exp(v - mx));
    double target = uniforms[b] * total, acc = 0;
    picked[b] = V - 1;
    for (int64_t i = 0; i < V; ++i) {
      acc += z[i];
      if (target < acc && z[i] > 0) {
        picked[b] = i;
        break;
      }
    }
  }
  return picked;
}
}  // namespace

Tensor GPT::generate(const Tensor& idx, int64_t max_new_tokens, const GenerateOptions& opts) {
  NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(1) > 0,
                "GPT::generate: idx must be [B, T] with T > 0, got ", shape_str(idx.shape()));
  const int64_t B = idx.size(0);
  const Device device = transformer.wte.weight.device();
  std::vector<int64_t> tokens =
      raw::to(idx, Device::cpu(), DType::i64).contiguous().to_vector<int64_t>();
  int64_t length = idx.size(1);
  // Token rows [B, n] of the last n tokens, on the model's device.
  auto last_tokens = [&](int64_t n) {
    std::vector<int64_t> rows;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = length - n; t < length; ++t) rows.push_back(tokens[b * length + t]);
    return from_vector(rows, {B, n}, {.dtype = DType::i64, .device = device});
  };
  KVCache cache = make_kv_cache(B);
  Tensor logits;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    if (length <= cfg_.block_size) {
      // Everything fits: feed the tokens the cache has not seen.
      logits = forward_incremental(last_tokens(length - cache.length), cache);
    } else {
      // Past the context the positions shift every step: recompute on the last block.
      logits = forward(last_tokens(cfg_.block_size));
    }
    const Tensor last = raw::select(logits, 1, logits.size(1) - 1);
    const std::vector<int64_t> next = sample_rows(last, opts);
    std::vector<int64_t> grown;
    grown.reserve(B * (length + 1));
    for (int64_t b = 0; b < B; ++b) {
      grown.insert(grown.end(), tokens.begin() + b * length, tokens.begin() + (b + 1) * length);
      grown.push_back(next[b]);
    }
    tokens = std::move(grown);
    ++length;
  }
  return from_vector(tokens, {B, length}, {.dtype = DType::i64});
}

}  // namespace tessera::nn
