// Optimizer base: parameter groups with their own learning rate and weight decay,
// per-parameter state (moments, step) and a state dict for checkpoints.
//
// Parameters are held as Tensors (shared TensorImpls), never as raw pointers:
// the dist layer may re-point a parameter's or gradient's storage into a flat
// buffer between steps, and the optimizer must follow. Updates never record on
// the autograd tape.
#pragma once
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/optim/host_parallel.h"

namespace tessera::optim {

struct ParamGroup {
  std::vector<Tensor> params;
  double lr = 1e-3;
  double weight_decay = 0.0;
  // The lr the schedule scales (set to `lr` when the optimizer is built).
  double initial_lr = -1.0;
  std::string name;  // for messages and state dicts ("decay", "no_decay", ...)
};

// What an optimizer saves: per-parameter tensors ("state.{i}.exp_avg", i = the
// parameter's position in the flat order of all groups) and scalars
// ("state.{i}.step", "group.{g}.lr", ...). Tensors go to safetensors, scalars to
// its metadata or JSON.
struct OptimizerStateDict {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, double> scalars;
};

// The per-parameter keys of an OptimizerStateDict, spelled here only: "state.{i}.{field}"
// ("state.3.exp_avg", "state.3.step"), every one starting with kOptimizerStateKeyPrefix.
inline constexpr std::string_view kOptimizerStateKeyPrefix = "state.";
std::string optimizer_state_key(size_t index, const std::string& field);
// {i, field} of such a key; nullopt for any other key ("group.0.lr", a malformed one).
std::optional<std::pair<size_t, std::string>> parse_optimizer_state_key(const std::string& key);

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient (others are skipped); nothing
  // while the step gate says no.
  void step();
  // Clears every parameter's gradient (set_to_none frees it; otherwise zeroes it in
  // place); nothing while the step gate says no.
  void zero_grad(bool set_to_none = true);
  // A gate asked by step() and zero_grad(): when it returns false both do nothing. The
  // Accelerator installs one that is open only on gradient-syncing micro-steps, so the
  // loop may call opt.step(); opt.zero_grad() on every micro-step while gradients
  // accumulate (as with Hugging Face Accelerate's prepared optimizer). An empty function
  // removes the gate.
  void set_step_gate(std::function<bool()> gate) { gate_ = std::move(gate); }
  bool step_gate_open() const { return !gate_ || gate_(); }
  // Global-norm clipping folded into the next step(): `norm` is the gradients' norm as
  // clip_grad_norm_on_device_ measured it (max_norm 0 there only measures), and the update
  // reads every gradient times max_norm / (norm + 1e-6) when that is below 1 -- the bits of
  // clipping first -- without the clip's own pass over the gradients, which stay unclipped.
  // AdamW's multi-tensor kernel applies the factor as it reads; gradients of any other update
  // are clipped in place before it (clip_grads_by_norm_). The request ends with the next
  // step(), also when the step gate is shut.
  void clip_grads_in_next_step(const Tensor& norm, double max_norm);
  // ZeRO-Offload's per-bucket step: updates now, as step() would, only the parameters at
  // `indices` (flat order) that have a gradient — the gate and the post-step hook are not
  // asked — and the next step() skips them (then forgets them). Only an optimizer whose
  // supports_partial_steps() (AdamW) can; a pending clip is an error (a clip needs every
  // gradient before any update). Calls must not overlap each other or step(): the caller
  // waits for one before the next.
  void step_parameters(const std::vector<size_t>& indices);
  virtual bool supports_partial_steps() const { return false; }
  // Whether step_parameters updated some parameters that the next step() will skip.
  bool has_early_steps() const { return !stepped_early_.empty(); }
  // The runner the CPU loops of step() and step_parameters() split their elements with
  // (optim/host_parallel.h; ZeRO-Offload: the rank's pinned threads); null: OpenMP. It must
  // outlive its use.
  void set_range_runner(const RangeRunner* runner) { runner_ = runner; }
  // Runs in step() once the gate is open and no clip is pending, before the update (ZeRO-
  // Offload: steps bucket by bucket through step_parameters, each bucket's copy back queued
  // behind its own update).
  void set_pre_step_hook(std::function<void()> hook) { pre_step_ = std::move(hook); }
  // Runs after every update step() made (ZeRO: all-gathers the updated shards).
  void set_post_step_hook(std::function<void()> hook) { post_step_ = std::move(hook); }
  // Replaces what the optimizer updates (ZeRO: this rank's slices of the parameters) and
  // forgets any state; the groups keep their own lr, weight decay and names.
  void replace_param_groups(std::vector<ParamGroup> groups);
  // Mixed precision: keep f32 master copies of f16/bf16 parameters and update those.
  // Optimizers that cannot raise an error naming themselves.
  virtual void set_master_weights(bool on);

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // All parameters in group order (the index used in state dicts).
  std::vector<Tensor> parameters() const;
  // Sets lr of every group (schedules set it per group through param_groups()).
  void set_lr(double lr);
  double lr() const { return groups_.empty() ? 0.0 : groups_.front().lr; }

