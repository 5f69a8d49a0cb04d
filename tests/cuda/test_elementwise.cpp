// fill, copy (conversion, strided), random (same numbers as the CPU), unary, binary, where.
#include <cmath>
#include <functional>

#include "cuda_test_util.h"
#include "tests/gelu_reference.h"

namespace tessera {
namespace {
using namespace cuda_test;

TEST(CudaElementwise, FillEveryDtypeAndStridedView) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64,
                  DType::u8, DType::boolean}) {
    Tensor out = poisoned({7, 33}, t);
    gpu().fill(out, 3.0);
    for (double v : values(out)) ASSERT_EQ(v, t == DType::boolean ? 1.0 : 3.0) << dtype_name(t);
  }
  // A strided column: only it changes.
  Tensor base = to_gpu(host_randn({5, 6}));
  const auto before = values(base);
  gpu().fill(raw::select(base, 1, 2), -1.5);
  const auto after = values(base);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(after[i], i % 6 == 2 ? -1.5 : before[i]) << i;
}

TEST(CudaElementwise, CopyConvertsLikeTheCpu) {
  TESSERA_REQUIRE_GPU();
  const std::vector<DType> types = {DType::f32, DType::f16, DType::bf16, DType::f64,
                                    DType::i32, DType::i64, DType::boolean};
  Tensor src_host = host_randn({33, 7}, DType::f64, 0.0, 40.0);
  for (DType from : types) {
    Tensor s_host = raw::to(src_host, Device::cpu(), from);
    Tensor s_dev = to_gpu(s_host);
    for (DType to : types) {
      Tensor ref = raw::to(s_host, Device::cpu(), to);  // the CPU kernel's conversion
      Tensor out = poisoned({33, 7}, to);
      gpu().copy(out, s_dev);
      EXPECT_EQ(values(out), values(ref)) << dtype_name(from) << " -> " << dtype_name(to);
    }
  }
}

TEST(CudaElementwise, CopyStridedSourcesAndDestinations) {
  TESSERA_REQUIRE_GPU();
  Tensor h = host_randn({9, 17, 5});
  Tensor d = to_gpu(h);
  // Transposed source -> contiguous destination (same dtype and bf16).
  for (DType to : {DType::f32, DType::bf16}) {
    Tensor src = raw::permute(d, {2, 0, 1});
    Tensor out = poisoned({5, 9, 17}, to);
    gpu().copy(out, src);
    Tensor ref = raw::contiguous(raw::to(raw::permute(h, {2, 0, 1}), Device::cpu(), to));
    EXPECT_EQ(values(out), values(ref));
  }
  // Broadcast source (stride 0) into a strided slice of a bigger tensor.
  Tensor row = to_gpu(host_randn({1, 5}));
  Tensor big = to_gpu(host_randn({9, 10}));
  const auto big_before = values(big);
  Tensor dst = raw::slice(big, 1, 0, 10, 2);  // every other column: [9, 5]
  gpu().copy(dst, raw::expand(row, {9, 5}));
  const auto got = values(big), r = values(row);
  for (int i = 0; i < 9; ++i)
    for (int j = 0; j < 10; ++j)
      EXPECT_EQ(got[i * 10 + j], j % 2 == 0 ? r[j / 2] : big_before[i * 10 + j]);
}

