#include "tessera/nn/gpt.h"

#include <sstream>
#include <string>
#include <tuple>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/deferred_init.h"

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
  weight = register_parameter("weight", init_normal({vocab_size, n_embd}, 0.0, 0.02, gen, opts));
}

Tensor LMHead::forward(const Tensor& x) {
  return matmul(autograd::autocast(x), autograd::autocast(weight).t());
}

GPT::GPT(const GPTConfig& cfg, Generator* gen, TensorOptions opts)
    : transformer(validated(cfg), gen, opts), cfg_(cfg) {
  register_module("transformer", transformer);
  for (Block* block : transformer.blocks) fast_blocks.emplace_back(*block);
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
  Tensor x = transformer.drop(transformer.wte(tokens) + transformer.wpe(pos));
  if (runs_fast_blocks()) return gpt_fast_hidden_states(*this, x, past, cache);
  for (size_t i = 0; i < transformer.blocks.size(); ++i) {
    Block& block = *transformer.blocks[i];
    x = cache ? block.forward(x, &cache->layers[i], past) : run_block(i, x);
  }
  return transformer.ln_f(x);
}

Tensor GPT::run_block(size_t index, const Tensor& x) {
  Block& block = *transformer.blocks[index];
  // The mode of the transformer (a classification model registers only it: nn/classification.h).
  const CheckpointRegion region = checkpoint_region(static_cast<int64_t>(index), transformer);
  if (region == CheckpointRegion::none) return block(x);
  // A sub-layer's checkpoint sits inside the block's call, between its hooks.
  if (region != CheckpointRegion::block)
    return block.call_with_hooks(x, [&] { return block.forward(x, nullptr, 0, region); });
  // The recompute replays the default generator and the autocast policy of this run, so
  // the block's dropout masks and dtypes are the same twice. The block's forward hooks run
  // in both passes, so a hook that gathers the block's parameters does so for the recompute.
  return checkpointed(true, [&block](const Tensor& in) { return block(in); }, x);
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
  const Tensor w = transformer.wte.weight;
  return nn::make_kv_cache(cfg_.n_layer, {batch, cfg_.n_head, cfg_.block_size, cfg_.n_embd / cfg_.n_head},
                           {.dtype = w.dtype(), .device = w.device()});
}

Tensor GPT::forward_incremental(const Tensor& idx, KVCache& cache) {
  NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(0) == cache.batch, "GPT::forward_incremental: idx ",
                shape_str(idx.shape()), " does not match the cache's batch of ", cache.batch);
  Tensor x = hidden_states(idx, cache.length, &cache);
  cache.length += idx.size(1);
  return matmul(x, output_weight().t());
}

}  // namespace tessera::nn
