#include "tessera/data/example_loader.h"

#include <algorithm>

#include "tessera/core/error.h"

namespace tessera::data {

ExampleLoader::ExampleLoader(ExampleDataset dataset, Collator collator,
                             ExampleLoaderOptions options)
    : dataset_(std::move(dataset)), collator_(std::move(collator)), options_(options) {
  TESSERA_CHECK(collator_ != nullptr, "ExampleLoader: no collator");
  TESSERA_CHECK(options_.batch_size >= 1, "ExampleLoader: batch_size ", options_.batch_size,
                " must be at least 1");
  if (options_.evaluation) {
    TESSERA_CHECK(!options_.drop_last && !options_.shuffle && !options_.group_by_length,
                  "ExampleLoader: evaluation keeps every example once in dataset order; ",
                  "drop_last, shuffle and group_by_length are for training");
    eval_sampler_.emplace(dataset_.size(), options_.batch_size, options_.rank,
                          options_.world_size);
    return;
  }
  train_sampler_.emplace(
      dataset_.size(),
      DistributedSamplerOptions{
          .num_replicas = options_.world_size,
          .rank = options_.rank,
          .shuffle = options_.shuffle,
          .seed = options_.seed,
          .drop_last = options_.drop_last,
          .lengths = options_.group_by_length ? dataset_.lengths() : std::vector<int64_t>{},
          .batch_size = options_.batch_size});
  set_epoch(0);
}

void ExampleLoader::set_epoch(uint64_t epoch) {
  epoch_ = epoch;
  if (!train_sampler_) return;
  train_sampler_->set_epoch(epoch);
  epoch_indices_ = train_sampler_->indices();
}

int64_t ExampleLoader::size() const {
  if (eval_sampler_) return eval_sampler_->size();
  const auto n = static_cast<int64_t>(epoch_indices_.size()), b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

EvalBatchIndices ExampleLoader::batch_indices(int64_t k) const {
  TESSERA_CHECK(k >= 0 && k < size(), "ExampleLoader: batch ", k, " is outside [0, ", size(), ")");
  if (eval_sampler_) return eval_sampler_->batch(k);
  const size_t first = static_cast<size_t>(k * options_.batch_size);
  const size_t last = std::min(epoch_indices_.size(), first + options_.batch_size);
  EvalBatchIndices out;
  out.indices.assign(epoch_indices_.begin() + first, epoch_indices_.begin() + last);
  out.real_examples = static_cast<int64_t>(out.indices.size());
  return out;
}

ExampleBatch ExampleLoader::batch(int64_t k) const {
  EvalBatchIndices chosen = batch_indices(k);
  std::vector<Example> examples;
  examples.reserve(chosen.indices.size());
  for (int64_t i : chosen.indices) examples.push_back(dataset_[i]);
  ExampleBatch out = collator_(examples);
  out.indices = std::move(chosen.indices);
  out.real_examples = chosen.real_examples;
  return out;
}

}  // namespace tessera::data
