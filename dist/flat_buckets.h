// FlatBuckets: the gradient (and, for ZeRO, parameter) buckets every data-parallel
// strategy shares.
//
// Parameters are grouped into buckets in reverse registration order (roughly the
// order backward produces their gradients), each about `bucket_bytes`, or in groups
// the strategy gives (ZeRO-3: one bucket per block). A bucket owns one flat,
// contiguous gradient buffer and every parameter's .grad is a view into it, so a
// bucket is communicated in one call. The length of every flat buffer is padded to
// a multiple of the shard count, so a ZeRO rank owns the contiguous slice
// [rank·S, (rank+1)·S) of each bucket (S = padded / shards) whatever the sizes.
//
// Each parameter's slot is also its autograd gradient destination (set_grad_destination):
// when .grad is undefined at backward (zero_grad with set_to_none, as the optimizers and the
// Accelerator do), the weight GEMMs write the gradient straight into the bucket, with no copy
// into it afterwards. A released bucket (ZeRO-2/3) offers none until its buffer comes back.
//
// Backward drives the buckets: the autograd grad-ready hook of each parameter marks
// it ready, and when a bucket's last parameter is ready the buckets that are
// complete are handed, strictly in bucket order (so every rank issues the same
// sequence of collectives), to the communication hook. As PyTorch's
// `register_comm_hook`, the hook gets the bucket and returns the Work of the
// collective it started: the default all-reduces the average (DDP); ZeRO-2/3
// install a reduce-scatter into the rank's gradient shard.
//
// With max_buckets_in_flight (ZeRO-2/3, whose completion hook releases the bucket's buffer),
// a synced backward holds at most that many full gradient buffers: before another bucket's
// buffer is allocated (its first gradient), the oldest collectives are waited for and their
// completion hooks run, so a bucket's memory lives from its first gradient until its
// reduction is done rather than until the end of backward (DeepSpeed's double-buffered
// ipg buckets under overlap_comm: one filling, one being reduced).
//
// Solo parameters (DDP's sparsely synchronised embedding weights, dist/sparse_embedding.h)
// get a bucket each, outside that order: it is handed to the hook as soon as the parameter
// is ready, since its gradient may be final at the start of backward (a tied output head)
// or only at its end. Every rank issues the same sequence as long as the ranks run the same
// graph, which DDP asks of them anyway. An Extension lets such a sync add its own
// collectives (the last bucket may be held back until finish() to let them go first) and
// its results into a bucket before the completion hook.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tessera/autograd/autograd.h"
#include "tessera/dist/process_group.h"

namespace tessera::dist {

// The one default of each bucket setting, used by every struct and flag that has one
// (FlatBucketsOptions, DDPOptions, ZeroOptions, AcceleratorOptions, MemoryPlanOptions,
// `tessera plan`, the Python Accelerator): PyTorch DDP's 25 MiB buckets, and two full
// gradient buckets in flight under ZeRO-2/3 (one filling, one reduced: DeepSpeed's
// overlap_comm).
inline constexpr size_t kDefaultBucketBytes = size_t(25) << 20;
inline constexpr size_t kDefaultBucketsInFlight = 2;

struct FlatBucketsOptions {
  size_t bucket_bytes = kDefaultBucketBytes;
  // When below bucket_bytes: the bucket launched last (the first parameters, whose gradients
  // come at the very end of backward) holds about this many bytes, so that little
  // communication is left once backward is done. 0: like the others.
  size_t last_bucket_bytes = 0;
  // Explicit bucket membership (parameter indices, each listed once, in launch order);
  // empty: groups of about bucket_bytes in reverse order.
  std::vector<std::vector<size_t>> groups;
  // Flat buffers are padded to a multiple of this (the ranks that share a bucket).
  int shards = 1;
  // The dtype f16/bf16 gradients are reduced in (through `reduce_buffer`); none or equal
  // to the gradient dtype: reduced in place.
  std::optional<DType> reduce_dtype = DType::f32;
  // false: a parameter that gets no gradient in a synced backward is an error naming it.
  bool find_unused_parameters = false;
  // Parameters (indices, not listed in `groups`) that get a bucket of their own, launched as
  // soon as they are ready rather than in bucket order; these buckets come last.
  std::vector<size_t> solo;
  // The buffer each bucket communicates (the gradients when reduced in place, else the
  // reduce buffer) comes from group->allocate_communication_buffer (DDP with
  // TESSERA_NCCL_SYMMETRIC=1: an NCCL symmetric window), once per bucket, at construction, in
  // the parameters' order (the same on every rank). Such a buffer is never released
  // (release_gradients refuses): allocating it again would be a collective every step.
  bool communication_buffers_from_group = false;
  // Full gradient buffers a synced backward may hold at once (buckets being filled plus
  // buckets whose collective is in flight); 0: no bound, every collective is waited for in
  // finish(). Only bounds memory when the completion hook releases the buffer (ZeRO-2/3).
  size_t max_buckets_in_flight = 0;
};

class FlatBuckets {
 public:
  struct Bucket {
    std::vector<size_t> params;    // indices into parameters()
    std::vector<int64_t> offsets;  // element offset of each in the flat buffers
    int64_t numel = 0;             // elements in use
    int64_t padded_numel = 0;      // a multiple of `shards`
    DType dtype = DType::f32;      // of the parameters and gradients
    Device device = Device::cpu();
    Tensor gradients;      // [padded_numel]; undefined while released (ZeRO-2/3)
    Tensor reduce_buffer;  // [padded_numel] in reduce_dtype when that differs, else undefined
    size_t pending = 0;    // parameters not yet ready in this backward
    WorkPtr work;          // the communication hook's collective, once launched
    int64_t shard_numel() const { return padded_numel / std::max<int64_t>(1, shards); }
    // What the hook reduces: the reduce_buffer when there is one (filled from the
    // gradients before the hook runs), else the gradients themselves.
    const Tensor& communication_buffer() const {
      return reduce_buffer.defined() ? reduce_buffer : gradients;
    }
    int shards = 1;
    bool solo = false;      // launched when ready, outside the bucket order
    bool launched = false;  // in this backward
  };
  // Starts the bucket's collective; called in bucket order on every rank.
  using CommHook = std::function<WorkPtr(Bucket& bucket)>;
  // Runs after the bucket's Work completed (DDP: copies the f32 average back).
  using CompletionHook = std::function<void(Bucket& bucket)>;