  // ---- CUDA graphs (core/graph_capture.h) ----
  // For a replay of a graph that recorded step(): the host side of step() without its
  // launches (step counts advance; what changes per step, such as the lr and AdamW's bias
  // corrections, is written where the recorded launches read it). Nothing while the step
  // gate says no. Throws when this optimizer cannot be replayed (the default).
  virtual void prepare_graph_replay();
  // After step() was recorded in a CUDA graph and before the graph's first replay: makes what
  // the recorded launches read hold the recorded step's values (the capture ran nothing).
  virtual void graph_recorded() {}
  // Every parameter's step count (kept before a capture, restored when it fails).
  std::vector<int64_t> step_counts() const;
  void set_step_counts(const std::vector<int64_t>& steps);

  OptimizerStateDict state_dict() const;
  // Restores what state_dict() saved; error naming the key on missing entries or on
  // parameters whose shape differs.
  void load_state_dict(const OptimizerStateDict& state);

 protected:
  // The update itself (step() calls it when the gate is open).
  virtual void apply_step() = 0;
  // A clip requested by clip_grads_in_next_step for this step (norm undefined: none).
  struct PendingClip {
    Tensor norm;
    double max_norm = 0.0;
  };
  const PendingClip& pending_clip() const { return pending_clip_; }
  // Whether apply_step updates parameter `index` (flat order) in this pass: step_parameters
  // selects a few, and the step() after it skips those.
  bool in_this_pass(size_t index) const { return pass_.empty() || pass_[index] != 0; }
  // Whether apply_step applies pending_clip() itself; otherwise step() clips every gradient
  // in place first.
  virtual bool applies_pending_clip() const { return false; }
  // Per-parameter state: named tensors and a step count.
  struct ParamState {
    std::map<std::string, Tensor> tensors;
    int64_t step = 0;
  };
  // State of parameter `index` (flat order), created empty when first asked.
  ParamState& state(size_t index);
  // Names of the per-parameter state tensors this optimizer keeps (for load checks).
  virtual std::vector<std::string> state_tensor_names() const = 0;
  virtual const char* name() const = 0;

  std::vector<ParamGroup> groups_;
  std::vector<ParamState> states_;  // by flat parameter index

 private:
  PendingClip pending_clip_;
  std::function<bool()> gate_;
  std::function<void()> pre_step_, post_step_;
  const RangeRunner* runner_ = nullptr;
  std::vector<char> pass_;           // by flat index: updated in this pass; empty: every one
  std::vector<char> stepped_early_;  // by flat index: updated by step_parameters; empty: none
};

// An optimizer state as one safetensors file: tensors as they are, scalars in the
// metadata (printed with 17 significant digits, so they read back exactly). Atomic write.
void save_optimizer_state(const OptimizerStateDict& state, const std::string& path);
OptimizerStateDict load_optimizer_state(const std::string& path);

// Splits parameters the way GPT training does: tensors of rank >= 2 (matmul weights,
// embeddings) get `weight_decay`, the rest (biases, norm gains) none.
std::vector<ParamGroup> decay_groups(const std::vector<Tensor>& params, double lr,
                                     double weight_decay);

}  // namespace tessera::optim
