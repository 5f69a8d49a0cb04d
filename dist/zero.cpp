#include "tessera/dist/zero.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "tessera/core/deferred_init.h"
#include "tessera/core/memory_category.h"
#include "tessera/dist/ddp.h"
#include "tessera/dist/zero_trace.h"
#include "tessera/kernels/ops.h"
#include "tessera/optim/clip.h"

namespace tessera::dist {

namespace {

// Points the parameter's TensorImpl at `source`'s memory, keeping its identity and its
// version: tensors autograd saved are the same TensorImpl, so a backward reads whatever
// memory it points at then (gathered again by the backward pre-hook).
void repoint(const Tensor& target, const Tensor& source) {
  TensorImpl& impl = target.impl();
  impl.storage = source.storage();
  impl.shape = source.shape();
  impl.strides = source.strides();
  impl.offset = source.offset();
}

// A released stage-3 parameter keeps its shape, dtype and device but no memory.
void point_at_nothing(const Tensor& p) {
  p.impl().storage = empty({0}, {.dtype = p.dtype(), .device = p.device()}).storage();
  p.impl().offset = 0;
}

Tensor slot_view(const Tensor& flat, int64_t offset, const Tensor& like) {
  return ops::view(ops::narrow(flat, 0, offset, like.numel()), like.shape());
}

// Several collectives as one: done when all of them are.
class AllOfWork final : public Work {
 public:
  explicit AllOfWork(std::vector<WorkPtr> works) : works_(std::move(works)) {}
  void wait() override {
    for (const WorkPtr& w : works_) w->wait();
  }
  bool is_completed() override {
    return std::all_of(works_.begin(), works_.end(),
                       [](const WorkPtr& w) { return w->is_completed(); });
  }

 private:
  std::vector<WorkPtr> works_;
};

WorkPtr all_of(std::vector<WorkPtr> works) {
  return works.size() == 1 ? works.front() : std::make_shared<AllOfWork>(std::move(works));
}

// A collective that starts once another has finished (hybrid sharding: the replica group's
// all-gather of what the world's reduce-scatter produced). The second is issued by the first
// wait(): the buckets are waited for in launch order on every rank, so every rank issues them
// in the same order.
class ThenIssueWork final : public Work {
 public:
  ThenIssueWork(WorkPtr first, std::function<WorkPtr()> issue)
      : first_(std::move(first)), issue_(std::move(issue)) {}
  void wait() override {
    first_->wait();
    if (!second_) second_ = issue_();
    second_->wait();
  }
  bool is_completed() override { return second_ && second_->is_completed(); }

