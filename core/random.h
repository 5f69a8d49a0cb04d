#pragma once
#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera {

// Seed plus a block counter: a draw of n numbers reserves the blocks it uses and
// advances the counter, so (seed, offset) is the whole state to save and restore.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  void manual_seed(uint64_t seed) {
    seed_ = seed;
    offset_ = 0;
  }
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }
  // Returns the first block of a draw that needs `blocks` Philox blocks.
  uint64_t reserve(uint64_t blocks) {
    uint64_t start = offset_;
    offset_ += blocks;
    return start;
  }

 private:
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};

Generator& default_generator();
void manual_seed(uint64_t seed);

enum class RandomKind : uint8_t { Uniform, Normal, Integer };

// Uniform in [low, high); normal with mean, std; integers in [low, high).
Tensor rand(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor uniform(const Shape& shape, double low, double high, TensorOptions opts = {},
               Generator* gen = nullptr);
Tensor randn(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor normal(const Shape& shape, double mean, double std, TensorOptions opts = {},
              Generator* gen = nullptr);
Tensor randint(int64_t low, int64_t high, const Shape& shape,
               TensorOptions opts = {.dtype = DType::i64}, Generator* gen = nullptr);
// Fills an existing tensor in place (used by parameter init).
void normal_(const Tensor& t, double mean, double std, Generator* gen = nullptr);
void uniform_(const Tensor& t, double low, double high, Generator* gen = nullptr);

}  // namespace tessera
