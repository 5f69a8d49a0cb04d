// Counter-based RNG: the same (seed, offset) gives the same numbers regardless of how they
// are drawn, different seeds differ, and the moments are right.
#include <gtest/gtest.h>

#include <cmath>

#include "tessera/core/philox.h"
#include "tessera/core/random.h"

using namespace tessera;

namespace {

std::vector<double> values(const Tensor& t) {
  return raw::contiguous(raw::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

void moments(const std::vector<double>& v, double& mean, double& var) {
  mean = 0;
  for (double x : v) mean += x;
  mean /= v.size();
  var = 0;
  for (double x : v) var += (x - mean) * (x - mean);
  var /= v.size() - 1;
}

TEST(Random, SameSeedAndOffsetGiveSameNumbers) {
  Generator a(123), b(123), c(124);
  const auto x = values(randn({1000}, {}, &a));
  const auto y = values(randn({1000}, {}, &b));
  const auto z = values(randn({1000}, {}, &c));
  EXPECT_EQ(x, y);
  EXPECT_NE(x, z);
  // the generator advanced: the next draw differs from the first
  EXPECT_NE(values(randn({1000}, {}, &a)), x);
  // restoring (seed, offset) replays the stream exactly
  Generator d(999);
  randn({17}, {}, &d);
  const uint64_t seed = d.seed(), offset = d.offset();
  const auto first = values(rand({33}, {}, &d));
  Generator e;
  e.set_state(seed, offset);
  EXPECT_EQ(values(rand({33}, {}, &e)), first);
  // manual_seed resets the default generator
  manual_seed(5);
  const auto m1 = values(randn({10}));
  manual_seed(5);
  EXPECT_EQ(values(randn({10})), m1);
}

TEST(Random, DTypeOnlyChangesRounding) {
  Generator a(7), b(7);
  const auto f64 = values(randn({257}, {.dtype = DType::f64}, &a));
  const auto f32 = values(randn({257}, {.dtype = DType::f32}, &b));
  for (size_t i = 0; i < f64.size(); ++i) EXPECT_NEAR(f32[i], f64[i], 1e-6 * (1 + std::fabs(f64[i])));
}

TEST(Random, MomentsAndRanges) {
  Generator g(42);
  double mean, var;
  const auto n = values(normal({100000}, 2.0, 3.0, {}, &g));
  moments(n, mean, var);
  EXPECT_NEAR(mean, 2.0, 0.05);
  EXPECT_NEAR(std::sqrt(var), 3.0, 0.05);
  const auto u = values(uniform({100000}, -1.0, 3.0, {}, &g));
  moments(u, mean, var);
  EXPECT_NEAR(mean, 1.0, 0.03);
  EXPECT_NEAR(var, 16.0 / 12.0, 0.03);
  for (double x : u) ASSERT_TRUE(x >= -1.0 && x < 3.0) << x;
  const auto r = randint(3, 10, {100000}, {.dtype = DType::i64}, &g).to_vector<int64_t>();
  std::vector<int64_t> counts(10, 0);
  for (int64_t x : r) {
    ASSERT_TRUE(x >= 3 && x < 10) << x;
    ++counts[x];
  }
  for (int64_t k = 3; k < 10; ++k) EXPECT_NEAR(counts[k] / 100000.0, 1.0 / 7, 0.01) << k;
  // in-place fills of a strided view touch only the view
  Tensor base = zeros({4, 6});
  normal_(raw::slice(base, 1, 0, 6, 2), 0.0, 1.0, &g);
  const auto bv = values(base);
  for (int64_t i = 0; i < 24; ++i) {
    if ((i % 6) % 2 == 1) EXPECT_EQ(bv[i], 0.0);
    else EXPECT_NE(bv[i], 0.0);
  }
}

// dropout_keep_from(p) turns "the f32 uniform of word w is >= p" (the test composed dropout
// makes on rand()'s numbers) into w >= keep_from: the words on either side of the boundary
// fall on the right sides, and a draw's keep decisions agree with the f32 uniforms rand() gives.
TEST(Random, DropoutKeepFromIsTheBoundaryOfTheKeptWords) {
  auto keeps = [](uint64_t w, double p) {
    return static_cast<float>(philox_unit(static_cast<uint32_t>(w))) >= static_cast<float>(p);
  };
  for (double p : {0.1, 0.2, 0.5, 1.0 / 3.0, 0.999, 1e-9, 0.75}) {
    const uint64_t from = dropout_keep_from(p);
    ASSERT_LT(from, uint64_t{1} << 32) << p;
    EXPECT_TRUE(keeps(from, p)) << p;
    if (from > 0) EXPECT_FALSE(keeps(from - 1, p)) << p;
    EXPECT_NEAR(static_cast<double>(from) / 4294967296.0, p, 1e-7) << p;
  }
  Generator g(99);
  const uint64_t offset = g.offset();
  const std::vector<double> u = values(rand({1001}, {.dtype = DType::f32}, &g));
  const uint64_t from = dropout_keep_from(0.3);
  for (size_t i = 0; i < u.size(); ++i) {
    const uint32_t w = philox4x32_10(99, offset + i / 4).v[i % 4];
    EXPECT_EQ(w >= from, u[i] >= static_cast<float>(0.3)) << "element " << i;
  }
}

TEST(Random, BadArguments) {
  EXPECT_THROW(randint(5, 5, {3}), Error);
  EXPECT_THROW(randn({3}, {.dtype = DType::i64}), Error);
}

}  // namespace
