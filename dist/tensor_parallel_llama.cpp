// Llama over a tensor-parallel group (dist/tensor_parallel_models.h): the reference decoder
// layer of nn/llama.cpp on this rank's heads and MLP units. Grouped-query attention splits
// consistently: kv head j serves query heads [j·g, (j+1)·g) (g = H / H_kv), so rank r's query
// heads [r·H/W, (r+1)·H/W) read exactly its kv heads [r·H_kv/W, (r+1)·H_kv/W).
#include <tuple>

#include "tessera/autograd/functions.h"
#include "tessera/dist/tensor_parallel_models.h"

namespace tessera::dist {

void check_tensor_parallel(const nn::LlamaConfig& cfg, int tp_size) {
  cfg.validate();
  TESSERA_CHECK(tp_size >= 1, "tensor parallelism: tp_size must be >= 1, got ", tp_size);
  TESSERA_CHECK(cfg.num_attention_heads % tp_size == 0, "tensor parallelism: tp_size ", tp_size,
                " does not divide Llama's num_attention_heads ", cfg.num_attention_heads);
  TESSERA_CHECK(cfg.num_key_value_heads % tp_size == 0, "tensor parallelism: tp_size ", tp_size,
                " does not divide Llama's num_key_value_heads ", cfg.num_key_value_heads,
                " (grouped-query attention splits its kv heads; ", cfg.num_attention_heads,
                " query heads)");
  TESSERA_CHECK(cfg.intermediate_size % tp_size == 0, "tensor parallelism: tp_size ", tp_size,
                " does not divide Llama's intermediate_size ", cfg.intermediate_size);
  TESSERA_CHECK(cfg.vocab_size >= tp_size, "tensor parallelism: tp_size ", tp_size,
                " exceeds the vocabulary of ", cfg.vocab_size);
}

namespace tp_detail {
namespace {

TensorOptions options_of(const Tensor& t) { return {.dtype = t.dtype(), .device = t.device()}; }

// Output rows of a [out, in] projection: contiguous, whole heads of `head_dim` each.
ShardSpec outputs_of(const nn::TorchLinear& full, const GroupPtr& group) {
  return ShardSpec::contiguous(0, full.weight.size(0), group->size());
}

struct Attention : nn::Module {
  Attention(const nn::LlamaAttention& full, const GroupPtr& group)
      : q_proj(full.q_proj.weight, full.q_proj.bias, WeightLayout::out_in,
               outputs_of(full.q_proj, group), group),
        k_proj(full.k_proj.weight, full.k_proj.bias, WeightLayout::out_in,
               outputs_of(full.k_proj, group), group),
        v_proj(full.v_proj.weight, full.v_proj.bias, WeightLayout::out_in,
               outputs_of(full.v_proj, group), group),
        o_proj(full.o_proj.weight, full.o_proj.bias, WeightLayout::out_in,
               ShardSpec::contiguous(1, full.o_proj.weight.size(1), group->size()), group),
        heads(full.n_head / group->size()),
        kv_heads(full.n_kv_head / group->size()),
        head_dim(full.head_dim) {
    register_module("q_proj", q_proj);
    register_module("k_proj", k_proj);
    register_module("v_proj", v_proj);
    register_module("o_proj", o_proj);
  }
  Tensor forward(const Tensor& x_in, const ops::RopeTables& rope, int64_t past,
                 KVCache::Layer* cache, const Regions& regions) {
    // One entry for q, k and v: one all-reduce (or reduce-scatter) of the input's gradient.
    const Tensor x = regions.enter(x_in);
    const int64_t B = x.size(0), T = x.size(1);
    auto split_heads = [&](ColumnParallelLinear& proj, int64_t n) {
      return proj.forward_in_region(x).view({B, T, n, head_dim});
    };
    const Tensor q = rotary_embedding(split_heads(q_proj, heads), rope).transpose(1, 2);
    Tensor k = rotary_embedding(split_heads(k_proj, kv_heads), rope).transpose(1, 2);
    Tensor v = split_heads(v_proj, kv_heads).transpose(1, 2);
    if (cache) std::tie(k, v) = cache->append(k, v, past);
    const Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true);
    return regions.leave(o_proj, y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  ColumnParallelLinear q_proj, k_proj, v_proj;
  RowParallelLinear o_proj;
  int64_t heads, kv_heads, head_dim;
};

struct MLP : nn::Module {
  MLP(const nn::LlamaMLP& full, const GroupPtr& group)
      : gate_proj(full.gate_proj.weight, full.gate_proj.bias, WeightLayout::out_in,
                  outputs_of(full.gate_proj, group), group),
        up_proj(full.up_proj.weight, full.up_proj.bias, WeightLayout::out_in,
                outputs_of(full.up_proj, group), group),
        down_proj(full.down_proj.weight, full.down_proj.bias, WeightLayout::out_in,
                  ShardSpec::contiguous(1, full.down_proj.weight.size(1), group->size()), group) {
    register_module("gate_proj", gate_proj);
    register_module("up_proj", up_proj);
    register_module("down_proj", down_proj);
  }
  Tensor forward(const Tensor& x_in, const Regions& regions) {
    const Tensor x = regions.enter(x_in);  // one entry for gate and up
    return regions.leave(down_proj,
                         swiglu(gate_proj.forward_in_region(x), up_proj.forward_in_region(x)));
  }
  ColumnParallelLinear gate_proj, up_proj;
  RowParallelLinear down_proj;
};

// An RMSNorm kept whole on every rank, on whatever part of the sequence this rank holds.
Tensor norm(nn::RMSNorm& rms, const Tensor& x, const Regions& regions) {
  return rms_norm(x, regions.whole(rms.weight), rms.eps);
}

nn::RMSNorm& copied(nn::RMSNorm& norm, const nn::RMSNorm& full) {
  autograd::NoGradGuard no_grad;
  ops::copy_(norm.weight, full.weight);
  return norm;
}

struct DecoderLayer : nn::Module {
  DecoderLayer(const nn::LlamaDecoderLayer& full, const GroupPtr& group)
      : self_attn(full.self_attn, group),
        mlp(full.mlp, group),
        input_layernorm(full.input_layernorm.weight.size(0), full.input_layernorm.eps,
                        options_of(full.input_layernorm.weight)),
        post_attention_layernorm(full.post_attention_layernorm.weight.size(0),
                                 full.post_attention_layernorm.eps,
                                 options_of(full.post_attention_layernorm.weight)) {
    register_module("self_attn", self_attn);
    register_module("mlp", mlp);
    register_module("input_layernorm", copied(input_layernorm, full.input_layernorm));
    register_module("post_attention_layernorm",
                    copied(post_attention_layernorm, full.post_attention_layernorm));
  }
  Tensor forward(const Tensor& input, const ops::RopeTables& rope, int64_t past,
                 KVCache::Layer* cache, const Regions& regions,
                 nn::CheckpointRegion recompute = nn::CheckpointRegion::none) {
    const Tensor x = input + nn::checkpointed(
                                 recompute == nn::CheckpointRegion::attention,
                                 [this, rope, past, cache, regions](const Tensor& t) {
                                   return self_attn.forward(t, rope, past, cache, regions);
                                 },
                                 norm(input_layernorm, input, regions));
    return x + nn::checkpointed(
                   recompute == nn::CheckpointRegion::mlp,
                   [this, regions](const Tensor& t) { return mlp.forward(t, regions); },
                   norm(post_attention_layernorm, x, regions));
  }
  Attention self_attn;
  MLP mlp;
  nn::RMSNorm input_layernorm, post_attention_layernorm;
};

}  // namespace

// "model": embed_tokens (vocabulary-parallel), layers.{i}, norm (whole).
struct LlamaBody : nn::Module {
  LlamaBody(const nn::LlamaModel& full, const GroupPtr& group)
      : embed_tokens(full.embed_tokens.weight, group),
        norm(full.norm.weight.size(0), full.norm.eps, options_of(full.norm.weight)) {
    register_module("embed_tokens", embed_tokens);
    register_module("layers", layers);
    for (const nn::LlamaDecoderLayer* layer : full.decoder_layers)
      decoder_layers.push_back(&layers.push_back(std::make_unique<DecoderLayer>(*layer, group)));
    register_module("norm", copied(norm, full.norm));
  }
  VocabParallelEmbedding embed_tokens;
  nn::ModuleList layers;
  nn::RMSNorm norm;
  std::vector<DecoderLayer*> decoder_layers;
};

namespace {

// A pipeline stage of Llama on this tp rank's slices (TensorParallelStage): model.embed_tokens
// (first stage; the last too when tied), model.layers.{i} (its blocks), model.norm and lm_head
// (last), under the full model's names.
class LlamaStage : public TensorParallelStage {
 public:
  LlamaStage(const nn::Llama& full, GroupPtr pipeline, GroupPtr tensor, GroupPtr model_group)
      : TensorParallelStage(std::move(pipeline), full, full.config().tie_word_embeddings, tensor,
                            std::move(model_group)),
        cfg_(full.config()) {
    const nn::LlamaModel& m = full.model;
    register_module("model", model_);
    if (holds_token_embedding())
      embed_tokens_ = &model_.register_module(
          "embed_tokens", std::make_unique<VocabParallelEmbedding>(m.embed_tokens.weight, tensor));
    model_.register_module("layers", layers_);
    for (int64_t i = blocks().begin; i < blocks().end; ++i)
      layers_of_stage_.push_back(&layers_.register_module(
          std::to_string(i), std::make_unique<DecoderLayer>(*m.decoder_layers[i], tensor)));
    if (last_stage()) {
      norm_ = &model_.register_module(
          "norm", std::make_unique<nn::RMSNorm>(m.norm.weight.size(0), m.norm.eps,
                                                options_of(m.norm.weight)));
      copied(*norm_, m.norm);
    }
    finish_stage(full, cfg_.hidden_size,
                 cfg_.tie_word_embeddings ? Tensor() : full.output_weight());
  }
  std::string type_name() const override { return "TensorParallelStageLlama"; }

