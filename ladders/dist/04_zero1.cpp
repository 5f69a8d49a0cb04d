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

const LadderInfo kStep = {"04_zero1", "dist/zero.cpp (ZeroStrategy, stage 1)"};

Outcome run_step(Job& job, CountingGroup& comm) {
  FlatZeroReplica zero(job);  // the model, its flat buffers, this rank's shard and its AdamW

  const std::vector<double> losses = train_data_parallel(job, comm, zero.model, [&] {
    autograd::NoGradGuard no_grad;
    zero.layout.pack_grads(zero.flat_grads);
    // Every rank receives the average of ALL the gradients...
    comm.all_reduce(zero.flat_grads, dist::ReduceOp::Avg)->wait();
    // ...keeps its own part, updates its own shard of the parameters with it (AdamW),
    zero.my_shard.set_grad(zero.layout.owned(zero.flat_grads, job.rank).clone());
    // then everyone collects everyone's updated shard: the whole new model again.
    zero.update_shard_and_all_gather(comm);
  });

  const int64_t padded = padded_to(kMlpParameters, job.size);
  return replicated_outcome(
      job, losses, zero.model, zero_theory(kAllReduce, job.size),
      "one all_reduce of the flat gradients and one all_gather of the flat weights, each 4 x " +
          std::to_string(padded) + " bytes (" + std::to_string(kMlpParameters) +
          " parameters padded to W equal shards); AdamW state on this rank: 2 x " +
          std::to_string(zero.layout.shard) + " values instead of 2 x " +
          std::to_string(kMlpParameters));
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