 private:
  WorkPtr first_, second_;
  std::function<WorkPtr()> issue_;
};

}  // namespace

GradientAccumulation gradient_accumulation_from_name(const std::string& name) {
  if (name == "reduce_every_micro_batch") return GradientAccumulation::reduce_every_micro_batch;
  if (name == "no_sync") return GradientAccumulation::no_sync;
  TESSERA_FAIL("ZeRO gradient accumulation must be reduce_every_micro_batch or no_sync, got '",
               name, "'");
}

const char* gradient_accumulation_name(GradientAccumulation accumulation) {
  return accumulation == GradientAccumulation::no_sync ? "no_sync" : "reduce_every_micro_batch";
}

void check_hybrid_sharding(int hybrid_shard_size, int world_size, int stage, bool offload,
                           const std::string& who) {
  TESSERA_CHECK(hybrid_shard_size >= 1, who,
                ": hybrid_shard_size must be at least 1 (ranks per shard group), got ",
                hybrid_shard_size);
  TESSERA_CHECK(world_size % hybrid_shard_size == 0, who, ": hybrid_shard_size ", hybrid_shard_size,
                " does not divide the world size ", world_size, " (", world_size,
                " ranks cannot form shard groups of ", hybrid_shard_size, ")");
  TESSERA_CHECK(
      stage == 2 || stage == 3, who, ": hybrid sharding (hybrid_shard_size ", hybrid_shard_size,
      ") needs ZeRO stage 2 or 3 (FSDP's _HYBRID_SHARD_ZERO2 or HYBRID_SHARD), got stage ", stage,
      stage == 0 ? " (DDP)" : "");
  TESSERA_CHECK(!offload, who, ": hybrid sharding (hybrid_shard_size ", hybrid_shard_size,
                ") does not support offload; turn offload off or drop hybrid_shard_size");
}

ZeroStrategy::ZeroStrategy(nn::Module& module, std::shared_ptr<ProcessGroup> group,
                           ZeroOptions options)
    : module_(module), group_(group ? std::move(group) : world_ptr()), options_(options) {
  TESSERA_CHECK(options_.stage >= 1 && options_.stage <= 3,
                "ZeroStrategy: stage must be 1, 2 or 3, got ", options_.stage);
  if (options_.hybrid_shard_size != 0)  // 0: not hybrid
    check_hybrid_sharding(options_.hybrid_shard_size, group_->size(), options_.stage,
                          options_.offload_optimizer || options_.offload_param, "ZeroStrategy");
  TESSERA_CHECK(!options_.offload_param || options_.stage == 3,
                "ZeroStrategy: offload_param needs stage 3 (only stage 3 shards the parameters), "
                "got stage ",
                options_.stage);
  TESSERA_CHECK(options_.prefetch_numel >= 0, "ZeroStrategy: prefetch_numel must be >= 0, got ",
                options_.prefetch_numel);
  options_.offload_optimizer = options_.offload_optimizer || options_.offload_param;
  if (options_.stage < 3) refuse_deferred_parameters(module_, name());
  TESSERA_CHECK(!options_.offload_step_during_backward || options_.offload_optimizer,
                "ZeroStrategy: offload_step_during_backward needs offload_optimizer (only the host "
                "optimizer steps bucket by bucket)");
  broadcast_module_from_rank0(module_, *group_);
  make_mesh();
  auto [params, names] = trainable_parameters(module_);
  FlatBucketsOptions o;
  o.bucket_bytes = options_.bucket_bytes;
  o.find_unused_parameters = options_.find_unused_parameters;
  o.reduce_dtype = options_.reduce_dtype;
  o.shards = group_->size();
  // Stage 1 keeps its full gradients until the step: holding them all is what it is.
  if (options_.stage >= 2) o.max_buckets_in_flight = options_.max_buckets_in_flight;
  if (options_.stage == 3) o.groups = stage3_units(params);
  buckets_ = std::make_unique<FlatBuckets>(std::move(params), std::move(names), group_, o);
  // Stages 2/3 keep no full gradient between steps: a bucket's buffer comes back when its
  // first gradient of the next backward arrives (at most the buckets in flight are held).
  if (options_.stage >= 2)
    for (auto& bucket : buckets_->buckets()) buckets_->release_gradients(bucket);
  flatten_parameters();
  // What no bucket holds (frozen parameters) is kept whole on every rank, as without
  // sharded construction.
  for (const Tensor& p : module_.parameters())
    if (is_deferred(p)) materialize_deferred(p);
  install_comm_hooks();
  if (options_.stage == 3) install_unit_hooks();
}

ZeroStrategy::~ZeroStrategy() {
  // The module and optimizer may already be gone (declared after the Accelerator): their
  // hooks stay registered and find the strategy dead.
  *alive_ = false;
  for (auto& h : grad_hooks_) h.remove();
}

// Units: every child of every ModuleList (a transformer's blocks), in reverse order, then
// the root with everything else (embeddings, final norm, head, tied weights once).
std::vector<std::vector<size_t>> ZeroStrategy::stage3_units(const std::vector<Tensor>& params) {
  std::map<const TensorImpl*, size_t> index;
  for (size_t k = 0; k < params.size(); ++k) index[params[k].impl_ptr().get()] = k;
  std::vector<std::vector<size_t>> units;
  std::set<size_t> taken;
  for (auto& [name, m] : module_.named_modules()) {
    if (!dynamic_cast<nn::ModuleList*>(m)) continue;
    for (auto& [child_name, child] : m->named_children()) {
      std::vector<size_t> unit;
      for (const Tensor& p : child->parameters())
        if (auto it = index.find(p.impl_ptr().get());
            it != index.end() && taken.insert(it->second).second)
          unit.push_back(it->second);
      if (unit.empty()) continue;
      std::sort(unit.rbegin(), unit.rend());
      units.push_back(std::move(unit));
      unit_module_.push_back(child);
    }
  }
  std::reverse(units.begin(), units.end());
  std::reverse(unit_module_.begin(), unit_module_.end());
  std::vector<size_t> root;
  for (size_t k = params.size(); k-- > 0;)
    if (!taken.count(k)) root.push_back(k);
  if (!root.empty()) {
    units.push_back(std::move(root));
    unit_module_.push_back(&module_);
  }
  return units;
}

std::string ZeroStrategy::name() const {
  std::string n = "ZeRO-" + std::to_string(options_.stage) + (offload_ ? "-Offload" : "");
  if (options_.hybrid_shard_size > 0)
    n += " hybrid (" + std::to_string(slices_per_rank_) + " x " +
         std::to_string(options_.hybrid_shard_size) + ")";
  return n;
}

// Hybrid sharding's 2-D mesh: shard groups of S consecutive ranks, replica groups of the
// ranks with the same index in theirs. new_group is collective over the whole group: every
// rank creates every group, in the same order.
void ZeroStrategy::make_mesh() {
  shard_group_ = group_;
  shard_index_ = group_->rank();
  const int size = group_->size(), s = options_.hybrid_shard_size;
  if (s <= 0) return;
  slices_per_rank_ = size / s;
  shard_index_ = group_->rank() % s;
  for (int g = 0; g < slices_per_rank_; ++g) {
    std::vector<int> ranks;
    for (int l = 0; l < s; ++l) ranks.push_back(g * s + l);
    if (auto mine = group_->new_group(ranks)) shard_group_ = mine;
  }
  for (int l = 0; l < s; ++l) {
    std::vector<int> ranks;
    for (int g = 0; g < slices_per_rank_; ++g) ranks.push_back(g * s + l);
    if (auto mine = group_->new_group(ranks)) replica_group_ = mine;
  }
}

std::shared_ptr<ProcessGroup> ZeroStrategy::checkpoint_group() const {
  if (options_.hybrid_shard_size <= 0) return group_;
  return group_->rank() < options_.hybrid_shard_size ? shard_group_ : nullptr;
}

int64_t ZeroStrategy::slice_numel(size_t bucket) const {
  return buckets_->buckets()[bucket].shard_numel();
}

int64_t ZeroStrategy::slice_begin(size_t bucket, int k) const {
  return slice_begin_of(bucket, k, shard_index_);
}

int64_t ZeroStrategy::slice_begin_of(size_t bucket, int k, int index) const {
  const int slice = options_.hybrid_shard_size > 0 ? k * options_.hybrid_shard_size + index : index;
  return slice * slice_numel(bucket);
}

// Hybrid sharding: a parameter may overlap several of a rank's slices (a piece each).
std::vector<ZeroStrategy::Piece> ZeroStrategy::pieces_of(int index) const {
  std::vector<Piece> pieces;
  const auto& params = buckets_->parameters();
  for (size_t b = 0; b < buckets_->buckets().size(); ++b) {
    const auto& bucket = buckets_->buckets()[b];
    for (int k = 0; k < slices_per_rank_; ++k) {
      const int64_t begin = slice_begin_of(b, k, index), end = begin + slice_numel(b);
      for (size_t j = 0; j < bucket.params.size(); ++j) {
        const int64_t lo = std::max(begin, bucket.offsets[j]);
        const int64_t hi = std::min(end, bucket.offsets[j] + params[bucket.params[j]].numel());
        if (lo < hi)
          pieces.push_back({bucket.params[j], b, lo, hi - lo, k * slice_numel(b) + lo - begin});
      }
    }
  }
  return pieces;
}

int64_t ZeroStrategy::owned_numel(size_t bucket) const {
  return slices_per_rank_ * slice_numel(bucket);
}

Tensor ZeroStrategy::piece_values(const Piece& piece) const {
  if (options_.stage == 3)
    return ops::narrow(shards_[piece.bucket].owned_parameters, 0, piece.at, piece.numel);
  return ops::narrow(shards_[piece.bucket].parameters, 0, piece.begin, piece.numel);
}

// Stage 3: this rank's slice of bucket b straight from the parameters, never the whole
// bucket: each parameter's elements that fall in the slice are copied, or, for a placeholder
// of sharded construction, computed (core/deferred_init.h: the same bits as the eager
// construction, only these elements), and the padding is zero.
void ZeroStrategy::fill_owned_slice(size_t b) {
  const auto& bucket = buckets_->buckets()[b];
  const auto& params = buckets_->parameters();
  const Tensor& owned = shards_[b].owned_parameters;
  ops::fill_(owned, 0.0);
  for (int k = 0; k < slices_per_rank_; ++k) {
    const int64_t begin = slice_begin(b, k), end = begin + slice_numel(b);
    for (size_t j = 0; j < bucket.params.size(); ++j) {
      const Tensor& p = params[bucket.params[j]];
      const int64_t lo = std::max(begin, bucket.offsets[j]),
                    hi = std::min(end, bucket.offsets[j] + p.numel());
      if (lo >= hi) continue;
      const Tensor into = ops::narrow(owned, 0, k * slice_numel(b) + lo - begin, hi - lo);
      const int64_t first = lo - bucket.offsets[j];
      if (is_deferred(p)) {
        materialize_deferred_range(p, first, into);
      } else {
        ops::copy_(into, ops::narrow(ops::reshape(p.detach(), {p.numel()}), 0, first, hi - lo));
      }
    }
  }
  for (size_t k : bucket.params) forget_deferred(params[k]);
}

// Moves every parameter into its bucket's flat buffer (stage 3: keeps only this rank's
// slice) and lays out the pieces this rank updates.
void ZeroStrategy::flatten_parameters() {
  auto& buckets = buckets_->buckets();
  const auto& params = buckets_->parameters();
  shards_.assign(buckets.size(), Shard{});
  piece_layout_ = pieces_of(shard_index_);
  for (size_t b = 0; b < buckets.size(); ++b) {
    const auto& bucket = buckets[b];
    Shard& shard = shards_[b];
    const TensorOptions opts{.dtype = bucket.dtype, .device = bucket.device};
    const int64_t size = owned_numel(b);
    if (options_.stage < 3) {
      shard.parameters = zeros({bucket.padded_numel}, opts);
      for (size_t j = 0; j < bucket.params.size(); ++j) {
        const Tensor& p = params[bucket.params[j]];
        const Tensor slot = slot_view(shard.parameters, bucket.offsets[j], p);
        ops::copy_(slot, p.detach());
        repoint(p, slot);
      }
      shard.gathered = true;
    }
    // Offloaded, the host takes the averaged slice from the same device buffers every step:
    // they stay. Otherwise they exist only from a step's first reduce-scatter to its update.
    if (options_.stage >= 2 && options_.offload_optimizer) allocate_shard_gradient(b);
    if (options_.stage == 3) {
      shard.owned_parameters = options_.offload_param
                                   ? pinned_host_empty(size, bucket.dtype, bucket.device)
                                   : empty({size}, opts);
      fill_owned_slice(b);
      // Released from the start: the first forward gathers each unit.
      for (size_t k : bucket.params) point_at_nothing(params[k]);
      shard.gathered = false;
    }
  }
  if (options_.offload_optimizer) {
    std::vector<OptimizerOffload::SliceLayout> layout;
    for (const auto& bucket : buckets) layout.push_back({bucket.shard_numel(), bucket.dtype});
    offload_ = std::make_unique<OptimizerOffload>(
        buckets.empty() ? Device::cpu() : buckets.front().device, layout);
    for (size_t b = 0; b < buckets.size(); ++b) offload_->load_master(b, owned_slice(b));
  }
  for (const Piece& piece : piece_layout_)
    pieces_.push_back(offload_
                          ? ops::narrow(offload_->master(piece.bucket), 0, piece.at, piece.numel)
                          : piece_values(piece));
}

// Stages 2/3: the slice the bucket's reduce-scatter averages into, in the parameters' dtype,
// and beside it the reduce dtype's when that differs (bf16/f16 gradients averaged in f32).
void ZeroStrategy::allocate_shard_gradient(size_t b) {
  Shard& shard = shards_[b];
  if (shard.gradients.defined() || shard.reduced.defined()) return;
  const auto& bucket = buckets_->buckets()[b];
  const int64_t size = owned_numel(b);
  const bool low_precision = bucket.dtype != options_.reduce_dtype &&
                             (bucket.dtype == DType::f16 || bucket.dtype == DType::bf16);
  MemoryCategoryScope tag(MemoryCategory::Gradients);
  // Offloaded, the host rounds the f32 average itself: no device gradient slice.
  if (!(options_.offload_optimizer && low_precision))
    shard.gradients = empty({size}, {.dtype = bucket.dtype, .device = bucket.device});
  if (low_precision) {
    MemoryCategoryScope reduce_tag(MemoryCategory::Communication);
    shard.reduced = empty({size}, {.dtype = options_.reduce_dtype, .device = bucket.device});
  }
}

// After the update the averaged slices have done their work: stages 2/3 let them go (as
// DeepSpeed frees its averaged partitions after the step), so between steps and through the
// next forward a rank holds no gradient at all; the next backward's first reduce-scatter of
// each bucket allocates its slice again. The pieces' .grad views go with them.
void ZeroStrategy::release_shard_gradients() {
  if (options_.stage < 2 || offload_) return;
  for (Shard& shard : shards_) shard.gradients = shard.reduced = Tensor();
  for (Tensor& piece : pieces_) piece.set_grad(Tensor());
}

Tensor ZeroStrategy::owned_slice(size_t b) const {
  if (options_.stage == 3) return shards_[b].owned_parameters;
  // Stages 1/2 keep one slice per rank (hybrid sharding is refused with offload, the only
  // user of this for them; the pieces are read through piece_values).
  TESSERA_CHECK(slices_per_rank_ == 1, name(), ": a hybrid shard of stage ", options_.stage,
                " is not one contiguous slice");
  return ops::narrow(shards_[b].parameters, 0, slice_begin(b),
                     buckets_->buckets()[b].shard_numel());
}

bool ZeroStrategy::reduces_every_micro_batch() const {
  return options_.stage >= 2 && !offload_ &&
         options_.accumulation == GradientAccumulation::reduce_every_micro_batch;
}

void ZeroStrategy::set_gradient_sync(bool on) {
  sync_requested_ = on;
  buckets_->set_sync(on || reduces_every_micro_batch());
}

Tensor ZeroStrategy::reduce_scatter_target(size_t b) {
  allocate_shard_gradient(b);
  Shard& shard = shards_[b];
  if (!shard.holds_earlier_micro_batches) return averaged_gradient(b);
  const Tensor sum = averaged_gradient(b);
  MemoryCategoryScope tag(MemoryCategory::Communication);
  shard.incoming = empty({sum.numel()}, {.dtype = sum.dtype(), .device = sum.device()});
  return shard.incoming;
}

void ZeroStrategy::add_incoming(size_t b) {
  Shard& shard = shards_[b];
  if (shard.incoming.defined()) {
    ops::binary_(BinaryOp::Add, averaged_gradient(b), shard.incoming);
    shard.incoming = Tensor();
  }
  // The next micro-step of this optimizer step adds to what is there now.
  shard.holds_earlier_micro_batches = !sync_requested_;
}

Tensor ZeroStrategy::averaged_gradient(size_t b) {
  const Shard& shard = shards_[b];
  if (options_.stage >= 2) return shard.reduced.defined() ? shard.reduced : shard.gradients;
  const auto& bucket = buckets_->buckets()[b];
  return ops::narrow(bucket.communication_buffer(), 0, slice_begin(b), bucket.shard_numel());
}

// Stage 1 all-reduces a bucket (as DDP); stages 2 and 3 reduce-scatter it, so each
// rank receives the average of its own slice only (added to the shard's earlier
// micro-batches under reduce_every_micro_batch). Either way this rank's pieces then
// take their gradients from the result and the bucket lets its full buffer go (the
// next backward starts from a fresh one; stage 1's pieces keep viewing theirs until
// the optimizer's zero_grad). Under stages 2/3 the completion runs as soon as the
// buckets in flight need room (FlatBuckets::max_buckets_in_flight), during backward.
void ZeroStrategy::install_comm_hooks() {
  const bool scatter = options_.stage >= 2;
  buckets_->register_comm_hook(
      [this, scatter](FlatBuckets::Bucket& b) {
        const size_t index = &b - buckets_->buckets().data();
        shards_[index].reduction_issued_us = ZeroTrace::enabled() ? ZeroTrace::now_us() : 0;
        WorkPtr work;
        if (scatter && replica_group_) {
          // Hybrid: world slice r (the average over every rank, as without hybrid sharding),
          // then the replica group's all-gather assembles this rank's slices in its shard.
          const Tensor target = reduce_scatter_target(index);
          const int64_t n = slice_numel(index);
          const Tensor mine = ops::narrow(target, 0, replica_group_->rank() * n, n);
          work = std::make_shared<ThenIssueWork>(
              group_->reduce_scatter(mine, b.communication_buffer(), ReduceOp::Avg),
              [replica = replica_group_, target, mine] {
                return replica->all_gather(target, mine);
              });
        } else {
          work = scatter ? group_->reduce_scatter(reduce_scatter_target(index),
                                                  b.communication_buffer(), ReduceOp::Avg)
                         : group_->all_reduce(b.communication_buffer(), ReduceOp::Avg);
        }
        // Offloaded: the host worker takes the averaged slice as soon as it is there.
        if (!offload_) return work;
        WorkPtr landed = offload_->download_gradient(index, work, averaged_gradient(index));
        // And, stepping during backward, the stepper updates the bucket's pieces once it has
        // landed (the gate says whether this backward ends in a step).
        if (options_.offload_step_during_backward && optimizer_ && optimizer_->step_gate_open()) {
          early_steps_.push_back(offload_->step_after(index, landed, [this, index] {
            point_pieces_at_gradients(index);  // here, not in the completion hook: no race
            optimizer_->step_parameters(bucket_pieces_[index]);
          }));
          stepped_in_backward_.at(index) = 1;
        }
        return landed;
      },
      [this, scatter](FlatBuckets::Bucket& b) {
        const size_t index = &b - buckets_->buckets().data();
        Shard& shard = shards_[index];
        if (ZeroTrace::enabled())
          ZeroTrace::record(scatter ? "reduce_scatter" : "all_reduce", static_cast<int>(index),
                            shard.reduction_issued_us, ZeroTrace::now_us());
        if (scatter) add_incoming(index);
        if (!offload_ && scatter && shard.reduced.defined())
          ops::copy_(shard.gradients, shard.reduced);
        if (!offload_ && !scatter && b.reduce_buffer.defined())
          ops::copy_(b.gradients, b.reduce_buffer);
        // Stepping during backward, the step task points them (on the stepper thread).
        if (!options_.offload_step_during_backward) point_pieces_at_gradients(index);
        buckets_->release_gradients(b);
      });
}

void ZeroStrategy::install_unit_hooks() {
  if (unit_module_.empty()) return;  // nothing to train
  const size_t root = unit_module_.size() - 1;
  const bool has_root = unit_module_.back() == &module_;
  unit_waiting_.assign(shards_.size(), 0);
  // Blocks were listed in reverse (backward) order: forward runs them from the last index.
  for (size_t b = has_root ? root : unit_module_.size(); b-- > 0;) forward_order_.push_back(b);
  for (size_t b = 0; b < unit_module_.size(); ++b) {
    nn::Module* m = unit_module_[b];
    if (has_root && b == root) continue;
    m->register_forward_pre_hook([this, b, alive = alive_](nn::Module&, const Tensor&) {
      if (!*alive) return;
      gather(b);
      prefetch_after(b, /*forward=*/true);
      trace_unit_begin(b);
    });
    m->register_forward_hook([this, b, alive = alive_](nn::Module&, const Tensor&, const Tensor&) {
      if (!*alive) return;
      trace_unit_end(b, /*forward=*/true);
      release(b);
    });
    m->register_backward_pre_hook([this, b, alive = alive_](nn::Module&) {
      if (!*alive) return;
      gather(b);
      prefetch_after(b, /*forward=*/false);
      trace_unit_begin(b);
    });
  }
  // The model's own forward gathers the root unit and starts counting gradients; without
  // grad mode nothing follows, so the root is released at once. With grad mode the first
  // blocks backward needs are prefetched while the loss and the head's backward run.
  const size_t first = has_root ? root : SIZE_MAX;  // what runs before every block
  module_.register_forward_pre_hook(
      [this, root, first, has_root, alive = alive_](nn::Module&, const Tensor&) {
        if (!*alive) return;
        for (size_t b = 0; b < shards_.size(); ++b)
          unit_waiting_[b] = buckets_->buckets()[b].params.size();
        if (has_root) gather(root);
        prefetch_after(first, /*forward=*/true);
        if (has_root) trace_unit_begin(root);
      });
  module_.register_forward_hook(
      [this, root, first, has_root, alive = alive_](nn::Module&, const Tensor&, const Tensor&) {
        if (!*alive) return;
        if (has_root) {
          trace_unit_end(root, /*forward=*/true);
          trace_unit_begin(root);  // its backward starts with the loss's
        }
        if (!autograd::is_grad_enabled()) {
          if (has_root) release(root);
        } else {
          prefetch_after(first, /*forward=*/false);
        }
      });
  const auto& params = buckets_->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    const size_t b = buckets_->bucket_of(k);
    grad_hooks_.push_back(autograd::register_grad_ready_hook(
        params[k], [this, b](const Tensor&) { on_unit_grad_ready(b); }));
  }
}

