// Core tensor: views share memory and index correctly (checked against index arithmetic done
// here), factories, dtype conversion through copy, printing, and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "tessera/core/tensor.h"

using namespace tessera;

namespace {

// 0, 1, 2, ... as f32 in `shape`.
Tensor iota(const Shape& shape, DType dtype = DType::f32) {
  std::vector<double> v(shape_numel(shape));
  std::iota(v.begin(), v.end(), 0.0);
  return from_vector(v, shape, {.dtype = dtype});
}

std::vector<double> values(const Tensor& t) {
  return raw::contiguous(raw::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

template <class Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a tessera::Error mentioning " << parts.front();
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(Views, TransposeAndPermuteShareMemoryAndIndex) {
  const Tensor x = iota({2, 3, 4});
  const Tensor t = raw::transpose(x, 0, 2);  // [4, 3, 2]
  EXPECT_EQ(t.shape(), (Shape{4, 3, 2}));
  EXPECT_TRUE(t.shares_storage(x));
  EXPECT_FALSE(t.is_contiguous());
  const auto tv = values(t);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 2; ++k) EXPECT_EQ(tv[(i * 3 + j) * 2 + k], k * 12 + j * 4 + i);
  const Tensor p = raw::permute(x, {1, 2, 0});  // [3, 4, 2]
  const auto pv = values(p);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t k = 0; k < 2; ++k) EXPECT_EQ(pv[(i * 4 + j) * 2 + k], k * 12 + i * 4 + j);
  expect_error([&] { raw::permute(x, {0, 0, 1}); }, {"permute", "repeated"});
  expect_error([&] { raw::transpose(x, 0, 3); }, {"transpose"});
}

TEST(Views, ViewReshapeAndTheirErrors) {
  const Tensor x = iota({4, 6});
  const Tensor v = raw::view(x, {2, -1, 3});
  EXPECT_EQ(v.shape(), (Shape{2, 4, 3}));
  EXPECT_TRUE(v.shares_storage(x));
  EXPECT_EQ(values(v), values(x));
  // a transposed tensor cannot be viewed flat, but reshape copies
  const Tensor t = raw::transpose(x, 0, 1);
  expect_error([&] { raw::view(t, {24}); }, {"view", "[6, 4]", "[24]"});
  const Tensor r = raw::reshape(t, {24});
  EXPECT_FALSE(r.shares_storage(x));
  const auto rv = values(r);
  for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(rv[i], (i % 4) * 6 + i / 4);
  // splitting a dim of a transposed view is still a view
  EXPECT_TRUE(raw::view(t, {2, 3, 4}).shares_storage(x));
  expect_error([&] { raw::view(x, {5, 5}); }, {"view", "[5, 5]", "24"});
  expect_error([&] { raw::view(x, {-1, -1}); }, {"view", "-1"});
  EXPECT_EQ(raw::flatten(iota({2, 3, 4}), 1, 2).shape(), (Shape{2, 12}));
}

TEST(Views, SliceNarrowSelectWithSteps) {
  const Tensor x = iota({5, 7});
  const Tensor s = raw::slice(x, 1, 1, 7, 2);  // columns 1, 3, 5
  EXPECT_EQ(s.shape(), (Shape{5, 3}));
  EXPECT_TRUE(s.shares_storage(x));
  const auto sv = values(s);
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(sv[i * 3 + j], i * 7 + 1 + 2 * j);
  EXPECT_EQ(raw::slice(x, 0, -2, 100, 1).shape(), (Shape{2, 7}));  // clamps like Python
  const Tensor n = raw::narrow(x, 0, 1, 3);
  EXPECT_EQ(values(n)[0], 7);
  const Tensor sel = raw::select(x, 1, -1);  // last column
  EXPECT_EQ(sel.shape(), (Shape{5}));
  const auto selv = values(sel);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(selv[i], i * 7 + 6);
  // writes through a view land in the base tensor
  raw::fill_(s, -1.0);
  const auto xv = values(x);
  for (int64_t i = 0; i < 35; ++i) EXPECT_EQ(xv[i], (i % 7) % 2 == 1 ? -1.0 : i);
  expect_error([&] { raw::narrow(x, 1, 5, 3); }, {"narrow", "[5, 8)", "7"});
  expect_error([&] { raw::select(x, 0, 5); }, {"select", "5", "[5, 7]"});
  expect_error([&] { raw::slice(x, 0, 0, 5, 0); }, {"slice", "step"});
}

TEST(Views, SqueezeUnsqueezeExpand) {
  const Tensor x = iota({3, 1, 2});
  EXPECT_EQ(raw::squeeze(x).shape(), (Shape{3, 2}));
  EXPECT_EQ(raw::squeeze(x, 1).shape(), (Shape{3, 2}));
  EXPECT_EQ(raw::squeeze(x, 0).shape(), (Shape{3, 1, 2}));  // not size 1: unchanged
  const Tensor u = raw::unsqueeze(x, -1);
  EXPECT_EQ(u.shape(), (Shape{3, 1, 2, 1}));
  EXPECT_TRUE(u.shares_storage(x));
  const Tensor e = raw::expand(x, {4, 3, 5, 2});
  EXPECT_EQ(e.shape(), (Shape{4, 3, 5, 2}));
  EXPECT_EQ(e.strides()[0], 0);
  EXPECT_EQ(e.strides()[2], 0);
  const auto ev = values(e);
  for (int64_t i = 0; i < 4 * 3 * 5 * 2; ++i) {
    const int64_t c = i % 2, a = (i / 10) % 3;
    EXPECT_EQ(ev[i], a * 2 + c);
  }
  expect_error([&] { raw::expand(x, {3, 4, 3}); }, {"expand", "[3, 1, 2]", "[3, 4, 3]"});
  EXPECT_EQ(raw::broadcast_shapes({3, 1}, {4}, "t"), (Shape{3, 4}));
  expect_error([&] { raw::broadcast_shapes({3, 2}, {4}, "myop"); }, {"myop", "[3, 2]", "[4]"});
}

TEST(Views, ContiguousAndClone) {
  const Tensor x = iota({3, 4});
  EXPECT_TRUE(raw::contiguous(x).is_same(x));  // already contiguous: no copy
  const Tensor t = raw::transpose(x, 0, 1);
  const Tensor c = raw::contiguous(t);
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_FALSE(c.shares_storage(x));
  EXPECT_EQ(values(c), values(t));
  const Tensor k = raw::clone(x);
  raw::fill_(k, 0.0);
  EXPECT_EQ(values(x)[5], 5.0);
  EXPECT_TRUE(t.is_non_overlapping_and_dense());
  EXPECT_FALSE(raw::slice(x, 1, 0, 4, 2).is_non_overlapping_and_dense());
}

TEST(Factories, ShapesDTypesAndValues) {
  const Tensor e = empty({2, 3}, {.dtype = DType::f64});
  EXPECT_EQ(e.shape(), (Shape{2, 3}));
  EXPECT_EQ(e.dtype(), DType::f64);
  EXPECT_TRUE(e.is_contiguous());
  EXPECT_EQ(e.nbytes(), 48u);
  for (double v : values(zeros({4}, {.dtype = DType::bf16}))) EXPECT_EQ(v, 0.0);
  for (double v : values(ones({4}, {.dtype = DType::i32}))) EXPECT_EQ(v, 1.0);
  for (double v : values(full({2, 2}, -2.5, {.dtype = DType::f16}))) EXPECT_EQ(v, -2.5);
  const Tensor a = arange(5);
  EXPECT_EQ(a.dtype(), DType::i64);
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(values(arange(1, 2, 0.25, {.dtype = DType::f32})), (std::vector<double>{1, 1.25, 1.5, 1.75}));
  EXPECT_EQ(arange(3, 3).numel(), 0);
  const Tensor f = from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::i32});
  EXPECT_EQ(f.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(zeros({}).dim(), 0);
  EXPECT_EQ(zeros({}).numel(), 1);
  EXPECT_EQ(full({}, 7).item(), 7.0);
  EXPECT_EQ(empty({0, 3}).numel(), 0);
  expect_error([] { from_vector<float>({1, 2, 3}, {2, 2}); }, {"from_vector", "3", "[2, 2]"});
  expect_error([] { empty({2, -1}); }, {"empty", "[2, -1]"});
  expect_error([] { arange(0, 1, 0); }, {"arange", "step"});
}

