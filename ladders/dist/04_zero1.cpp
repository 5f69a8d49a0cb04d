// Step 4: ZeRO stage 1, the optimizer state sharded.
//
// AdamW keeps two moments per parameter: in fp32 that is twice the model again, and with a
// plain data-parallel job every rank keeps all of it. ZeRO-1 (the DeepSpeed paper's P_os)
// splits the optimizer's work instead: lay the parameters end to end in one flat vector, cut
// it into W equal shards, and let rank r own shard r: its moments, and its update.
//
// One step then reads:
//   1. backward, as in step 1;
//   2. all-reduce the (flat) gradients, so every rank has the global batch's gradient;
//   3. each rank runs AdamW on ITS shard only (state for 1/W of the model);
//   4. all-gather the updated shards, so every rank has the whole new model again.
// Step 2 moves 2(W-1)/W·N on a ring, step 4 another (W-1)/W·N. Step 5 removes the waste in
// step 2: a rank only needs the reduced gradient of its own shard.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_04_zero1
#include "ladder.h"

using namespace ladder;

Outcome run_step(Job& job, CountingGroup& comm) {
  TinyMlp model(job.device);
  const FlatLayout layout(model.parameters(), job.size);
  Tensor flat_grads = zeros({layout.padded}, job.floats());
  Tensor flat_params = zeros({layout.padded}, job.floats());
  layout.pack_values(flat_params);

  // This rank's shard is a parameter of its own: the optimizer sees only it, so AdamW's
  // moments exist for `layout.shard` values here, not for the whole model.
  Tensor my_shard = layout.owned(flat_params, job.rank).clone().requires_grad_();
  optim::AdamW opt(one_group({my_shard}), adamw_options());

  const std::vector<double> losses = train_data_parallel(job, comm, model, [&] {
    autograd::NoGradGuard no_grad;
    layout.pack_grads(flat_grads);
    comm.all_reduce(flat_grads, dist::ReduceOp::Avg)->wait();       // everyone: all gradients
    my_shard.set_grad(layout.owned(flat_grads, job.rank).clone());  // keep only my part
    opt.step();                                                     // update my part
    comm.all_gather(flat_params, my_shard.detach())->wait();        // everyone: all weights
    layout.unpack_values(flat_params);
    model.zero_grad();
  });

  Outcome out;
  const int64_t padded = padded_to(kMlpParameters, job.size);
  out.theory.add(kAllReduce, 1, 4 * padded);
  out.theory.add(kAllGather, 1, 4 * padded);
  out.theory_reason =
      "one all_reduce of the flat gradients and one all_gather of the flat "
      "weights, each 4 x " +
      std::to_string(padded) + " bytes (" + std::to_string(kMlpParameters) +
      " parameters padded to W equal shards); "
      "AdamW state on this rank: 2 x " +
      std::to_string(layout.shard) + " values instead of 2 x " + std::to_string(kMlpParameters);
  check_against(out.check, losses, model, train_one_process(job));
  return out;
}

int main(int argc, char** argv) {
  return run_ladder(argc, argv, {"04_zero1", "dist/zero.cpp (ZeroStrategy, stage 1)"}, run_step);
}
