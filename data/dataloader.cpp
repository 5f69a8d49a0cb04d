#include "tessera/data/dataloader.h"

#include <cmath>  // core/philox.h uses sqrt/log/cos without including it
#include <iterator>
#include <numeric>

#include "tessera/core/error.h"
#include "tessera/core/philox.h"

namespace tessera::data {

DataLoader::DataLoader(TokenFile file, DataLoaderOptions options)
    : file_(std::move(file)), options_(options) {
  const std::string name = file_.path().string();
  TESSERA_CHECK(options_.batch > 0 && options_.seq > 0, "DataLoader '", name, "': batch ",
                options_.batch, " and seq ", options_.seq, " must be positive");
  TESSERA_CHECK(options_.world_size > 0 && options_.rank >= 0 && options_.rank < options_.world_size,
                "DataLoader '", name, "': rank ", options_.rank, " is not in a world of ",
                options_.world_size);
  TESSERA_CHECK(file_.size() >= 2, "DataLoader '", name, "': ", file_.size(),
                " tokens; at least 2 are needed to form an input and its target");
  if (options_.shuffle) {
    windows_ = (file_.size() - 1) / options_.seq;
    TESSERA_CHECK(windows_ >= 1, "DataLoader '", name, "': shuffled mode needs at least seq + 1 = ",
                  options_.seq + 1, " tokens, the file has ", file_.size());
  }
}

const std::vector<int64_t>& DataLoader::epoch_permutation(uint64_t epoch) const {
  if (cached_epoch_ != epoch) {
    cached_permutation_.resize(windows_);
    std::iota(cached_permutation_.begin(), cached_permutation_.end(), int64_t{0});
    const uint64_t block_offset = epoch << 32;
    for (int64_t i = windows_ - 1; i > 0; --i) {
      const int64_t j = philox_randint_at(options_.seed, block_offset, static_cast<uint64_t>(i), 0, i + 1);
      std::swap(cached_permutation_[i], cached_permutation_[j]);
    }
    cached_epoch_ = epoch;
  }
  return cached_permutation_;
}

std::vector<int64_t> DataLoader::row_starts(uint64_t k) const {
  const int64_t B = options_.batch, T = options_.seq;
  const uint64_t first_row = (k * options_.world_size + options_.rank) * static_cast<uint64_t>(B);
  std::vector<int64_t> starts(B);
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t row = first_row + b;
    if (options_.shuffle) {
      const std::vector<int64_t>& perm = epoch_permutation(row / windows_);
      starts[b] = perm[row % windows_] * T;
    } else {
      starts[b] = static_cast<int64_t>(row) * T;
    }
  }
  return starts;
}

Batch DataLoader::batch_at(uint64_t k) const {
  const int64_t B = options_.batch, T = options_.seq, n = file_.size();
  std::vector<int64_t> x(B * T), y(B * T);
  const std::vector<int64_t> starts = row_starts(k);
  for (int64_t b = 0; b < B; ++b) {
    int64_t pos = starts[b] % n;
    int64_t prev = file_.at_unchecked(pos);
    for (int64_t t = 0; t < T; ++t) {
      pos = pos + 1 == n ? 0 : pos + 1;
      const int64_t cur = file_.at_unchecked(pos);
      x[b * T + t] = prev;
      y[b * T + t] = cur;
      prev = cur;
    }
  }
  const TensorOptions opts{.dtype = options_.dtype, .device = options_.device};
  return {from_vector(x, {B, T}, opts), from_vector(y, {B, T}, opts)};
}

Batch DataLoader::next() { return batch_at(position_++); }

DataLoader::Iterator::Iterator(DataLoader* loader, int64_t remaining)
    : loader_(loader), remaining_(remaining) {
  if (remaining_ != 0) current_ = loader_->next();
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  if (remaining_ > 0) --remaining_;
  if (remaining_ != 0) current_ = loader_->next();
  return *this;
}

}  // namespace tessera::data
