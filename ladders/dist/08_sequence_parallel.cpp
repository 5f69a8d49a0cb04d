// Step 8: sequence parallelism (Megatron-LM's, Korthikanti et al. 2022), on top of step 7.
//
// In step 7 every rank computes the LayerNorms, the residual adds, the biases after the
// row-parallel linears and the head on the WHOLE sequence: the same work W times over, and the
// same [T, B, d] activations kept W times over. Sequence parallelism gives those parts a slice
// of the sequence each: rank r holds tokens [r·T/W, (r+1)·T/W) outside the tensor-parallel
// regions. The two all-reduces of step 7 become:
//   entering a region (before q/k/v and fc): all-gather the slices into the whole sequence
//     (backward: reduce-scatter the gradient back into the slices);
//   leaving it (after o and proj): reduce-scatter the partial sums, so that each rank gets
//     the SUM over ranks of ITS slice only (backward: all-gather the gradient).
// An all-reduce is a reduce-scatter plus an all-gather, so the bytes are the same as step 7's;
// what is saved is compute and activation memory outside the regions.
//
// One new cost: the LayerNorms, the two row-parallel biases and the head are still whole on
// every rank, but each rank now sees only its tokens, so their gradients differ from rank to
// rank and are all-reduced after backward (Megatron all-reduces the LayerNorms' the same way).
// Each rank's loss is the mean over its tokens divided by W: the sum over the ranks is then the
// whole sequence's mean, so those all-reduces sum.
//
// Run: tessera launch --nproc-per-node 3 build/ladders/dist/ladder_08_sequence_parallel
#include "gpt_block.h"

using namespace ladder;
using namespace ladder::block;

const LadderInfo kStep = {
    "08_sequence_parallel",
    "dist/tensor_parallel.cpp (Regions: gather_from_sequence_parallel_region, "
    "reduce_scatter_to_sequence_parallel_region), TensorParallelCausalLM::set_sequence_parallel "
    "(docs/parallelism.md)"};

namespace {

// [T/W, B, d] slices -> [T, B, d] on every rank; backward, the reduce-scatter of the gradient.
Tensor gather_sequence(const Tensor& slice, CountingGroup& comm) {
  Shape whole = slice.shape();
  whole[0] *= comm.size();
  Tensor y = zeros(whole, {.dtype = slice.dtype(), .device = slice.device()});
  comm.all_gather(y, slice.detach().contiguous())->wait();
  autograd::record("GatherSequenceBackward", {slice}, {y},
                   [&comm, shape = slice.shape()](const autograd::BackwardArgs& a) {
                     Tensor mine =
                         zeros(shape, {.dtype = a.grad().dtype(), .device = a.grad().device()});
                     comm.reduce_scatter(mine, a.grad().contiguous(), dist::ReduceOp::Sum)->wait();
                     return std::vector<Tensor>{mine};
                   });
  return y;
}

// [T, B, d] partial sums -> this rank's [T/W, B, d] slice of their sum over the ranks;
// backward, the all-gather of the slices' gradients.
Tensor scatter_sequence(const Tensor& partial, CountingGroup& comm) {
  Shape slice = partial.shape();
  slice[0] /= comm.size();
  Tensor y = zeros(slice, {.dtype = partial.dtype(), .device = partial.device()});
  comm.reduce_scatter(y, partial.detach().contiguous(), dist::ReduceOp::Sum)->wait();
  autograd::record("ScatterSequenceBackward", {partial}, {y},
                   [&comm, shape = partial.shape()](const autograd::BackwardArgs& a) {
                     Tensor whole =
                         zeros(shape, {.dtype = a.grad().dtype(), .device = a.grad().device()});
                     comm.all_gather(whole, a.grad().contiguous())->wait();
                     return std::vector<Tensor>{whole};
                   });
  return y;
}

}  // namespace

Outcome run_step(Job& job, CountingGroup& comm) {
  TESSERA_CHECK(kHeads % job.size == 0 && kInner % job.size == 0 && kTokens % job.size == 0,
                "08_sequence_parallel: ", job.size, " ranks do not divide ", kHeads, " heads, ",
                kInner, " hidden units and ", kTokens, " tokens");
  std::vector<Parameter> mine = my_slices(job);
  const int64_t tokens_here = kTokens / job.size;
  BlockTraining how;
  how.regions.enter = [&](const Tensor& x) { return gather_sequence(x, comm); };
  how.regions.leave = [&](const Tensor& x) { return scatter_sequence(x, comm); };
  how.my_part = [&](const Batch& b) {  // my tokens of every sequence
    return Batch{b.x.narrow(0, job.rank * tokens_here, tokens_here),
                 b.y.narrow(0, job.rank * tokens_here, tokens_here)};
  };
  how.loss_scale = 1.0 / job.size;
  // The parameters every rank holds whole: 2 LayerNorms, the o and proj biases, the head.
  constexpr int64_t whole_values = 4 * kModel + 2 * kModel + kModel * kVocab + kVocab;
  how.after_backward = [&] {
    for (const Parameter& p : mine)
      if (p.split == Split::Whole) comm.all_reduce(p.value.grad(), dist::ReduceOp::Sum)->wait();
  };
  std::vector<double> losses = train_block(mine, job, how, &comm);
  for (double& loss : losses) loss = job.mean_over_ranks(loss);  // the whole sequence's mean

  Outcome out;
  check_slices(out.check, losses, mine, job);
  const int64_t activation_bytes = 4 * kTokens * job.options.rows_per_rank * kModel;
  out.theory.add(kAllGather, 4, 4 * activation_bytes);
  out.theory.add(kReduceScatter, 4, 4 * activation_bytes);
  out.theory.add(kAllReduce, 8, 4 * whole_values);
  out.theory_reason =
      "4 all_gathers and 4 reduce_scatters of T x B x d = " + std::to_string(kTokens) + " x " +
      std::to_string(job.options.rows_per_rank) + " x " + std::to_string(kModel) + " floats (" +
      std::to_string(activation_bytes) +
      " bytes; 2 of each forward, 2 backward): step 7's 4 "
      "all-reduces cut in halves; plus an all_reduce of each of the 8 tensors kept whole (2 "
      "LayerNorms, the o and proj biases, the head: " +
      std::to_string(whole_values) + " values)";
  return out;
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
