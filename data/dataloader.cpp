#include "tessera/data/dataloader.h"

#include <cmath>  // core/philox.h uses sqrt/log/cos without including it
#include <iterator>
#include <numeric>

#include "tessera/core/error.h"
#include "tessera/core/philox.h"
#include "tessera/data/sampler.h"

namespace tessera::data {

Sampling parse_sampling(const std::string& name) {
  if (name == "windows") return Sampling::windows;
  if (name == "random") return Sampling::random;
  TESSERA_FAIL("DataLoader: unknown sampling '", name, "' (expected windows or random)");
}

const char* sampling_name(Sampling sampling) {
  return sampling == Sampling::random ? "random" : "windows";
}

DataLoader::DataLoader(TokenFile file, DataLoaderOptions options)
    : file_(std::move(file)), options_(options) {
  const std::string name = file_.path().string();
  TESSERA_CHECK(options_.batch > 0 && options_.seq > 0, "DataLoader '", name, "': batch ",
                options_.batch, " and seq ", options_.seq, " must be positive");
  TESSERA_CHECK(
      options_.world_size > 0 && options_.rank >= 0 && options_.rank < options_.world_size,
      "DataLoader '", name, "': rank ", options_.rank, " is not in a world of ",
      options_.world_size);
  TESSERA_CHECK(file_.size() >= 2, "DataLoader '", name, "': ", file_.size(),
                " tokens; at least 2 are needed to form an input and its target");
  if (options_.sampling == Sampling::random) {
    TESSERA_CHECK(!options_.shuffle, "DataLoader '", name,
                  "': shuffle applies to windows sampling; random sampling draws its own order");
    TESSERA_CHECK(file_.size() >= options_.seq + 1, "DataLoader '", name,
                  "': random sampling needs at least seq + 1 = ", options_.seq + 1,
                  " tokens, the file has ", file_.size());
  }
  if (options_.shuffle) {
    windows_ = (file_.size() - 1) / options_.seq;
    TESSERA_CHECK(windows_ >= 1, "DataLoader '", name,
                  "': shuffled mode needs at least seq + 1 = ", options_.seq + 1,
                  " tokens, the file has ", file_.size());
  }
}

const std::vector<int64_t>& DataLoader::epoch_permutation(uint64_t epoch) const {
  if (cached_epoch_ != epoch) {
    cached_permutation_ = seeded_permutation(windows_, options_.seed, epoch);
    cached_epoch_ = epoch;
  }
  return cached_permutation_;
}

int64_t DataLoader::random_start(uint64_t global_row) const {
  // Its own Philox block per row (far from the shuffle's blocks) and 64 bits of it, so the
  // draw is uniform over any file length without modulo bias worth the name.
  const Philox4 block = philox4x32_10(options_.seed, (uint64_t{1} << 63) + global_row);
  const uint64_t bits = (static_cast<uint64_t>(block.v[1]) << 32) | block.v[0];
  const auto starts = static_cast<unsigned __int128>(file_.size() - options_.seq);
  return static_cast<int64_t>((bits * starts) >> 64);
}

std::vector<int64_t> DataLoader::row_starts(uint64_t k) const {
  const int64_t B = options_.batch, T = options_.seq;
  const uint64_t first_row = (k * options_.world_size + options_.rank) * static_cast<uint64_t>(B);
  std::vector<int64_t> starts(B);
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t row = first_row + b;
    if (options_.sampling == Sampling::random) {
      starts[b] = random_start(row);
    } else if (options_.shuffle) {
      const std::vector<int64_t>& perm = epoch_permutation(row / windows_);
      starts[b] = perm[row % windows_] * T;
    } else {
      starts[b] = static_cast<int64_t>(row) * T;
    }
  }
  return starts;
}

Batch DataLoader::batch_at(uint64_t k) const {
  file_.check_not_shrunk();  // a shrunk map would fault (SIGBUS) in the reads below
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

uint64_t DataLoader::max_position() const {
  // Every row r of micro-batch k starts at token r·T (row_starts), r < (k·W + rank + 1)·B.
  const uint64_t rows = static_cast<uint64_t>(INT64_MAX / options_.seq) - 1;
  const uint64_t per_batch = static_cast<uint64_t>(options_.batch);
  const uint64_t world = static_cast<uint64_t>(options_.world_size);
  return (rows / per_batch - 1 - static_cast<uint64_t>(options_.rank)) / world;
}

void DataLoader::set_position(uint64_t k) {
  TESSERA_CHECK(k <= max_position(), "DataLoader: position ", k,
                " is past the largest this loader can address (", max_position(), ")");
  position_ = k;
}

Batch DataLoader::next() { return batch_at(position_++); }

DataLoader::Iterator DataLoader::begin() {
  if (options_.max_batches <= 0) return Iterator(this, -1);
  const auto bound = static_cast<uint64_t>(options_.max_batches);
  return Iterator(this, position_ < bound ? static_cast<int64_t>(bound - position_) : 0);
}

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
