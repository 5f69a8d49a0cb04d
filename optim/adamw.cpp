#include "tessera/optim/adamw.h"

#include <cmath>
#include <functional>
#include <map>

#include "tessera/kernels/ops.h"
#include "tessera/core/fused_dispatch.h"
#include "tessera/core/graph_capture.h"
#include "tessera/optim/fused_update.h"

namespace tessera::optim {

namespace {

// Scalars of one AdamW step, in the moments' precision (as PyTorch's kernels use them).
template <class A>
struct AdamWCoeffs {
  A decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, bias_correction2_sqrt, eps;
};

template <class T, class A>
void adamw_cpu(T* p, const T* g, A* m, A* v, int64_t n, const AdamWCoeffs<A>& c) {
  detail::parallel_ranges(n, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const A grad = static_cast<A>(g[i]);
      A param = static_cast<A>(p[i]) * c.decay;
      const A mi = c.beta1 * m[i] + c.one_minus_beta1 * grad;
      const A vi = c.beta2 * v[i] + c.one_minus_beta2 * grad * grad;
      m[i] = mi;
      v[i] = vi;
      const A denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
      param -= c.step_size * (mi / denom);
      p[i] = static_cast<T>(param);
    }
  });
}

// Any device: the same formula from tape-free ops (one kernel launch per term).
void adamw_generic(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                   const AdamWCoeffs<double>& c) {
  const Tensor gs = raw::to(g, g.device(), m.dtype());
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
// core/fused_dispatch.h): an f32 parameter, or an f16/bf16 one with its f32 master.
struct MultiTensorItem {
  Tensor p, g, m, v, master;
  int64_t step;
  size_t index;  // flat parameter index
};

// Where a launch being recorded in a CUDA graph reads its lr and bias corrections (given its
// parameters' flat indices); empty outside a capture.
using ReplaySlotFor = std::function<float*(std::vector<size_t> params)>;

constexpr size_t kMaxRecordedLaunches = 256;
constexpr size_t kSlotFloats = 4;  // lr, bias1, bias2 (+ padding)

bool fits_multi_tensor(const Tensor& p, const Tensor& g, const Tensor& master) {
  return fused_kernel_table(p.device().type).multi_tensor_adamw != nullptr &&
         (p.dtype() == DType::f32 || master.defined()) &&
         p.is_contiguous() && g.is_contiguous();
}

bool is_low_precision(DType t) { return t == DType::f16 || t == DType::bf16; }

void run_multi_tensor(std::vector<MultiTensorItem>& items, const ParamGroup& group,
                      const AdamWOptions& opts, const ReplaySlotFor& replay_slot_for) {
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
    MultiTensorAdamWConfig cfg{.lr = float(group.lr), .beta1 = float(opts.beta1),
                          .beta2 = float(opts.beta2), .eps = float(opts.eps),
                          .weight_decay = float(group.weight_decay), .step = step,
                          .grad_scale = 1.0f,
                          .replay_scalars = replay_slot_for ? replay_slot_for(std::move(indices)) : nullptr};
    // fits_multi_tensor admitted only parameters whose device has the kernel.
    fused_kernel_table(ps.front().device().type)
        .multi_tensor_adamw(ps, gs, ms, vs, masters, std::vector<bool>(ps.size(), true), cfg);
  }
}

// One update of `target` (the parameter, or its f32 master) from gradient g.
void update_one(const Tensor& target, const Tensor& g, const Tensor& m, const Tensor& v,
                const AdamWCoeffs<double>& c) {
  detail::update_in_place(target, [&](const Tensor& pc) {
    if (pc.device().is_cpu() && m.dtype() == detail::state_dtype(pc.dtype())) {
      visit_dtype(pc.dtype(), [&](auto tag) {
        using T = decltype(tag);
        if constexpr (std::is_same_v<T, double>) {
          adamw_cpu<T, double>(pc.data<T>(), g.data<T>(), m.data<double>(), v.data<double>(),
                               pc.numel(), c);
        } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, Half> ||
                             std::is_same_v<T, BFloat16>) {
          const AdamWCoeffs<float> cf{
              float(c.decay),           float(c.beta1),     float(c.beta2),
              float(c.one_minus_beta1), float(c.one_minus_beta2), float(c.step_size),
              float(c.bias_correction2_sqrt), float(c.eps)};
          adamw_cpu<T, float>(pc.data<T>(), g.data<T>(), m.data<float>(), v.data<float>(),
                              pc.numel(), cf);
        }
      });
    } else {
      adamw_generic(pc, g, m, v, c);
    }
  });
}
}  // namespace

