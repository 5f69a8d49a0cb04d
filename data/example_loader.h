// ExampleLoader: PyTorch's DataLoader over an ExampleDataset with a collator. One epoch's
// batches come from a sampler (data/sampler.h): for training a DistributedSampler (shuffle,
// seed, set_epoch, drop_last, group_by_length), for evaluation an EvalSampler (dataset
// order, every example once; the padding rows of the last round are counted in
// ExampleBatch::real_examples for gather_for_metrics). Iterating again restarts the epoch;
// set_epoch(e) picks the next epoch's order.
#pragma once
#include <cstdint>
#include <functional>
#include <iterator>
#include <optional>
#include <span>
#include <vector>

#include "tessera/data/collator.h"
#include "tessera/data/example_dataset.h"
#include "tessera/data/sampler.h"

namespace tessera::data {

using Collator = std::function<ExampleBatch(std::span<const Example>)>;

struct ExampleLoaderOptions {
  int64_t batch_size = 8;  // per rank
  bool shuffle = false;
  uint64_t seed = 0;
  // Training: the sampler drops the tail that does not divide among the ranks, and the
  // loader the last incomplete batch (PyTorch's drop_last on both). Refused for evaluation.
  bool drop_last = false;
  bool group_by_length = false;  // training: HF's LengthGroupedSampler order
  int rank = 0;
  int world_size = 1;
  bool evaluation = false;  // EvalSampler: dataset order, gather_for_metrics padding
};

class ExampleLoader {
 public:
  ExampleLoader(ExampleDataset dataset, Collator collator, ExampleLoaderOptions options);

  void set_epoch(uint64_t epoch);
  uint64_t epoch() const { return epoch_; }
  int64_t size() const;                 // batches per epoch on this rank (len())
  ExampleBatch batch(int64_t k) const;  // batch k of the current epoch
  // The dataset indices of batch k (and how many of them are real).
  EvalBatchIndices batch_indices(int64_t k) const;

  const ExampleDataset& dataset() const { return dataset_; }
  const ExampleLoaderOptions& options() const { return options_; }

  class Iterator {
   public:
    Iterator(const ExampleLoader* loader, int64_t k) : loader_(loader), k_(k) {}
    ExampleBatch operator*() const { return loader_->batch(k_); }
    Iterator& operator++() {
      ++k_;
      return *this;
    }
    bool operator==(std::default_sentinel_t) const { return k_ >= loader_->size(); }

   private:
    const ExampleLoader* loader_;
    int64_t k_;
  };
  Iterator begin() const { return Iterator(this, 0); }
  std::default_sentinel_t end() const { return {}; }

 private:
  ExampleDataset dataset_;
  Collator collator_;
  ExampleLoaderOptions options_;
  uint64_t epoch_ = 0;
  std::optional<DistributedSampler> train_sampler_;
  std::optional<EvalSampler> eval_sampler_;
  std::vector<int64_t> epoch_indices_;  // training: this rank's indices for epoch_
};

}  // namespace tessera::data