TEST(CudaElementwise, RandomMatchesCpuNumbers) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f64}) {
    Tensor cpu_u = empty({1001}, {.dtype = t}), gpu_u = poisoned({1001}, t);
    kernel_table(DeviceType::CPU).random(cpu_u, RandomKind::Uniform, 1234, 17, -2.0, 3.0);
    gpu().random(gpu_u, RandomKind::Uniform, 1234, 17, -2.0, 3.0);
    EXPECT_EQ(values(gpu_u), values(cpu_u)) << dtype_name(t);

    Tensor cpu_n = empty({1001}, {.dtype = t}), gpu_n = poisoned({1001}, t);
    kernel_table(DeviceType::CPU).random(cpu_n, RandomKind::Normal, 99, 5, 1.0, 0.5);
    gpu().random(gpu_n, RandomKind::Normal, 99, 5, 1.0, 0.5);
    // Same Philox words; the device's log/cos may differ from libm in the last double bit.
    expect_close(values(gpu_n), values(cpu_n), t == DType::f64 ? 1e-14 : tolerance(t) * 0.1,
                 "normal");
  }
  Tensor cpu_i = empty({777}, {.dtype = DType::i64}), gpu_i = poisoned({777}, DType::i64);
  kernel_table(DeviceType::CPU).random(cpu_i, RandomKind::Integer, 7, 0, -5, 50304);
  gpu().random(gpu_i, RandomKind::Integer, 7, 0, -5, 50304);
  EXPECT_EQ(values(gpu_i), values(cpu_i));
}

double ref_unary(UnaryOp op, double x) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return std::exp(x);
    case UnaryOp::Log: return std::log(x);
    case UnaryOp::Sqrt: return std::sqrt(x);
    case UnaryOp::Rsqrt: return 1 / std::sqrt(x);
    case UnaryOp::Abs: return std::fabs(x);
    case UnaryOp::Tanh: return std::tanh(x);
    case UnaryOp::Sigmoid: return 1 / (1 + std::exp(-x));
    case UnaryOp::Relu: return x > 0 ? x : 0;
    case UnaryOp::Gelu: return test::gelu_tanh(x);
    case UnaryOp::Sin: return std::sin(x);
    case UnaryOp::Cos: return std::cos(x);
    case UnaryOp::Square: return x * x;
    case UnaryOp::Reciprocal: return 1 / x;
    case UnaryOp::Sign: return (x > 0) - (x < 0);
    case UnaryOp::Floor: return std::floor(x);
    case UnaryOp::Ceil: return std::ceil(x);
    case UnaryOp::Round: return std::nearbyint(x);
    case UnaryOp::LogicalNot: return x == 0;
    case UnaryOp::Log1p: return std::log1p(x);
    case UnaryOp::Expm1: return std::expm1(x);
    case UnaryOp::Erf: return std::erf(x);
  }
  return 0;
}

TEST(CudaElementwise, UnaryOpsAgainstFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (int o = 0; o <= static_cast<int>(UnaryOp::Erf); ++o) {
      const UnaryOp op = static_cast<UnaryOp>(o);
      const bool positive = op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::Rsqrt ||
                            op == UnaryOp::Reciprocal || op == UnaryOp::Log1p;
      Tensor h = positive ? host_uniform({7, 33}, 0.5, 4.0, t) : host_randn({7, 33}, t, 0.0, 2.0);
      // Non-contiguous input: the transpose of a [33, 7] tensor.
      Tensor d = raw::transpose(to_gpu(raw::contiguous(raw::transpose(h, 0, 1))), 0, 1);
      Tensor out = poisoned({7, 33}, t);
      gpu().unary(op, d, out);
      std::vector<double> in = values(h), ref(in.size());
      for (size_t i = 0; i < in.size(); ++i) ref[i] = ref_unary(op, in[i]);
      // The reference rounded to the output dtype, as the kernel's result must be.
      ref = values(raw::to(from_vector(ref, {7, 33}, {.dtype = DType::f64}), Device::cpu(), t));
      expect_close(values(out), ref, tolerance(t), unary_op_name(op));
    }
  }
}

double ref_binary(BinaryOp op, double a, double b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::Pow: return std::pow(a, b);
    case BinaryOp::Maximum: return std::max(a, b);
    case BinaryOp::Minimum: return std::min(a, b);
    case BinaryOp::Eq: return a == b;
    case BinaryOp::Ne: return a != b;
    case BinaryOp::Lt: return a < b;
    case BinaryOp::Le: return a <= b;
    case BinaryOp::Gt: return a > b;
    case BinaryOp::Ge: return a >= b;
    case BinaryOp::LogicalAnd: return (a != 0) && (b != 0);
    case BinaryOp::LogicalOr: return (a != 0) || (b != 0);
    case BinaryOp::GeluBackward: return b * test::gelu_tanh_grad(a);
  }
  return 0;
}

