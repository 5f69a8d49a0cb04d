#include "tessera/optim/optimizer.h"
#include "tessera/kernels/ops.h"

#include "tessera/core/memory_category.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "tessera/core/safetensors.h"
#include "tessera/optim/clip.h"

#include "tessera/autograd/autograd.h"

namespace tessera::optim {

Optimizer::Optimizer(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
  size_t count = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& group = groups_[g];
    if (group.initial_lr < 0) group.initial_lr = group.lr;
    if (group.name.empty()) group.name = "group" + std::to_string(g);
    for (const auto& p : group.params) {
      TESSERA_CHECK(p.defined(), "Optimizer: parameter ", count, " of group '", group.name,
                    "' is an undefined tensor");
      TESSERA_CHECK(is_floating(p.dtype()), "Optimizer: parameter ", count, " of group '",
                    group.name, "' has dtype ", dtype_name(p.dtype()),
                    "; only floating-point tensors can be optimized");
      ++count;
    }
  }
  states_.resize(count);
}

std::vector<Tensor> Optimizer::parameters() const {
  std::vector<Tensor> all;
  for (const auto& g : groups_) all.insert(all.end(), g.params.begin(), g.params.end());
  return all;
}

void Optimizer::clip_grads_in_next_step(const Tensor& norm, double max_norm) {
  TESSERA_CHECK(norm.defined() && norm.numel() == 1 && is_floating(norm.dtype()), name(),
                "::clip_grads_in_next_step: the norm must be one floating value, got ",
                norm.defined() ? shape_str(norm.shape()) + " " + dtype_name(norm.dtype()) : "none");
  TESSERA_CHECK(max_norm > 0, name(), "::clip_grads_in_next_step: max_norm must be > 0, got ",
                max_norm);
  pending_clip_ = {norm, max_norm};
}

void Optimizer::step() {
  PendingClip clip = std::exchange(pending_clip_, PendingClip{});  // ends here either way
  if (!step_gate_open()) return;
  MemoryCategoryScope tag(MemoryCategory::OptimizerState);  // moments and masters appear here
  if (clip.norm.defined() && !applies_pending_clip()) {
    std::vector<Tensor> grads;
    for (const Tensor& p : parameters())
      if (p.grad().defined()) grads.push_back(p.grad());
    clip_grads_by_norm_(grads, clip.norm, clip.max_norm);
    clip = PendingClip{};
  }
  // apply_step reads the request through pending_clip(); cleared however it ends.
  pending_clip_ = std::move(clip);
  struct Clear {
    PendingClip& pending;
    ~Clear() { pending = PendingClip{}; }
  } clear{pending_clip_};
  struct Forget {
    std::vector<char>& pass;
    std::vector<char>& early;
    ~Forget() {
      pass.clear();
      early.clear();
    }
  } forget{pass_, stepped_early_};
  if (pre_step_ && !pending_clip_.norm.defined()) pre_step_();
  // Parameters step_parameters already updated are skipped this once.
  if (!stepped_early_.empty()) {
    TESSERA_CHECK(!pending_clip_.norm.defined(), name(),
                  "::step: a clip was requested after "
                  "some parameters were already updated (step_parameters)");
    pass_.assign(stepped_early_.size(), 1);
    for (size_t i = 0; i < stepped_early_.size(); ++i) pass_[i] = !stepped_early_[i];
  }
  const RangeRunnerScope threads(runner_);
  apply_step();
  if (post_step_) post_step_();
}

void Optimizer::step_parameters(const std::vector<size_t>& indices) {
  TESSERA_CHECK(supports_partial_steps(), name(),
                " cannot update a subset of its parameters "
                "(step_parameters); AdamW can");
  TESSERA_CHECK(!pending_clip_.norm.defined(), name(),
                "::step_parameters: a clip is pending; "
                "it needs every gradient before any update");
  MemoryCategoryScope tag(MemoryCategory::OptimizerState);
  pass_.assign(states_.size(), 0);
  if (stepped_early_.empty()) stepped_early_.assign(states_.size(), 0);
  for (size_t i : indices) {
    TESSERA_CHECK(i < states_.size(), name(), "::step_parameters: parameter index ", i,
                  " out of range (", states_.size(), " parameters)");
    TESSERA_CHECK(!stepped_early_[i], name(), "::step_parameters: parameter ", i,
                  " was already updated in this step");
    pass_[i] = 1;
    stepped_early_[i] = 1;
  }
  struct Clear {
    std::vector<char>& pass;
    ~Clear() { pass.clear(); }
  } clear{pass_};
  const RangeRunnerScope threads(runner_);
  apply_step();
}

