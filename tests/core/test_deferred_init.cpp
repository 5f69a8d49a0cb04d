// Deferred initialisation (core/deferred_init.h): any range of a placeholder materialises
// to the eager factory's bits, whatever its alignment to Philox blocks, through dtype
// conversions and from a copy source; the generator advances as the eager factory's does.
#include <gtest/gtest.h>

#include <cstring>

#include "tessera/core/deferred_init.h"
#include "tessera/core/random.h"

using namespace tessera;

namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = raw::contiguous(a), y = raw::contiguous(b);
  return x.dtype() == y.dtype() && x.numel() == y.numel() &&
         std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

Tensor flat(const Tensor& t) { return raw::reshape(t, {t.numel()}); }

}  // namespace

TEST(DeferredInit, EveryRangeOfANormalDrawMatchesTheEagerOne) {
  // A first draw, so the one checked starts at a block other than 0.
  manual_seed(3);
  init_normal({3}, 0.0, 1.0, nullptr, {});
  const Tensor eager = init_normal({37, 5}, 0.5, 0.02, nullptr, {});
  const uint64_t eager_next = default_generator().offset();
  manual_seed(3);
  Tensor placeholder;
  {
    DeferredInitGuard deferred;
    EXPECT_TRUE(DeferredInitGuard::active());
    EXPECT_TRUE(is_deferred(init_normal({3}, 0.0, 1.0, nullptr, {})));
    placeholder = init_normal({37, 5}, 0.5, 0.02, nullptr, {});
  }
  EXPECT_FALSE(DeferredInitGuard::active());
  EXPECT_TRUE(is_deferred(placeholder));
  EXPECT_EQ(placeholder.shape(), (Shape{37, 5}));
  EXPECT_EQ(placeholder.storage()->nbytes(), 0u);
  EXPECT_EQ(default_generator().offset(), eager_next)
      << "the generator advances as the eager factory's";
  for (int64_t begin = 0; begin < 9; ++begin)
    for (int64_t n = 1; n < 11; ++n) {
      const Tensor out = empty({n});
      materialize_deferred_range(placeholder, begin, out);
      EXPECT_TRUE(same_bits(out, raw::narrow(flat(eager), 0, begin, n))) << begin << " +" << n;
    }
  const Tensor tail = empty({30});
  materialize_deferred_range(placeholder, 185 - 30, tail);
  EXPECT_TRUE(same_bits(tail, raw::narrow(flat(eager), 0, 155, 30)));
}

TEST(DeferredInit, ConversionsConstantsAndCopySources) {
  manual_seed(9);
  const Tensor eager = init_normal({7, 3}, 0.0, 0.02, nullptr, {});
  manual_seed(9);
  Tensor p, ones, loaded;
  {
    DeferredInitGuard deferred;
    p = init_normal({7, 3}, 0.0, 0.02, nullptr, {});
    ones = init_constant({5}, 1.0, {});
    loaded = init_constant({6}, 0.0, {});
  }
  // f32 drawn, then bf16 (what prepare does under the bf16 policy): the same rounding.
  retarget_deferred(p, Device::cpu(), DType::bf16);
  EXPECT_EQ(p.dtype(), DType::bf16);
  const Tensor out = empty({13}, {.dtype = DType::bf16});
  materialize_deferred_range(p, 5, out);
  EXPECT_TRUE(
      same_bits(out, raw::narrow(flat(raw::to(eager, Device::cpu(), DType::bf16)), 0, 5, 13)));
  const Tensor o = empty({3});
  materialize_deferred_range(ones, 1, o);
  EXPECT_EQ(o.to_vector<float>(), (std::vector<float>{1, 1, 1}));
  // A copy source: only the range is read (and counted).
  const Tensor source = arange(0.0, 6.0, 1.0, {.dtype = DType::f64});
  set_deferred_source(loaded, source);
  const uint64_t read = deferred_bytes_read();
  const Tensor two = empty({2});
  materialize_deferred_range(loaded, 3, two);
  EXPECT_EQ(two.to_vector<float>(), (std::vector<float>{3, 4}));
  EXPECT_EQ(deferred_bytes_read() - read, 2u * 8u);
  // Whole, it stops being a placeholder.
  materialize_deferred(p);
  EXPECT_FALSE(is_deferred(p));
  EXPECT_TRUE(same_bits(p, raw::to(eager, Device::cpu(), DType::bf16)));
  EXPECT_THROW(materialize_deferred_range(p, 0, empty({1}, {.dtype = DType::bf16})), Error);
}
