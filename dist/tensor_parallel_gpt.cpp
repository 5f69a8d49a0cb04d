// GPT-2 over a tensor-parallel group (dist/tensor_parallel_models.h). The block is nanoGPT's
// pre-LayerNorm block, the reference of nn/attention.cpp, on this rank's heads and hidden
// units: per block, forward, one all-reduce after attention's c_proj and one after the MLP's;
// backward, one at the input of c_attn and one at the input of c_fc.
#include <tuple>

#include "tessera/autograd/functions.h"
#include "tessera/dist/tensor_parallel_models.h"

namespace tessera::dist {

void check_tensor_parallel(const nn::GPTConfig& cfg, int tp_size) {
  cfg.validate();
  TESSERA_CHECK(tp_size >= 1, "tensor parallelism: tp_size must be >= 1, got ", tp_size);
  TESSERA_CHECK(cfg.n_head % tp_size == 0, "tensor parallelism: tp_size ", tp_size,
                " does not divide GPT-2's n_head ", cfg.n_head);
  TESSERA_CHECK(cfg.vocab_size >= tp_size, "tensor parallelism: tp_size ", tp_size,
                " exceeds the vocabulary of ", cfg.vocab_size);
  TESSERA_CHECK(cfg.dropout == 0, "tensor parallelism: GPT-2's dropout is ", cfg.dropout,
                "; it runs without dropout (GPT::set_dropout(0)): the ranks' draws could not be "
                "one process's");
}

namespace tp_detail {
namespace {

TensorOptions options_of(const Tensor& t) { return {.dtype = t.dtype(), .device = t.device()}; }

// A LayerNorm kept whole on every rank, on whatever part of the sequence this rank holds.
Tensor norm(nn::LayerNorm& ln, const Tensor& x, const Regions& regions) {
  return layer_norm(x, regions.whole(ln.weight), regions.whole(ln.bias), ln.eps);
}

// A module holding copies of a full module's whole parameters.
void copy_values(nn::Module& into, const nn::Module& from) {
  autograd::NoGradGuard no_grad;
  const nn::NamedTensors want = from.named_parameters();
  const nn::NamedTensors got = into.named_parameters();
  TESSERA_CHECK(want.size() == got.size(), "tensor parallelism: copying ", from.type_name());
  for (size_t i = 0; i < want.size(); ++i) ops::copy_(got[i].second, want[i].second);
}

// Rank r's query, key and value heads: part r of each of c_attn's q | k | v blocks.
struct Attention : nn::Module {
  Attention(const nn::CausalSelfAttention& full, const GroupPtr& group)
      : c_attn(full.c_attn.weight, full.c_attn.bias, WeightLayout::in_out,
               ShardSpec::blocked(1, 3 * full.n_embd, 3, group->size()), group),
        c_proj(full.c_proj.weight, full.c_proj.bias, WeightLayout::in_out,
               ShardSpec::contiguous(0, full.n_embd, group->size()), group),
        heads(full.n_head / group->size()),
        head_dim(full.n_embd / full.n_head),
        block_size(full.block_size) {
    register_module("c_attn", c_attn);
    register_module("c_proj", c_proj);
  }
  // x: the block's normed input, [B, T, C], or this rank's [B, T/W, C] under sequence
  // parallelism.
  Tensor forward(const Tensor& x_in, KVCache::Layer* cache, int64_t past, const Regions& regions) {
    const Tensor x = regions.enter(x_in);  // [B, T, C] on every rank
    const int64_t B = x.size(0), T = x.size(1);
    TESSERA_CHECK(past + T <= block_size, "GPT (tensor-parallel): ", past + T,
                  " positions exceed block_size ", block_size);
    auto split_heads = [&](const Tensor& t) {
      return t.reshape({B, T, heads, head_dim}).transpose(1, 2);
    };
    const std::vector<Tensor> qkv = split(c_attn.forward_in_region(x), heads * head_dim, -1);
    Tensor q = split_heads(qkv[0]), k = split_heads(qkv[1]), v = split_heads(qkv[2]);
    if (cache) std::tie(k, v) = cache->append(k, v, past);
    const Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true);
    return regions.leave(c_proj, y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  ColumnParallelLinear c_attn;
  RowParallelLinear c_proj;
  int64_t heads, head_dim, block_size;
};

struct MLP : nn::Module {
  MLP(const nn::MLP& full, const GroupPtr& group)
      : c_fc(full.c_fc.weight, full.c_fc.bias, WeightLayout::in_out,
             ShardSpec::contiguous(1, full.c_fc.weight.size(1), group->size()), group),
        c_proj(full.c_proj.weight, full.c_proj.bias, WeightLayout::in_out,
               ShardSpec::contiguous(0, full.c_proj.weight.size(0), group->size()), group) {
    register_module("c_fc", c_fc);
    register_module("c_proj", c_proj);
  }
  Tensor forward(const Tensor& x, const Regions& regions) {
    return regions.leave(c_proj, gelu(c_fc.forward_in_region(regions.enter(x))));
  }
  ColumnParallelLinear c_fc;
  RowParallelLinear c_proj;
};

struct Block : nn::Module {
  Block(const nn::Block& full, const GroupPtr& group)
      : ln_1(full.ln_1.weight.size(0), full.ln_1.eps, full.ln_1.bias.defined(),
             options_of(full.ln_1.weight)),
        attn(full.attn, group),
        ln_2(full.ln_2.weight.size(0), full.ln_2.eps, full.ln_2.bias.defined(),
             options_of(full.ln_2.weight)),
        mlp(full.mlp, group) {
    register_module("ln_1", ln_1);
    register_module("attn", attn);
    register_module("ln_2", ln_2);
    register_module("mlp", mlp);
    copy_values(ln_1, full.ln_1);
    copy_values(ln_2, full.ln_2);
  }
  Tensor forward(const Tensor& input, KVCache::Layer* cache, int64_t past, const Regions& regions,
                 nn::CheckpointRegion recompute = nn::CheckpointRegion::none) {
    const Tensor x = input + nn::checkpointed(
                                 recompute == nn::CheckpointRegion::attention,
                                 [this, cache, past, regions](const Tensor& t) {
                                   return attn.forward(t, cache, past, regions);
                                 },
                                 norm(ln_1, input, regions));
    return x + nn::checkpointed(
                   recompute == nn::CheckpointRegion::mlp,
                   [this, regions](const Tensor& t) { return mlp.forward(t, regions); },
                   norm(ln_2, x, regions));
  }
  nn::LayerNorm ln_1;
  Attention attn;
  nn::LayerNorm ln_2;
  MLP mlp;
};

}  // namespace

// "transformer": wte (vocabulary-parallel), wpe and ln_f whole, h.{i}.
struct GPTTransformer : nn::Module {
  GPTTransformer(const nn::GPTTransformer& full, const GroupPtr& group)
      : wte(full.wte.weight, group),
        wpe(full.wpe.weight.size(0), full.wpe.weight.size(1), 0.02, &scratch,
            options_of(full.wpe.weight)),
        ln_f(full.ln_f.weight.size(0), full.ln_f.eps, full.ln_f.bias.defined(),
             options_of(full.ln_f.weight)) {
    register_module("wte", wte);
    register_module("wpe", wpe);
    register_module("h", h);
    for (const nn::Block* block : full.blocks)
      blocks.push_back(&h.push_back(std::make_unique<Block>(*block, group)));
    register_module("ln_f", ln_f);
    copy_values(wpe, full.wpe);
    copy_values(ln_f, full.ln_f);
  }
  Generator scratch{0};  // wpe's initial draw (overwritten), kept off the default generator
  VocabParallelEmbedding wte;
  nn::Embedding wpe;
  nn::ModuleList h;
  nn::LayerNorm ln_f;
  std::vector<Block*> blocks;
};

namespace {

// A pipeline stage of GPT-2 on this tp rank's slices (TensorParallelStage): transformer.wte
// (first stage; the last too when tied), wpe (first), h.{i} (its blocks), ln_f and lm_head
// (last), under the full model's names.
class GPTStage : public TensorParallelStage {
 public:
  GPTStage(const nn::GPT& full, GroupPtr pipeline, GroupPtr tensor, GroupPtr model_group)
      : TensorParallelStage(std::move(pipeline), full, full.config().tie_word_embeddings, tensor,
                            std::move(model_group)),
        cfg_(full.config()) {
    const nn::GPTTransformer& t = full.transformer;
    const TensorOptions opts = options_of(t.wpe.weight);
    register_module("transformer", transformer_);
    if (holds_token_embedding())
      wte_ = &transformer_.register_module(
          "wte", std::make_unique<VocabParallelEmbedding>(t.wte.weight, tensor));
    if (first_stage()) {
      wpe_ = &transformer_.register_module(
          "wpe", std::make_unique<nn::Embedding>(t.wpe.weight.size(0), t.wpe.weight.size(1), 0.02,
                                                 &scratch_, opts));
      copy_values(*wpe_, t.wpe);
    }
    transformer_.register_module("h", h_);
    for (int64_t i = blocks().begin; i < blocks().end; ++i)
      blocks_.push_back(
          &h_.register_module(std::to_string(i), std::make_unique<Block>(*t.blocks[i], tensor)));
    if (last_stage()) {
      ln_f_ = &transformer_.register_module(
          "ln_f", std::make_unique<nn::LayerNorm>(t.ln_f.weight.size(0), t.ln_f.eps,
                                                  t.ln_f.bias.defined(), opts));
      copy_values(*ln_f_, t.ln_f);
    }
    finish_stage(full, cfg_.n_embd, cfg_.tie_word_embeddings ? Tensor() : full.output_weight());
  }
  std::string type_name() const override { return "TensorParallelStageGPT"; }

