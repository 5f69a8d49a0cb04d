#include "tessera/optim/adamw.h"

#include <cmath>
#include <functional>
#include <map>

#include "tessera/core/graph_capture.h"
#include "tessera/kernels/fused_table.h"
#include "tessera/kernels/ops.h"
#include "tessera/optim/adamw_cpu.h"
#include "tessera/optim/clip.h"
#include "tessera/optim/fused_update.h"

namespace tessera::optim {

namespace {

// Any device: the same formula from tape-free ops (one kernel launch per term).
void adamw_generic(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                   const AdamWCoefficients<double>& c) {
  const Tensor gs = ops::to(g, g.device(), m.dtype());
  ops::binary_(BinaryOp::Mul, p, c.decay);
  ops::binary_(BinaryOp::Mul, m, c.beta1);
  ops::binary_(BinaryOp::Add, m, ops::mul(gs, c.one_minus_beta1));
  ops::binary_(BinaryOp::Mul, v, c.beta2);
  ops::binary_(BinaryOp::Add, v, ops::mul(ops::mul(gs, gs), c.one_minus_beta2));
  Tensor denom = ops::unary(UnaryOp::Sqrt, v);
  ops::binary_(BinaryOp::Div, denom, c.bias_correction2_sqrt);
  ops::binary_(BinaryOp::Add, denom, c.eps);
  ops::binary_(BinaryOp::Sub, p, ops::mul(ops::div(m, denom), c.step_size));
}

}  // namespace

AdamW::AdamW(const std::vector<Tensor>& params, AdamWOptions opts)
    : AdamW(decay_groups(params, opts.lr, opts.weight_decay), opts) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions opts)
    : Optimizer(std::move(groups)), opts_(opts) {
  TESSERA_CHECK(opts.beta1 >= 0 && opts.beta1 < 1 && opts.beta2 >= 0 && opts.beta2 < 1,
                "AdamW: betas must lie in [0, 1), got (", opts.beta1, ", ", opts.beta2, ")");
  TESSERA_CHECK(opts.eps >= 0, "AdamW: eps must be >= 0, got ", opts.eps);
}

