#include "tessera/data/sampler.h"

#include <algorithm>
#include <cmath>  // core/philox.h uses sqrt/log/cos without including it
#include <numeric>

#include "tessera/core/error.h"
#include "tessera/core/philox.h"

namespace tessera::data {

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, uint64_t epoch) {
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::iota(out.begin(), out.end(), int64_t{0});
  // Its own Philox blocks per epoch (2^32 draws apart), one draw per swap.
  const uint64_t block_offset = epoch << 32;
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = philox_randint_at(seed, block_offset, static_cast<uint64_t>(i), 0, i + 1);
    std::swap(out[i], out[j]);
  }
  return out;
}

std::vector<int64_t> length_grouped(std::vector<int64_t> permutation,
                                    std::span<const int64_t> lengths, int64_t batch_size,
                                    int64_t megabatch_batches) {
  const auto n = static_cast<int64_t>(permutation.size());
  if (megabatch_batches <= 0)
    megabatch_batches = std::max<int64_t>(1, std::min<int64_t>(n / (4 * batch_size), 50));
  const int64_t megabatch = megabatch_batches * batch_size;
  const auto longer = [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; };
  size_t longest_start = 0;
  for (int64_t start = 0; start < n; start += megabatch) {
    const auto first = permutation.begin() + start;
    std::stable_sort(first, permutation.begin() + std::min(n, start + megabatch), longer);
    if (lengths[*first] > lengths[permutation[longest_start]]) longest_start = start;
  }
  if (n > 0) std::swap(permutation[0], permutation[longest_start]);
  return permutation;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : dataset_size_(dataset_size), options_(std::move(options)) {
  const int W = options_.num_replicas;
  TESSERA_CHECK(dataset_size > 0, "DistributedSampler: the dataset is empty");
  TESSERA_CHECK(W >= 1, "DistributedSampler: num_replicas ", W, " must be at least 1");
  TESSERA_CHECK(options_.rank >= 0 && options_.rank < W, "DistributedSampler: rank ",
                options_.rank, " is outside [0, ", W, ")");
  TESSERA_CHECK(options_.lengths.empty() ||
                    static_cast<int64_t>(options_.lengths.size()) == dataset_size,
                "DistributedSampler: ", options_.lengths.size(), " lengths for ", dataset_size,
                " examples");
  TESSERA_CHECK(options_.batch_size >= 1, "DistributedSampler: batch_size ", options_.batch_size,
                " must be at least 1");
  TESSERA_CHECK(!options_.drop_last || dataset_size >= W, "DistributedSampler: drop_last with ",
                dataset_size, " examples for ", W, " ranks leaves every rank none");
  // torch: with drop_last the tail is cut, otherwise the list is padded up to W · ceil(n / W).
  num_samples_ = options_.drop_last ? dataset_size / W : (dataset_size + W - 1) / W;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order;
  if (options_.shuffle) {
    order = seeded_permutation(dataset_size_, options_.seed, epoch_);
  } else {
    order.resize(static_cast<size_t>(dataset_size_));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  if (!options_.lengths.empty())
    order = length_grouped(std::move(order), options_.lengths,
                           options_.batch_size * options_.num_replicas);
  const int64_t total = total_size();
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  // Position p past the end repeats order[p mod n] (torch pads with the list's start,
  // repeated as often as needed).
  for (int64_t p = options_.rank; p < total; p += options_.num_replicas)
    mine.push_back(order[static_cast<size_t>(p % dataset_size_)]);
  return mine;
}

EvalSampler::EvalSampler(int64_t dataset_size, int64_t batch_size, int rank, int num_replicas)
    : dataset_size_(dataset_size),
      batch_size_(batch_size),
      rank_(rank),
      num_replicas_(num_replicas) {
  TESSERA_CHECK(dataset_size > 0, "EvalSampler: the dataset is empty");
  TESSERA_CHECK(batch_size >= 1, "EvalSampler: batch_size ", batch_size, " must be at least 1");
  TESSERA_CHECK(num_replicas >= 1 && rank >= 0 && rank < num_replicas, "EvalSampler: rank ", rank,
                " is outside [0, ", num_replicas, ")");
  const int64_t per_round = batch_size * num_replicas;
  rounds_ = (dataset_size + per_round - 1) / per_round;
}

EvalBatchIndices EvalSampler::batch(int64_t k) const {
  TESSERA_CHECK(k >= 0 && k < rounds_, "EvalSampler: batch ", k, " is outside [0, ", rounds_, ")");
  const int64_t first = (k * num_replicas_ + rank_) * batch_size_;
  EvalBatchIndices out;
  out.real_examples = std::clamp<int64_t>(dataset_size_ - first, 0, batch_size_);
  for (int64_t p = first; p < first + batch_size_; ++p) out.indices.push_back(p % dataset_size_);
  return out;
}

}  // namespace tessera::data