float* AdamW::replay_slot(size_t launch, Device device) {
  TESSERA_CHECK(launch < kMaxRecordedLaunches, "AdamW: more than ", kMaxRecordedLaunches,
                " multi-tensor launches in one step cannot be recorded in a CUDA graph");
  if (!replay_slots_) {
    Allocator* pinned = device_backend(device.type).pinned_host_allocator();
    TESSERA_CHECK(pinned != nullptr, "AdamW: ", device.str(), " has no page-locked host memory "
                  "for the values a CUDA graph replay reads");
    const size_t bytes = kMaxRecordedLaunches * kSlotFloats * sizeof(float);
    replay_slots_ = std::shared_ptr<float>(static_cast<float*>(pinned->allocate(bytes)),
                                           [pinned, bytes](float* p) { pinned->deallocate(p, bytes); });
  }
  return replay_slots_.get() + launch * kSlotFloats;
}

void AdamW::prepare_graph_replay() {
  if (!step_gate_open()) return;
  TESSERA_CHECK(!recorded_.empty(), "AdamW::prepare_graph_replay: no step was recorded in a CUDA graph");
  for (const RecordedLaunch& launch : recorded_) {
    const int64_t step = state(launch.params.front()).step + 1;
    for (size_t i : launch.params) {
      TESSERA_CHECK(state(i).step + 1 == step, "AdamW::prepare_graph_replay: parameters of one "
                    "recorded launch are at different steps (", state(i).step + 1, " vs ", step, ")");
      state(i).step = step;
    }
    launch.scalars[0] = static_cast<float>(groups_[launch.group].lr);
    launch.scalars[1] = adamw_bias_correction(static_cast<float>(opts_.beta1), step);
    launch.scalars[2] = adamw_bias_correction(static_cast<float>(opts_.beta2), step);
  }
}

void AdamW::apply_step() {
  const bool recording = graph_capture_underway();
  if (recording) recorded_.clear();
  size_t index = 0;
  for (size_t group_index = 0; group_index < groups_.size(); ++group_index) {
    const ParamGroup& group = groups_[group_index];
    std::vector<MultiTensorItem> multi_tensor;
    for (const auto& p : group.params) {
      ParamState& s = state(index++);
      const Tensor grad = p.grad();
      if (!grad.defined()) continue;
      const bool keep_master = opts_.master_weights && is_low_precision(p.dtype());
      if (s.tensors.empty()) {
        const TensorOptions sopts{.dtype = detail::state_dtype(p.dtype()), .device = p.device()};
        s.tensors["exp_avg"] = zeros(p.shape(), sopts);
        s.tensors["exp_avg_sq"] = zeros(p.shape(), sopts);
      }
      if (keep_master && !s.tensors.count("master"))
        s.tensors["master"] = raw::contiguous(raw::clone(raw::to(p, p.device(), DType::f32)));
      const Tensor master = keep_master ? s.tensors["master"] : Tensor();
      const Tensor& m = s.tensors["exp_avg"];
      const Tensor& v = s.tensors["exp_avg_sq"];
      s.step += 1;
      // With a master the fused kernel reads the gradient in its own dtype (as f32).
      if (keep_master) {
        TESSERA_CHECK(grad.shape() == p.shape() && grad.device() == p.device(), "AdamW::step: gradient ",
                      shape_str(grad.shape()), " on ", grad.device().str(), " does not match parameter ",
                      shape_str(p.shape()), " on ", p.device().str());
      }
      const Tensor direct_grad = keep_master ? grad : detail::grad_like_param(p, grad, "AdamW::step");
      if (fits_multi_tensor(p, direct_grad, master)) {
        multi_tensor.push_back({p, direct_grad, m, v, master, s.step, index - 1});
        continue;
      }
      // Its coefficients would be frozen into the graph's kernel arguments.
      TESSERA_CHECK(!recording, "AdamW: parameter ", index - 1, " (", shape_str(p.shape()), " ",
                    dtype_name(p.dtype()), " on ", p.device().str(), ") has no multi-tensor "
                    "update, which a CUDA graph needs");
      const double bc1 = 1.0 - std::pow(opts_.beta1, static_cast<double>(s.step));
      const double bc2 = 1.0 - std::pow(opts_.beta2, static_cast<double>(s.step));
      const AdamWCoeffs<double> c{1.0 - group.lr * group.weight_decay,
                                  opts_.beta1,
                                  opts_.beta2,
                                  1.0 - opts_.beta1,
                                  1.0 - opts_.beta2,
                                  group.lr / bc1,
                                  std::sqrt(bc2),
                                  opts_.eps};
      if (keep_master) {
        update_one(master, detail::grad_like_param(master, grad, "AdamW::step"), m, v, c);
        raw::copy_(p, master);
        p.impl().version++;
      } else {
        update_one(p, direct_grad, m, v, c);
      }
    }
    ReplaySlotFor slot_for;
    if (recording && !multi_tensor.empty()) {
      const Device device = multi_tensor.front().p.device();
      slot_for = [this, group_index, device](std::vector<size_t> params) {
        float* slot = replay_slot(recorded_.size(), device);
        recorded_.push_back({group_index, std::move(params), slot});
        return slot;
      };
    }
    run_multi_tensor(multi_tensor, group, opts_, slot_for);
  }
}

}  // namespace tessera::optim
