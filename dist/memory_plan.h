// `tessera plan`: each rank's peak memory for a GPT training step, predicted by running two
// real optimizer steps of rank 0 in size-only mode (core/size_only.h: every op allocates
// its outputs, no kernel runs, no memory is touched) with a process group that pretends to
// be W ranks and moves nothing. The strategy (DDP or a ZeRO stage), the mixed-precision
// policy, the buckets, the optimizer and autograd all run their own code, so the prediction
// follows them wherever they change. The peak is what the allocator's per-category counters
// saw (core/memory_category.h), the same counters `tessera train --memory-report` prints.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/memory_category.h"
#include "tessera/dist/memory_report.h"
#include "tessera/dist/zero.h"
#include "tessera/nn/gpt.h"

namespace tessera::dist {

struct MemoryPlanOptions {
  nn::GPTConfig model;
  int zero_stage = 0;  // 0 = DDP
  int world = 1;
  // Hybrid sharding (dist/zero.h; stages 2/3): shard groups of this many ranks, replicated
  // across; the shard state is that of ZeRO on this many ranks (Ψ/S). 0 = not hybrid.
  int hybrid_shard_size = 0;
  int64_t batch = 8, seq = 1024;
  int gradient_accumulation_steps = 1;
  std::string mixed_precision = "no";  // no | bf16 | fp16
  std::string reduce_dtype;            // "" = the policy's default (MixedPrecisionPolicy::from_name)
  size_t bucket_bytes = kDefaultBucketBytes;
  // ZeRO-2/3 (dist/zero.h): how accumulation micro-steps reach the shard, and the full
  // gradient buckets a backward holds at once.
  GradientAccumulation accumulation = GradientAccumulation::reduce_every_micro_batch;
  size_t max_buckets_in_flight = kDefaultBucketsInFlight;
  // Stage 3: elements gathered ahead of use; -1 = the Accelerator's default (what a
  // `tessera train` run uses).
  int64_t stage3_prefetch_bucket_size = -1;
  // ZeRO-Offload (stage >= 1; offload_param needs stage 3 and implies the optimizer's):
  // AdamW's state and work in host memory, counted apart from the device's (host_peak).
  bool offload_optimizer = false;
  bool offload_param = false;
  // Take the routes a CUDA device takes (flash attention, fused classifier and AdamW): what a
  // GPU run allocates rather than what the CPU's composed ops do.
  bool gpu_routes = false;
  // What backward recomputes (the model's gradient_checkpointing_enable): the activations
  // term follows the policy, its recomputes included. Refused, naming it, when it cannot apply
  // to model.n_layer blocks.
  nn::CheckpointPolicy gradient_checkpointing;
  // Whether the run writes a checkpoint (Accelerator::save_state between steps): `tessera
  // train` does at its end, and every --save-every steps, unless --save-strategy no. The save
  // phase is predicted either way; this says whether `peak` covers it.
  bool saves_checkpoints = true;
  // The device mesh (dist/parallelize.h) of `world` ranks: tp_size > 1 splits the model as the
  // run does (dist::split_over_mesh over a size-only mesh; the whole model released after it),
  // DDP or ZeRO-1/2 on the dp axis of world / tp_size ranks; rank 0's piece is planned (an
  // uneven vocabulary gives the last ranks one row more). pp_size > 1: plan_pipeline_stages.
  int tp_size = 1, pp_size = 1;
  int pipeline_micro_batches = 1;
};

// What one step sends, counted as the dry run's collectives were issued (one rank's view).
struct StepTraffic {
  int64_t collectives = 0;  // calls over the group
  int64_t bytes = 0;        // their tensors' bytes (an all-reduce of B bytes sends about
                            // 2 (W - 1) / W x B from each rank in a ring)
};

struct MemoryPlan {
  int64_t psi = 0;                                      // trainable parameters
  int64_t peak = 0;                                     // bytes at the most
  std::array<int64_t, kNumMemoryCategories> at_peak{};  // by category at that moment
  // The construction (the model built, cast and sharded, as `tessera train` builds it: whole
  // in f32 on every rank, or under stage 3 by sharded construction, each rank filling only
  // its slices), the training steps and a checkpoint's save between two steps (rank 0's: the
  // main process also streams the model's shards into model.safetensors) apart: peak is the
  // largest of them (of the first two without saves_checkpoints).
  int64_t setup_peak = 0, step_peak = 0, save_peak = 0;
  std::array<int64_t, kNumMemoryCategories> setup_at_peak{}, step_at_peak{}, save_at_peak{};
  bool sharded_construction = false;
  std::array<int64_t, kNumMemoryCategories> steady{};   // between steps (after zero_grad)
  int64_t host_peak = 0;  // host memory of the run under offload (0 without)
  ZeroMemoryFormula formula;
  std::string strategy;
  // The layout behind the peak: the largest bucket's gradient (and reduce) buffers, the
  // largest stage-3 unit's gathered parameters, and how many buckets a backward may hold
  // (0: all of them, DDP and stage 1).
  int64_t largest_bucket_bytes = 0;
  int64_t largest_unit_bytes = 0;
  size_t max_buckets_in_flight = 0;
  // What the training steps' peak is made of, by the terms ZeRO's analysis uses (per rank,
  // bytes).
  struct Terms {
    int64_t shard_parameters = 0, shard_gradients = 0, optimizer = 0;  // kept between steps
    int64_t activations = 0;
    int64_t gathered_units = 0;    // communication at the peak: gathered parameters, reduce buffers
    int64_t buckets_in_flight = 0; // full gradient buckets alive at the peak
    int64_t other = 0;
  };
  Terms terms() const;
  // One training step's collectives over the tp group (tensor parallelism: 4L + 4 all-reduces
  // per micro-batch, docs/mesh.md) and over the dp axis (the gradients), in the second step.
  StepTraffic tp_traffic, dp_traffic;
  // ZeRO's formula plus activations at the steps' peak, two gathered units and the bound on
  // the buckets in flight: what a stage-3 step's peak should stay close to.
  int64_t expected_stage3_bound() const;
};

MemoryPlan plan_memory(const MemoryPlanOptions& options);

// A pipeline of options.pp_size stages (options.world ranks, DDP or ZeRO-1/2 on the dp axis:
// ZeRO shards the optimizer state, the gradients stay whole): each stage's
// blocks (pipeline_stage_blocks, the split's own cut) and its state at the steps' peak, with
// the model's own parameter shapes (a size-only model): its blocks, the embeddings on the first
// stage, the final norm and head on the last (a tied head's copy of the token embedding too).
// Activations: plan_memory runs rank 0's stage (the first) through its schedule. Sends per micro-batch: its [B/m, T, C] activations to the
// next stage, their gradient back; a tied model's embedding gradient all-reduced between the
// first and the last stage once a step.
struct PipelineStagePlan {
  int stage = 0;
  int64_t blocks_begin = 0, blocks_end = 0;
  int64_t parameters = 0;  // elements (trainable)
  int64_t parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
  StepTraffic sends;  // point to point, one step (every micro-batch), from this stage
  int64_t tied_all_reduce_bytes = 0;
};
std::vector<PipelineStagePlan> plan_pipeline_stages(const MemoryPlanOptions& options);

}  // namespace tessera::dist