void ZeroStrategy::on_unit_grad_ready(size_t b) {
  if (unit_waiting_[b] > 0 && --unit_waiting_[b] == 0) {
    trace_unit_end(b, /*forward=*/false);
    release(b);
  }
}

void ZeroStrategy::trace_unit_begin(size_t b) {
  if (!ZeroTrace::enabled()) return;
  shards_[b].unit_began_us = ZeroTrace::now_us();
  shards_[b].unit_began_event = ZeroTrace::device_event(buckets_->buckets()[b].device);
}

// Host span, and on a GPU the compute stream's span, of unit b's forward or backward.
void ZeroStrategy::trace_unit_end(size_t b, bool forward) {
  if (!ZeroTrace::enabled()) return;
  Shard& shard = shards_[b];
  const Device device = buckets_->buckets()[b].device;
  ZeroTrace::record(forward ? "forward" : "backward", static_cast<int>(b), shard.unit_began_us,
                    ZeroTrace::now_us());
  ZeroTrace::record_device(forward ? "forward_gpu" : "backward_gpu", static_cast<int>(b), device,
                           std::move(shard.unit_began_event), ZeroTrace::device_event(device));
}

// Starts unit b's all-gather without waiting for it (every rank issues the same sequence:
// the hooks that call this fire in the same order everywhere).
void ZeroStrategy::wait_for_upload(size_t b) {
  if (b >= uploads_.size() || !uploads_[b]) return;
  WorkPtr upload = std::move(uploads_[b]);
  uploads_[b].reset();
  upload->wait();
}

