// Whole optimizer steps as CUDA graphs: the device work of forward, backward, clipping, the
// optimizer update and zero_grad is recorded once and replayed while the shapes stay the
// same, so the host issues one launch per step instead of hundreds (issue 12: small models
// are bound by host work, not by the GPU).
//
//   StepGraphRunner runner(acc, optimizer, [&](const auto& batches) { return my_step(batches); },
//                          {.enabled = StepGraphRunner::enabled_by_environment()});
//   StepOutputs out = runner.run(batches);   // eager, recorded and replayed, or replayed
//   double loss = out.loss.item();           // read before the next run() overwrites it
//
// The step function must keep everything that changes between steps on the device or in
// what the recording reads from (the micro-batches come in through buffers the runner
// owns; the optimizer's lr and bias corrections through Optimizer::prepare_graph_replay;
// the loss and the gradient norm stay device tensors) and must not read device values on
// the host. Per shape (of the micro-batches) the runner runs `warmup_steps` steps eagerly,
// then records the next one and replays it for every later step of that shape. A new shape
// runs eagerly (and is recorded in turn, up to kMaxGraphs shapes); a step that cannot be
// recorded (a host read, random numbers such as dropout, an optimizer without replay
// support) turns graphs off for the run: its host state is restored and it runs eagerly,
// and status() says why.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/graph_capture.h"
#include "tessera/data/dataloader.h"
#include "tessera/dist/accelerator.h"
#include "tessera/optim/optimizer.h"

namespace tessera::train {

// What a step leaves on the device: its loss (0-d, f64) and the gradient norm before
// clipping (0-d f32, undefined when not measured).
struct StepOutputs {
  Tensor loss;
  Tensor grad_norm;
};

class StepGraphRunner {
 public:
  using StepFn = std::function<StepOutputs(const std::vector<data::Batch>& micro_batches)>;
  struct Options {
    bool enabled = true;
    int warmup_steps = 1;  // eager steps per shape before recording (optimizer state exists)
  };
  static constexpr size_t kMaxGraphs = 4;

  // TESSERA_CUDA_GRAPHS: "0" turns graphs off; unset (or "1") they are on.
  static bool enabled_by_environment();

  StepGraphRunner(dist::Accelerator& acc, optim::Optimizer& optimizer, StepFn step,
                  Options options);
  ~StepGraphRunner();
  StepGraphRunner(const StepGraphRunner&) = delete;
  StepGraphRunner& operator=(const StepGraphRunner&) = delete;

  // One optimizer step over `micro_batches` (one per accumulation micro-step). The outputs
  // of a replayed step live in the graph's memory until the next run().
  StepOutputs run(const std::vector<data::Batch>& micro_batches);

  // "replaying", "recording", "eager: <why>" (graphs off, or this shape not recorded yet).
  const std::string& status() const { return status_; }
  int64_t replayed_steps() const { return replayed_; }
  int64_t eager_steps() const { return eager_; }
  int64_t recorded_graphs() const { return recorded_; }

 private:
  // A recorded step of one shape: the buffers it reads its micro-batches from and the
  // outputs its replays write.
  struct Recorded {
    int eager_runs = 0;
    std::vector<data::Batch> inputs;
    std::unique_ptr<DeviceGraph> graph;
    StepOutputs outputs;
  };
  // What a capture changes on the host before its work has run, to undo a failed one.
  struct HostState {
    std::vector<int64_t> optimizer_steps;
    int64_t micro_step;
    std::vector<Tensor> grads;
    uint64_t rng_seed, rng_offset;
  };
  StepOutputs record(Recorded& entry, const std::vector<data::Batch>& micro_batches);
  StepOutputs replay(Recorded& entry, const std::vector<data::Batch>& micro_batches);
  StepOutputs run_eagerly(const std::vector<data::Batch>& micro_batches, std::string why);
  HostState save_host_state() const;
  void restore_host_state(const HostState& state);
  void turn_off(std::string why);

  dist::Accelerator& acc_;
  optim::Optimizer& optimizer_;
  StepFn step_;
  Options options_;
  std::string off_reason_;  // non-empty once graphs are off for the run
  std::map<std::string, Recorded> by_shape_;
  std::string status_ = "eager: not started";
  int64_t replayed_ = 0, eager_ = 0, recorded_ = 0;
};

}  // namespace tessera::train
