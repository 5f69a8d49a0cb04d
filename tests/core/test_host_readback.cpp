// HostReadback: values read back in order, whatever their dtype and device; undefined ones
// as NaN; a second start() waits for the first read. On a GPU the copies are asynchronous:
// the values read are those computed before start(), not what later work wrote.
#include <gtest/gtest.h>

#include <cmath>

#include "tessera/core/host_readback.h"
#include "tessera/core/tensor.h"

namespace tessera {
namespace {

TEST(HostReadback, ReadsHostValuesInOrder) {
  HostReadback read;
  EXPECT_FALSE(read.pending());
  EXPECT_THROW(read.wait(), Error);
  read.start({full({1}, 2.5, {.dtype = DType::f64}), Tensor(),
              full({}, -3.0, {.dtype = DType::f32}), full({1, 1}, 7.0, {.dtype = DType::i64})});
  EXPECT_TRUE(read.pending());
  const std::vector<double> v = read.wait();
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0], 2.5);
  EXPECT_TRUE(std::isnan(v[1]));
  EXPECT_EQ(v[2], -3.0);
  EXPECT_EQ(v[3], 7.0);
  EXPECT_FALSE(read.pending());
  EXPECT_THROW(read.start({full({2}, 1.0, {})}), Error);  // more than one element
}

TEST(HostReadback, DeviceValuesAreThoseBeforeLaterWork) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const Device gpu = Device::cuda(0);
  Tensor a = full({1}, 1.25, {.dtype = DType::f32, .device = gpu});
  Tensor b = full({}, 0.5, {.dtype = DType::bf16, .device = gpu});
  HostReadback read;
  read.start({a, full({1}, 3.0, {.dtype = DType::f64}), b});
  // Work queued after start() changes the device values; the read must not see it.
  Tensor big = full({1 << 24}, 1.0, {.dtype = DType::f32, .device = gpu});
  Tensor other = empty({1 << 24}, {.dtype = DType::f32, .device = gpu});
  for (int i = 0; i < 20; ++i) raw::copy_(i % 2 ? big : other, i % 2 ? other : big);
  a.fill_(9.0);
  const std::vector<double> v = read.wait();
  EXPECT_EQ(v, (std::vector<double>{1.25, 3.0, 0.5}));
  read.start({a});
  read.start({b});  // waits for the first read, then reads b
  EXPECT_EQ(read.wait(), std::vector<double>{0.5});
}

}  // namespace
}  // namespace tessera
