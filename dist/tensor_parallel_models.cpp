// What the tensor-parallel GPT-2 and Llama share: each parameter's cut, the gathering of the
// full model, its checkpoint files, and the choice between the two.
#include "tessera/dist/tensor_parallel_models.h"

#include "tessera/autograd/autograd.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

TensorParallelCausalLM::TensorParallelCausalLM(GroupPtr group, const nn::CausalLM& full)
    : group_(std::move(group)), full_description_(full.describe()) {
  TESSERA_CHECK(group_ != nullptr,
                "tensor parallelism: no group (this rank is not a member of the one given)");
}

std::string TensorParallelCausalLM::describe() const {
  return full_description_ + "; tensor-parallel rank " + std::to_string(tp_rank()) + " of " +
         std::to_string(tp_size());
}

void TensorParallelCausalLM::finish_construction(const nn::CausalLM& full, bool tied,
                                                 const Tensor& output_weight) {
  if (!tied)
    lm_head_ = &register_module("lm_head",
                                std::make_unique<VocabParallelEmbedding>(output_weight, group_));
  record_shards(full);
  set_block_implementation(nn::BlockImplementation::reference);
  train(full.is_training());
}

Tensor TensorParallelCausalLM::run_block(
    int64_t i, const nn::Module& blocks, const Tensor& x,
    const std::function<Tensor(const Tensor&, nn::CheckpointRegion)>& forward) {
  const nn::CheckpointRegion region = checkpoint_region(i, blocks);
  if (region != nn::CheckpointRegion::block) return forward(x, region);
  // By value: backward's recompute calls it after this returns.
  return nn::checkpointed(
      true, [forward](const Tensor& in) { return forward(in, nn::CheckpointRegion::none); }, x);
}

TensorShards tensor_parallel_shards(const nn::Module& split, const nn::Module& full, int tp_rank,
                                    bool every_parameter) {
  TensorShards shards;
  for (const auto& [prefix, module] : split.named_modules()) {
    // named_modules names a module "a.b." (or "" for the root): its parameters are "a.b.weight".
    auto name = [&prefix](const char* leaf) {
      return prefix.empty() || prefix.back() == '.' ? prefix + leaf : prefix + "." + leaf;
    };
    if (auto* column = dynamic_cast<const ColumnParallelLinear*>(module)) {
      shards[name("weight")].first = column->weight_spec;
      if (column->bias.defined()) shards[name("bias")].first = column->bias_spec;
    } else if (auto* row = dynamic_cast<const RowParallelLinear*>(module)) {
      shards[name("weight")].first = row->weight_spec;
    } else if (auto* vocab = dynamic_cast<const VocabParallelEmbedding*>(module)) {
      shards[name("weight")].first = vocab->spec;
    }
  }
  std::map<std::string, Tensor> full_params;
  for (const auto& [name, p] : full.named_parameters()) full_params[name] = p;
  for (const auto& [name, p] : split.named_parameters()) {
    auto it = full_params.find(name);
    TESSERA_CHECK(it != full_params.end(), "tensor parallelism: ", name,
                  " is not a parameter of the full model");
    auto& [spec, shape] = shards[name];  // a parameter no layer cut is whole
    shape = it->second.shape();
    Shape local = shape;
    if (!spec.replicated()) local[spec.dim] = spec.local_size(tp_rank);
    TESSERA_CHECK(p.shape() == local, "tensor parallelism: ", name, " is ", shape_str(p.shape()),
                  " on rank ", tp_rank, ", its slice of ", shape_str(shape), " is ",
                  shape_str(local));
    full_params.erase(it);
  }
  TESSERA_CHECK(!every_parameter || full_params.empty(), "tensor parallelism: the full model's ",
                full_params.empty() ? "" : full_params.begin()->first, " has no counterpart");
  return shards;
}

void TensorParallelCausalLM::record_shards(const nn::Module& full) {
  shards_ = tensor_parallel_shards(*this, full, tp_rank(), true);
}

Tensor TensorParallelCausalLM::forward(const Tensor& idx) {
  return gather_from_tensor_parallel_region(head().logits_in_region(head_input(idx, 0, nullptr)),
                                            head().vocab_widths(), group_);
}

Tensor TensorParallelCausalLM::loss(const Tensor& idx, const Tensor& targets) {
  TESSERA_CHECK(targets.shape() == idx.shape(), type_name(), "::loss: targets ",
                shape_str(targets.shape()), " must have idx's shape ", shape_str(idx.shape()));
  return call_with_hooks(idx, [&] {
    return vocab_parallel_cross_entropy(head().logits_in_region(head_input(idx, 0, nullptr)),
                                        targets, head().vocab_begin(), group_);
  });
}

Tensor TensorParallelCausalLM::forward_incremental(const Tensor& idx, KVCache& cache) {
  autograd::NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(0) == cache.batch, type_name(),
                "::forward_incremental: idx ", shape_str(idx.shape()),
                " does not match the cache's batch of ", cache.batch);
  const Tensor h = head_input(idx, cache.length, &cache);
  cache.length += idx.size(1);
  return gather_from_tensor_parallel_region(head().logits_in_region(h), head().vocab_widths(),
                                            group_);
}

