// Each rank's memory next to ZeRO's formula (Rajbhandari et al., 2020). With Ψ trainable
// parameters of p bytes each on W ranks, one rank holds
//
//   stage        parameters   gradients   optimizer state (Adam: 2 moments, f32 masters
//   0 (DDP)      pΨ           pΨ          KΨ                 for low-precision p: K = 12,
//   1            pΨ           pΨ          KΨ / W             else K = 2p)
//   2            pΨ           pΨ / W      KΨ / W
//   3            pΨ / W       pΨ / W      KΨ / W
//
// so mixed-precision Adam is the paper's 2Ψ + 2Ψ + 12Ψ = 16Ψ bytes under DDP. Measured
// figures come from the allocator's per-category counters (core/memory_category.h).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/memory_category.h"

namespace tessera::dist {

struct ZeroMemoryFormula {
  int64_t parameters = 0, gradients = 0, optimizer = 0;
  int64_t total() const { return parameters + gradients + optimizer; }
};
ZeroMemoryFormula zero_memory_formula(int64_t psi, int64_t param_bytes, bool f32_masters, int stage,
                                      int world);

// One rank's counters: bytes alive now and the split at its peak.
struct RankMemory {
  std::array<int64_t, kNumMemoryCategories> now{}, at_peak{};
  int64_t peak = 0;
};

struct MemoryReportHeader {
  std::string strategy;  // "ZeRO-2", "DDP"
  int world = 1;
  int64_t psi = 0;
  std::string precision;  // "f32", "bf16 parameters + f32 masters"
};

// An earlier phase of the run (its `now` is not printed): "construction", the model built
// and prepared, whose peak can be the run's.
struct MemoryPhase {
  std::string name;
  std::vector<RankMemory> ranks;
};

// The table the memory report prints: each earlier phase's peak per rank ("rank 0
// construction"), then one row per rank now and at its peak since those phases, and the
// formula.
std::string format_memory_report(const MemoryReportHeader& header,
                                 const std::vector<RankMemory>& ranks,
                                 const ZeroMemoryFormula& formula,
                                 const std::vector<MemoryPhase>& phases = {});

}  // namespace tessera::dist
