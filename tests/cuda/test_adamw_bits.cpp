// AdamW on the GPU (the multi-tensor CUDA kernel: what DDP and ZeRO without offload run) and
// on the CPU (the host loop: what ZeRO-Offload runs) give the same bits for the same inputs,
// step after step: both are core/adamw_math.h's update with the same coefficients, every
// operation rounded on its own. Odd sizes (chunk tails, sizes that are not multiples of the
// CPU's vector width), a schedule changing lr, weight decay on the matrices, and mixed
// precision (bf16 parameters with f32 masters, and the offload form of it: an f32 master
// updated on the host from the gradient rounded through bf16).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "tessera/optim/adamw.h"
#include "tessera/optim/clip.h"
#include "tests/cuda/cuda_test_util.h"

using namespace tessera;
using namespace tessera::cuda_test;

namespace {

// Odd shapes: rank 2 (weight decay) and rank 1 (none); 70001 spans three kernel chunks.
const std::vector<Shape> kShapes = {{37, 19}, {1}, {70001}, {3, 5, 7}, {257}};

std::vector<uint32_t> bits(const Tensor& t) {
  const Tensor c = raw::contiguous(raw::to(t, Device::cpu(), DType::f32));
  const std::vector<float> v = c.to_vector<float>();
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

size_t differing(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

const optim::AdamWOptions kOptions{
    .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

// The f32 masters of a mixed-precision AdamW for `params` (the state dict counts parameters
// in its groups' order: decay first).
std::vector<Tensor> masters(const optim::AdamW& opt, const std::vector<Tensor>& params) {
  const optim::OptimizerStateDict state = opt.state_dict();
  const std::vector<Tensor> order = opt.parameters();
  std::vector<Tensor> out;
  for (const Tensor& p : params) {
    const auto at =
        std::find_if(order.begin(), order.end(), [&](const Tensor& t) { return t.is_same(p); });
    out.push_back(state.tensors.at("state." + std::to_string(at - order.begin()) + ".master"));
  }
  return out;
}

// Runs `steps` AdamW steps on both devices with the same random gradients (of grad_dtype)
// and checks every parameter (and master, with master_weights) bit for bit after each step.
// offset_grads: the device gradients are views one element into a larger buffer (as DDP's
// bucket views may be), so the kernel's unaligned path runs instead of its 16-byte packs.
void expect_same_bits(DType param_dtype, bool master_weights, int steps,
                      bool offset_grads = false) {
  Generator gen(7);
  std::vector<Tensor> host, device;
  for (const Shape& s : kShapes) {
    const Tensor start = raw::to(normal(s, 0, 1, {}, &gen), Device::cpu(), param_dtype);
    host.push_back(raw::clone(start).requires_grad_(true));
    device.push_back(raw::to(start, dev(), param_dtype).requires_grad_(true));
  }
  optim::AdamWOptions opts = kOptions;
  opts.master_weights = master_weights;
  optim::AdamW host_opt(host, opts), device_opt(device, opts);
  for (int step = 1; step <= steps; ++step) {
    const double lr = kOptions.lr * (1.0 - 0.11 * step);  // a decaying schedule
    host_opt.set_lr(lr);
    device_opt.set_lr(lr);
    for (size_t i = 0; i < host.size(); ++i) {
      const Tensor g =
          raw::to(normal(host[i].shape(), 0.1, 0.5 / step, {}, &gen), Device::cpu(), param_dtype);
      host[i].set_grad(g);
      Tensor dg = raw::to(g, dev(), param_dtype);
      if (offset_grads) {
        Tensor buffer = zeros({g.numel() + 1}, {.dtype = param_dtype, .device = dev()});
        Tensor view = raw::view(raw::narrow(buffer, 0, 1, g.numel()), g.shape());
        raw::copy_(view, dg);
        dg = view;
      }
      device[i].set_grad(dg);
    }
    host_opt.step();
    device_opt.step();
    for (size_t i = 0; i < host.size(); ++i)
      ASSERT_EQ(differing(bits(host[i]), bits(device[i])), 0u)
          << dtype_name(param_dtype) << " parameter " << i << " " << shape_str(host[i].shape())
          << " after step " << step;
    if (!master_weights) continue;
    const std::vector<Tensor> hm = masters(host_opt, host), dm = masters(device_opt, device);
    for (size_t i = 0; i < hm.size(); ++i)
      ASSERT_EQ(differing(bits(hm[i]), bits(dm[i])), 0u)
          << "master " << i << " after step " << step;
  }
  const optim::OptimizerStateDict hs = host_opt.state_dict(), ds = device_opt.state_dict();
  for (const auto& [key, t] : hs.tensors)
    EXPECT_EQ(differing(bits(t), bits(ds.tensors.at(key))), 0u) << key;
}

}  // namespace

TEST(CudaAdamWBits, Float32ParametersMatchTheCpuBitForBit) {
  TESSERA_REQUIRE_GPU();
  expect_same_bits(DType::f32, false, 6);
}

TEST(CudaAdamWBits, Bf16ParametersWithMastersMatchTheCpuBitForBit) {
  TESSERA_REQUIRE_GPU();
  expect_same_bits(DType::bf16, true, 6);
}

TEST(CudaAdamWBits, UnalignedGradientViewsMatchTheCpuBitForBit) {
  TESSERA_REQUIRE_GPU();
  expect_same_bits(DType::f32, false, 3, /*offset_grads=*/true);
  expect_same_bits(DType::bf16, true, 3, /*offset_grads=*/true);
}

// ZeRO-Offload's form: the device keeps bf16 parameters with f32 masters (the fused kernel
// reads the bf16 gradient); the host updates an f32 master as a plain f32 parameter from the
// gradient rounded through bf16. Same masters, and the bf16 parameters are their rounding.
TEST(CudaAdamWBits, OffloadedMasterUpdateMatchesTheDeviceKernel) {
  TESSERA_REQUIRE_GPU();
  Generator gen(9);
  std::vector<Tensor> host_masters, device;
  for (const Shape& s : kShapes) {
    const Tensor start = raw::to(normal(s, 0, 1, {}, &gen), Device::cpu(), DType::bf16);
    host_masters.push_back(raw::to(start, Device::cpu(), DType::f32).requires_grad_(true));
    device.push_back(raw::to(start, dev(), DType::bf16).requires_grad_(true));
  }
  optim::AdamWOptions device_opts = kOptions;
  device_opts.master_weights = true;
  optim::AdamW host_opt(host_masters, kOptions), device_opt(device, device_opts);
  for (int step = 1; step <= 5; ++step) {
    for (size_t i = 0; i < device.size(); ++i) {
      const Tensor g =
          raw::to(normal(device[i].shape(), 0, 0.3, {}, &gen), Device::cpu(), DType::bf16);
      host_masters[i].set_grad(raw::to(g, Device::cpu(), DType::f32));
      device[i].set_grad(raw::to(g, dev(), DType::bf16));
    }
    host_opt.step();
    device_opt.step();
    const std::vector<Tensor> dm = masters(device_opt, device);
    for (size_t i = 0; i < device.size(); ++i) {
      ASSERT_EQ(differing(bits(host_masters[i]), bits(dm[i])), 0u)
          << "master " << i << " after step " << step;
      ASSERT_EQ(
          differing(bits(raw::to(host_masters[i], Device::cpu(), DType::bf16)), bits(device[i])),
          0u)
          << "bf16 parameter " << i << " after step " << step;
    }
  }
}

namespace {

// Whether two tensors of one dtype hold the same bytes.
bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ca = raw::contiguous(raw::to(a, Device::cpu(), a.dtype()));
  const Tensor cb = raw::contiguous(raw::to(b, Device::cpu(), b.dtype()));
  return ca.dtype() == cb.dtype() && ca.numel() == cb.numel() &&
         std::memcmp(ca.raw_data(), cb.raw_data(), ca.numel() * dtype_size(ca.dtype())) == 0;
}

// Clipping folded into the step (Optimizer::clip_grads_in_next_step, what `tessera train` runs)
// against clip_grad_norm_on_device_ followed by step: the same parameters, masters and moments
// bit for bit, step after step. The folded form leaves the multi-tensor kernel's gradients as
// they were; an f64 parameter (no multi-tensor update) has its gradient clipped in place first.
void expect_folded_clip_matches(DType param_dtype, bool master_weights, double max_norm,
                                bool offset_grads) {
  Generator gen(11);
  std::vector<Tensor> first, folded;
  std::vector<Shape> shapes = kShapes;
  shapes.push_back({6, 9});  // the f64 parameter
  for (size_t i = 0; i < shapes.size(); ++i) {
    const DType dtype = i + 1 == shapes.size() ? DType::f64 : param_dtype;
    const Tensor start = raw::to(normal(shapes[i], 0, 1, {}, &gen), dev(), dtype);
    first.push_back(raw::clone(start).requires_grad_(true));
    folded.push_back(raw::clone(start).requires_grad_(true));
  }
  optim::AdamWOptions opts = kOptions;
  opts.master_weights = master_weights;
  optim::AdamW first_opt(first, opts), folded_opt(folded, opts);
  bool clipped = false;
  for (int step = 1; step <= 4; ++step) {
    std::vector<Tensor> grads;
    for (size_t i = 0; i < first.size(); ++i) {
      const Tensor g = raw::to(normal(first[i].shape(), 0.1, 0.5 / step, {}, &gen), dev(),
                               first[i].dtype());
      grads.push_back(g);
      first[i].set_grad(raw::clone(g));
      Tensor dg = raw::clone(g);
      if (offset_grads) {
        Tensor buffer = zeros({g.numel() + 1}, {.dtype = g.dtype(), .device = dev()});
        dg = raw::view(raw::narrow(buffer, 0, 1, g.numel()), g.shape());
        raw::copy_(dg, g);
      }
      folded[i].set_grad(dg);
    }
    const Tensor norm_first = optim::clip_grad_norm_on_device_(first, max_norm);
    first_opt.step();
    const Tensor norm = optim::clip_grad_norm_on_device_(folded, 0.0);
    folded_opt.clip_grads_in_next_step(norm, max_norm);
    folded_opt.step();
    ASSERT_TRUE(same_bytes(norm, norm_first)) << "the norms differ at step " << step;
    clipped = clipped || max_norm / (norm.item() + 1e-6) < 1.0;
    for (size_t i = 0; i + 1 < folded.size(); ++i)
      ASSERT_TRUE(same_bytes(folded[i].grad(), grads[i]))
          << "the folded clip wrote gradient " << i << " at step " << step;
    const optim::OptimizerStateDict a = first_opt.state_dict(), b = folded_opt.state_dict();
    for (const auto& [key, t] : a.tensors)
      ASSERT_TRUE(same_bytes(t, b.tensors.at(key))) << key << " after step " << step;
    for (size_t i = 0; i < first.size(); ++i)
      ASSERT_TRUE(same_bytes(first[i], folded[i]))
          << dtype_name(first[i].dtype()) << " parameter " << i << " after step " << step;
  }
  EXPECT_EQ(clipped, max_norm < 1.0) << "max_norm " << max_norm << " should "
                                     << (max_norm < 1.0 ? "" : "not ") << "have clipped";
}

}  // namespace

TEST(CudaAdamWBits, ClippingFoldedIntoTheStepMatchesClippingFirst) {
  TESSERA_REQUIRE_GPU();
  for (double max_norm : {0.5, 1e6}) {
    SCOPED_TRACE("max_norm " + std::to_string(max_norm));
    expect_folded_clip_matches(DType::f32, false, max_norm, false);
    expect_folded_clip_matches(DType::bf16, true, max_norm, false);
    expect_folded_clip_matches(DType::bf16, true, max_norm, /*offset_grads=*/true);
    if (HasFatalFailure()) return;
  }
}
