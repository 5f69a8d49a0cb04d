// Step 5: ZeRO stage 2, the gradients sharded too.
//
// In step 4 every rank received the reduced gradient of the WHOLE model and then used 1/W of
// it. A reduce-scatter gives each rank exactly the sum over ranks of its own shard: half the
// ring traffic of an all-reduce ((W-1)/W·N instead of 2(W-1)/W·N). An all-reduce IS a
// reduce-scatter followed by an all-gather, so ZeRO-2 moves the same bytes as plain data
// parallelism (step 3), while each rank keeps 1/W of the optimizer state and of the reduced
// gradients.
//
// For clarity the reduce-scatter runs once after backward. Production ZeRO-2 reduce-scatters
// bucket by bucket DURING backward (the hooks of steps 2 and 3) and frees each bucket's full
// gradients right after, which is where the gradient memory is saved.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_05_zero2
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {"05_zero2",
                          "dist/zero.cpp (ZeroStrategy, stage 2: reduce-scatter of the buckets)"};

Outcome run_step(Job& job, CountingGroup& comm) {
  FlatZeroReplica zero(job);  // as step 4 (ladder.h)

  const std::vector<double> losses = train_data_parallel(job, comm, zero.model, [&] {
    autograd::NoGradGuard no_grad;
    zero.layout.pack_grads(zero.flat_grads);
    // The one change from step 4: rank r receives the average over the ranks of shard r of
    // the gradients, and nothing else.
    comm.reduce_scatter(zero.my_grad, zero.flat_grads, dist::ReduceOp::Avg)->wait();
    zero.my_shard.set_grad(zero.my_grad);
    zero.update_shard_and_all_gather(comm);  // AdamW on the shard, all_gather: as step 4
  });

  return replicated_outcome(job, losses, zero.model, zero_theory(kReduceScatter, job.size),
                            "one reduce_scatter of the flat gradients and one all_gather of the "
                            "flat weights, each 4 x " +
                                std::to_string(padded_to(kMlpParameters, job.size)) +
                                " bytes: on a ring 2(W-1)/W x payload in all, what the "
                                "all-reduce of step 3 moves");
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
