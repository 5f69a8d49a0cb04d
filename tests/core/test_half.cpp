// f16/bf16 conversions checked exhaustively against an independent float64 model of
// IEEE round-to-nearest-even.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "tessera/core/half.h"

using namespace tessera;

namespace {

// Decodes a binary16 pattern with ldexp (independent of the bit-twiddling under test).
double decode_half(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f) v = mant ? NAN : INFINITY;
  else if (exp == 0) v = std::ldexp(mant, -24);
  else v = std::ldexp(1024 + mant, exp - 25);
  return sign ? -v : v;
}

double decode_bf16(uint16_t b) {
  const int sign = b >> 15, exp = (b >> 7) & 0xff, mant = b & 0x7f;
  double v;
  if (exp == 0xff) v = mant ? NAN : INFINITY;
  else if (exp == 0) v = std::ldexp(mant, -133);
  else v = std::ldexp(128 + mant, exp - 134);
  return sign ? -v : v;
}

// Reference rounding: the representable neighbour nearest x, ties to even mantissa.
template <class Decode>
uint16_t reference_round(double x, Decode decode, uint16_t max_finite_bits) {
  if (std::isnan(x)) return 0xffff;  // only NaN-ness is compared
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  uint16_t lo = 0, hi = max_finite_bits;
  if (a >= decode(max_finite_bits)) {
    const double next = decode(max_finite_bits) + (decode(max_finite_bits) - decode(max_finite_bits - 1));
    const double mid = (decode(max_finite_bits) + next) / 2;
    if (a < mid) return sign | max_finite_bits;
    return sign | static_cast<uint16_t>(max_finite_bits + 1);  // infinity pattern follows max
  }
  while (hi - lo > 1) {  // decode is monotonic on positive patterns
    const uint16_t m = static_cast<uint16_t>((lo + hi) / 2);
    if (decode(m) <= a) lo = m; else hi = m;
  }
  const double dl = a - decode(lo), dh = decode(hi) - a;
  uint16_t r = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
  return sign | r;
}

}  // namespace

TEST(Half, AllBitPatternsRoundTripThroughFloat) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = half_bits_to_float(h);
    const double ref = decode_half(h);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << b;
      ASSERT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(f))));
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref) << "pattern " << b;
    ASSERT_EQ(float_to_half_bits(f), h) << "pattern " << b;
  }
}

TEST(BFloat16, AllBitPatternsRoundTripThroughFloat) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = bf16_bits_to_float(h);
    const double ref = decode_bf16(h);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << b;
      ASSERT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(f))));
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref) << "pattern " << b;
    ASSERT_EQ(float_to_bf16_bits(f), h) << "pattern " << b;
  }
}

// Every float32 between consecutive half values (midpoints, just above and below) rounds as
// IEEE round-to-nearest-even says.
TEST(Half, RoundsMidpointsToNearestEven) {
  for (uint32_t b = 0; b < 0x7c00; ++b) {
    const double lo = decode_half(static_cast<uint16_t>(b));
    const double hi = b + 1 < 0x7c00 ? decode_half(static_cast<uint16_t>(b + 1)) : 65536.0;
    const double mid = (lo + hi) / 2;
    for (double x : {mid, std::nextafter(static_cast<float>(mid), 0.0f) * 1.0,
                     std::nextafter(static_cast<float>(mid), 1e30f) * 1.0}) {
      for (double s : {1.0, -1.0}) {
        const float f = static_cast<float>(s * x);
        ASSERT_EQ(float_to_half_bits(f), reference_round(f, decode_half, 0x7bff))
            << "x=" << f << " between patterns " << b << " and " << b + 1;
      }
    }
  }
}

TEST(BFloat16, RoundsMidpointsToNearestEven) {
  for (uint32_t b = 0; b < 0x7f80; b += 1) {
    const double lo = decode_bf16(static_cast<uint16_t>(b));
    const double hi = b + 1 < 0x7f80 ? decode_bf16(static_cast<uint16_t>(b + 1)) : std::ldexp(1.0, 128);
    const double mid = (lo + hi) / 2;
    for (double x : {mid, static_cast<double>(std::nextafter(static_cast<float>(mid), 0.0f)),
                     static_cast<double>(std::nextafter(static_cast<float>(mid), INFINITY))}) {
      const float f = static_cast<float>(x);
      if (std::isinf(f)) continue;
      ASSERT_EQ(float_to_bf16_bits(f), reference_round(f, decode_bf16, 0x7f7f))
          << "x=" << f << " between patterns " << b << " and " << b + 1;
    }
  }
}

TEST(Half, InfAndNanPreserved) {
  EXPECT_EQ(float_to_half_bits(INFINITY), 0x7c00);
  EXPECT_EQ(float_to_half_bits(-INFINITY), 0xfc00);
  EXPECT_EQ(float_to_half_bits(1e6f), 0x7c00);
  EXPECT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(NAN))));
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(-NAN))));
}
