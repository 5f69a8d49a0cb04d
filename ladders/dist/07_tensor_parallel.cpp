// Step 7: tensor parallelism (Megatron-LM's; picotron's ColumnParallelLinear and
// RowParallelLinear).
//
// Data parallelism (steps 1-6) gives every rank different rows and the same model. Tensor
// parallelism gives every rank the SAME rows and a slice of every big matrix of the layer, so
// a layer too large for one device fits on W of them. One GPT block, pre-LayerNorm:
//
//   a = x + Attention(LN1(x))        y = a + MLP(LN2(a))        loss = CE(y·W_head + b_head)
//
// The MLP: fc [d, 4d] is split by COLUMNS (column-parallel: rank r computes hidden units
// [r·4d/W, (r+1)·4d/W) of every token, GELU applies to them independently), proj [4d, d] by
// ROWS (row-parallel: rank r multiplies its hidden units by its rows, which gives a PARTIAL
// sum of the output). One all-reduce adds the partial sums; proj's bias is added once, after.
// Attention is split by heads, the same way: q, k, v column-parallel (rank r owns whole heads:
// their attention needs nobody else), the output projection row-parallel.
//
// So each half of the block needs one all-reduce forward (after the row-parallel linear:
// "g" below) and one backward: the input of the column-parallel linears is used by every
// rank, so its gradient is the SUM of the ranks' contributions ("f" below, the identity
// forward, an all-reduce of the input gradient backward). 2 + 2 all-reduces of B·T·d values
// per block and step. The LayerNorms and the head stay whole on every rank: their inputs and
// the gradients reaching them are the same everywhere, so their replicas never drift apart.
//
// The check: the very same forward with the whole matrices and no communication is the one
// process; each rank's slices after the steps must equal the same slices of its result.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_07_tensor_parallel
#include "gpt_block.h"

using namespace ladder;
using namespace ladder::block;

const LadderInfo kStep = {
    "07_tensor_parallel",
    "dist/tensor_parallel.cpp (ColumnParallelLinear, RowParallelLinear, the f and g of this step) "
    "and dist/tensor_parallel_models.h (GPT-2 and Llama split whole, docs/parallelism.md)"};

namespace {

// ---- f and g, the two communicating functions ----

// f: identity forward; backward, the all-reduce of the gradient of a tensor every rank used.
Tensor copy_to_parallel_region(const Tensor& x, CountingGroup& comm) {
  Tensor y = ops::alias(x);
  autograd::record("CopyToParallelRegionBackward", {x}, {y},
                   [&comm](const autograd::BackwardArgs& a) {
                     Tensor summed = a.grad().contiguous().clone();
                     comm.all_reduce(summed, dist::ReduceOp::Sum)->wait();
                     return std::vector<Tensor>{summed};
                   });
  return y;
}

// g: the all-reduce of the row-parallel linear's partial sums forward; backward, identity
// (every rank's partial sum contributed to the output with weight one).
Tensor reduce_from_parallel_region(const Tensor& partial, CountingGroup& comm) {
  Tensor y = partial.detach().contiguous().clone();
  comm.all_reduce(y, dist::ReduceOp::Sum)->wait();
  autograd::record("ReduceFromParallelRegionBackward", {partial}, {y},
                   [](const autograd::BackwardArgs& a) { return std::vector<Tensor>{a.grad()}; });
  return y;
}

}  // namespace

Outcome run_step(Job& job, CountingGroup& comm) {
  TESSERA_CHECK(kHeads % job.size == 0 && kInner % job.size == 0, "07_tensor_parallel: ", job.size,
                " ranks do not divide ", kHeads, " heads and ", kInner, " hidden units");
  std::vector<Parameter> mine = my_slices(job);
  BlockTraining how;
  how.regions.enter = [&](const Tensor& x) { return copy_to_parallel_region(x, comm); };      // f
  how.regions.leave = [&](const Tensor& x) { return reduce_from_parallel_region(x, comm); };  // g
  const std::vector<double> losses = train_block(mine, job, how, &comm);

  Outcome out;
  check_slices(out.check, losses, mine, job);
  const int64_t activation_bytes = 4 * kTokens * job.options.rows_per_rank * kModel;
  out.theory.add(kAllReduce, 4, 4 * activation_bytes);
  out.theory_reason = "4 all_reduces of T x B x d = " + std::to_string(kTokens) + " x " +
                      std::to_string(job.options.rows_per_rank) + " x " + std::to_string(kModel) +
                      " floats (" + std::to_string(activation_bytes) +
                      " bytes): forward after the row-parallel attention output and MLP proj, "
                      "backward at the input of the column-parallel q/k/v and fc";
  return out;
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
