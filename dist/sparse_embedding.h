// DDP's sparse synchronisation of embedding gradients.
//
// An embedding weight's gradient is G_dense (from its other uses: a tied output head,
// ready at the start of backward) plus the lookup's scatter of dY at the looked-up rows,
// which is complete only after the lookup's backward, the last op of backward. Averaged
// densely, the weight's [V, C] all-reduce waits for that last op and then runs with nothing
// left to overlap. Synchronised sparsely (the idea of PyTorch DDP's sparse gradients, without
// sparse tensors):
//   - the lookup hands (indices [N], dY [N, C]) to a sink (EmbeddingGradSink) instead of
//     scattering them, so G_dense is final early: the weight's own bucket (a solo bucket,
//     dist/flat_buckets.h) is all-reduced while the rest of backward runs;
//   - as the lookup's backward hands them over, every rank all-gathers every rank's
//     (indices, dY) (ahead of the last bucket, which waits for finish()), and once the
//     weight's all-reduce is done adds, in rank order, the scatter of
//     dY_r / world_size at indices_r into the reduced bucket. Every rank computes the same
//     bits (the scatter must be deterministic), equal to the dense average up to rounding.
// It is worth it while world_size · N < 2 · V (the all-gather moves less than the ring
// all-reduce). A lookup takes the ordinary dense path when that does not hold, while sync is
// off (no_sync micro-steps accumulate locally as before), when a custom comm hook is
// registered, or when its N is not agreed: all_gather needs the same N on every rank, so the
// ranks agree on each new N once, with a blocking all-reduce (never inside a graph capture:
// there an unagreed N goes dense); one disagreement turns the sparse path off for good, the
// same decision on every rank. Agreed sizes are cached, so the ranks must meet the same
// sequence of lookup sizes in training mode (the data loaders' equal batches do); a module in
// eval mode always takes the dense path.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <vector>

#include "tessera/dist/flat_buckets.h"
#include "tessera/dist/process_group.h"
#include "tessera/nn/layers.h"

namespace tessera::dist {

class SparseEmbeddingSync {
 public:
  struct Stats {
    int64_t sparse_lookups = 0;  // lookups whose gradient went through the sink
    int64_t dense_lookups = 0;   // lookups of a synchronised weight that took the dense path
    // Sparse lookups whose weight's bucket had been launched before their backward ran.
    int64_t launched_before_lookup_backward = 0;
    // Lookups whose rows were all-gathered while the last bucket was still held back.
    int64_t gathered_before_last_bucket = 0;
  };

  // The indices into `params` of the weights of `module`'s nn::Embedding modules.
  static std::vector<size_t> embedding_weights(const nn::Module& module,
                                               const std::vector<Tensor>& params);

  // Installs a sink on every Embedding of `module` whose weight is buckets.parameters()[k]
  // for a k in `weights` (each of them a solo parameter of `buckets`), and plugs into the
  // buckets' Extension. `buckets` must outlive this object; `module` need not: this object
  // never reaches into the modules once built (a model may go before its DDP).
  SparseEmbeddingSync(nn::Module& module, FlatBuckets& buckets, std::shared_ptr<ProcessGroup> group,
                      const std::vector<size_t>& weights);
  // Detaches the sinks without touching the modules (they may be gone): a module that is
  // still there keeps its sink, which accepts nothing from then on (its lookups take the
  // ordinary dense backward); a graph recorded before keeps its sink too, which then adds the
  // lookup's gradient into weight.grad locally.
  ~SparseEmbeddingSync();
  SparseEmbeddingSync(const SparseEmbeddingSync&) = delete;
  SparseEmbeddingSync& operator=(const SparseEmbeddingSync&) = delete;

  // Off: every lookup takes the dense path (a custom comm hook owns the buckets' data).
  void set_enabled(bool on) { enabled_ = on; }
  // Runs the buckets' finish() with the lookups of this backward synchronised.
  void finish();
  const Stats& stats() const { return stats_; }

 private:
  class Sink;
  struct Gathered {
    Tensor indices, grads;  // [W·N], [W·N, C], rank r's rows at [r·N, (r+1)·N)
    WorkPtr indices_work, grads_work;
  };
  struct Weight {
    size_t param = 0;
    Tensor tensor;
    std::shared_ptr<Sink> sink;      // shared with the modules (and recorded graphs)
    int64_t accepted = 0;            // lookups accepted since the last finish
    std::vector<Gathered> gathered;  // their rows, all-gathered in backward
  };

  bool accepts(size_t w, const Tensor& weight, const Tensor& indices);
  void take(size_t w, const Tensor& indices, const Tensor& grad);
  bool agreed(int64_t n, Device device);
  // The weight's dense gradient is final when no recorded graph uses the weight densely.
  void mark_ready_without_dense_use(Weight& w);
  void on_backward_started();
  // All-gathers every rank's (indices, dY) of one lookup.
  void gather(Weight& w, const Tensor& indices, const Tensor& grad);
  // The tensors one gather of `rows` rows like (indices, grad) goes into.
  Gathered destinations(int64_t rows, const Tensor& indices, const Tensor& grad);
  void add_into_reduced(FlatBuckets::Bucket& bucket);
  void reset();

  nn::Module& module_;
  FlatBuckets& buckets_;
  std::shared_ptr<ProcessGroup> group_;
  std::vector<Weight> weights_;
  std::set<int64_t> agreed_sizes_;
  // Gather destinations from the group (see destinations()), by (lookup of the backward, rows,
  // columns, index dtype, gradient dtype).
  using GatherKey = std::tuple<int64_t, int64_t, int64_t, DType, DType>;
  std::map<GatherKey, Gathered> gather_buffers_;
  int64_t gathers_ = 0;  // gathers since the last finish()
  bool sizes_disagree_ = false;
  bool enabled_ = true;
  Stats stats_;
};

// Adds the lookup gradient (indices [N], dY [N, C]) into weight.grad (made when missing).
void add_lookup_gradient(const Tensor& weight, const Tensor& indices, const Tensor& grad);

}  // namespace tessera::dist
