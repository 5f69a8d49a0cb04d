// The fused element-wise routes of kernels/fused_table.h, on the CPU row and, where there is
// one, on the GPU's: dropout (its mask drawn in the kernel) against the composition it
// replaces (rand, compare, scale, multiply) bit for bit, the generator left in the same state;
// the exact GELU against the composition (bit for bit in f32, where both round each step to
// f32) and against float64 (values and slopes; the slope also against central differences).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tessera/autograd/functions.h"
#include "tessera/core/allocator.h"
#include "tessera/core/random.h"
#include "tessera/kernels/fused_table.h"
#include "tessera/kernels/ops.h"

namespace tessera::test {
namespace {

std::vector<Device> devices() {
  std::vector<Device> all = {Device::cpu()};
  if (cuda_device_count() > 0) all.push_back(Device::cuda());
  return all;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = ops::contiguous(ops::to(a, Device::cpu(), a.dtype()));
  const Tensor y = ops::contiguous(ops::to(b, Device::cpu(), b.dtype()));
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

// Normal(0, scale) values, some of them huge, in `dtype` on `device`.
Tensor random_values(const Shape& shape, DType dtype, Device device, uint64_t seed,
                     double scale = 2.0) {
  Generator g(seed);
  return ops::to(normal(shape, 0.0, scale, {.dtype = DType::f64}, &g), device, dtype);
}

// What dropout computed before its fused route: the mask from rand(), kept scaled by 1/(1-p).
Tensor composed_mask(const Shape& shape, double p, DType dtype, Device device, Generator* g) {
  const Tensor uniform = rand(shape, {.dtype = DType::f32, .device = device}, g);
  const Tensor keep = ops::to(ops::binary(BinaryOp::Ge, uniform, p), device, dtype);
  return p < 1.0 ? ops::mul(keep, 1.0 / (1.0 - p)) : keep;
}

TEST(FusedDropout, TheCpuRowHasTheRoute) {
  EXPECT_TRUE(dropout_takes(zeros({3, 5})));
  EXPECT_FALSE(dropout_takes(zeros({5, 3}).transpose(0, 1))) << "non-contiguous: the composition";
  EXPECT_FALSE(dropout_takes(zeros({3}, {.dtype = DType::i64})));
  EXPECT_TRUE(gelu_erf_takes(zeros({3, 5}, {.dtype = DType::bf16})));
  EXPECT_DOUBLE_EQ(dropout_kept_scale(0.5, DType::bf16), 2.0);
  EXPECT_DOUBLE_EQ(dropout_kept_scale(1.0, DType::f32), 1.0);
  EXPECT_EQ(dropout_kept_scale(0.1, DType::bf16), 1.109375) << "1/0.9 rounded to bf16";
  EXPECT_EQ(dropout_kept_scale(0.1, DType::f32), static_cast<double>(1.0f / 0.9f));
  // The entries refuse what their contract excludes, naming the operands.
  const FusedKernelTable& cpu = fused_kernel_table(DeviceType::CPU);
  try {
    cpu.dropout_forward(zeros({3, 5}), {0.5, 1, 0}, zeros({5, 3}));
    ADD_FAILURE() << "accepted an output of another shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dropout_forward: input and output"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(cpu.dropout_forward(zeros({3, 5}), {1.5, 1, 0}, zeros({3, 5})), Error);
}

// Forward and backward equal the composition's bits, for every dtype, several p (1 keeps
// nothing), a size that is no multiple of 4 or 8, from a generator already past its start;
// both routes leave the generator at the same offset.
TEST(FusedDropout, GivesTheCompositionsBitsAndLeavesTheGeneratorAlike) {
  for (Device device : devices())
    for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64})
      for (double p : {0.1, 0.5, 0.9, 1.0}) {
        SCOPED_TRACE(device.str() + " " + dtype_name(dtype) + " p " + std::to_string(p));
        const Shape shape{13, 77};
        const Tensor x = random_values(shape, dtype, device, 1);
        const Tensor dy = random_values(shape, dtype, device, 2);
        Generator composed(77), fused(77);
        composed.reserve(5);
        fused.reserve(5);
        const Tensor mask = composed_mask(shape, p, dtype, device, &composed);
        const Tensor want = ops::mul(x, mask), want_dx = ops::mul(dy, mask);
        ASSERT_TRUE(dropout_takes(x) || device.is_cuda()) << "the CPU row takes it";
        const Tensor leaf = x.detach().requires_grad_(true);
        const Tensor y = dropout(leaf, p, /*training=*/true, &fused);
        y.backward(dy);
        EXPECT_TRUE(same_bits(y, want)) << "forward";
        EXPECT_TRUE(same_bits(leaf.grad(), want_dx)) << "backward";
        EXPECT_EQ(fused.offset(), composed.offset());
        if (p < 1.0) {
          const double kept = ops::sum(ops::to(ops::binary(BinaryOp::Ne, mask, 0.0), Device::cpu(),
                                               DType::f64))
                                  .item();
          EXPECT_NEAR(kept / 1001.0, 1.0 - p, 0.06) << "about 1 - p of the elements kept";
        }
      }
}

// A non-contiguous input takes the composition, which indexes the draw by the logical
// position: the same bits as its contiguous copy through the fused route.
TEST(FusedDropout, NonContiguousInputDropsTheSameElements) {
  for (Device device : devices()) {
    SCOPED_TRACE(device.str());
    const Tensor x = random_values({77, 13}, DType::bf16, device, 3).transpose(0, 1);
    ASSERT_FALSE(x.is_contiguous());
    Generator a(5), b(5);
    const Tensor strided = dropout(x, 0.3, true, &a);
    const Tensor dense = dropout(ops::contiguous(x), 0.3, true, &b);
    EXPECT_TRUE(same_bits(strided, dense));
    EXPECT_EQ(a.offset(), b.offset());
  }
}

double gelu_erf_f64(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double gelu_erf_slope_f64(double x) {
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) +
         x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}

// max |got - want| / max |want| over the elements.
double max_rel(const Tensor& got, const std::vector<double>& want) {
  const std::vector<double> g = ops::to(got, Device::cpu(), DType::f64).to_vector<double>();
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(g[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

TEST(FusedGeluErf, MatchesFloat64AndTheF32Composition) {
  for (Device device : devices())
    for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      SCOPED_TRACE(device.str() + " " + dtype_name(dtype));
      const Shape shape{3, 5, 67};
      const Tensor x = random_values(shape, dtype, device, 11, 3.0);
      const Tensor dy = random_values(shape, dtype, device, 12);
      ASSERT_TRUE(gelu_erf_takes(x) || device.is_cuda());
      const Tensor leaf = x.detach().requires_grad_(true);
      const Tensor y = gelu_erf(leaf);
      y.backward(dy);
      EXPECT_EQ(autograd::meta_of(y).grad_fn->name, "GeluErfBackward");
      const std::vector<double> xs = ops::to(x, Device::cpu(), DType::f64).to_vector<double>();
      const std::vector<double> gs = ops::to(dy, Device::cpu(), DType::f64).to_vector<double>();
      std::vector<double> want(xs.size()), want_dx(xs.size());
      for (size_t i = 0; i < xs.size(); ++i) {
        want[i] = gelu_erf_f64(xs[i]);
        want_dx[i] = gs[i] * gelu_erf_slope_f64(xs[i]);
      }
      // One rounding to the dtype at the end (f32 and f64: a few more inside the formula).
      const double tol = dtype == DType::f64   ? 1e-14
                         : dtype == DType::f32 ? 1e-6
                         : dtype == DType::f16 ? 1e-3
                                               : 8e-3;
      EXPECT_LT(max_rel(y, want), tol) << "forward";
      EXPECT_LT(max_rel(leaf.grad(), want_dx), tol) << "backward";
      if (dtype == DType::f32) {
        NoGradGuard no_grad;
        const Tensor composed =
            ops::mul(ops::mul(x, 0.5),
                     ops::add(ops::unary(UnaryOp::Erf, ops::mul(x, M_SQRT1_2)), 1.0));
        EXPECT_TRUE(same_bits(y, composed)) << "the composition's f32 bits";
      }
    }
}

TEST(FusedGeluErf, SlopeMatchesCentralDifferences) {
  const Tensor x = random_values({257}, DType::f64, Device::cpu(), 13, 3.0);
  const Tensor leaf = x.detach().requires_grad_(true);
  gelu_erf(leaf).backward(ones({257}, {.dtype = DType::f64}));
  const std::vector<double> xs = x.to_vector<double>(), slope = leaf.grad().to_vector<double>();
  const double h = 1e-5;
  for (size_t i = 0; i < xs.size(); ++i)
    EXPECT_NEAR(slope[i], (gelu_erf_f64(xs[i] + h) - gelu_erf_f64(xs[i] - h)) / (2 * h), 1e-9)
        << "x = " << xs[i];
}

}  // namespace
}  // namespace tessera::test