  FlatBuckets(std::vector<Tensor> params, std::vector<std::string> names,
              std::shared_ptr<ProcessGroup> group, FlatBucketsOptions options);
  ~FlatBuckets();
  FlatBuckets(const FlatBuckets&) = delete;
  FlatBuckets& operator=(const FlatBuckets&) = delete;

  // Replaces the default (all-reduce of the average, result copied back into the
  // gradients) with `hook`; `done` runs once its Work has completed. With `done_on_device`
  // (what `done` does is device work, ordered after the collective on the stream) finish()
  // does not wait on the host: it orders the device after each Work (Work::wait_on_device),
  // as the default does.
  void register_comm_hook(CommHook hook, CompletionHook done = {}, bool done_on_device = false);
  // Plugs a gradient sync that rides along the buckets' (every member optional).
  struct Extension {
    // The first gradient of a synced backward is ready (the graph is complete).
    std::function<void()> backward_started;
    // finish(): the bucket's collective completed; runs before the completion hook.
    std::function<void(Bucket&)> bucket_reduced;
  };
  void set_extension(Extension extension) { extension_ = std::move(extension); }
  // For this backward, the last bucket in bucket order is launched by finish() rather than
  // when it is ready (an Extension whose own collectives, issued at the very end of backward,
  // should run before it: their results are then applied while it is reduced).
  void hold_last_bucket() { hold_last_bucket_ = true; }
  // Whether the last bucket in bucket order is held back and not launched yet.
  bool last_bucket_held() const {
    return hold_last_bucket_ && ordered_buckets_ > 0 && !buckets_[ordered_buckets_ - 1].launched;
  }
  // Reports parameter i's gradient final for this backward (as its grad-ready hook does), for
  // a gradient that the autograd graph does not deliver. With sync off: only adopts it.
  void mark_ready(size_t i) { on_grad_ready(i); }
  bool is_ready(size_t i) const { return ready_.at(i); }
  // While off, grad-ready hooks only let gradients accumulate where they are.
  void set_sync(bool on) { sync_ = on; }
  bool sync() const { return sync_; }
  // After a backward: launches what the hooks did not (unused parameters, a held bucket),
  // waits for every bucket's Work in the order they were launched and runs the completion
  // hooks. Does nothing while sync is off.
  void finish();

  const std::vector<Tensor>& parameters() const { return params_; }
  const std::vector<std::string>& parameter_names() const { return names_; }
  std::vector<Bucket>& buckets() { return buckets_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  size_t bucket_of(size_t param) const { return bucket_of_.at(param); }
  int64_t offset_of(size_t param) const;
  // The view of bucket memory that is parameter i's gradient (allocating the bucket's
  // buffer when it was released).
  Tensor gradient_slot(size_t i);
  // Drops a bucket's gradient buffer and the .grad views into it (ZeRO-2/3 after the
  // reduce-scatter); the next backward allocates it again. Not with
  // communication_buffers_from_group.
  void release_gradients(Bucket& bucket);
  // How gradients reached the buckets since construction: `in_place` were already in their
  // slot (written there by backward, or accumulated into it), `copied` were copied in,
  // `zero_filled` got zeros (no gradient in a synced backward, or at construction).
  struct AdoptionCounts {
    int64_t in_place = 0;
    int64_t copied = 0;
    int64_t zero_filled = 0;
  };
  const AdoptionCounts& adoption_counts() const { return adoption_counts_; }
  // Bytes of the gradient buffers and of the reduce buffers currently allocated.
  int64_t gradient_bytes() const;
  int64_t reduce_buffer_bytes() const;

 private:
  void build(const std::vector<std::vector<size_t>>& groups);
  std::vector<std::vector<size_t>> groups_by_size() const;
  void on_grad_ready(size_t param);
  void adopt_gradient(size_t param, bool zero_when_missing);
  void launch_ready_buckets();
  void launch(Bucket& b);
  void reset_backward_state();
  void ensure_gradient_buffer(Bucket& b);
  // Before a new buffer in a synced backward: completes the oldest launched buckets until
  // fewer than max_buckets_in_flight buffers are held (or nothing launched is left).
  void make_room_for_a_buffer();
  // Waits for a launched bucket's Work and runs the extension's (unless an earlier bucket
  // failed) and the completion hooks.
  void complete(Bucket& b, bool run_extension = true);
  Tensor slot_view(const Bucket& b, size_t index_in_bucket) const;

  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  FlatBucketsOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<size_t> index_in_bucket_;
  std::vector<bool> ready_;
  size_t next_bucket_to_launch_ = 0;
  size_t ordered_buckets_ = 0;        // the buckets before the solo ones
  std::vector<size_t> launch_order_;  // of this backward's buckets
  size_t completed_ = 0;              // launch_order_[0, completed_) completed already
  bool hold_last_bucket_ = false;
  bool backward_started_ = false;
  Extension extension_;
  bool sync_ = true;
  CommHook hook_;
  CompletionHook done_;
  bool done_on_device_ = true;
  std::vector<autograd::HookHandle> hooks_;
  AdoptionCounts adoption_counts_;
};

}  // namespace tessera::dist
