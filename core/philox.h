// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
// A counter-based generator: block `counter` under key `seed` gives four 32-bit
// words, with no state between blocks. CPU and CUDA kernels call the same
// function, so every device and every rank draws identical numbers.
#pragma once
#include <cmath>
#include <cstdint>

#include "tessera/core/half.h"

namespace tessera {

struct Philox4 {
  uint32_t v[4];
};

TESSERA_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

TESSERA_HD Philox4 philox4x32_10(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c0, hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// Uniform in the open interval (0, 1), from one 32-bit word.
TESSERA_HD double philox_unit(uint32_t w) { return (static_cast<double>(w) + 0.5) * 2.3283064365386963e-10; }

// The numbering every device follows (element i of a draw that starts at block `offset`):
//   uniform, randint: block offset + i/4, word i%4
//   normal:           block offset + i/2, words 2(i%2) and 2(i%2)+1, Box-Muller (cos branch)
TESSERA_HD double philox_uniform_at(uint64_t seed, uint64_t offset, uint64_t i) {
  return philox_unit(philox4x32_10(seed, offset + i / 4).v[i % 4]);
}

TESSERA_HD double philox_normal_at(uint64_t seed, uint64_t offset, uint64_t i) {
  Philox4 b = philox4x32_10(seed, offset + i / 2);
  double u1 = philox_unit(b.v[2 * (i % 2)]);
  double u2 = philox_unit(b.v[2 * (i % 2) + 1]);
  return ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
}

TESSERA_HD int64_t philox_randint_at(uint64_t seed, uint64_t offset, uint64_t i, int64_t low,
                                     int64_t high) {
  uint32_t w = philox4x32_10(seed, offset + i / 4).v[i % 4];
  uint64_t range = static_cast<uint64_t>(high - low);
  return low + static_cast<int64_t>((static_cast<uint64_t>(w) * range) >> 32);
}

// The smallest 32-bit word w whose uniform number, rounded to f32, is >= f32(p) (2^32 when
// there is none): "keep" of a dropout with probability p (kept when the uniform is >= p) as one
// integer comparison, w >= this. For p < 1 it is below 2^32 (the largest uniform rounds to 1).
// Rounding to f32 is monotonic, so the words that keep form one range; found by bisection.
inline uint64_t dropout_keep_from(double p) {
  const float threshold = static_cast<float>(p);
  uint64_t lo = 0, hi = uint64_t{1} << 32;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (static_cast<float>(philox_unit(static_cast<uint32_t>(mid))) >= threshold) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}
// Whether a dropout with draw (seed, offset) keeps element i: the uniform number i, rounded to
// f32, is >= p, tested as word i >= keep_from = dropout_keep_from(p) (above).
TESSERA_HD bool dropout_keeps(uint64_t seed, uint64_t offset, uint64_t i, uint64_t keep_from) {
  return philox4x32_10(seed, offset + i / 4).v[i % 4] >= keep_from;
}
}  // namespace tessera
