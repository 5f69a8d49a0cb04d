#include "tessera/dist/strategy.h"

#include <map>

namespace tessera::dist {

MixedPrecisionPolicy MixedPrecisionPolicy::from_name(const std::string& name,
                                                     const std::string& reduce) {
  // Masters are kept in f32 whatever the parameters' dtype. bf16 gradients are averaged in
  // bf16 by default, as FSDP's and Accelerate's bf16 policies do (bf16 has f32's range; the
  // sums round at each step of the ring, but no cast passes run and half the bytes travel);
  // f16 gradients, whose range is narrow, in f32.
  MixedPrecisionPolicy policy;
  if (name == "bf16") policy = {DType::bf16, DType::bf16, DType::bf16, DType::f32};
  else if (name == "fp16") policy = {DType::f16, DType::f16, DType::f32, DType::f32};
  else TESSERA_CHECK(name == "no", "mixed_precision must be no, fp16 or bf16; got '", name, "'");
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

std::vector<DataParallelStrategy::ParameterShard> DataParallelStrategy::parameter_shards() {
  std::vector<ParameterShard> shards;
  for (auto& [param_name, p] : module().named_parameters()) {
    if (!p.requires_grad()) continue;
    TESSERA_CHECK(p.is_contiguous(), name(), ": parameter '", param_name,
                  "' is not contiguous; a checkpoint cannot view it as one range");
    shards.push_back({param_name, 0, p.numel(), raw::view(p.detach(), {p.numel()})});
  }
  return shards;
}

int64_t optimizer_state_bytes(const optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, t] : optimizer.state_dict().tensors)
    bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

void broadcast_module_from_rank0(nn::Module& module, ProcessGroup& group) {
  if (group.size() == 1) return;
  std::vector<WorkPtr> works;
  for (const Tensor& p : module.parameters()) works.push_back(group.broadcast(p.detach(), 0));
  for (auto& [name, b] : module.named_buffers()) works.push_back(group.broadcast(b.detach(), 0));
  for (auto& w : works) w->wait();
}

}  // namespace tessera::dist
