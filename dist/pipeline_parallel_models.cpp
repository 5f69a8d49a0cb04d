// GPT-2 and Llama cut into pipeline stages (dist/pipeline_parallel.h). Each stage holds copies
// of the full model's modules it runs, registered under the full model's names: GPT-2's
// transformer.wte / wpe (first stage), transformer.h.{i} (its blocks), transformer.ln_f and
// lm_head (last stage); Llama's model.embed_tokens, model.layers.{i}, model.norm and lm_head.
// A tied head's last stage registers its copy of the token embedding under the embedding's own
// name. The blocks are the full model's modules (nn::Block, nn::LlamaDecoderLayer), run as the
// full model runs them: its fast implementation unless it was told to run the reference.
#include <memory>
#include <utility>
#include <vector>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/functions.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"
#include "tessera/nn/llama_fast.h"

namespace tessera::dist {

namespace {

TensorOptions options_of(const Tensor& t) { return {.dtype = t.dtype(), .device = t.device()}; }

// `into` (a freshly constructed module of `from`'s shape) takes `from`'s parameter values.
template <class M>
M& copied(std::unique_ptr<M>& slot, std::unique_ptr<M> into, const nn::Module& from) {
  autograd::NoGradGuard no_grad;
  const nn::NamedTensors want = from.named_parameters(), got = into->named_parameters();
  TESSERA_CHECK(want.size() == got.size(), "pipeline parallelism: copying ", from.type_name());
  for (size_t i = 0; i < want.size(); ++i) ops::copy_(got[i].second, want[i].second);
  slot = std::move(into);
  return *slot;
}

// A copy of `from` (a token or position embedding), its padding row included.
nn::Embedding& copied_embedding(std::unique_ptr<nn::Embedding>& slot, const nn::Embedding& from) {
  Generator scratch(0);  // overwritten by from's values
  nn::Embedding& copy =
      copied(slot,
             std::make_unique<nn::Embedding>(from.weight.size(0), from.weight.size(1), 0.02,
                                             &scratch, options_of(from.weight)),
             from);
  copy.padding_idx = from.padding_idx;
  return copy;
}

// An untied head's [V, C] rows (the full models keep their heads private).
void copy_head(const Tensor& into, const Tensor& from) {
  autograd::NoGradGuard no_grad;
  ops::copy_(into, from);
}

// The logits of the final hidden states h against the head's [V, C] rows, as nn::GPT and
// nn::Llama compute them (under autocast the head runs in the compute dtype).
Tensor logits_of(const Tensor& h, const Tensor& head_rows) {
  return matmul(autograd::autocast(h), autograd::autocast(head_rows).t());
}

class PipelineParallelGPT : public PipelineParallelCausalLM {
 public:
  PipelineParallelGPT(const nn::GPT& full, GroupPtr group)
      : PipelineParallelCausalLM(std::move(group), full, full.config().tie_word_embeddings),
        cfg_(full.config()) {
    const nn::GPTTransformer& t = full.transformer;
    const TensorOptions opts = options_of(t.wpe.weight);
    Generator scratch(0);  // every value is overwritten by the full model's
    register_module("transformer", transformer_);
    const bool tied = cfg_.tie_word_embeddings;
    if (holds_token_embedding()) transformer_.register_module("wte", copied_embedding(wte_, t.wte));
    if (first_stage()) transformer_.register_module("wpe", copied_embedding(wpe_, t.wpe));
    transformer_.register_module("h", h_);
    blocks_.resize(cfg_.n_layer);
    for (int64_t i = blocks().begin; i < blocks().end; ++i) {
      nn::Block& block =
          copied(blocks_[i], std::make_unique<nn::Block>(cfg_, &scratch, opts), *t.blocks[i]);
      h_.register_module(std::to_string(i), block);
      fast_.emplace_back(block);
    }
    if (last_stage()) {
      auto& ln_f = copied(
          ln_f_,
          std::make_unique<nn::LayerNorm>(cfg_.n_embd, cfg_.layer_norm_epsilon, cfg_.bias, opts),
          t.ln_f);
      transformer_.register_module("ln_f", ln_f);
      if (!tied) {
        lm_head_ = std::make_unique<nn::LMHead>(cfg_.vocab_size, cfg_.n_embd, &scratch, opts);
        copy_head(lm_head_->weight, full.output_weight());
        register_module("lm_head", *lm_head_);
      }
    }
    finish_construction(full, cfg_.n_embd);
  }
  std::string type_name() const override { return "PipelineParallelGPT"; }

 private:
  Tensor embed(const Tensor& idx) override {
    const Tensor pos = arange(0, static_cast<double>(idx.size(1)), 1.0,
                              {.dtype = DType::i64, .device = idx.device()});
    return (*wte_)(idx) + (*wpe_)(pos);
  }
  Tensor run_blocks(const Tensor& x) override {
    Tensor out = x;
    for (size_t i = 0; i < fast_.size(); ++i)
      out = fast_blocks() ? fast_[i].call(out) : fast_[i].block()(out);
    return out;
  }
  Tensor head_logits(const Tensor& h) override {
    const Tensor x = (*ln_f_)(h);
    return lm_head_ ? (*lm_head_)(x) : logits_of(x, wte_->weight);
  }
  Tensor tied_weight() const override { return wte_->weight; }
  std::unique_ptr<nn::CausalLM> new_full_model() const override {
    Generator scratch(0);
    return std::make_unique<nn::GPT>(cfg_, &scratch, options_of(parameters().front()));
  }

