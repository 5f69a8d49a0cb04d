// DistributedDataParallel: every rank holds the whole model; after each
// backward the gradients are averaged over the ranks, so every rank takes the
// same optimizer step.
//
// Like PyTorch's reducer: parameters are grouped into buckets of about
// `bucket_bytes` in reverse registration order (roughly the order backward
// produces their gradients). Each bucket owns one flat, contiguous gradient
// buffer and every parameter's .grad is a view into it, so a bucket is sent in
// one all_reduce and a later ZeRO stage can shard the buffer without touching
// each tensor. The all_reduce of a bucket starts from the autograd
// grad-ready hook as soon as its last gradient is final, while backward still
// runs; buckets are launched in bucket order on every rank.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/autograd/autograd.h"
#include "tessera/nn/module.h"

namespace tessera::dist {

struct DDPOptions {
  size_t bucket_bytes = size_t(25) << 20;
  // false: a parameter that gets no gradient in a synced backward is an error naming it.
  // true: its bucket slot counts as zero (or as what no_sync steps accumulated).
  bool find_unused_parameters = false;
  // Copy rank 0's parameters and buffers to every rank when wrapping.
  bool broadcast_parameters = true;
  // f16/bf16 gradients are averaged in f32 (each bucket is cast into an f32 buffer, reduced
  // and cast back), so they are rounded once rather than at every step of the reduction;
  // false reduces them in their own dtype (half the bytes on the wire).
  bool reduce_low_precision_in_f32 = true;
};

class DistributedDataParallel {
 public:
  struct Bucket {
    std::vector<size_t> params;    // indices into parameters()
    std::vector<int64_t> offsets;  // element offset of each in `gradients`
    Tensor gradients;              // flat buffer, one dtype and device
    Tensor reduce_buffer;          // f32 copy reduced instead, for f16/bf16 (else undefined)
    size_t pending = 0;            // parameters not yet ready in this backward
    WorkPtr work;                  // its all_reduce, once launched
  };

  // The group defaults to the world group.
  explicit DistributedDataParallel(nn::Module& module, std::shared_ptr<ProcessGroup> group = nullptr,
                                   DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  nn::Module& module() const { return module_; }
  Tensor operator()(const Tensor& x) { return module_(x); }
  ProcessGroup& group() const { return *group_; }

  // loss.backward(), then finish_gradient_sync().
  void backward(const Tensor& loss);
  // After a backward: launches buckets the hooks did not (unused parameters), waits for
  // every all_reduce and leaves each parameter's .grad holding the average over ranks.
  // Does nothing inside no_sync.
  void finish_gradient_sync();

  // While the guard lives, backward only accumulates gradients locally.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel* ddp) : ddp_(ddp), previous_(ddp->sync_) {
      ddp->sync_ = false;
    }
    ~NoSyncGuard() {
      if (ddp_) ddp_->sync_ = previous_;
    }
    NoSyncGuard(NoSyncGuard&& o) noexcept : ddp_(o.ddp_), previous_(o.previous_) { o.ddp_ = nullptr; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel* ddp_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(this); }
  bool sync_enabled() const { return sync_; }

  const std::vector<Tensor>& parameters() const { return params_; }
  const std::vector<std::string>& parameter_names() const { return names_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // The view of bucket memory that is parameter i's gradient.
  Tensor gradient_slot(size_t i) const;

 private:
  void build_buckets();
  void broadcast_from_rank0();
  void on_grad_ready(size_t param);
  // Places the parameter's current gradient in its slot and makes the slot its .grad.
  void adopt_gradient(size_t param, bool zero_when_missing);
  void launch_ready_buckets();
  void reset_backward_state();

  nn::Module& module_;
  std::shared_ptr<ProcessGroup> group_;
  DDPOptions options_;
  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;    // by parameter
  std::vector<size_t> index_in_bucket_;
  std::vector<bool> ready_;
  size_t next_bucket_to_launch_ = 0;
  bool sync_ = true;
  std::vector<autograd::HookHandle> hooks_;
};

}  // namespace tessera::dist
