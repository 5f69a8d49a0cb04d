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

#include "tessera/core/memory_category.h"
#include "tessera/dist/memory_report.h"
#include "tessera/nn/gpt.h"

namespace tessera::dist {

struct MemoryPlanOptions {
  nn::GPTConfig model;
  int zero_stage = 0;  // 0 = DDP
  int world = 1;
  int64_t batch = 8, seq = 1024;
  int gradient_accumulation_steps = 1;
  std::string mixed_precision = "no";  // no | bf16 | fp16
  std::string reduce_dtype;            // "" = the policy's default (MixedPrecisionPolicy::from_name)
  size_t bucket_bytes = size_t(25) << 20;
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
};

struct MemoryPlan {
  int64_t psi = 0;                                      // trainable parameters
  int64_t peak = 0;                                     // bytes at the most
  std::array<int64_t, kNumMemoryCategories> at_peak{};  // by category at that moment
  std::array<int64_t, kNumMemoryCategories> steady{};   // between steps (after zero_grad)
  int64_t host_peak = 0;  // host memory of the run under offload (0 without)
  ZeroMemoryFormula formula;
  std::string strategy;
};

MemoryPlan plan_memory(const MemoryPlanOptions& options);

}  // namespace tessera::dist