TEST(CudaElementwise, BinaryOpsBroadcastAndMixedDtypes) {
  TESSERA_REQUIRE_GPU();
  for (int o = 0; o <= static_cast<int>(BinaryOp::GeluBackward); ++o) {
    const BinaryOp op = static_cast<BinaryOp>(o);
    const bool cmp = op >= BinaryOp::Eq && op <= BinaryOp::LogicalOr;
    // a: f32 [33, 7]; b: bf16 [1, 7] broadcast (stride 0 along dim 0). Promoted type f32.
    Tensor ah = op == BinaryOp::Pow ? host_uniform({33, 7}, 0.5, 2.0) : host_randn({33, 7});
    Tensor bh = host_randn({1, 7}, DType::bf16);
    if (cmp) bh = raw::to(raw::slice(ah, 0, 3, 4, 1), Device::cpu(), DType::bf16);  // ties
    Tensor a = to_gpu(ah), b = raw::expand(to_gpu(bh), {33, 7});
    const DType ot = cmp ? DType::boolean : DType::f32;
    Tensor out = poisoned({33, 7}, ot);
    gpu().binary(op, a, b, out);
    std::vector<double> av = values(ah), bv = values(bh), ref(av.size());
    for (size_t i = 0; i < av.size(); ++i) ref[i] = ref_binary(op, av[i], bv[i % 7]);
    if (!cmp) ref = values(raw::to(from_vector(ref, {33, 7}, {.dtype = DType::f64}), Device::cpu(), ot));
    expect_close(values(out), ref, cmp ? 0.0 : 1e-5, binary_op_name(op));
  }
}

TEST(CudaElementwise, BinaryIntegerArithmeticIsExact) {
  TESSERA_REQUIRE_GPU();
  std::vector<int64_t> a = {(int64_t{1} << 60) + 3, -7, 12, 0}, b = {5, 3, -4, 9};
  Tensor out = poisoned({4}, DType::i64);
  gpu().binary(BinaryOp::Add, to_gpu(from_vector(a, {4}, {.dtype = DType::i64})),
               to_gpu(from_vector(b, {4}, {.dtype = DType::i64})), out);
  EXPECT_EQ(out.to_vector<int64_t>(), (std::vector<int64_t>{(int64_t{1} << 60) + 8, -4, 8, 9}));
  // True division of integers into a float output.
  Tensor q = poisoned({4}, DType::f32);
  gpu().binary(BinaryOp::Div, to_gpu(from_vector(b, {4}, {.dtype = DType::i64})),
               to_gpu(from_vector(std::vector<int64_t>{2, 2, 8, 4}, {4}, {.dtype = DType::i64})), q);
  EXPECT_EQ(values(q), (std::vector<double>{2.5, 1.5, -0.5, 2.25}));
}

TEST(CudaElementwise, WhereSelectsPerElement) {
  TESSERA_REQUIRE_GPU();
  Tensor ch = host_randn({7, 9}), ah = host_randn({7, 9}, DType::bf16), bh = host_randn({1, 9}, DType::bf16);
  const auto c = values(ch);
  std::vector<bool> mask(c.size());
  for (size_t i = 0; i < c.size(); ++i) mask[i] = c[i] > 0;
  Tensor cond = to_gpu(from_vector(mask, {7, 9}, {.dtype = DType::boolean}));
  Tensor out = poisoned({7, 9}, DType::bf16);
  gpu().where(cond, to_gpu(ah), raw::expand(to_gpu(bh), {7, 9}), out);
  auto a = values(ah), b = values(bh), got = values(out);
  for (int i = 0; i < 63; ++i) EXPECT_EQ(got[i], c[i] > 0 ? a[i] : b[i % 9]) << i;
}

}  // namespace
}  // namespace tessera