void Optimizer::prepare_graph_replay() {
  TESSERA_FAIL(name(), " cannot be replayed in a CUDA graph");
}

std::vector<int64_t> Optimizer::step_counts() const {
  std::vector<int64_t> steps;
  for (const ParamState& s : states_) steps.push_back(s.step);
  return steps;
}

void Optimizer::set_step_counts(const std::vector<int64_t>& steps) {
  TESSERA_CHECK(steps.size() == states_.size(), name(), "::set_step_counts: ", steps.size(),
                " counts for ", states_.size(), " parameters");
  for (size_t i = 0; i < steps.size(); ++i) states_[i].step = steps[i];
}

void Optimizer::replace_param_groups(std::vector<ParamGroup> groups) {
  size_t count = 0;
  for (const auto& g : groups) count += g.params.size();
  groups_ = std::move(groups);
  states_.assign(count, ParamState{});
}

void Optimizer::set_master_weights(bool on) {
  TESSERA_CHECK(!on, name(),
                " keeps no f32 master weights; mixed precision (bf16/fp16 "
                "parameters) needs an optimizer that does, such as AdamW");
}

void Optimizer::zero_grad(bool set_to_none) {
  if (step_gate_open()) autograd::zero_grad(parameters(), set_to_none);
}

void Optimizer::set_lr(double lr) {
  for (auto& g : groups_) g.lr = lr;
}

Optimizer::ParamState& Optimizer::state(size_t index) {
  TESSERA_CHECK(index < states_.size(), name(), ": parameter index ", index, " out of range (",
                states_.size(), " parameters)");
  return states_[index];
}

OptimizerStateDict Optimizer::state_dict() const {
  OptimizerStateDict out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const std::string prefix = "group." + std::to_string(g) + ".";
    out.scalars[prefix + "lr"] = groups_[g].lr;
    out.scalars[prefix + "initial_lr"] = groups_[g].initial_lr;
    out.scalars[prefix + "weight_decay"] = groups_[g].weight_decay;
  }
  for (size_t i = 0; i < states_.size(); ++i) {
    const auto& s = states_[i];
    if (s.step == 0 && s.tensors.empty()) continue;  // never updated
    out.scalars[optimizer_state_key(i, "step")] = static_cast<double>(s.step);
    for (const auto& [k, t] : s.tensors) out.tensors[optimizer_state_key(i, k)] = t;
  }
  return out;
}