namespace {
// A parameter updated by its device's multi-tensor kernel (one launch per group and step;
// kernels/fused_table.h): an f32 parameter, or an f16/bf16 one with its f32 master.
struct MultiTensorItem {
  Tensor p, g, m, v, master;
  int64_t step;
  size_t index;  // flat parameter index
};

// Where a launch being recorded in a CUDA graph reads its lr and bias corrections (given its
// parameters' flat indices); empty outside a capture.
using ReplaySlotFor = std::function<const float*(std::vector<size_t> params)>;

constexpr size_t kMaxRecordedLaunches = 256;
constexpr size_t kSlotFloats = 4;  // kAdamWReplayScalars (+ padding)
static_assert(kAdamWReplayScalars <= kSlotFloats);

MultiTensorAdamWConfig multi_tensor_config(const ParamGroup& group, const AdamWOptions& opts,
                                           int64_t step) {
  return {.lr = group.lr,
          .beta1 = opts.beta1,
          .beta2 = opts.beta2,
          .eps = opts.eps,
          .weight_decay = group.weight_decay,
          .step = step,
          .grad_scale = 1.0f};
}

bool fits_multi_tensor(const Tensor& p, const Tensor& g, const Tensor& master) {
  return fused_kernel_table(p.device().type).multi_tensor_adamw != nullptr &&
         (p.dtype() == DType::f32 || master.defined()) && p.is_contiguous() && g.is_contiguous();
}

bool is_low_precision(DType t) { return t == DType::f16 || t == DType::bf16; }

void run_multi_tensor(std::vector<MultiTensorItem>& items, const ParamGroup& group,
                      const AdamWOptions& opts, const ReplaySlotFor& replay_slot_for,
                      const Tensor& clip_norm, double clip_max_norm) {
  // Parameters skipped in earlier steps have other step counts: one launch per count.
  std::map<int64_t, std::vector<MultiTensorItem*>> by_step;
  for (auto& item : items) by_step[item.step].push_back(&item);
  for (auto& [step, batch] : by_step) {
    std::vector<Tensor> ps, gs, ms, vs, masters;
    std::vector<size_t> indices;
    for (auto* item : batch) {
      indices.push_back(item->index);
      ps.push_back(item->p);
      gs.push_back(item->g);
      ms.push_back(item->m);
      vs.push_back(item->v);
      masters.push_back(item->master);
      item->p.impl().version++;
    }
    MultiTensorAdamWConfig cfg = multi_tensor_config(group, opts, step);
    cfg.replay_scalars = replay_slot_for ? replay_slot_for(std::move(indices)) : nullptr;
    if (clip_norm.defined()) {
      cfg.clip_norm = clip_norm.data<float>();
      cfg.clip_max_norm = clip_max_norm;
    }
    // fits_multi_tensor admitted only parameters whose device has the kernel.
    fused_kernel_table(ps.front().device().type)
        .multi_tensor_adamw(ps, gs, ms, vs, masters, std::vector<bool>(ps.size(), true), cfg);
  }
}

// One update of `target` (a parameter without master) from gradient g.
void update_one(const Tensor& target, const Tensor& g, const Tensor& m, const Tensor& v,
                const AdamWCoefficients<double>& c) {
  detail::update_in_place(target, [&](const Tensor& pc) {
    if (pc.device().is_cpu() && m.dtype() == detail::state_dtype(pc.dtype()))
      detail::adamw_cpu(pc, g, m, v, c);
    else
      adamw_generic(pc, g, m, v, c);
  });
}

// One update of an f16/bf16 parameter through its f32 master: on the CPU in one pass when the
// operands allow it, else the master's update followed by the rounded copy (the same bits).
void update_with_master(const Tensor& p, const Tensor& master, const Tensor& grad, const Tensor& m,
                        const Tensor& v, const AdamWCoefficients<double>& c) {
  if (p.device().is_cpu() && master.device().is_cpu() && p.is_contiguous() &&
      grad.is_contiguous() && grad.shape() == p.shape() && grad.device().is_cpu() &&
      (grad.dtype() == p.dtype() || grad.dtype() == DType::f32)) {
    detail::adamw_cpu_master(p, master, grad, m, v, c);
    master.impl().version++;
  } else {
    update_one(master, detail::grad_like_param(master, grad, "AdamW::step"), m, v, c);
    ops::copy_(p, master);
  }
  p.impl().version++;
}
}  // namespace

const float* AdamW::replay_slot(size_t launch, Device device) {
  TESSERA_CHECK(launch < kMaxRecordedLaunches, "AdamW: more than ", kMaxRecordedLaunches,
                " multi-tensor launches in one step cannot be recorded in a CUDA graph");
  if (!replay_scalars_.defined())
    replay_scalars_ = zeros({int64_t(kMaxRecordedLaunches * kSlotFloats)},
                            {.dtype = DType::f32, .device = device});
  return replay_scalars_.data<float>() + launch * kSlotFloats;
}

void AdamW::upload_replay_scalars() {
  std::vector<float> values(recorded_.size() * kSlotFloats, 0.f);
  for (size_t k = 0; k < recorded_.size(); ++k) {
    const RecordedLaunch& launch = recorded_[k];
    const int64_t step = state(launch.params.front()).step;
    adamw_replay_scalars(multi_tensor_config(groups_[launch.group], opts_, step),
                         values.data() + k * kSlotFloats);
  }
  // A small host-to-device copy: staged and queued, so it lands after the previous replay
  // (which read the old values) and before the next one.
  ops::copy_(ops::narrow(replay_scalars_, 0, 0, int64_t(values.size())),
             from_vector(values, {int64_t(values.size())}));
}

void AdamW::graph_recorded() {
  // The capture ran apply_step: step counts are already those of the recorded step.
  if (!recorded_.empty()) upload_replay_scalars();
}

void AdamW::prepare_graph_replay() {
  // Replays the multi-tensor launches recorded in the last capture: their parameters' step
  // counts advance and each launch's lr and bias corrections go to its device slot.
  if (!step_gate_open()) return;
  TESSERA_CHECK(!recorded_.empty(),
                "AdamW::prepare_graph_replay: no step was recorded in a CUDA graph");
  for (const RecordedLaunch& launch : recorded_) {
    const int64_t step = state(launch.params.front()).step + 1;
    for (size_t i : launch.params) {
      TESSERA_CHECK(state(i).step + 1 == step,
                    "AdamW::prepare_graph_replay: parameters of one "
                    "recorded launch are at different steps (",
                    state(i).step + 1, " vs ", step, ")");
      state(i).step = step;
    }
  }
  upload_replay_scalars();
}