 private:
  Tensor embed(const Tensor& idx) override { return regions().embed(*embed_tokens_, idx); }
  Tensor run_blocks(const Tensor& x) override {
    const ops::RopeTables rope = ops::rope_tables(0, x.size(1), cfg_.attention_head_dim(),
                                                  cfg_.rope_theta, x.dtype(), x.device());
    Tensor out = x;
    for (DecoderLayer* layer : layers_of_stage_)
      out = layer->forward(out, rope, 0, nullptr, regions());
    return out;
  }
  Tensor final_norm(const Tensor& h) override { return norm(*norm_, h, regions()); }
  VocabParallelEmbedding& token_embedding() const override { return *embed_tokens_; }
  std::unique_ptr<nn::CausalLM> new_full_model() const override {
    Generator scratch(0);  // overwritten; the default generator is left alone
    return std::make_unique<nn::Llama>(cfg_, &scratch, options_of(parameters().front()));
  }

  nn::LlamaConfig cfg_;
  nn::Module model_;
  StageModuleList layers_;
  VocabParallelEmbedding* embed_tokens_ = nullptr;
  std::vector<DecoderLayer*> layers_of_stage_;
  nn::RMSNorm* norm_ = nullptr;
};

}  // namespace

}  // namespace tp_detail

std::unique_ptr<PipelineParallelCausalLM> tensor_parallel_stage(const nn::Llama& full,
                                                                GroupPtr pipeline, GroupPtr tensor,
                                                                GroupPtr model_group) {
  check_tensor_parallel(full.config(), tensor ? tensor->size() : 0);
  return std::make_unique<tp_detail::LlamaStage>(full, std::move(pipeline), std::move(tensor),
                                                 std::move(model_group));
}

TensorParallelLlama::TensorParallelLlama(const nn::Llama& full, GroupPtr group)
    : TensorParallelCausalLM(std::move(group), full), cfg_(full.config()) {
  check_tensor_parallel(cfg_, tp_size());
  model_ =
      &register_module("model", std::make_unique<tp_detail::LlamaBody>(full.model, this->group()));
  finish_construction(full, cfg_.tie_word_embeddings, full.output_weight());
}

TensorParallelLlama::~TensorParallelLlama() = default;

Tensor TensorParallelLlama::head_input(const Tensor& idx, int64_t past, KVCache* cache) {
  const Regions regions = regions_of_this_forward(idx, past, cache != nullptr);
  const int64_t T = idx.size(1);
  const Tensor w = model_->norm.weight;
  // The attention sees the whole sequence (inside the regions), so the tables cover all T.
  const ops::RopeTables rope =
      ops::rope_tables(past, T, cfg_.attention_head_dim(), cfg_.rope_theta, w.dtype(), w.device());
  Tensor x = regions.embed(model_->embed_tokens, idx);
  for (size_t i = 0; i < model_->decoder_layers.size(); ++i) {
    tp_detail::DecoderLayer& layer = *model_->decoder_layers[i];
    if (cache) {
      x = layer.forward(x, rope, past, &cache->layers[i], regions);
      continue;
    }
    x = run_block(static_cast<int64_t>(i), *model_, x,
                  [&layer, rope, regions](const Tensor& in, nn::CheckpointRegion region) {
                    return layer.forward(in, rope, 0, nullptr, regions, region);
                  });
  }
  return regions.enter(tp_detail::norm(model_->norm, x, regions));
}

VocabParallelEmbedding& TensorParallelLlama::head() const {
  return lm_head_ ? *lm_head_ : model_->embed_tokens;
}

KVCache TensorParallelLlama::make_kv_cache(int64_t batch) const {
  TESSERA_CHECK(batch > 0, "Llama::make_kv_cache: batch must be > 0, got ", batch);
  const Tensor w = model_->norm.weight;
  return nn::make_kv_cache(cfg_.num_hidden_layers,
                           {batch, cfg_.num_key_value_heads / tp_size(),
                            cfg_.max_position_embeddings, cfg_.attention_head_dim()},
                           {.dtype = w.dtype(), .device = w.device()});
}

std::unique_ptr<nn::CausalLM> TensorParallelLlama::new_full_model() const {
  Generator scratch(0);  // overwritten; the default generator is left alone
  const Tensor w = model_->norm.weight;
  return std::make_unique<nn::Llama>(cfg_, &scratch,
                                     TensorOptions{.dtype = w.dtype(), .device = w.device()});
}

}  // namespace tessera::dist