TEST(Conversion, CopyConvertsBetweenDTypes) {
  const std::vector<double> src = {-2.75, -1, 0, 0.5, 1.25, 3, 100.5, 65519};
  const Tensor x = from_vector(src, {8}, {.dtype = DType::f64});
  EXPECT_EQ(values(raw::to(x, Device::cpu(), DType::f32)), src);
  // integers truncate toward zero, bool is "non-zero"
  EXPECT_EQ(raw::to(x, Device::cpu(), DType::i64).to_vector<int64_t>(),
            (std::vector<int64_t>{-2, -1, 0, 0, 1, 3, 100, 65519}));
  EXPECT_EQ(values(raw::to(x, Device::cpu(), DType::boolean)), (std::vector<double>{1, 1, 0, 1, 1, 1, 1, 1}));
  // f16 rounds to nearest even: 100.5 is exact, 65519 rounds to 65504
  const auto h = values(raw::to(x, Device::cpu(), DType::f16));
  EXPECT_EQ(h[6], 100.5);
  EXPECT_EQ(h[7], 65504);
  // bf16 keeps 8 bits of mantissa: 100.5 -> 100.5 (exact), 65519 -> 65536
  const auto b = values(raw::to(x, Device::cpu(), DType::bf16));
  EXPECT_EQ(b[6], 100.5);
  EXPECT_EQ(b[7], 65536);
  // copy_ into a strided destination converts and broadcasts
  const Tensor dst = zeros({3, 4}, {.dtype = DType::f16});
  raw::copy_(raw::slice(dst, 1, 0, 4, 2), from_vector<double>({7, 8}, {2}, {.dtype = DType::f64}));
  EXPECT_EQ(values(dst), (std::vector<double>{7, 0, 8, 0, 7, 0, 8, 0, 7, 0, 8, 0}));
  EXPECT_TRUE(raw::to(x, Device::cpu(), DType::f64).is_same(x));  // no-op conversion is free
}