  nn::GPTConfig cfg_;
  nn::Module transformer_;
  StageModuleList h_;
  std::unique_ptr<nn::Embedding> wte_, wpe_;
  std::vector<std::unique_ptr<nn::Block>> blocks_;  // indexed by block; this stage's only
  std::vector<nn::GPTFastBlock> fast_;              // this stage's, in order
  std::unique_ptr<nn::LayerNorm> ln_f_;
  std::unique_ptr<nn::LMHead> lm_head_;
};

class PipelineParallelLlama : public PipelineParallelCausalLM {
 public:
  PipelineParallelLlama(const nn::Llama& full, GroupPtr group)
      : PipelineParallelCausalLM(std::move(group), full, full.config().tie_word_embeddings),
        cfg_(full.config()) {
    const nn::LlamaModel& m = full.model;
    const TensorOptions opts = options_of(m.embed_tokens.weight);
    Generator scratch(0);  // every value is overwritten by the full model's
    register_module("model", model_);
    const bool tied = cfg_.tie_word_embeddings;
    if (holds_token_embedding())
      model_.register_module("embed_tokens", copied_embedding(embed_tokens_, m.embed_tokens));
    model_.register_module("layers", layers_);
    for (int64_t i = blocks().begin; i < blocks().end; ++i) {
      std::unique_ptr<nn::LlamaDecoderLayer> layer;
      layers_.register_module(
          std::to_string(i),
          copied(layer, std::make_unique<nn::LlamaDecoderLayer>(cfg_, &scratch, opts),
                 *m.decoder_layers[i]));
      stage_layers_.push_back(std::move(layer));
    }
    if (last_stage()) {
      auto& norm = copied(
          norm_, std::make_unique<nn::RMSNorm>(cfg_.hidden_size, cfg_.rms_norm_eps, opts), m.norm);
      model_.register_module("norm", norm);
      if (!tied) {
        lm_head_ = std::make_unique<nn::TorchLinear>(cfg_.hidden_size, cfg_.vocab_size,
                                                     cfg_.initializer_range, &scratch, opts);
        copy_head(lm_head_->weight, full.output_weight());
        register_module("lm_head", *lm_head_);
      }
    }
    finish_construction(full, cfg_.hidden_size);
  }
  std::string type_name() const override { return "PipelineParallelLlama"; }

 private:
  Tensor embed(const Tensor& idx) override { return (*embed_tokens_)(idx); }
  Tensor run_blocks(const Tensor& x) override {
    const ops::RopeTables rope = ops::rope_tables(0, x.size(1), cfg_.attention_head_dim(),
                                                  cfg_.rope_theta, x.dtype(), x.device());
    Tensor out = x;
    for (const auto& layer : stage_layers_) {
      out = layer->call_with_hooks(out, [&, in = out] {
        if (!fast_blocks()) return layer->forward(in, rope, 0, nullptr);
        auto [h, mlp_out] = nn::llama_fast_layer(*layer, in, Tensor(), rope, 0, nullptr);
        return h + mlp_out;
      });
    }
    return out;
  }
  Tensor head_logits(const Tensor& h) override {
    return logits_of((*norm_)(h), lm_head_ ? lm_head_->weight : embed_tokens_->weight);
  }
  Tensor tied_weight() const override { return embed_tokens_->weight; }
  std::unique_ptr<nn::CausalLM> new_full_model() const override {
    Generator scratch(0);
    return std::make_unique<nn::Llama>(cfg_, &scratch, options_of(parameters().front()));
  }

  nn::LlamaConfig cfg_;
  nn::Module model_;
  StageModuleList layers_;
  std::unique_ptr<nn::Embedding> embed_tokens_;
  std::vector<std::unique_ptr<nn::LlamaDecoderLayer>> stage_layers_;
  std::unique_ptr<nn::RMSNorm> norm_;
  std::unique_ptr<nn::TorchLinear> lm_head_;
};

}  // namespace

std::unique_ptr<PipelineParallelCausalLM> pipeline_parallel(const nn::CausalLM& model,
                                                            GroupPtr group,
                                                            const PipelineOptions& options) {
  TESSERA_CHECK(group != nullptr, "pipeline parallelism: this rank is in no pipeline group");
  check_pipeline_options(options);
  const int pp_size = group->size();
  std::unique_ptr<PipelineParallelCausalLM> pipeline;
  if (auto* gpt = dynamic_cast<const nn::GPT*>(&model)) {
    check_pipeline_parallel(gpt->num_blocks(), pp_size, "GPT-2");
    TESSERA_CHECK(gpt->config().dropout == 0, "pipeline parallelism: GPT-2's dropout is ",
                  gpt->config().dropout,
                  "; it runs without dropout (GPT::set_dropout(0)): the stages' draws could not "
                  "be one process's");
    pipeline = std::make_unique<PipelineParallelGPT>(*gpt, std::move(group));
  } else if (auto* llama = dynamic_cast<const nn::Llama*>(&model)) {
    check_pipeline_parallel(llama->num_blocks(), pp_size, "Llama");
    pipeline = std::make_unique<PipelineParallelLlama>(*llama, std::move(group));
  } else {
    TESSERA_CHECK(false, "pipeline parallelism: only GPT-2 and Llama can be cut into stages, not ",
                  model.describe());
  }
  pipeline->set_options(options);
  return pipeline;
}

}  // namespace tessera::dist