void ZeroStrategy::wait_for_uploads() {
  for (size_t b = 0; b < uploads_.size(); ++b) wait_for_upload(b);
}

void ZeroStrategy::issue_gather(size_t b) {
  Shard& shard = shards_[b];
  if (shard.gathered || shard.gathering) return;
  wait_for_upload(b);  // offload: the shard holds the step's result once it has landed
  const auto& bucket = buckets_->buckets()[b];
  // New memory each time: views that autograd saved keep the previous gather alive.
  MemoryCategoryScope tag(MemoryCategory::Communication);  // the gathered parameters
  shard.parameters = empty({bucket.padded_numel}, {.dtype = bucket.dtype, .device = bucket.device});
  // offload_param keeps the shard on the host: it travels to the device first.
  const Tensor mine = shard.owned_parameters.device() == bucket.device
                          ? shard.owned_parameters
                          : ops::to(shard.owned_parameters, bucket.device, bucket.dtype);
  shard.gather_issued_us = ZeroTrace::enabled() ? ZeroTrace::now_us() : 0;
  // Within the shard group: its S ranks' k-th slices are the k-th run of S world slices.
  const int64_t n = slice_numel(b), run = n * shard_group_->size();
  std::vector<WorkPtr> works;
  for (int k = 0; k < slices_per_rank_; ++k)
    works.push_back(shard_group_->all_gather(ops::narrow(shard.parameters, 0, k * run, run),
                                             ops::narrow(mine, 0, k * n, n)));
  shard.gathering = all_of(std::move(works));
}

