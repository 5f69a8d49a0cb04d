// GPT-2 and Llama split over the ranks of a tensor-parallel group (dist/tensor_parallel.h has
// the layers; docs/parallelism.md the collectives of each block and their bytes).
//
// tensor_parallel(model, group) turns a constructed nn::GPT or nn::Llama (the same weights
// on every rank, as one process would hold them) into its tensor-parallel form: each rank keeps
// its slices of every weight, copied from the full model:
//   - attention split by heads: rank r of W owns query heads [r·H/W, (r+1)·H/W) and, for
//     Llama's grouped-query attention, the kv heads [r·H_kv/W, (r+1)·H_kv/W) those query heads
//     read, so no head needs another rank; q/k/v (GPT-2's c_attn: its q, k and v blocks) are
//     column-parallel, the output projection row-parallel;
//   - the MLP column-parallel (c_fc; gate_proj and up_proj) then row-parallel (c_proj;
//     down_proj);
//   - the token embedding vocabulary-parallel (contiguous ranges of rows, uneven when W does
//     not divide the vocabulary), the head on the same rows (tied) or on lm_head's (untied),
//     and the loss the vocabulary-parallel cross-entropy: the logits are never gathered;
//   - norms, GPT-2's position embedding and the row-parallel biases whole on every rank.
// The result is a CausalLM with the model's interface (forward gives the full logits, loss
// the mean cross-entropy, the same on every rank; generate, save_pretrained): parameters() are
// this rank's slices under the full model's names, so optim::AdamW steps them as they are.
// full_state_dict() gathers the full parameters back (collective), for a comparison or a
// checkpoint; save_pretrained writes the full model directory from rank 0.
//
// Refused before anything is built, naming the numbers: a tp_size that does not divide the
// heads (Llama: the query heads or the kv heads), the MLP's width, or that exceeds the
// vocabulary; dropout (the ranks' draws could not be those of one process); a rank outside
// the group.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "tessera/dist/device_mesh.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/dist/tensor_parallel.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

namespace tessera::dist {

using nn::KVCache;

// The checks tensor_parallel makes before building anything (no group needed).
void check_tensor_parallel(const nn::GPTConfig& cfg, int tp_size);
void check_tensor_parallel(const nn::LlamaConfig& cfg, int tp_size);

// What the two models share: the group, each parameter's full shape and how it is cut, and
// the gathering of the full model.
class TensorParallelCausalLM : public nn::CausalLM, public MeshParallelModel {
 public:
  const GroupPtr& group() const { return group_; }
  int tp_rank() const { return group_->rank(); }
  int tp_size() const { return group_->size(); }
  // The full model's description, and this rank's place in the group.
  std::string describe() const override;
  // The full logits [B, T, V] on every rank (one all-gather over the vocabulary).
  Tensor forward(const Tensor& idx) override;
  // The mean cross-entropy, vocabulary-parallel: the logits are never gathered.
  Tensor loss(const Tensor& idx, const Tensor& targets) override;
  // Decoding on a KV cache of this rank's heads; the full logits of the new tokens.
  Tensor forward_incremental(const Tensor& idx, KVCache& cache) override;
  // How the full parameter `name` is cut, and its full shape.
  const ShardSpec& spec_of(const std::string& name) const;
  const Shape& full_shape_of(const std::string& name) const;
  // Collective over the group: every parameter whole, under its full name, on every rank.
  std::map<std::string, Tensor> full_state_dict() const;
  // Copies this rank's slices out of a full model's parameters (same names and shapes as
  // the model this was built from).
  void load_full_state_dict(const nn::Module& full);
  // A full model of the same configuration holding full_state_dict() (collective).
  std::unique_ptr<nn::CausalLM> gather_full_model() const override;
  // MeshParallelModel: gather_shard / take_shard of each parameter's spec.
  std::map<std::string, Tensor> gather_full(
      const std::map<std::string, Tensor>& pieces) const override;
  Tensor piece_of(const std::string& name, const Tensor& full) const override;
  ProcessGroup& model_group() const override { return *group_; }
  bool counts_in_model_sums(const std::string& name) const override {
    return !spec_of(name).replicated() || tp_rank() == 0;
  }