 private:
  Tensor embed(const Tensor& idx) override {
    const Tensor pos = arange(0, static_cast<double>(idx.size(1)), 1.0,
                              {.dtype = DType::i64, .device = idx.device()});
    return regions().embed(*wte_, idx) + regions().positions((*wpe_)(pos));
  }
  Tensor run_blocks(const Tensor& x) override {
    Tensor out = x;
    for (Block* block : blocks_) out = block->forward(out, nullptr, 0, regions());
    return out;
  }
  Tensor final_norm(const Tensor& h) override { return norm(*ln_f_, h, regions()); }
  VocabParallelEmbedding& token_embedding() const override { return *wte_; }
  std::unique_ptr<nn::CausalLM> new_full_model() const override {
    Generator scratch(0);  // overwritten; the default generator is left alone
    return std::make_unique<nn::GPT>(cfg_, &scratch, options_of(parameters().front()));
  }

  nn::GPTConfig cfg_;
  Generator scratch_{0};  // wpe's initial draw (overwritten), kept off the default generator
  nn::Module transformer_;
  StageModuleList h_;
  VocabParallelEmbedding* wte_ = nullptr;
  nn::Embedding* wpe_ = nullptr;
  std::vector<Block*> blocks_;  // this stage's, in order
  nn::LayerNorm* ln_f_ = nullptr;
};

}  // namespace

}  // namespace tp_detail

std::unique_ptr<PipelineParallelCausalLM> tensor_parallel_stage(const nn::GPT& full,
                                                                GroupPtr pipeline, GroupPtr tensor,
                                                                GroupPtr model_group) {
  check_tensor_parallel(full.config(), tensor ? tensor->size() : 0);
  return std::make_unique<tp_detail::GPTStage>(full, std::move(pipeline), std::move(tensor),
                                               std::move(model_group));
}

TensorParallelGPT::TensorParallelGPT(const nn::GPT& full, GroupPtr group)
    : TensorParallelCausalLM(std::move(group), full), cfg_(full.config()) {
  check_tensor_parallel(cfg_, tp_size());
  transformer_ = &register_module(
      "transformer", std::make_unique<tp_detail::GPTTransformer>(full.transformer, this->group()));
  finish_construction(full, cfg_.tie_word_embeddings, full.output_weight());
}

TensorParallelGPT::~TensorParallelGPT() = default;

Tensor TensorParallelGPT::head_input(const Tensor& idx, int64_t past, KVCache* cache) {
  const Regions regions = regions_of_this_forward(idx, past, cache != nullptr);
  const int64_t T = idx.size(1);
  const Tensor pos = arange(static_cast<double>(past), static_cast<double>(past + T), 1.0,
                            {.dtype = DType::i64, .device = idx.device()});
  Tensor x = regions.embed(transformer_->wte, idx) + regions.positions(transformer_->wpe(pos));
  for (size_t i = 0; i < transformer_->blocks.size(); ++i) {
    tp_detail::Block& block = *transformer_->blocks[i];
    if (cache) {
      x = block.forward(x, &cache->layers[i], past, regions);
      continue;
    }
    x = run_block(static_cast<int64_t>(i), *transformer_, x,
                  [&block, regions](const Tensor& in, nn::CheckpointRegion region) {
                    return block.forward(in, nullptr, 0, regions, region);
                  });
  }
  const nn::LayerNorm& ln_f = transformer_->ln_f;
  return regions.enter(
      layer_norm(x, regions.whole(ln_f.weight), regions.whole(ln_f.bias), ln_f.eps));
}

VocabParallelEmbedding& TensorParallelGPT::head() const {
  return lm_head_ ? *lm_head_ : transformer_->wte;
}

KVCache TensorParallelGPT::make_kv_cache(int64_t batch) const {
  TESSERA_CHECK(batch > 0, "GPT::make_kv_cache: batch must be > 0, got ", batch);
  const Tensor w = transformer_->wpe.weight;
  return nn::make_kv_cache(
      cfg_.n_layer, {batch, cfg_.n_head / tp_size(), cfg_.block_size, cfg_.n_embd / cfg_.n_head},
      {.dtype = w.dtype(), .device = w.device()});
}

std::unique_ptr<nn::CausalLM> TensorParallelGPT::new_full_model() const {
  Generator scratch(0);  // overwritten; the default generator is left alone
  const Tensor w = transformer_->wpe.weight;
  return std::make_unique<nn::GPT>(cfg_, &scratch,
                                   TensorOptions{.dtype = w.dtype(), .device = w.device()});
}

}  // namespace tessera::dist