void ZeroStrategy::gather(size_t b) {
  Shard& shard = shards_[b];
  if (shard.gathered) return;
  issue_gather(b);
  {
    ZeroTrace::Span wait("gather_wait", static_cast<int>(b));
    shard.gathering->wait();
  }
  shard.gathering.reset();
  if (ZeroTrace::enabled())
    ZeroTrace::record("all_gather", static_cast<int>(b), shard.gather_issued_us,
                      ZeroTrace::now_us());
  const auto& bucket = buckets_->buckets()[b];
  const auto& params = buckets_->parameters();
  for (size_t j = 0; j < bucket.params.size(); ++j)
    repoint(params[bucket.params[j]],
            slot_view(shard.parameters, bucket.offsets[j], params[bucket.params[j]]));
  shard.gathered = true;
}

// Issues the gathers of the units that run after unit b (forward: the next blocks;
// backward: the previous ones) until prefetch_numel elements are on their way.
void ZeroStrategy::prefetch_after(size_t b, bool forward) {
  if (options_.prefetch_numel <= 0 || forward_order_.empty()) return;
  std::vector<size_t> order = forward_order_;
  if (!forward) std::reverse(order.begin(), order.end());
  auto at = std::find(order.begin(), order.end(), b);
  at = at == order.end() ? order.begin() : at + 1;  // the root runs before every block
  int64_t issued = 0;
  for (; at != order.end() && issued < options_.prefetch_numel; ++at) {
    issue_gather(*at);
    issued += buckets_->buckets()[*at].padded_numel;
  }
}

