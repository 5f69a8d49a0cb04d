// Step 10: pipeline parallelism, one forward one backward (1F1B, PipeDream-Flush's schedule;
// picotron's train_step_pipeline_1f1b).
//
// Step 9 (AFAB) holds the activations of every micro-batch until the backward half begins. But
// micro-batch 0's backward can start on the last stage as soon as its forward is done there.
// 1F1B lets every stage alternate: after a warm-up of (W - 1 - s) forwards (what stage s must
// run before the first gradient can come back to it), stage s runs one forward and one
// backward in turn, then drains the remaining backwards. The bubble is the same as AFAB's,
// (W-1)/(M+W-1), but stage s never holds more than W - s micro-batches' activations instead of
// M: with many micro-batches (the way to a small bubble) that is the difference between
// fitting and not.
//
// The same stage as step 9 (ladder.h, PipelineStage), the same messages and the same result:
// only the order of forward(m) and backward(m) below differs.
//
// Run: tessera launch --nproc-per-node 3 build/ladders/dist/ladder_10_pipeline_1f1b
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {"10_pipeline_1f1b", kPipelineProduction};

Outcome run_step(Job& job, CountingGroup& comm) {
  PipelineStage stage(job, comm);
  const int warmup = std::min(stage.stages() - 1 - stage.stage(), kMicroBatches);
  const std::vector<double> losses = stage.train([&] {
    int forwards = 0, backwards = 0;
    while (forwards < warmup) stage.forward(forwards++);  // fill the pipe
    while (forwards < kMicroBatches) {                    // steady state: 1F, 1B
      stage.forward(forwards++);
      stage.backward(backwards++);
    }
    while (backwards < kMicroBatches) stage.backward(backwards++);  // drain it
  });
  return stage.outcome(losses, "warm-up of " + std::to_string(warmup) + " forwards on this stage");
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
