// DistributedDataParallel: every rank holds the whole model; after each
// backward the gradients are averaged over the ranks, so every rank takes the
// same optimizer step. The first data-parallel strategy (dist/strategy.h).
//
// Like PyTorch's reducer: the gradients live in flat buckets (dist/flat_buckets.h)
// filled in reverse registration order, and each bucket's all_reduce starts from
// the autograd grad-ready hook as soon as its last gradient is final, while
// backward still runs. register_comm_hook replaces the all-reduce (as PyTorch's
// DDP.register_comm_hook does). The gradients of nn::Embedding weights are synchronised
// sparsely where that moves fewer bytes (dist/sparse_embedding.h).
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/dist/flat_buckets.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/sparse_embedding.h"
#include "tessera/dist/strategy.h"
#include "tessera/nn/module.h"

namespace tessera::dist {

struct DDPOptions {
  size_t bucket_bytes = kDefaultBucketBytes;
  // The bucket reduced last (the first parameters, ready at the very end of backward) is kept
  // to about this size, so that little communication is left after backward (see
  // FlatBucketsOptions::last_bucket_bytes); at or above bucket_bytes: no such cap.
  size_t last_bucket_bytes = size_t(4) << 20;
  // false: a parameter that gets no gradient in a synced backward is an error naming it.
  // true: its bucket slot counts as zero (or as what no_sync steps accumulated).
  bool find_unused_parameters = false;
  // Copy rank 0's parameters and buffers to every rank when wrapping.
  bool broadcast_parameters = true;
  // f16/bf16 gradients are averaged in f32 (each bucket is cast into an f32 buffer, reduced
  // and cast back), so they are rounded once rather than at every step of the reduction;
  // their own dtype (or none) reduces them in place: half the bytes on the wire, no casts.
  std::optional<DType> reduce_dtype = DType::f32;
  // Embedding lookups hand their gradient rows to an all-gather instead of scattering them
  // into the weight's bucket, when that moves fewer bytes (dist/sparse_embedding.h); each
  // Embedding weight gets a bucket of its own. false: every gradient is averaged densely.
  bool sparse_embedding_gradients = true;
};

class DistributedDataParallel : public DataParallelStrategy {
 public:
  using Bucket = FlatBuckets::Bucket;

  // The group defaults to the world group.
  explicit DistributedDataParallel(nn::Module& module,
                                   std::shared_ptr<ProcessGroup> group = nullptr,
                                   DDPOptions options = {});
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  std::string name() const override { return "DDP"; }
  nn::Module& module() const override { return module_; }
  Tensor operator()(const Tensor& x) { return module_(x); }
  ProcessGroup& group() const { return *group_; }

  // loss.backward(), then finish_gradient_sync().
  void backward(const Tensor& loss);
  // After a backward: launches buckets the hooks did not (unused parameters), waits for
  // every all_reduce and leaves each parameter's .grad holding the average over ranks.
  // Does nothing inside no_sync.
  void finish_gradient_sync() override;
  // Every parameter reported ready (what the no_sync backwards accumulated, zero where none
  // came), then finish_gradient_sync; embedding gradients go densely here.
  void sync_accumulated_gradients() override;
  // A custom hook owns what the buckets carry: embedding gradients go densely from then on.
  void register_comm_hook(FlatBuckets::CommHook hook, FlatBuckets::CompletionHook done = {});
  // How the embedding lookups were synchronised (all zero when none is synchronised sparsely).
  SparseEmbeddingSync::Stats sparse_embedding_stats() const;

  // DDP keeps the optimizer as the user built it.
  void prepare_optimizer(optim::Optimizer&) override {}
  void set_gradient_sync(bool on) override { buckets_.set_sync(on); }
  bool gradient_sync() const override { return buckets_.sync(); }
  bool sync_enabled() const { return gradient_sync(); }
  double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) override;
  MemoryUsage memory() const override;

  const std::vector<Tensor>& parameters() const { return buckets_.parameters(); }
  const std::vector<std::string>& parameter_names() const { return buckets_.parameter_names(); }
  const std::vector<Bucket>& buckets() const { return buckets_.buckets(); }
  // The view of bucket memory that is parameter i's gradient.
  Tensor gradient_slot(size_t i) { return buckets_.gradient_slot(i); }
  // How gradients reached the buckets (written in place vs copied in; FlatBuckets).
  const FlatBuckets::AdoptionCounts& adoption_counts() const { return buckets_.adoption_counts(); }

 private:
  nn::Module& module_;
  std::shared_ptr<ProcessGroup> group_;
  FlatBuckets buckets_;
  std::unique_ptr<SparseEmbeddingSync> sparse_;  // null: no sparse embedding gradients
};

// The parameters that require grad, with their names (tied tensors once).
std::pair<std::vector<Tensor>, std::vector<std::string>> trainable_parameters(const nn::Module& m);

}  // namespace tessera::dist