void ZeroStrategy::release(size_t b) {
  Shard& shard = shards_[b];
  if (options_.stage < 3) return;
  if (shard.gathering) {  // prefetched but not used (the unit did not run): drop it
    shard.gathering->wait();
    shard.gathering.reset();
    shard.parameters = Tensor();
  }
  if (!shard.gathered) return;
  for (size_t k : buckets_->buckets()[b].params) point_at_nothing(buckets_->parameters()[k]);
  shard.parameters = Tensor();
  shard.gathered = false;
}

void ZeroStrategy::gather_full_parameters() {
  for (size_t b = 0; b < shards_.size(); ++b) issue_gather(b);
  for (size_t b = 0; b < shards_.size(); ++b) gather(b);
}

void ZeroStrategy::release_full_parameters() {
  for (size_t b = 0; b < shards_.size(); ++b) release(b);
}

void ZeroStrategy::after_parameters_loaded() {
  wait_for_uploads();
  // Stages 1/2: the parameters are the flat buffers themselves.
  for (size_t b = 0; b < shards_.size() && options_.stage == 3; ++b) {
    TESSERA_CHECK(shards_[b].gathered, name(), ": parameters were loaded while released");
    const int64_t n = slice_numel(b);
    for (int k = 0; k < slices_per_rank_; ++k)
      ops::copy_(ops::narrow(shards_[b].owned_parameters, 0, k * n, n),
                 ops::narrow(shards_[b].parameters, 0, slice_begin(b, k), n));
  }
  if (offload_)
    for (size_t b = 0; b < shards_.size(); ++b) offload_->load_master(b, owned_slice(b));
  if (options_.stage == 3) release_full_parameters();
}

void ZeroStrategy::prepare_optimizer(optim::Optimizer& optimizer) {
  TESSERA_CHECK(optimizer_ == nullptr || optimizer_ == &optimizer, name(),
                ": one optimizer per model (a second one was prepared for it)");
  // A parameter may have several pieces on this rank (hybrid sharding): each takes its place.
  std::map<const TensorImpl*, std::vector<size_t>> piece_of;
  for (size_t i = 0; i < piece_layout_.size(); ++i)
    piece_of[buckets_->parameters()[piece_layout_[i].param].impl_ptr().get()].push_back(i);
  std::set<const TensorImpl*> trained;
  for (const Tensor& p : buckets_->parameters()) trained.insert(p.impl_ptr().get());
  std::vector<optim::ParamGroup> groups = optimizer.param_groups();
  for (auto& g : groups) {
    std::vector<Tensor> mine;
    for (const Tensor& p : g.params) {
      if (auto it = piece_of.find(p.impl_ptr().get()); it != piece_of.end())
        for (size_t i : it->second) mine.push_back(pieces_[i]);
      else if (!trained.count(p.impl_ptr().get()))
        mine.push_back(p);  // frozen or not in the model
    }
    g.params = std::move(mine);
  }
  optimizer.replace_param_groups(std::move(groups));
  if (offload_) optimizer.set_range_runner(&offload_->host_threads());
  TESSERA_CHECK(!options_.offload_step_during_backward || optimizer.supports_partial_steps(),
                name(),
                ": offload_step_during_backward steps each bucket on its own, which this "
                "optimizer cannot (AdamW can)");
  if (offload_ && optimizer.supports_partial_steps()) {
    std::map<const TensorImpl*, size_t> flat_index;
    const std::vector<Tensor> flat = optimizer.parameters();
    for (size_t i = 0; i < flat.size(); ++i) flat_index[flat[i].impl_ptr().get()] = i;
    bucket_pieces_.assign(shards_.size(), {});
    for (size_t i = 0; i < piece_layout_.size(); ++i)
      if (auto it = flat_index.find(pieces_[i].impl_ptr().get()); it != flat_index.end())
        bucket_pieces_[piece_layout_[i].bucket].push_back(it->second);
    stepped_in_backward_.assign(shards_.size(), 0);
    optimizer.set_pre_step_hook([this, alive = alive_] {
      if (*alive) step_offloaded_buckets();
    });
  }
  optimizer.set_post_step_hook([this, alive = alive_] {
    if (*alive) after_optimizer_step();
  });
  optimizer_ = &optimizer;
}

