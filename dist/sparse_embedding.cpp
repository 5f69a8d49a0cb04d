#include "tessera/dist/sparse_embedding.h"

#include <algorithm>

#include "tessera/autograd/functions.h"
#include "tessera/core/graph_capture.h"

namespace tessera::dist {

// What the Embedding modules hold. It outlives the sync when a recorded graph keeps it; the
// sync clears `owner` when it goes, and the sink then accumulates locally.
class SparseEmbeddingSync::Sink final : public EmbeddingGradSink {
 public:
  Sink(SparseEmbeddingSync* owner, size_t weight, Tensor tensor)
      : owner(owner), weight(weight), tensor(std::move(tensor)) {}
  bool accepts(const Tensor& w, const Tensor& indices) override {
    return owner != nullptr && owner->accepts(weight, w, indices);
  }
  void take(const Tensor& indices, const Tensor& grad) override {
    if (owner)
      owner->take(weight, indices, grad);
    else
      add_lookup_gradient(tensor, indices, grad);
  }

  SparseEmbeddingSync* owner;
  size_t weight;
  Tensor tensor;
};

namespace {
// out[indices[i]] += scale · rows[i] (each product rounded to out's dtype), each row's sum taken
// in position order in f32 and added once. Every rank runs it on the same data and must get
// the same bits: embedding_backward_into is deterministic on every device (index_add_ on CUDA
// is not).
void add_rows(const Tensor& out, const Tensor& indices, const Tensor& rows, double scale = 1.0) {
  ops::embedding_backward_into(out, rows, indices, /*accumulate=*/true, scale);
}
}  // namespace

void add_lookup_gradient(const Tensor& weight, const Tensor& indices, const Tensor& grad) {
  Tensor g = weight.grad();
  if (!g.defined()) {
    g = zeros(weight.shape(), {.dtype = weight.dtype(), .device = weight.device()});
    weight.set_grad(g);
  }
  add_rows(g, indices, grad);
}

std::vector<size_t> SparseEmbeddingSync::embedding_weights(const nn::Module& module,
                                                           const std::vector<Tensor>& params) {
  std::vector<size_t> out;
  for (auto& [name, m] : module.named_modules()) {
    auto* embedding = dynamic_cast<const nn::Embedding*>(m);
    if (embedding == nullptr || !embedding->weight.defined()) continue;
    for (size_t k = 0; k < params.size(); ++k)
      if (params[k].impl_ptr() == embedding->weight.impl_ptr() &&
          std::find(out.begin(), out.end(), k) == out.end())
        out.push_back(k);
  }
  return out;
}

SparseEmbeddingSync::SparseEmbeddingSync(nn::Module& module, FlatBuckets& buckets,
                                         std::shared_ptr<ProcessGroup> group,
                                         const std::vector<size_t>& weights)
    : module_(module), buckets_(buckets), group_(std::move(group)) {
  for (size_t k : weights) {
    Weight w;
    w.param = k;
    w.tensor = buckets_.parameters().at(k);
    w.sink = std::make_shared<Sink>(this, weights_.size(), w.tensor);
    for (auto& [name, m] : module.named_modules())
      if (auto* e = dynamic_cast<nn::Embedding*>(m);
          e && e->weight.impl_ptr() == w.tensor.impl_ptr())
        e->grad_sink = w.sink;
    weights_.push_back(std::move(w));
  }
  buckets_.set_extension(
      {.backward_started = [this] { on_backward_started(); },
       .bucket_reduced = [this](FlatBuckets::Bucket& b) { add_into_reduced(b); }});
}

SparseEmbeddingSync::~SparseEmbeddingSync() {
  buckets_.set_extension({});
  // The modules may be gone already (a model destroyed before its DDP): only the sinks are
  // touched; the modules that are left keep theirs, detached (accepting nothing).
  for (Weight& w : weights_) w.sink->owner = nullptr;
}

bool SparseEmbeddingSync::accepts(size_t index, const Tensor& weight, const Tensor& indices) {
  Weight& w = weights_.at(index);
  if (weight.impl_ptr() != w.tensor.impl_ptr()) return false;  // not the weight DDP holds
  const int64_t n = indices.numel();
  // Only training lookups: a forward in eval mode may run on one rank alone (evaluation on the
  // main process), where agreeing on a new N would wait for the others forever.
  const bool sparse = enabled_ && buckets_.sync() && module_.is_training() && n > 0 &&
                      group_->size() * n < 2 * w.tensor.size(0) && agreed(n, w.tensor.device());
  if (!sparse) {
    ++stats_.dense_lookups;
    return false;
  }
  ++w.accepted;
  ++stats_.sparse_lookups;
  return true;
}

// One blocking all-reduce per new size: max of (n, -n) over the ranks is (n, -n) only when
// every rank has n.
bool SparseEmbeddingSync::agreed(int64_t n, Device device) {
  if (agreed_sizes_.count(n)) return true;
  if (sizes_disagree_ || graph_capture_underway()) return false;
  Tensor both =
      ops::to(from_vector<int64_t>({n, -n}, {2}, {.dtype = DType::i64}), device, DType::i64);
  group_->all_reduce(both, ReduceOp::Max)->wait();
  const std::vector<int64_t> max = ops::to(both, Device::cpu(), DType::i64).to_vector<int64_t>();
  if (max[0] == n && max[1] == -n) {
    agreed_sizes_.insert(n);
    return true;
  }
  sizes_disagree_ = true;
  return false;
}

void SparseEmbeddingSync::take(size_t index, const Tensor& indices, const Tensor& grad) {
  Weight& w = weights_.at(index);
  if (!buckets_.sync()) {  // sync was turned off after the forward: accumulate as no_sync does
    add_lookup_gradient(w.tensor, indices, grad);
    return;
  }
  if (buckets_.buckets()[buckets_.bucket_of(w.param)].launched)
    ++stats_.launched_before_lookup_backward;
  else
    mark_ready_without_dense_use(w);
  gather(w, indices, grad);
}

void SparseEmbeddingSync::mark_ready_without_dense_use(Weight& w) {
  // A leaf's AccumulateGrad node lives while a recorded graph has an edge into it.
  if (!buckets_.is_ready(w.param) && autograd::meta_of(w.tensor).accumulate_grad.expired())
    buckets_.mark_ready(w.param);
}

// The graph of this backward is complete: a weight whose only uses went to the sink has its
// dense gradient (zero, or what no_sync steps accumulated) final now, and its bucket goes.
// The lookups' gradients arrive at the end of backward, when the last bucket (the first
// layers' gradients) is ready too: it waits until finish(), so that the all-gathers run
// first and their rows are added while it is all-reduced.
void SparseEmbeddingSync::on_backward_started() {
  bool any = false;
  for (Weight& w : weights_)
    if (w.accepted > 0) {
      mark_ready_without_dense_use(w);
      any = true;
    }
  if (any) buckets_.hold_last_bucket();
}

// Issued as soon as the lookup's backward hands its rows over: every rank reaches each take()
// at the same place in its backward, so the collectives come in the same order everywhere.
void SparseEmbeddingSync::gather(Weight& w, const Tensor& indices, const Tensor& grad) {
  const int64_t world = group_->size(), n = indices.numel();
  if (buckets_.last_bucket_held()) ++stats_.gathered_before_last_bucket;
  Gathered g = destinations(world * n, indices, grad);
  g.indices_work = group_->all_gather(g.indices, indices);
  g.grads_work = group_->all_gather(g.grads, grad);
  w.gathered.push_back(std::move(g));
}

// Where the gather of one lookup goes: memory from the group where it offers some (two GPUs
// of one host gather through the copy engines into it), one pair per lookup of a backward
// and per size, kept for every later step and for the graphs that record them; otherwise (or
// for a size first met while a graph is recorded: allocating it is a collective outside any
// stream) fresh tensors. Every rank takes the same branch: the same lookups, sizes and
// recordings come in the same order everywhere.
SparseEmbeddingSync::Gathered SparseEmbeddingSync::destinations(int64_t rows, const Tensor& indices,
                                                                const Tensor& grad) {
  const int64_t c = grad.size(1);
  const GatherKey key{gathers_++, rows, c, indices.dtype(), grad.dtype()};
  auto it = gather_buffers_.find(key);
  if (it == gather_buffers_.end() && group_->offers_communication_buffers() &&
      !graph_capture_underway()) {
    Gathered g;
    g.indices = group_->allocate_communication_buffer(rows, indices.dtype(), indices.device());
    g.grads = ops::view(
        group_->allocate_communication_buffer(rows * c, grad.dtype(), grad.device()), {rows, c});
    it = gather_buffers_.emplace(key, std::move(g)).first;
  }
  Gathered g;
  if (it != gather_buffers_.end()) {
    g.indices = it->second.indices, g.grads = it->second.grads;
  } else {
    g.indices = empty({rows}, {.dtype = indices.dtype(), .device = indices.device()});
    g.grads = empty({rows, c}, {.dtype = grad.dtype(), .device = grad.device()});
  }
  return g;
}

void SparseEmbeddingSync::add_into_reduced(FlatBuckets::Bucket& bucket) {
  if (!bucket.solo) return;
  for (Weight& w : weights_) {
    if (w.param != bucket.params.front() || w.gathered.empty()) continue;
    const Tensor& reduced = bucket.communication_buffer();
    const Tensor slot = ops::view(ops::narrow(reduced, 0, bucket.offsets.front(), w.tensor.numel()),
                                  w.tensor.shape());
    const double scale = 1.0 / static_cast<double>(group_->size());
    for (Gathered& g : w.gathered) {
      g.indices_work->wait_on_device();
      g.grads_work->wait_on_device();
      // Rank 0's rows first, then rank 1's, ...: the same order, so the same bits, everywhere.
      // Each row is scaled and rounded in the reduced buffer's dtype (f32 under a bf16 policy
      // reducing in f32) as the scatter reads it: no pass over the gathered rows before it.
      add_rows(slot, g.indices, g.grads, scale);
    }
    w.gathered.clear();
  }
}

void SparseEmbeddingSync::finish() {
  if (!buckets_.sync()) {
    buckets_.finish();
    return;
  }
  // A weight whose lookups all went to the sink and that nothing reported yet (its graph
  // outlived by an older one that uses it densely, say) is complete now.
  for (Weight& w : weights_)
    if (w.accepted > 0 && !buckets_.is_ready(w.param)) buckets_.mark_ready(w.param);
  try {
    buckets_.finish();
  } catch (...) {
    reset();
    throw;
  }
  reset();
}

void SparseEmbeddingSync::reset() {
  gathers_ = 0;
  for (Weight& w : weights_) {
    w.accepted = 0;
    w.gathered.clear();
  }
}

}  // namespace tessera::dist
