// Where the CPU optimizers' fused loops run their chunks.
//
// By default a loop over n elements is split by OpenMP over the process's cores
// (detail::parallel_ranges, optim/fused_update.h). A caller that owns threads of its own —
// ZeRO-Offload's host AdamW, which runs on the rank's pinned share of the host's cores
// (dist/host_threads.h) — installs a RangeRunner for the calling thread instead, and every
// loop the optimizer runs on that thread goes through it.
//
// The loops are elementwise: element i's result depends on element i's operands only, so
// however a runner splits [0, n) the bits are the same as those of one thread.
#pragma once
#include <cstdint>
#include <functional>

namespace tessera::optim {

using RangeBody = std::function<void(int64_t begin, int64_t end)>;
// Runs body over [0, n) in contiguous, disjoint chunks that cover it, and returns when all of
// them have run (rethrowing the first exception a chunk threw).
using RangeRunner = std::function<void(int64_t n, const RangeBody& body)>;

// Makes `runner` (null: OpenMP again) the calling thread's runner while the scope lives.
class RangeRunnerScope {
 public:
  explicit RangeRunnerScope(const RangeRunner* runner);
  ~RangeRunnerScope();
  RangeRunnerScope(const RangeRunnerScope&) = delete;
  RangeRunnerScope& operator=(const RangeRunnerScope&) = delete;

 private:
  const RangeRunner* previous_;
};

// The calling thread's runner, or null (OpenMP).
const RangeRunner* current_range_runner();

}  // namespace tessera::optim