void Optimizer::load_state_dict(const OptimizerStateDict& state) {
  auto scalar = [&](const std::string& key) {
    auto it = state.scalars.find(key);
    TESSERA_CHECK(it != state.scalars.end(), name(), "::load_state_dict: missing scalar '", key,
                  "'");
    return it->second;
  };
  for (size_t g = 0; g < groups_.size(); ++g) {
    const std::string prefix = "group." + std::to_string(g) + ".";
    groups_[g].lr = scalar(prefix + "lr");
    groups_[g].initial_lr = scalar(prefix + "initial_lr");
    groups_[g].weight_decay = scalar(prefix + "weight_decay");
  }
  TESSERA_CHECK(state.scalars.count("group." + std::to_string(groups_.size()) + ".lr") == 0, name(),
                "::load_state_dict: the state has more than the optimizer's ", groups_.size(),
                " parameter groups");
  const std::vector<Tensor> params = parameters();
  for (const auto& [key, value] : state.scalars) {
    const auto parsed = parse_optimizer_state_key(key);
    if (!parsed) continue;
    TESSERA_CHECK(parsed->first < params.size(), name(), "::load_state_dict: state key '", key,
                  "' names parameter ", parsed->first, " but the optimizer has ", params.size());
  }
  std::vector<ParamState> loaded(states_.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto step_it = state.scalars.find(optimizer_state_key(i, "step"));
    if (step_it == state.scalars.end()) continue;  // not updated yet when saved
    loaded[i].step = static_cast<int64_t>(step_it->second);
    for (const auto& tname : state_tensor_names()) {
      const std::string key = optimizer_state_key(i, tname);
      auto it = state.tensors.find(key);
      if (it == state.tensors.end()) continue;  // e.g. SGD without momentum keeps none
      const Tensor& src = it->second;
      TESSERA_CHECK(src.shape() == params[i].shape(), name(), "::load_state_dict: '", key,
                    "' has shape ", shape_str(src.shape()), " but parameter ", i, " has shape ",
                    shape_str(params[i].shape()));
      // Moments keep the dtype they were saved in (f32 for low-precision parameters).
      loaded[i].tensors[tname] = ops::clone(ops::to(src, params[i].device(), src.dtype()));
    }
  }
  states_ = std::move(loaded);
}

std::string optimizer_state_key(size_t index, const std::string& field) {
  return std::string(kOptimizerStateKeyPrefix) + std::to_string(index) + "." + field;
}

std::optional<std::pair<size_t, std::string>> parse_optimizer_state_key(const std::string& key) {
  constexpr size_t kPrefix = kOptimizerStateKeyPrefix.size();
  if (!key.starts_with(kOptimizerStateKeyPrefix)) return std::nullopt;
  const size_t dot = key.find('.', kPrefix);
  if (dot == std::string::npos || dot == kPrefix || dot + 1 == key.size() ||
      key.find_first_not_of("0123456789", kPrefix) != dot)
    return std::nullopt;
  return std::pair{static_cast<size_t>(std::stoull(key.substr(kPrefix, dot - kPrefix))),
                   key.substr(dot + 1)};
}

void save_optimizer_state(const OptimizerStateDict& state, const std::string& path) {
  std::vector<std::pair<std::string, Tensor>> tensors(state.tensors.begin(), state.tensors.end());
  std::map<std::string, std::string> metadata{{"format", "tessera.optimizer"}};
  for (const auto& [key, value] : state.scalars) {
    char text[40];
    std::snprintf(text, sizeof text, "%.17g", value);
    metadata["scalar." + key] = text;
  }
  save_safetensors(path, tensors, metadata);
}

OptimizerStateDict load_optimizer_state(const std::string& path) {
  const SafetensorsContents file = load_safetensors(path, {.memory_map = false});
  auto format = file.metadata.find("format");
  TESSERA_CHECK(format != file.metadata.end() && format->second == "tessera.optimizer",
                "load_optimizer_state: '", path, "' is not an optimizer state file");
  OptimizerStateDict state;
  state.tensors = file.tensors;
  for (const auto& [key, text] : file.metadata) {
    if (key.rfind("scalar.", 0) != 0) continue;
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    TESSERA_CHECK(end && *end == '\0' && !text.empty(), "load_optimizer_state: '", path,
                  "': metadata '", key, "' is not a number: '", text, "'");
    state.scalars[key.substr(7)] = value;
  }
  return state;
}

std::vector<ParamGroup> decay_groups(const std::vector<Tensor>& params, double lr,
                                     double weight_decay) {
  ParamGroup decay{.params = {}, .lr = lr, .weight_decay = weight_decay, .name = "decay"};
  ParamGroup no_decay{.params = {}, .lr = lr, .weight_decay = 0.0, .name = "no_decay"};
  for (const auto& p : params) (p.dim() >= 2 ? decay : no_decay).params.push_back(p);
  std::vector<ParamGroup> groups;
  if (!decay.params.empty()) groups.push_back(std::move(decay));
  if (!no_decay.params.empty()) groups.push_back(std::move(no_decay));
  return groups;
}

}  // namespace tessera::optim