void ZeroStrategy::point_pieces_at_gradients(size_t b) {
  for (size_t i = 0; i < piece_layout_.size(); ++i) {
    const Piece& piece = piece_layout_[i];
    if (piece.bucket != b) continue;
    const auto& bucket = buckets_->buckets()[piece.bucket];
    const int64_t at = piece.at;
    if (offload_)
      pieces_[i].set_grad(ops::narrow(offload_->gradient(b), 0, at, piece.numel));
    else if (options_.stage == 1)
      pieces_[i].set_grad(ops::narrow(bucket.gradients, 0, piece.begin, piece.numel));
    else
      pieces_[i].set_grad(ops::narrow(shards_[piece.bucket].gradients, 0, at, piece.numel));
  }
}

void ZeroStrategy::finish_gradient_sync() {
  // Without its optimizer re-pointed at this rank's slices nothing would be updated: the
  // full gradients are gone after the reduce-scatter.
  TESSERA_CHECK(optimizer_ != nullptr || !buckets_->sync() || !sync_requested_, name(),
                ": the optimizer was not prepared with the model; call accelerator.prepare(model, "
                "optimizer) so that it updates this rank's slices");
  buckets_->finish();
  // Steps queued during this backward end before anything reads the optimizer again (the
  // clip's norm, opt.step()); the last bucket's is all that is usually left.
  for (WorkPtr& step : early_steps_) step->wait();
  early_steps_.clear();
  // The step about to run rewrites the masters that uploads still in flight read (a unit
  // the last forward did not gather).
  wait_for_uploads();
  synced_at_us_ = ZeroTrace::enabled() ? ZeroTrace::now_us() : 0;
}

void ZeroStrategy::sync_accumulated_gradients() {
  if (!gradient_sync()) return;
  TESSERA_CHECK(options_.stage <= 2 && !offload_ && !reduces_every_micro_batch(), name(),
                ": a model that runs its own backwards (a pipeline stage) accumulates its "
                "micro-batches' gradients locally: ZeRO stage 1 or 2 with accumulation no_sync "
                "and no offload");
  // In bucket-slot order on every rank, as DDP: each bucket launches once its last slot is in.
  for (size_t i = 0; i < buckets_->parameters().size(); ++i)
    if (!buckets_->is_ready(i)) buckets_->mark_ready(i);
  finish_gradient_sync();
}

double ZeroStrategy::clip_grad_norm_(const std::vector<Tensor>&, double max_norm) {
  return clip_split_grad_norm_(max_norm, nullptr, *shard_group_);
}

double ZeroStrategy::clip_split_grad_norm_(double max_norm,
                                           const std::function<bool(const std::string&)>& counts,
                                           ProcessGroup& model_group) {
  // The slices are disjoint and cover every parameter once (tied weights included).
  // On the buckets' device: NCCL reduces CUDA tensors only.
  const Device device = shards_.empty() ? Device::cpu() : buckets_->buckets().front().device;
  std::vector<Tensor> counted;
  for (size_t i = 0; i < pieces_.size(); ++i)
    if (!counts || counts(buckets_->parameter_names()[piece_layout_[i].param]))
      counted.push_back(pieces_[i]);
  Tensor total =
      full({1}, optim::grad_norm_squared(counted), {.dtype = DType::f64, .device = device});
  // Hybrid: the shard group's slices cover the model once (the replicas hold the same). A
  // split model: then the model group's pieces.
  shard_group_->all_reduce(total, ReduceOp::Sum)->wait();
  if (counts) model_group.all_reduce(total, ReduceOp::Sum)->wait();
  const double norm = std::sqrt(ops::to(total, Device::cpu(), DType::f64).to_vector<double>()[0]);
  const double factor = max_norm / (norm + 1e-6);
  TESSERA_CHECK(factor >= 1.0 || !(optimizer_ && optimizer_->has_early_steps()), name(),
                ": clip_grad_norm_ with max_norm ", max_norm, " would scale gradients of norm ",
                norm,
                ", but offload_step_during_backward already stepped with them; turn that "
                "option off to clip");
  if (factor < 1.0) {
    optim::scale_grads_(pieces_, factor);
    // Offloaded f32 copies of bf16/f16 gradients round as the device's own would.
    if (offload_) offload_->round_gradients();
  }
  return norm;
}

void ZeroStrategy::after_optimizer_step() {
  // Device work again (the offloaded optimizer step ran on the host).
  const HostMemoryScope device_side(false);
  const double began = ZeroTrace::enabled() ? ZeroTrace::now_us() : 0;
  if (ZeroTrace::enabled()) ZeroTrace::record("clip_and_step", -1, synced_at_us_, began);
  // Offloaded: the copies back, unless the pre-step hook queued them behind its steps.
  if (offload_ && !std::exchange(uploads_queued_, false))
    uploads_ = offload_->upload_parameters(upload_targets(), upload_order());
  if (options_.stage == 3) {
    // Anything still gathered holds the values from before the step.
    release_full_parameters();
  } else {
    all_gather_owned_slices();
  }
  release_shard_gradients();
  if (ZeroTrace::enabled()) {
    ZeroTrace::record("after_step", -1, began, ZeroTrace::now_us());
    ZeroTrace::end_step(group_->rank());
  }
}

