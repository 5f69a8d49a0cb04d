// AdamW with PyTorch's semantics (torch.optim.AdamW, amsgrad=False):
//   p -= lr·wd·p                                  (decoupled weight decay)
//   m = β1·m + (1-β1)·g ;  v = β2·v + (1-β2)·g²
//   p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)
// Moments are f32 (f64 for f64 parameters). Built from a parameter list, weight
// decay applies to tensors of rank >= 2 only (see decay_groups).
#pragma once
#include <memory>

#include "tessera/optim/optimizer.h"

namespace tessera::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  // Mixed precision: f16/bf16 parameters get an f32 master copy in the optimizer state
  // ("master"); the update runs on the master in f32 and the parameter receives its rounded
  // value, so small updates are not lost to bf16 rounding. On CUDA one fused launch reads
  // the low-precision gradients and writes masters, moments and parameters.
  bool master_weights = false;
};

class AdamW : public Optimizer {
 public:
  // Groups "decay" (rank >= 2, opts.weight_decay) and "no_decay" (the rest, 0).
  explicit AdamW(const std::vector<Tensor>& params, AdamWOptions opts = {});
  // Groups as given (each group's lr and weight_decay are used as they are).
  AdamW(std::vector<ParamGroup> groups, AdamWOptions opts);

  const AdamWOptions& options() const { return opts_; }
  void set_master_weights(bool on) override { opts_.master_weights = on; }
  bool supports_partial_steps() const override { return true; }
  // Replays the multi-tensor launches recorded in the last capture: their parameters' step
  // counts advance and each launch's lr and bias corrections go to its page-locked slot.
  // Needs the previous replay to have finished reading the slots (the caller synchronises).
  void prepare_graph_replay() override;

 private:
  void apply_step() override;
  // The multi-tensor kernel applies a pending clip as it reads the gradients; apply_step clips
  // the gradients of the other updates in place first.
  bool applies_pending_clip() const override { return true; }
  void graph_recorded() override;
  // One multi-tensor launch recorded in a graph: its group and its parameters (flat indices);
  // launch i reads its lr and bias corrections from slot i of replay_scalars_
  // (MultiTensorAdamWConfig::replay_scalars).
  struct RecordedLaunch {
    size_t group;
    std::vector<size_t> params;
  };
  // Slot `launch` of replay_scalars_ (allocated on `device` on first use).
  const float* replay_slot(size_t launch, Device device);
  // Copies each recorded launch's coefficients, for its parameters' current step, into its
  // slot in stream order: the next replay reads them, and the host waits for nothing.
  void upload_replay_scalars();
  std::vector<RecordedLaunch> recorded_;
  Tensor replay_scalars_;  // f32 [kMaxRecordedLaunches x 4] on the parameters' device
  std::vector<std::string> state_tensor_names() const override {
    return {"exp_avg", "exp_avg_sq", "master"};
  }
  const char* name() const override { return "AdamW"; }
  AdamWOptions opts_;
};

}  // namespace tessera::optim