  // Sequence parallelism (off by default): loss() and forward() keep the activations outside
  // the tensor-parallel regions in slices of the sequence ([B, T/W, C]; T must divide by W),
  // the all-reduces becoming all-gathers and reduce-scatters (docs/parallelism.md). The same
  // parameters, losses and gradients; decoding from a KV cache runs without it.
  void set_sequence_parallel(bool on) { sequence_parallel_ = on; }
  bool sequence_parallel() const { return sequence_parallel_; }

  // Collective: rank 0 writes the full model directory; every rank waits for it.
  void save_pretrained(const std::string& dir) const override;
  // Every rank reads the full file and keeps its slices.
  void load_safetensors_weights(const std::string& path) override;

 protected:
  TensorParallelCausalLM(GroupPtr group, const nn::CausalLM& full);
  // After the modules are registered: each parameter's spec (from the parallel layers) and
  // full shape (from `full`, whose names they share).
  void record_shards(const nn::Module& full);
  // The end of both constructors, after the body's modules: the untied head's rows (from
  // the full model's output weight), each parameter's spec, the reference blocks, and the
  // full model's train/eval mode.
  void finish_construction(const nn::CausalLM& full, bool tied, const Tensor& output_weight);
  // Block i of `blocks` (the module a checkpointing policy numbers) under that policy: the
  // whole block recomputed in backward, or `forward` told which of its parts to recompute.
  // Recomputation runs the block's collectives again, in the same order on every rank.
  Tensor run_block(int64_t i, const nn::Module& blocks, const Tensor& x,
                   const std::function<Tensor(const Tensor&, nn::CheckpointRegion)>& forward);
  VocabParallelEmbedding* lm_head_ = nullptr;  // untied only
  // How this forward of idx [B, T] at positions [past, past + T) enters and leaves the
  // regions; refuses, before any communication, idx that is not integer [B, T], positions past
  // the context, and T that sequence parallelism cannot split.
  Regions regions_of_this_forward(const Tensor& idx, int64_t past, bool decoding) const;
  // The final norm's output as the head reads it: [B, T, C] after f, or gathered from the
  // sequence slices (with a cache: positions [past, past + T), appended to it).
  virtual Tensor head_input(const Tensor& idx, int64_t past, KVCache* cache) = 0;
  // The vocabulary-parallel rows the logits are computed with (tied: the token embedding).
  virtual VocabParallelEmbedding& head() const = 0;
  // A fresh full model of this configuration (its values overwritten by the caller).
  virtual std::unique_ptr<nn::CausalLM> new_full_model() const = 0;

 private:
  GroupPtr group_;
  std::map<std::string, std::pair<ShardSpec, Shape>> shards_;
  std::string full_description_;
  bool sequence_parallel_ = false;
};

namespace tp_detail {
struct GPTTransformer;
struct LlamaBody;
}  // namespace tp_detail

class TensorParallelGPT : public TensorParallelCausalLM {
 public:
  TensorParallelGPT(const nn::GPT& full, GroupPtr group);
  ~TensorParallelGPT() override;
  std::string type_name() const override { return "TensorParallelGPT"; }
  KVCache make_kv_cache(int64_t batch) const override;  // this rank's heads
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t context_length() const override { return cfg_.block_size; }
  int64_t num_blocks() const override { return cfg_.n_layer; }
  void save_config(const std::string& path) const override { nn::save_gpt_config(cfg_, path); }
  const nn::GPTConfig& config() const { return cfg_; }

 private:
  std::unique_ptr<nn::CausalLM> new_full_model() const override;
  Tensor head_input(const Tensor& idx, int64_t past, KVCache* cache) override;
  VocabParallelEmbedding& head() const override;  // wte (tied) or lm_head
  nn::GPTConfig cfg_;
  tp_detail::GPTTransformer* transformer_ = nullptr;
};

class TensorParallelLlama : public TensorParallelCausalLM {
 public:
  TensorParallelLlama(const nn::Llama& full, GroupPtr group);
  ~TensorParallelLlama() override;
  std::string type_name() const override { return "TensorParallelLlama"; }
  KVCache make_kv_cache(int64_t batch) const override;
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t context_length() const override { return cfg_.max_position_embeddings; }
  int64_t num_blocks() const override { return cfg_.num_hidden_layers; }
  void save_config(const std::string& path) const override { nn::save_llama_config(cfg_, path); }
  const nn::LlamaConfig& config() const { return cfg_; }