std::vector<Tensor> ZeroStrategy::upload_targets() const {
  std::vector<Tensor> targets;
  for (size_t b = 0; b < shards_.size(); ++b) targets.push_back(owned_slice(b));
  return targets;
}

std::vector<size_t> ZeroStrategy::upload_order() const {
  // Stage 3: in the order the next forward gathers the units (the root first), so its first
  // blocks can run while the last ones are still being copied.
  std::vector<size_t> order;
  if (forward_order_.size() < shards_.size()) order.push_back(shards_.size() - 1);
  order.insert(order.end(), forward_order_.begin(), forward_order_.end());
  for (size_t b = 0; order.size() < shards_.size(); ++b) order.push_back(b);  // stages 1/2
  return order;
}

void ZeroStrategy::step_offloaded_buckets() {
  const std::vector<size_t> order = upload_order();
  std::vector<WorkPtr> steps(shards_.size());
  for (size_t b : order)
    if (!std::exchange(stepped_in_backward_[b], 0))
      steps[b] = offload_->step_after(
          b, nullptr, [this, b] { optimizer_->step_parameters(bucket_pieces_[b]); });
  // Bucket b's copy back overlaps the update of the buckets after it.
  uploads_ = offload_->upload_parameters(upload_targets(), order, steps);
  uploads_queued_ = true;
  // step() goes on with what the buckets left (frozen parameters, none usually) once they are
  // all updated: the optimizer is not shared between threads.
  for (const WorkPtr& step : steps)
    if (step) step->wait();
}

void ZeroStrategy::all_gather_owned_slices() {
  std::vector<WorkPtr> works;
  for (size_t b = 0; b < shards_.size(); ++b) {
    wait_for_upload(b);  // each bucket is all-gathered while the next one is copied
    // Within the shard group, one run of S world slices per slice this rank keeps.
    const int64_t n = slice_numel(b), run = n * shard_group_->size();
    for (int k = 0; k < slices_per_rank_; ++k) {
      const Tensor mine = ops::clone(ops::narrow(shards_[b].parameters, 0, slice_begin(b, k), n));
      works.push_back(
          shard_group_->all_gather(ops::narrow(shards_[b].parameters, 0, k * run, run), mine));
    }
  }
  for (auto& w : works) w->wait();
}

std::vector<DataParallelStrategy::ParameterShard> ZeroStrategy::parameter_shard_layout(
    int index) const {
  std::vector<ParameterShard> shards;
  for (const Piece& piece : pieces_of(index))
    shards.push_back({buckets_->parameter_names()[piece.param],
                      piece.begin - buckets_->offset_of(piece.param), piece.numel, Tensor()});
  return shards;
}

std::vector<DataParallelStrategy::ParameterShard> ZeroStrategy::parameter_shards() {
  wait_for_uploads();  // the offloaded step's results must have landed in the owned slices
  std::vector<ParameterShard> shards;
  for (const Piece& piece : piece_layout_)
    shards.push_back({buckets_->parameter_names()[piece.param],
                      piece.begin - buckets_->offset_of(piece.param), piece.numel,
                      piece_values(piece)});
  return shards;
}

void ZeroStrategy::after_parameter_shards_loaded() {
  if (options_.stage == 3) release_full_parameters();  // gathered copies hold the old values
  if (offload_)
    for (size_t b = 0; b < shards_.size(); ++b) offload_->load_master(b, owned_slice(b));
  if (options_.stage < 3) all_gather_owned_slices();
}

std::vector<DataParallelStrategy::OptimizerSlice> ZeroStrategy::optimizer_slices(
    const optim::Optimizer& optimizer) const {
  std::map<const TensorImpl*, size_t> piece_of;
  for (size_t i = 0; i < pieces_.size(); ++i) piece_of[pieces_[i].impl_ptr().get()] = i;
  std::vector<OptimizerSlice> slices;
  for (const Tensor& t : optimizer.parameters()) {
    auto it = piece_of.find(t.impl_ptr().get());
    TESSERA_CHECK(it != piece_of.end(), name(), ": the optimizer holds a tensor of shape ",
                  shape_str(t.shape()), " that is none of this rank's slices");
    const Piece& piece = piece_layout_[it->second];
    const int64_t start = buckets_->offset_of(piece.param);
    slices.push_back({buckets_->parameter_names()[piece.param], piece.begin - start, piece.numel});
  }
  return slices;
}

MemoryUsage ZeroStrategy::memory() const {
  MemoryUsage m;
  m.gradients = buckets_->gradient_bytes();
  m.communication = buckets_->reduce_buffer_bytes();
  for (const Shard& s : shards_) {
    if (options_.stage == 3) {
      // Counted where it lives: a shard kept on the host (offload_param) of a GPU run is no
      // device memory.
      if (!options_.offload_param || s.owned_parameters.device() == buckets_->buckets()[0].device)
        m.parameters += s.owned_parameters.nbytes();
      if (s.gathered || s.gathering) m.communication += s.parameters.nbytes();
    } else {
      m.parameters += s.parameters.nbytes();
    }
    if (s.gradients.defined()) m.gradients += s.gradients.nbytes();
    if (s.reduced.defined()) m.communication += s.reduced.nbytes();
  }
  // Stage 1's pieces keep viewing a released full gradient buffer until zero_grad.
  std::set<const Storage*> counted;
  for (const auto& b : buckets_->buckets())
    if (b.gradients.defined()) counted.insert(b.gradients.storage().get());
  for (const Shard& shard : shards_)
    if (shard.gradients.defined()) counted.insert(shard.gradients.storage().get());
  for (const Tensor& piece : pieces_) {
    const Tensor g = piece.grad();
    if (g.defined() && counted.insert(g.storage().get()).second)
      m.gradients += g.storage()->nbytes();
  }
  return m;
}

}  // namespace tessera::dist
