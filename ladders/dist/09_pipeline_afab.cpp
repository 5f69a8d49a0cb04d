// Step 9: pipeline parallelism, all forward then all backward (AFAB, GPipe's schedule;
// picotron's train_step_pipeline_afab).
//
// Tensor parallelism (step 7) splits every layer; a pipeline splits the model into STAGES of
// whole layers, one per rank, and passes activations from stage to stage with point-to-point
// sends (ProcessGroup::send/recv): stage s receives its input from stage s-1 and sends its
// output to stage s+1; backward, the gradient of that output comes back from s+1 and the
// gradient of its input goes to s-1. The stage itself (ladder.h, PipelineStage) is shared with
// step 10: the two steps differ only in the ORDER in which a stage runs its micro-batches.
//
// One batch through one stage after another would leave all but one rank idle, so the batch
// is cut into M micro-batches that follow each other down the pipe. AFAB runs the forward of
// all M, then the backward of all M; the micro-batches' gradients add up in .grad, and then
// every stage steps its own parameters. The cost: each rank idles (W-1) of the (M+W-1) slots
// of each half (the bubble), and holds the activations of all M micro-batches until their
// backward. Step 10 keeps at most W in flight.
//
// Run: tessera launch --nproc-per-node 3 build/ladders/dist/ladder_09_pipeline_afab
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {"09_pipeline_afab", kPipelineProduction};

Outcome run_step(Job& job, CountingGroup& comm) {
  PipelineStage stage(job, comm);
  const std::vector<double> losses = stage.train([&] {
    for (int m = 0; m < kMicroBatches; ++m) stage.forward(m);   // all forward...
    for (int m = 0; m < kMicroBatches; ++m) stage.backward(m);  // ...then all backward
  });
  char bubble[96];
  std::snprintf(bubble, sizeof bubble, "AFAB's bubble (W-1)/(M+W-1) = %.2f",
                double(stage.stages() - 1) / (kMicroBatches + stage.stages() - 1));
  return stage.outcome(losses, bubble);
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