 private:
  std::unique_ptr<nn::CausalLM> new_full_model() const override;
  Tensor head_input(const Tensor& idx, int64_t past, KVCache* cache) override;
  VocabParallelEmbedding& head() const override;  // embed_tokens (tied) or lm_head
  nn::LlamaConfig cfg_;
  tp_detail::LlamaBody* model_ = nullptr;
};

// The tensor-parallel form of `model` (an nn::GPT or nn::Llama; anything else is refused,
// naming it) over `group` (this rank's tensor-parallel group: tensor_parallel_group).
std::unique_ptr<TensorParallelCausalLM> tensor_parallel(const nn::CausalLM& model, GroupPtr group);

// ---- tensor-parallel pipeline stages (dist/parallelize.h) ----
// A pipeline stage (dist/pipeline_parallel.h) whose layers are the tensor-parallel ones above,
// split over `tensor`: the first stage's token embedding vocabulary-parallel, its blocks split
// by heads and hidden units (their f/g all-reduces inside every forward and backward of a
// micro-batch), the last stage's head on the vocabulary rows of this tp rank and the loss the
// vocabulary-parallel cross-entropy. The activations between stages are whole on every tp rank,
// so stage s's tp rank t sends them to tp rank t of stage s + 1 (the pipeline group holds the
// ranks of one tp index). A tied head's copy of the embedding is the same vocabulary rows as the
// first stage's, and their gradients are all-reduced between the first and the last stage as a
// pipeline's are.
class TensorParallelStage : public PipelineParallelCausalLM {
 protected:
  TensorParallelStage(GroupPtr pipeline, const nn::CausalLM& full, bool tied, GroupPtr tensor,
                      GroupPtr model_group);
  // The last stage's full logits (gathered over the vocabulary): forward()'s.
  Tensor head_logits(const Tensor& h) override;
  // The vocabulary-parallel cross-entropy, summed: the logits are never gathered.
  Tensor summed_loss(const Tensor& h, const Tensor& targets) override;
  Tensor tied_weight() const override { return token_embedding().weight; }
  // The last stage's final norm of h [b, T, C] (whole on every rank).
  virtual Tensor final_norm(const Tensor& h) = 0;
  // The rows the last stage's logits are computed with: lm_head, or tied the token embedding.
  VocabParallelEmbedding& head() const { return lm_head_ ? *lm_head_ : token_embedding(); }
  // The token embedding (first stage; the last too when tied).
  virtual VocabParallelEmbedding& token_embedding() const = 0;
  // Tensor parallelism alone between the blocks (no sequence parallelism).
  Regions regions() const { return {tensor_group(), false}; }
  // The end of a stage's construction: the last stage's untied head (this rank's rows of
  // `output_weight`, the full model's; undefined when tied), the cut of every parameter, then
  // the pipeline's.
  void finish_stage(const nn::CausalLM& full, int64_t hidden, const Tensor& output_weight);

 private:
  VocabParallelEmbedding* lm_head_ = nullptr;  // the last stage of an untied model
};

// `full` cut into the stages of `pipeline` with each stage split over `tensor` (checks as
// check_tensor_parallel; the pipeline's own by pipeline_parallel's rules, in
// dist::tensor_parallel_pipeline). Collective over the pipeline and the tp group.
std::unique_ptr<PipelineParallelCausalLM> tensor_parallel_stage(const nn::GPT& full,
                                                                GroupPtr pipeline, GroupPtr tensor,
                                                                GroupPtr model_group);
std::unique_ptr<PipelineParallelCausalLM> tensor_parallel_stage(const nn::Llama& full,
                                                                GroupPtr pipeline, GroupPtr tensor,
                                                                GroupPtr model_group);

}  // namespace tessera::dist