TEST(Printing, ShowsValuesShapeDTypeAndDevice) {
  const std::string s = from_vector<float>({1.5f, -2, 3}, {3}).str();
  EXPECT_NE(s.find("1.5000"), std::string::npos) << s;
  EXPECT_NE(s.find("-2.0000"), std::string::npos) << s;
  EXPECT_NE(s.find("shape=[3]"), std::string::npos) << s;
  EXPECT_NE(s.find("float32"), std::string::npos) << s;
  EXPECT_NE(s.find("cpu"), std::string::npos) << s;
  const std::string i = iota({2, 2}, DType::i64).str();
  EXPECT_NE(i.find("[[0, 1],"), std::string::npos) << i;
  EXPECT_NE(i.find("int64"), std::string::npos) << i;
  const std::string big = iota({100}).str();
  EXPECT_NE(big.find("..."), std::string::npos) << big;  // long tensors are elided
  EXPECT_NE(big.find("99."), std::string::npos) << big;
  std::ostringstream os;
  os << ones({1}, {.dtype = DType::boolean});
  EXPECT_NE(os.str().find("True"), std::string::npos) << os.str();
  EXPECT_EQ(Tensor().str(), "tensor(undefined)");
}

TEST(Errors, UndefinedAndWrongTypeAccess) {
  expect_error([] { Tensor().shape(); }, {"undefined"});
  expect_error([] { ones({2}).data<double>(); }, {"float64", "float32"});
  expect_error([] { dtype_from_name("float8"); }, {"float8"});
  expect_error([] { Device::parse("tpu"); }, {"tpu"});
  expect_error([] { wrap_dim(3, 2, "myop"); }, {"myop"});
  EXPECT_EQ(wrap_dim(-1, 3, "x"), 2);
  EXPECT_EQ(Device::parse("cuda:1").index, 1);
  EXPECT_EQ(promote_types(DType::i32, DType::f16), DType::f16);
  EXPECT_EQ(promote_types(DType::bf16, DType::f16), DType::f32);
  EXPECT_EQ(promote_types(DType::boolean, DType::u8), DType::u8);
}

}  // namespace
