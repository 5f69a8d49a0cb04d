// Step 1: data parallelism, the naive way (picotron's DataParallelNaive).
//
// Every rank holds the whole model and trains on its own rows of the global batch. After
// backward, each rank's gradients are the gradients of ITS rows' mean loss; averaging them
// over the W ranks gives the gradient of the global batch's mean loss (every rank has the
// same number of rows), so after one all-reduce per parameter every rank takes the same
// AdamW step and the replicas never drift apart.
//
// What it costs: one collective per parameter tensor, all of them after backward has
// finished, so the network idles during backward and the compute idles during the
// all-reduces. Steps 2 and 3 fix those two problems.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_01_naive_all_reduce
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {"01_naive_all_reduce", "dist/ddp.cpp (DistributedDataParallel)"};

Outcome run_step(Job& job, CountingGroup& comm) {
  TinyMlp model(job.device);  // the same seed on every rank: identical replicas
  optim::AdamW opt(one_group(model.parameters()), adamw_options());
  const std::vector<double> losses = train_data_parallel(job, comm, model, [&] {
    // The whole idea: average every gradient over the ranks, one tensor at a
    // time, after backward has finished.
    for (const Tensor& p : model.parameters())
      comm.all_reduce(p.grad(), dist::ReduceOp::Avg)->wait();
    opt.step();
    opt.zero_grad();
  });

  Traffic theory;
  theory.add(kAllReduce, kMlpTensors, 4 * kMlpParameters);
  return replicated_outcome(job, losses, model, theory,
                            "one all_reduce per parameter tensor (" + std::to_string(kMlpTensors) +
                                "), 4 bytes x " + std::to_string(kMlpParameters) + " parameters");
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
