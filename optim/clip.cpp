#include "tessera/optim/clip.h"

#include <cmath>

#include "tessera/kernels/fused_table.h"
#include "tessera/kernels/ops.h"
#include "tessera/optim/fused_update.h"

namespace tessera::optim {

namespace {

template <class Fn>
void for_each_grad(const std::vector<Tensor>& params, Fn&& fn) {
  for (const auto& p : params) {
    const Tensor g = p.grad();
    if (g.defined()) fn(g);
  }
}

// Runs fn(T* data, n) on a contiguous CPU floating tensor's elements, writing back if
// it had to be made contiguous.
template <class Fn>
void with_cpu_floats(const Tensor& t, Fn&& fn) {
  Tensor work = t.is_contiguous() ? t : ops::contiguous(t);
  visit_dtype(work.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> ||
                  std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      fn(work.data<T>(), work.numel());
    } else {
      TESSERA_FAIL("gradient clipping: gradient dtype ", dtype_name(work.dtype()),
                   " is not floating point");
    }
  });
  if (!work.is_same(t) && !work.shares_storage(t)) ops::copy_(t, work);
}

}  // namespace

double grad_norm_squared(const std::vector<Tensor>& params) {
  double total = 0.0;
  std::vector<Tensor> device_grads;  // summed on their device, read back once
  for_each_grad(params, [&](const Tensor& g) {
    if (!g.device().is_cpu()) {
      device_grads.push_back(g);
      return;
    }
    with_cpu_floats(g, [&](auto* data, int64_t n) {
      double sum = 0.0;
#pragma omp parallel for reduction(+ : sum) if (n > (1 << 15))
      for (int64_t i = 0; i < n; ++i) {
        const double v = static_cast<double>(static_cast<float>(data[i]));
        sum += v * v;
      }
      total += sum;
    });
  });
  if (device_grads.empty()) return total;
  // Contiguous gradients on one device with a fused norm kernel: one launch, one read back.
  const Device device = device_grads.front().device();
  if (auto fused_norm = fused_kernel_table(device.type).global_grad_norm) {
    bool one_launch = true;
    for (const auto& g : device_grads)
      one_launch = one_launch && g.device() == device && g.is_contiguous();
    if (one_launch) {
      const double norm = fused_norm(device_grads).item();
      return total + norm * norm;
    }
  }
  Tensor device_total;
  for (const auto& g : device_grads) {
    Tensor gf = ops::to(g, g.device(), DType::f32);
    Tensor s = ops::sum(ops::mul(gf, gf));
    device_total = device_total.defined() ? ops::add(device_total, s) : s;
  }
  return total + device_total.item();
}

double grad_norm(const std::vector<Tensor>& params) { return std::sqrt(grad_norm_squared(params)); }

namespace {

std::vector<Tensor> grads_of(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for_each_grad(params, [&](const Tensor& g) { grads.push_back(g); });
  return grads;
}

// Multiplies every gradient by factor; with check_finite, also reports whether all were finite
// (on a device that costs a reduction and a host read, so clipping skips it).
bool scale_grads(const std::vector<Tensor>& grads, double factor, bool check_finite) {
  bool finite = true;
  // Contiguous gradients on one device with a fused scale kernel: one launch instead of one
  // per tensor.
  if (!check_finite) {
    const auto fused_scale =
        grads.empty() ? nullptr
                      : fused_kernel_table(grads.front().device().type).multi_tensor_scale;
    bool one_launch = fused_scale != nullptr;
    for (const auto& g : grads)
      one_launch = one_launch && g.device() == grads.front().device() && g.is_contiguous();
    if (one_launch) {
      fused_scale(grads, factor);
      return true;
    }
  }
  Tensor device_probe;  // sum of g*0 over non-CPU grads: NaN iff some element is inf/NaN
  for (const Tensor& g : grads) {
    if (g.device().is_cpu()) {
      with_cpu_floats(g, [&](auto* data, int64_t n) {
        using T = std::remove_pointer_t<decltype(data)>;
        using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
        const A f = static_cast<A>(factor);
        int bad = 0;
#pragma omp parallel for reduction(| : bad) if (n > (1 << 15))
        for (int64_t i = 0; i < n; ++i) {
          const A v = static_cast<A>(data[i]);
          bad |= !std::isfinite(v);
          data[i] = static_cast<T>(v * f);
        }
        if (bad) finite = false;
      });
    } else {
      if (check_finite) {
        Tensor probe = ops::sum(ops::mul(ops::to(g, g.device(), DType::f32), 0.0));
        device_probe = device_probe.defined() ? ops::add(device_probe, probe) : probe;
      }
      ops::binary_(BinaryOp::Mul, g, factor);
    }
    g.impl().version++;
  }
  if (device_probe.defined() && !std::isfinite(device_probe.item())) finite = false;
  return finite;
}

// clip_grad_norm_'s scaling of `grads` for a norm read on the host.
void clip_by_host_norm(const std::vector<Tensor>& grads, double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  // PyTorch multiplies by the clamped coefficient even for non-finite norms (NaN grads).
  if (coef < 1.0 || !std::isfinite(norm)) scale_grads(grads, std::min(coef, 1.0), false);
}

}  // namespace

void scale_grads_(const std::vector<Tensor>& params, double factor) {
  scale_grads(grads_of(params), factor, /*check_finite=*/false);
}

bool scale_grads_and_check_finite_(const std::vector<Tensor>& params, double factor) {
  return scale_grads(grads_of(params), factor, /*check_finite=*/true);
}

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) {
  TESSERA_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be > 0, got ", max_norm);
  const double norm = grad_norm(params);
  clip_by_host_norm(grads_of(params), norm, max_norm);
  return norm;
}

void clip_grads_by_norm_(const std::vector<Tensor>& grads, const Tensor& norm, double max_norm) {
  TESSERA_CHECK(max_norm > 0, "clip_grads_by_norm_: max_norm must be > 0, got ", max_norm);
  TESSERA_CHECK(norm.defined() && norm.numel() == 1 && is_floating(norm.dtype()),
                "clip_grads_by_norm_: the norm must be one floating value");
  if (grads.empty()) return;
  const Device device = grads.front().device();
  const auto fused_clip = fused_kernel_table(device.type).multi_tensor_clip;
  bool on_device = fused_clip != nullptr && norm.device() == device && norm.dtype() == DType::f32;
  for (const Tensor& g : grads) on_device = on_device && g.device() == device && g.is_contiguous();
  if (on_device)
    fused_clip(grads, norm, max_norm);
  else
    clip_by_host_norm(grads, norm.item(), max_norm);
}

Tensor clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm) {
  const std::vector<Tensor> grads = grads_of(params);
  TESSERA_CHECK(!grads.empty(), "clip_grad_norm_on_device_: no parameter has a gradient");
  const Device device = grads.front().device();
  const FusedKernelTable& fused = fused_kernel_table(device.type);
  TESSERA_CHECK(fused.global_grad_norm && fused.multi_tensor_clip,
                "clip_grad_norm_on_device_: ", device.str(), " has no fused norm and clip kernels");
  for (const Tensor& g : grads)
    TESSERA_CHECK(g.device() == device && g.is_contiguous(),
                  "clip_grad_norm_on_device_: gradients "
                  "must be contiguous and on one device; got one of shape ",
                  shape_str(g.shape()), " on ", g.device().str(),
                  g.is_contiguous() ? "" : " (not contiguous)");
  const Tensor norm = fused.global_grad_norm(grads);
  if (max_norm > 0) fused.multi_tensor_clip(grads, norm, max_norm);
  return norm;
}

}  // namespace tessera::optim
