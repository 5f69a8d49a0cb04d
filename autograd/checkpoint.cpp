// Activation checkpointing: forward without saving activations, recompute in backward.
//
// The backward node's edges cover only the explicit inputs; parameters that fn
// captures receive their gradients from a nested backward through the recomputed
// graph (their AccumulateGrad nodes and grad-ready hooks run there).
//
// The recompute sees the conditions of the first run: the default generator's state (so
// dropout draws the same masks) and the autocast policy (backward usually runs outside
// the forward's AutocastGuard, and a recompute in another dtype would not be the same graph).
#include "tessera/autograd/autocast.h"
#include "tessera/autograd/autograd.h"
#include "tessera/core/random.h"
#include "tessera/kernels/ops.h"

namespace tessera::autograd {

namespace {

// Puts the default generator at a saved state for a scope and restores the current
// one after, also when the recompute throws.
class GeneratorStateGuard {
 public:
  GeneratorStateGuard(uint64_t seed, uint64_t offset)
      : saved_seed_(default_generator().seed()), saved_offset_(default_generator().offset()) {
    default_generator().set_state(seed, offset);
  }
  ~GeneratorStateGuard() { default_generator().set_state(saved_seed_, saved_offset_); }
  GeneratorStateGuard(const GeneratorStateGuard&) = delete;
  GeneratorStateGuard& operator=(const GeneratorStateGuard&) = delete;

 private:
  uint64_t saved_seed_, saved_offset_;
};

}  // namespace

std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs) {
  if (!is_grad_enabled()) return fn(inputs);
  const uint64_t seed = default_generator().seed();
  const uint64_t offset = default_generator().offset();
  const DType compute_dtype = autocast_dtype().value_or(DType::f32);  // f32: autocast off
  std::vector<Tensor> outputs;
  {
    NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  // Fresh TensorImpls: an output may be one of the inputs, whose history must stay as is.
  for (Tensor& out : outputs) out = ops::alias(out);

  std::vector<SavedTensor> saved_inputs;
  for (const Tensor& in : inputs) saved_inputs.push_back(SavedTensor::input(in));
  record(
      "CheckpointBackward", inputs, outputs,
      [fn = std::move(fn), saved_inputs, seed, offset, compute_dtype](const BackwardArgs& args) {
        // Detached copies of the inputs as leaves, so the nested backward stops at them.
        std::vector<Tensor> leaves;
        for (size_t i = 0; i < saved_inputs.size(); ++i) {
          Tensor in = saved_inputs[i].unpack("CheckpointBackward");
          Tensor leaf = in.defined() ? in.detach() : in;
          if (args.needs(i)) leaf.requires_grad_(true);
          leaves.push_back(leaf);
        }
        std::vector<Tensor> recomputed;
        {
          GeneratorStateGuard same_random_draws(seed, offset);
          AutocastGuard same_compute_dtype(compute_dtype);
          GradModeGuard grad_on(true);
          recomputed = fn(leaves);
        }
        TESSERA_CHECK(recomputed.size() == args.grad_outputs.size(),
                      "CheckpointBackward: the "
                      "recompute returned ",
                      recomputed.size(), " outputs, the first run ", args.grad_outputs.size());
        std::vector<Tensor> roots, root_grads;
        for (size_t i = 0; i < recomputed.size(); ++i) {
          if (!recomputed[i].requires_grad()) continue;
          roots.push_back(recomputed[i]);
          root_grads.push_back(args.grad_outputs[i]);
        }
        if (!roots.empty()) backward(roots, root_grads);
        std::vector<Tensor> grads;
        for (const Tensor& leaf : leaves) grads.push_back(leaf.defined() ? leaf.grad() : Tensor());
        return grads;
      },
      /*force=*/true);
  return outputs;
}

}  // namespace tessera::autograd