Regions TensorParallelCausalLM::regions_of_this_forward(const Tensor& idx, int64_t past,
                                                        bool decoding) const {
  TESSERA_CHECK(idx.dim() == 2 && is_integral(idx.dtype()) && idx.dtype() != DType::boolean,
                type_name(), ": idx must be integer [B, T], got ", dtype_name(idx.dtype()), " ",
                shape_str(idx.shape()));
  TESSERA_CHECK(past + idx.size(1) <= context_length(), type_name(), ": sequence of ",
                past + idx.size(1), " tokens exceeds the context of ", context_length());
  const bool split = sequence_parallel_ && !decoding;
  if (split) check_sequence_split(idx.size(1), tp_size());
  return {group_, split};
}

const ShardSpec& TensorParallelCausalLM::spec_of(const std::string& name) const {
  auto it = shards_.find(name);
  TESSERA_CHECK(it != shards_.end(), "tensor parallelism: no parameter ", name);
  return it->second.first;
}

const Shape& TensorParallelCausalLM::full_shape_of(const std::string& name) const {
  auto it = shards_.find(name);
  TESSERA_CHECK(it != shards_.end(), "tensor parallelism: no parameter ", name);
  return it->second.second;
}

std::map<std::string, Tensor> TensorParallelCausalLM::full_state_dict() const {
  std::map<std::string, Tensor> mine;
  for (const auto& [name, p] : named_parameters()) mine[name] = p;
  return gather_full(mine);
}

std::map<std::string, Tensor> TensorParallelCausalLM::gather_full(
    const std::map<std::string, Tensor>& pieces) const {
  std::map<std::string, Tensor> full;
  // shards_ is ordered by name, the same on every rank: the gathers pair up.
  for (const auto& [name, cut] : shards_) {
    auto it = pieces.find(name);
    TESSERA_CHECK(it != pieces.end(), type_name(), "::gather_full: no piece of ", name);
    TESSERA_CHECK(it->second.shape() == parameter(name).shape(), type_name(),
                  "::gather_full: ", name, "'s piece is ", shape_str(it->second.shape()),
                  ", its parameter's ", shape_str(parameter(name).shape()));
    full[name] = gather_shard(it->second.detach(), cut.first, cut.second, *group_);
  }
  return full;
}

Tensor TensorParallelCausalLM::piece_of(const std::string& name, const Tensor& full) const {
  TESSERA_CHECK(full.shape() == full_shape_of(name), type_name(), ": ", name, " is ",
                shape_str(full_shape_of(name)), " in the full model, got ",
                shape_str(full.shape()));
  return take_shard(full, spec_of(name), tp_rank());
}

void TensorParallelCausalLM::load_full_state_dict(const nn::Module& full) {
  autograd::NoGradGuard no_grad;
  for (const auto& [name, p] : named_parameters())
    ops::copy_(p, take_shard(full.parameter(name), spec_of(name), tp_rank()));
}

std::unique_ptr<nn::CausalLM> TensorParallelCausalLM::gather_full_model() const {
  std::unique_ptr<nn::CausalLM> full = new_full_model();
  const std::map<std::string, Tensor> state = full_state_dict();
  full->load_state_dict(state);
  return full;
}

void TensorParallelCausalLM::save_pretrained(const std::string& dir) const {
  const std::unique_ptr<nn::CausalLM> full = gather_full_model();
  if (tp_rank() == 0) full->save_pretrained(dir);
  group_->barrier()->wait();
}

void TensorParallelCausalLM::load_safetensors_weights(const std::string& path) {
  const std::unique_ptr<nn::CausalLM> full = new_full_model();
  full->load_safetensors_weights(path);
  load_full_state_dict(*full);
}

TensorParallelStage::TensorParallelStage(GroupPtr pipeline, const nn::CausalLM& full, bool tied,
                                         GroupPtr tensor, GroupPtr model_group)
    : PipelineParallelCausalLM(std::move(pipeline), full, tied, std::move(tensor),
                               std::move(model_group)) {
  TESSERA_CHECK(tensor_group() != nullptr,
                "tensor parallelism: no group (this rank is not a member of the one given)");
}

Tensor TensorParallelStage::head_logits(const Tensor& h) {
  return gather_from_tensor_parallel_region(head().logits_in_region(regions().enter(final_norm(h))),
                                            head().vocab_widths(), tensor_group());
}

Tensor TensorParallelStage::summed_loss(const Tensor& h, const Tensor& targets) {
  return vocab_parallel_cross_entropy(head().logits_in_region(regions().enter(final_norm(h))),
                                      targets, head().vocab_begin(), tensor_group(), -100,
                                      Reduction::Sum);
}

void TensorParallelStage::finish_stage(const nn::CausalLM& full, int64_t hidden,
                                       const Tensor& output_weight) {
  if (last_stage() && output_weight.defined())
    lm_head_ = &register_module(
        "lm_head", std::make_unique<VocabParallelEmbedding>(output_weight, tensor_group()));
  finish_construction(full, hidden,
                      tensor_parallel_shards(*this, full, tensor_group()->rank(), false));
}

std::unique_ptr<TensorParallelCausalLM> tensor_parallel(const nn::CausalLM& model, GroupPtr group) {
  if (auto* gpt = dynamic_cast<const nn::GPT*>(&model))
    return std::make_unique<TensorParallelGPT>(*gpt, std::move(group));
  if (auto* llama = dynamic_cast<const nn::Llama*>(&model))
    return std::make_unique<TensorParallelLlama>(*llama, std::move(group));
  TESSERA_CHECK(false, "tensor parallelism: only GPT-2 and Llama can be split, not ",
                model.describe());
}

}  // namespace tessera::dist
