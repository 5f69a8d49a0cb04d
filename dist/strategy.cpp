#include "tessera/dist/strategy.h"

#include <cstring>
#include <map>

#include "tessera/core/deferred_init.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

MixedPrecisionPolicy MixedPrecisionPolicy::from_name(const std::string& name,
                                                     const std::string& reduce) {
  // Masters are kept in f32 whatever the parameters' dtype. bf16 gradients are averaged in
  // bf16 by default, as FSDP's and Accelerate's bf16 policies do (bf16 has f32's range; the
  // sums round at each step of the ring, but no cast passes run and half the bytes travel);
  // f16 gradients, whose range is narrow, in f32.
  MixedPrecisionPolicy policy;
  if (name == "bf16")
    policy = {DType::bf16, DType::bf16, DType::bf16, DType::f32};
  else if (name == "fp16")
    policy = {DType::f16, DType::f16, DType::f32, DType::f32};
  else
    TESSERA_CHECK(name == "no", "mixed_precision must be no, fp16 or bf16; got '", name, "'");
  if (reduce == "fp32") policy.reduce_dtype = DType::f32;
  if (reduce.empty() || reduce == "fp32") return policy;
  const std::string own = name == "no" ? "fp32" : name;
  TESSERA_CHECK(reduce == own, "reduce_dtype must be fp32 or the parameters' dtype (", own,
                " with mixed_precision ", name, "); got '", reduce, "'");
  policy.reduce_dtype = policy.param_dtype;
  return policy;
}

std::vector<DataParallelStrategy::OptimizerSlice> DataParallelStrategy::optimizer_slices(
    const optim::Optimizer& optimizer) const {
  std::map<const TensorImpl*, std::string> names;
  for (auto& [name, p] : module().named_parameters()) names[p.impl_ptr().get()] = name;
  std::vector<OptimizerSlice> slices;
  for (const Tensor& p : optimizer.parameters()) {
    auto it = names.find(p.impl_ptr().get());
    TESSERA_CHECK(it != names.end(), name(), ": the optimizer trains a tensor of shape ",
                  shape_str(p.shape()), " that is not a parameter of the prepared model");
    slices.push_back({it->second, 0, p.numel()});
  }
  return slices;
}

void DataParallelStrategy::sync_accumulated_gradients() {
  TESSERA_FAIL(name(),
               " cannot average the gradients of a model that runs its own backwards "
               "(a pipeline stage's train_step); use DDP or ZeRO stage 1 or 2 on the data axis");
}

std::vector<DataParallelStrategy::ParameterShard> DataParallelStrategy::parameter_shards() {
  std::vector<ParameterShard> shards;
  for (auto& [param_name, p] : module().named_parameters()) {
    if (!p.requires_grad()) continue;
    TESSERA_CHECK(p.is_contiguous(), name(), ": parameter '", param_name,
                  "' is not contiguous; a checkpoint cannot view it as one range");
    shards.push_back({param_name, 0, p.numel(), ops::view(p.detach(), {p.numel()})});
  }
  return shards;
}

int64_t optimizer_state_bytes(const optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, t] : optimizer.state_dict().tensors)
    bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

namespace {

// Rank 0's recipes for the placeholders of sharded construction: what broadcasting their
// values would have given every rank (rank 0's generator), without any values. Five words a
// placeholder: kind, seed, first block, and the two parameters' bits. A copy recipe's source
// is each rank's own (every rank reads the same files): only its kind is compared.
void broadcast_recipes_from_rank0(const nn::NamedTensors& deferred, ProcessGroup& group,
                                  Device device) {
  constexpr int64_t kWords = 5;
  Tensor words = empty({static_cast<int64_t>(deferred.size()) * kWords}, {.dtype = DType::i64});
  int64_t* w = words.data<int64_t>();
  std::vector<InitRecipe> recipes;
  for (size_t i = 0; i < deferred.size(); ++i) {
    recipes.push_back(deferred_recipe(deferred[i].second, deferred[i].first));
    const InitRecipe& r = recipes.back();
    w[i * kWords] = static_cast<int64_t>(r.kind);
    w[i * kWords + 1] = static_cast<int64_t>(r.seed);
    w[i * kWords + 2] = static_cast<int64_t>(r.offset);
    std::memcpy(&w[i * kWords + 3], &r.a, sizeof(double));
    std::memcpy(&w[i * kWords + 4], &r.b, sizeof(double));
  }
  const Tensor on_device = device == Device::cpu() ? words : ops::to(words, device, DType::i64);
  group.broadcast(on_device, 0)->wait();
  if (!on_device.is_same(words)) ops::copy_(words, ops::to(on_device, Device::cpu(), DType::i64));
  for (size_t i = 0; i < deferred.size(); ++i) {
    InitRecipe r = recipes[i];
    const auto kind = static_cast<InitRecipe::Kind>(w[i * kWords]);
    TESSERA_CHECK(kind == r.kind, "sharded construction: parameter '", deferred[i].first, "' is ",
                  r.kind == InitRecipe::Kind::Copy ? "loaded from a file" : "initialised",
                  " on rank ", group.rank(), " but ",
                  kind == InitRecipe::Kind::Copy ? "loaded" : "initialised",
                  " on rank 0: every rank must build the same model the same way");
    if (kind == InitRecipe::Kind::Copy) continue;
    r.seed = static_cast<uint64_t>(w[i * kWords + 1]);
    r.offset = static_cast<uint64_t>(w[i * kWords + 2]);
    std::memcpy(&r.a, &w[i * kWords + 3], sizeof(double));
    std::memcpy(&r.b, &w[i * kWords + 4], sizeof(double));
    set_deferred_recipe(deferred[i].second, std::move(r));
  }
}

}  // namespace

void broadcast_module_from_rank0(nn::Module& module, ProcessGroup& group) {
  if (group.size() == 1) return;
  std::vector<WorkPtr> works;
  nn::NamedTensors deferred;
  for (auto& [name, p] : module.named_parameters()) {
    if (is_deferred(p))
      deferred.emplace_back(name, p);
    else
      works.push_back(group.broadcast(p.detach(), 0));
  }
  for (auto& [name, b] : module.named_buffers()) works.push_back(group.broadcast(b.detach(), 0));
  for (auto& w : works) w->wait();
  if (!deferred.empty())
    broadcast_recipes_from_rank0(deferred, group, deferred.front().second.device());
}

void refuse_deferred_parameters(const nn::Module& module, const std::string& strategy) {
  if (!any_deferred()) return;
  for (auto& [name, p] : module.named_parameters())
    TESSERA_CHECK(
        !is_deferred(p), strategy, ": parameter '", name,
        "' was built under sharded initialisation (Accelerator::sharded_init) and holds no "
        "values; only ZeRO stage 3 shards parameters, so only it can prepare such a model "
        "(build it without sharded_init for this strategy)");
}

}  // namespace tessera::dist
