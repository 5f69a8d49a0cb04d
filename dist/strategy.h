// The data-parallel strategy seam: what the Accelerator asks of DDP and the ZeRO
// stages. A strategy is attached to one model (the user's object stays the user's;
// unwrap_model is the identity) and, once prepared, to the optimizer that trains it.
//
//   prepare_optimizer  the strategy may re-point the optimizer at what this rank
//                      updates (ZeRO: its slices of the flat buffers)
//   no_sync / finish_gradient_sync   gradient accumulation and the reduction
//   clip_grad_norm_    global-norm clipping over whatever this rank holds (shards are
//                      summed across ranks before the root)
//   after_optimizer_step             ZeRO-1/2: all-gather the updated parameters
//   gather_full_parameters           before reading the whole model (saving)
//   memory             bytes held per category (parameters, gradients, communication)
//
// Which collective a bucket uses is the strategy's choice through the flat buckets'
// communication hook (dist/flat_buckets.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/dist/process_group.h"
#include "tessera/nn/module.h"
#include "tessera/optim/optimizer.h"

namespace tessera::dist {

// Mixed precision as one policy (FSDP's MixedPrecision): parameters (and their
// gradients) live in param_dtype, matmuls run in compute_dtype, gradients are
// averaged across ranks in reduce_dtype, and the optimizer keeps master copies of
// low-precision parameters in master_dtype.
struct MixedPrecisionPolicy {
  DType param_dtype = DType::f32;
  DType compute_dtype = DType::f32;
  DType reduce_dtype = DType::f32;
  DType master_dtype = DType::f32;
  // "no" | "bf16" | "fp16"; anything else is an error naming the value. `reduce` picks the
  // dtype gradients are averaged in: "" = the default (bf16 for "bf16", else f32), "fp32",
  // or the parameters' own low precision (half the bytes on the wire and no cast passes, as
  // FSDP's bf16 policy and llm.c; each step of the ring rounds).
  static MixedPrecisionPolicy from_name(const std::string& name, const std::string& reduce = "");
  bool low_precision_parameters() const { return param_dtype != DType::f32; }
};

// Bytes one rank holds, by category (what ZeRO's memory formula counts).
struct MemoryUsage {
  int64_t parameters = 0;     // model parameters as stored (full or this rank's shard)
  int64_t gradients = 0;      // gradient buffers (full buckets and this rank's shards)
  int64_t optimizer = 0;      // optimizer state: moments and f32 masters
  int64_t communication = 0;  // reduce buffers and gathered parameter buffers in use
};

class DataParallelStrategy {
 public:
  virtual ~DataParallelStrategy() = default;
  virtual std::string name() const = 0;
  virtual nn::Module& module() const = 0;

  virtual void prepare_optimizer(optim::Optimizer& optimizer) = 0;
  virtual void set_gradient_sync(bool on) = 0;
  virtual bool gradient_sync() const = 0;
  // After a syncing backward: every gradient this rank keeps holds the average over
  // ranks when it returns.
  virtual void finish_gradient_sync() = 0;
  // For a model that runs its own backwards (a pipeline stage's train_step: one per
  // micro-batch), all of them under no_sync: averages what they accumulated over the ranks,
  // as finish_gradient_sync does after one synced backward. The base refuses, naming the
  // strategy (DDP and ZeRO-1/2 implement it).
  virtual void sync_accumulated_gradients();
  // Scales the gradients by max_norm / (norm + 1e-6) when below 1; returns the global
  // norm before clipping (over the whole model, whatever is sharded).
  virtual double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) = 0;
  virtual void after_optimizer_step() {}
  // Makes every parameter hold its full value until release_full_parameters().
  virtual void gather_full_parameters() {}
  virtual void release_full_parameters() {}
  // After the full parameters were overwritten (load_state): each rank keeps its slice.
  virtual void after_parameters_loaded() {}
  // Parameters, gradients and communication buffers (the Accelerator adds the
  // optimizer's state).
  virtual MemoryUsage memory() const = 0;

  // What parameter k of the prepared optimizer (flat order) is: elements
  // [begin, begin + numel) of the flattened model parameter `name` (DDP: all of it).
  struct OptimizerSlice {
    std::string name;
    int64_t begin = 0, numel = 0;
  };
  virtual std::vector<OptimizerSlice> optimizer_slices(const optim::Optimizer& optimizer) const;

  // The parameter values this rank keeps between steps, as sharded checkpoints write and
  // read them (dist/checkpoint.h): elements [begin, begin + numel) of the flattened
  // trainable parameter `name`, and a 1-D view of where they live. DDP: every parameter
  // whole; ZeRO: this rank's slices only (stages 1/2 too: the slices of all ranks tile the
  // model once).
  struct ParameterShard {
    std::string name;
    int64_t begin = 0, numel = 0;
    Tensor values;
  };
  virtual std::vector<ParameterShard> parameter_shards();
  // After the views parameter_shards() returned were overwritten: ZeRO-1/2 all-gather the
  // full parameters from them, ZeRO-3 drops stale gathered copies, offload refreshes its masters.
  virtual void after_parameter_shards_loaded() {}

  // While the guard lives, backward only accumulates gradients locally.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DataParallelStrategy* s) : strategy_(s), previous_(s->gradient_sync()) {
      s->set_gradient_sync(false);
    }
    ~NoSyncGuard() {
      if (strategy_) strategy_->set_gradient_sync(previous_);
    }
    NoSyncGuard(NoSyncGuard&& o) noexcept : strategy_(o.strategy_), previous_(o.previous_) {
      o.strategy_ = nullptr;
    }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DataParallelStrategy* strategy_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(this); }
};

// Sum of nbytes over the optimizer's state tensors (moments, masters).
int64_t optimizer_state_bytes(const optim::Optimizer& optimizer);

// Copies rank 0's parameters and buffers to every rank of the group; placeholders of
// sharded construction (core/deferred_init.h) receive rank 0's init recipes instead.
void broadcast_module_from_rank0(nn::Module& module, ProcessGroup& group);

// An error naming the first placeholder of sharded construction in `module`: every
// strategy but ZeRO-3 needs the parameters' values whole.
void refuse_deferred_parameters(const nn::Module& module, const std::string& strategy);

}  // namespace tessera::dist
