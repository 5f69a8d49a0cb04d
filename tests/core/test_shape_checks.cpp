// Issue 14, defect 5: element counts are computed with checked arithmetic, so a shape
// whose product does not fit int64 is an error naming it rather than a wrapped count.
#include <gtest/gtest.h>

#include <limits>

#include "tessera/core/error.h"
#include "tessera/core/tensor.h"

using namespace tessera;

namespace {
void expect_overflow(const Shape& shape) {
  try {
    const int64_t n = shape_numel(shape);
    ADD_FAILURE() << shape_str(shape) << " gave " << n;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(shape_str(shape)), std::string::npos) << msg;
    EXPECT_NE(msg.find("overflow"), std::string::npos) << msg;
  }
}
}  // namespace

TEST(ShapeChecks, ElementCountsThatOverflowAreErrors) {
  constexpr int64_t k2to32 = int64_t{1} << 32, k2to62 = int64_t{1} << 62;
  expect_overflow({k2to32, k2to32});
  expect_overflow({k2to62, 2});
  expect_overflow({3, 5, k2to62});
  expect_overflow({std::numeric_limits<int64_t>::max(), 2});
  EXPECT_THROW(empty({k2to32, k2to32}), Error);
  // The largest products that fit, and a zero anywhere, are fine.
  EXPECT_EQ(shape_numel({k2to62, 1}), k2to62);
  EXPECT_EQ(shape_numel({std::numeric_limits<int64_t>::max()}),
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(shape_numel({k2to32, 0, k2to32}), 0);
  EXPECT_EQ(shape_numel({7, 11, 13}), 1001);
  EXPECT_EQ(shape_numel({}), 1);
}
