// Which examples each rank takes, epoch by epoch.
//
// Training: DistributedSampler has torch.utils.data.DistributedSampler's semantics (shuffle
// with seed + epoch, set_epoch(e) before each epoch; without drop_last the list is padded by
// repeating its start until every rank has ceil(n / W) examples, with drop_last its tail is
// cut so every rank has floor(n / W); rank r takes positions r, r + W, ...). The shuffle is
// Tessera's own seeded permutation (seeded_permutation: Fisher-Yates driven by Philox), not
// torch.randperm, so it does not reproduce torch's order bit for bit; it is the same on
// every machine and at every world size for a seed and epoch. With group_by_length it is
// Hugging Face's LengthGroupedSampler order: the permutation is cut into megabatches of
// up to 50 global batches, each sorted by length (longest first), and the longest example of
// all leads, so a batch holds examples of similar length and the first step meets the
// largest memory need at once.
//
// Evaluation: EvalSampler keeps every example exactly once with Accelerate's
// gather_for_metrics semantics. Batches are dealt to ranks in dataset order (round k gives
// rank r positions [(kW + r)B, (kW + r + 1)B)), every rank gets the same number of full
// batches, and positions past the end repeat the dataset from its start (even_batches).
// Each batch records how many of its examples are real; gathering a round (rank 0's batch,
// then rank 1's, ...) and keeping the real ones gives the dataset in its order at any world
// size: the padding can only be the tail of the last round, which is what gather_for_metrics
// drops.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace tessera::data {

// A permutation of [0, n) that depends only on (seed, epoch).
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, uint64_t epoch);

// Hugging Face's get_length_grouped_indices over `permutation`: megabatches of
// megabatch_batches × batch_size, each sorted by lengths[i] descending (stably), the longest
// of all swapped to the front. megabatch_batches 0: min(n / (4 batch_size), 50), at least 1.
std::vector<int64_t> length_grouped(std::vector<int64_t> permutation,
                                    std::span<const int64_t> lengths, int64_t batch_size,
                                    int64_t megabatch_batches = 0);

struct DistributedSamplerOptions {
  int num_replicas = 1;
  int rank = 0;
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
  // Non-empty (one length per example): group by length; then batch_size (per rank) sets
  // the megabatch, batch_size × num_replicas × up to 50.
  std::vector<int64_t> lengths{};
  int64_t batch_size = 1;
};

class DistributedSampler {
 public:
  // Errors name the problem: an empty dataset, rank outside [0, num_replicas), lengths of
  // another size than the dataset, a dataset smaller than the world with drop_last.
  DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options);
  void set_epoch(uint64_t epoch) { epoch_ = epoch; }
  uint64_t epoch() const { return epoch_; }
  // This rank's examples for the current epoch.
  std::vector<int64_t> indices() const;
  int64_t size() const { return num_samples_; }  // torch's num_samples
  int64_t total_size() const { return num_samples_ * options_.num_replicas; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  DistributedSamplerOptions options_;
  int64_t num_samples_ = 0;
  uint64_t epoch_ = 0;
};

struct EvalBatchIndices {
  std::vector<int64_t> indices;  // batch_size of them
  int64_t real_examples = 0;     // the first real_examples are real, the rest repeats
};

class EvalSampler {
 public:
  EvalSampler(int64_t dataset_size, int64_t batch_size, int rank = 0, int num_replicas = 1);
  int64_t size() const { return rounds_; }  // batches per rank
  EvalBatchIndices batch(int64_t k) const;  // this rank's batch k, k < size()

 private:
  int64_t dataset_size_, batch_size_;
  int rank_, num_replicas_;
  int64_t rounds_;
};

}  // namespace tessera::data
