#include "tessera/dist/ddp.h"

#include "tessera/optim/clip.h"

namespace tessera::dist {

std::pair<std::vector<Tensor>, std::vector<std::string>> trainable_parameters(const nn::Module& m) {
  std::pair<std::vector<Tensor>, std::vector<std::string>> out;
  for (auto& [name, p] : m.named_parameters()) {
    if (!p.requires_grad()) continue;
    out.first.push_back(p);
    out.second.push_back(name);
  }
  return out;
}

namespace {
bool sparse_embeddings(const ProcessGroup& group, const DDPOptions& options) {
  return options.sparse_embedding_gradients && group.size() > 1;
}

FlatBuckets make_ddp_buckets(nn::Module& module, const std::shared_ptr<ProcessGroup>& group,
                             const DDPOptions& options) {
  refuse_deferred_parameters(module, "DDP");
  // Rank 0's weights first, so every rank's buckets start from the same model.
  if (options.broadcast_parameters) broadcast_module_from_rank0(module, *group);
  auto [params, names] = trainable_parameters(module);
  FlatBucketsOptions o;
  o.bucket_bytes = options.bucket_bytes;
  o.last_bucket_bytes = options.last_bucket_bytes;
  o.find_unused_parameters = options.find_unused_parameters;
  o.reduce_dtype = options.reduce_dtype;
  if (sparse_embeddings(*group, options))
    o.solo = SparseEmbeddingSync::embedding_weights(module, params);
  // The buckets in the group's own memory where it offers some (NCCL symmetric windows, the
  // two-rank copy-engine all-reduce's shared buffers). DDP keeps its buckets for the whole
  // run, so they are allocated once (the ZeRO stages release theirs and do not ask for this).
  o.communication_buffers_from_group = group->offers_communication_buffers();
  return FlatBuckets(std::move(params), std::move(names), group, o);
}
}  // namespace

DistributedDataParallel::DistributedDataParallel(nn::Module& module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DDPOptions options)
    : module_(module),
      group_(group ? std::move(group) : world_ptr()),
      buckets_(make_ddp_buckets(module_, group_, options)) {
  if (sparse_embeddings(*group_, options))
    sparse_ = std::make_unique<SparseEmbeddingSync>(
        module_, buckets_, group_,
        SparseEmbeddingSync::embedding_weights(module_, buckets_.parameters()));
}

void DistributedDataParallel::finish_gradient_sync() {
  if (sparse_)
    sparse_->finish();
  else
    buckets_.finish();
}

void DistributedDataParallel::sync_accumulated_gradients() {
  if (!gradient_sync()) return;
  // In bucket-slot order on every rank: each bucket launches once its last slot is reported.
  for (size_t i = 0; i < buckets_.parameters().size(); ++i)
    if (!buckets_.is_ready(i)) buckets_.mark_ready(i);
  finish_gradient_sync();
}

void DistributedDataParallel::register_comm_hook(FlatBuckets::CommHook hook,
                                                 FlatBuckets::CompletionHook done) {
  if (sparse_) sparse_->set_enabled(false);
  buckets_.register_comm_hook(std::move(hook), std::move(done));
}

SparseEmbeddingSync::Stats DistributedDataParallel::sparse_embedding_stats() const {
  return sparse_ ? sparse_->stats() : SparseEmbeddingSync::Stats{};
}

void DistributedDataParallel::backward(const Tensor& loss) {
  loss.backward();
  finish_gradient_sync();
}

double DistributedDataParallel::clip_grad_norm_(const std::vector<Tensor>& params,
                                                double max_norm) {
  return optim::clip_grad_norm_(params, max_norm);  // every rank holds the whole average
}

MemoryUsage DistributedDataParallel::memory() const {
  MemoryUsage m;
  for (const Tensor& p : module_.parameters()) m.parameters += static_cast<int64_t>(p.nbytes());
  m.gradients = buckets_.gradient_bytes();
  m.communication = buckets_.reduce_buffer_bytes();
  return m;
}

}  // namespace tessera::dist