void AdamW::apply_step() {
  const bool recording = graph_capture_underway();
  if (recording) recorded_.clear();
  // A pending clip (clip_grads_in_next_step): the multi-tensor kernel reads its norm where it
  // lies when that is an f32 on the parameters' device; other gradients are clipped in place
  // before their update.
  const PendingClip& clip = pending_clip();
  size_t index = 0;
  for (size_t group_index = 0; group_index < groups_.size(); ++group_index) {
    const ParamGroup& group = groups_[group_index];
    std::vector<MultiTensorItem> multi_tensor;
    for (const auto& p : group.params) {
      ParamState& s = state(index++);
      if (!in_this_pass(index - 1)) continue;
      const Tensor grad = p.grad();
      if (!grad.defined()) continue;
      const bool keep_master = opts_.master_weights && is_low_precision(p.dtype());
      if (s.tensors.empty()) {
        const TensorOptions sopts{.dtype = detail::state_dtype(p.dtype()), .device = p.device()};
        s.tensors["exp_avg"] = zeros(p.shape(), sopts);
        s.tensors["exp_avg_sq"] = zeros(p.shape(), sopts);
      }
      if (keep_master && !s.tensors.count("master"))
        s.tensors["master"] = ops::contiguous(ops::clone(ops::to(p, p.device(), DType::f32)));
      const Tensor master = keep_master ? s.tensors["master"] : Tensor();
      const Tensor& m = s.tensors["exp_avg"];
      const Tensor& v = s.tensors["exp_avg_sq"];
      s.step += 1;
      // With a master the fused kernel reads the gradient in its own dtype (as f32).
      if (keep_master) {
        TESSERA_CHECK(grad.shape() == p.shape() && grad.device() == p.device(),
                      "AdamW::step: gradient ", shape_str(grad.shape()), " on ",
                      grad.device().str(), " does not match parameter ", shape_str(p.shape()),
                      " on ", p.device().str());
      }
      Tensor direct_grad = keep_master ? grad : detail::grad_like_param(p, grad, "AdamW::step");
      const bool norm_readable = !clip.norm.defined() || (clip.norm.device() == p.device() &&
                                                          clip.norm.dtype() == DType::f32);
      if (norm_readable && fits_multi_tensor(p, direct_grad, master)) {
        multi_tensor.push_back({p, direct_grad, m, v, master, s.step, index - 1});
        continue;
      }
      if (clip.norm.defined()) {
        clip_grads_by_norm_({grad}, clip.norm, clip.max_norm);
        if (!keep_master) direct_grad = detail::grad_like_param(p, grad, "AdamW::step");
      }
      // Its coefficients would be frozen into the graph's kernel arguments.
      TESSERA_CHECK(!recording, "AdamW: parameter ", index - 1, " (", shape_str(p.shape()), " ",
                    dtype_name(p.dtype()), " on ", p.device().str(),
                    ") has no multi-tensor "
                    "update, which a CUDA graph needs");
      const AdamWCoefficients<double> c = adamw_coefficients(group.lr, opts_.beta1, opts_.beta2,
                                                             opts_.eps, group.weight_decay, s.step);
      if (keep_master)
        update_with_master(p, master, grad, m, v, c);
      else
        update_one(p, direct_grad, m, v, c);
    }
    ReplaySlotFor slot_for;
    if (recording && !multi_tensor.empty()) {
      const Device device = multi_tensor.front().p.device();
      slot_for = [this, group_index, device](std::vector<size_t> params) {
        const float* slot = replay_slot(recorded_.size(), device);
        recorded_.push_back({group_index, std::move(params)});
        return slot;
      };
    } else if (!multi_tensor.empty() && !multi_tensor.front().p.device().is_cpu()) {
      // Before any capture, so that the slots are ordinary device memory rather than part of
      // a graph's private pool.
      replay_slot(0, multi_tensor.front().p.device());
    }
    run_multi_tensor(multi_tensor, group, opts_, slot_for, clip.norm, clip.max_norm);
  }
}

}  // namespace tessera::optim
