#include "tessera/train/step_graph.h"
#include "tessera/kernels/ops.h"

#include "tessera/core/random.h"
#include "tessera/core/settings.h"
#include "tessera/dist/env.h"

namespace tessera::train {

namespace {

// The shapes, dtypes and device of the micro-batches: a replay needs all of them unchanged.
std::string shape_key(const std::vector<data::Batch>& batches) {
  std::string key;
  for (const data::Batch& b : batches)
    for (const Tensor* t : {&b.x, &b.y})
      key += shape_str(t->shape()) + dtype_name(t->dtype()) + t->device().str() + ";";
  return key;
}

Device device_of(const std::vector<data::Batch>& batches) {
  TESSERA_CHECK(!batches.empty() && batches.front().x.defined(),
                "StepGraphRunner::run: no micro-batches");
  return batches.front().x.device();
}

}  // namespace

bool StepGraphRunner::enabled_by_environment() { return setting_enabled(Setting::CudaGraphs); }

StepGraphRunner::StepGraphRunner(dist::Accelerator& acc, optim::Optimizer& optimizer, StepFn step,
                                 Options options)
    : acc_(acc), optimizer_(optimizer), step_(std::move(step)), options_(options) {
  if (!options_.enabled)
    turn_off("graphs are off (TESSERA_CUDA_GRAPHS=0)");
  else if (std::string blocker = acc_.graph_capture_blocker(); !blocker.empty())
    turn_off(blocker);
}

StepGraphRunner::~StepGraphRunner() = default;

void StepGraphRunner::turn_off(std::string why) {
  off_reason_ = std::move(why);
  by_shape_.clear();  // frees the graphs and their memory pools
}

StepOutputs StepGraphRunner::run(const std::vector<data::Batch>& micro_batches) {
  TESSERA_CHECK(static_cast<int>(micro_batches.size()) == acc_.gradient_accumulation_steps(),
                "StepGraphRunner::run: ", micro_batches.size(), " micro-batches for ",
                acc_.gradient_accumulation_steps(), " accumulation steps");
  if (!off_reason_.empty()) return run_eagerly(micro_batches, off_reason_);
  const Device device = device_of(micro_batches);
  if (graph_backend(device.type) == nullptr) {
    turn_off(device.str() + " cannot record graphs");
    return run_eagerly(micro_batches, off_reason_);
  }
  const std::string key = shape_key(micro_batches);
  auto it = by_shape_.find(key);
  if (it == by_shape_.end()) {
    if (by_shape_.size() >= kMaxGraphs)
      return run_eagerly(micro_batches, "more than " + std::to_string(kMaxGraphs) + " shapes");
    it = by_shape_.emplace(key, Recorded{}).first;
  }
  Recorded& entry = it->second;
  if (entry.graph) return replay(entry, micro_batches);
  if (entry.eager_runs < options_.warmup_steps) {
    ++entry.eager_runs;
    return run_eagerly(micro_batches, "warming up this shape");
  }
  return record(entry, micro_batches);
}

StepOutputs StepGraphRunner::run_eagerly(const std::vector<data::Batch>& micro_batches,
                                         std::string why) {
  status_ = "eager: " + std::move(why);
  ++eager_;
  return step_(micro_batches);
}

StepGraphRunner::HostState StepGraphRunner::save_host_state() const {
  HostState s;
  s.optimizer_steps = optimizer_.step_counts();
  s.micro_step = acc_.micro_step();
  for (const Tensor& p : optimizer_.parameters()) s.grads.push_back(p.grad());
  s.rng_seed = default_generator().seed();
  s.rng_offset = default_generator().offset();
  return s;
}

void StepGraphRunner::restore_host_state(const HostState& s) {
  optimizer_.set_step_counts(s.optimizer_steps);
  acc_.set_micro_step(s.micro_step);
  const std::vector<Tensor> params = optimizer_.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].set_grad(s.grads[i]);
  default_generator().set_state(s.rng_seed, s.rng_offset);
}

// Records the step on buffers owned by the entry (filled with this step's micro-batches),
// then replays it once: the capture itself runs nothing on the device.
StepOutputs StepGraphRunner::record(Recorded& entry,
                                    const std::vector<data::Batch>& micro_batches) {
  const Device device = device_of(micro_batches);
  entry.inputs.clear();
  for (const data::Batch& b : micro_batches)  // allocated before the capture: they stay put
    entry.inputs.push_back({ops::clone(b.x), ops::clone(b.y)});
  const HostState before = save_host_state();
  GraphBackend& backend = *graph_backend(device.type);
  std::string failure;
  try {
    backend.begin_capture(device);
    try {
      entry.outputs = step_(entry.inputs);
    } catch (...) {
      backend.abort_capture(device);
      throw;
    }
    entry.graph = backend.end_capture(device);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (failure.empty() && (default_generator().seed() != before.rng_seed ||
                          default_generator().offset() != before.rng_offset))
    failure = "the step draws random numbers (dropout), which a replay would repeat";
  if (!failure.empty()) {
    entry.graph.reset();
    entry.outputs = {};
    restore_host_state(before);
    turn_off("the step could not be recorded: " + failure);
    return run_eagerly(micro_batches, off_reason_);
  }
  ++recorded_;
  status_ = "recording";
  optimizer_.graph_recorded();
  entry.graph->replay();
  return entry.outputs;
}

StepOutputs StepGraphRunner::replay(Recorded& entry,
                                    const std::vector<data::Batch>& micro_batches) {
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    ops::copy_(entry.inputs[i].x, micro_batches[i].x);
    ops::copy_(entry.inputs[i].y, micro_batches[i].y);
  }
  // What changes per step reaches the device through copies queued behind the previous
  // replay: the host does not wait for it (a wait here left the GPU idle between steps while
  // the host logged, loaded the next batch and launched the graph).
  optimizer_.prepare_graph_replay();
  acc_.set_micro_step(acc_.micro_step() + acc_.gradient_accumulation_steps());
  entry.graph->replay();
  ++replayed_;
  status_ = "replaying";
  return entry.outputs;
}

}  // namespace tessera::train
