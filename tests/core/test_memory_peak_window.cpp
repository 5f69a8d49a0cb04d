// The allocator's per-category peak windows (core/memory_category.h): a MemoryPeakWindow
// measures a phase nested in the current window (the memory report's save phase) apart, and
// puts the enclosing window's peak back when it closes, so the enclosing peak stays that of
// what ran outside it.
#include <gtest/gtest.h>

#include "tessera/core/memory_category.h"
#include "tessera/core/tensor.h"

using namespace tessera;

namespace {

constexpr DeviceType kCpu = DeviceType::CPU;

// n f32 elements filed under `category`, alive while the result lives.
Tensor allocate(int64_t n, MemoryCategory category) {
  const MemoryCategoryScope tag(category);
  return empty({n});
}

int64_t alive() { return category_memory_stats(kCpu).total_in_use(); }

}  // namespace

TEST(MemoryPeakWindow, MeasuresANestedPhaseApartAndPutsTheEnclosingPeakBack) {
  enable_memory_categories(true);
  const int64_t base = alive();
  reset_category_peak(kCpu);
  allocate(1000, MemoryCategory::Gradients);  // the enclosing window's peak: base + 4000
  Tensor kept;
  {
    const MemoryPeakWindow save(kCpu);
    EXPECT_EQ(save.stats().peak, base);
    allocate(3000, MemoryCategory::Other);  // the window's peak: base + 12000
    {
      // A window inside it, higher than it: not folded into it either.
      const MemoryPeakWindow inner(kCpu);
      allocate(5000, MemoryCategory::Other);
      EXPECT_EQ(inner.stats().peak, base + 20000);
    }
    const CategoryMemoryStats s = save.stats();
    EXPECT_EQ(s.peak, base + 12000);
    EXPECT_EQ(s.at_peak_of(MemoryCategory::Other), 12000);
    EXPECT_EQ(s.at_peak_of(MemoryCategory::Gradients), 0);
    kept = allocate(100, MemoryCategory::Parameters);  // outlives the window
  }
  // The enclosing peak and its split are what they were before the window opened.
  CategoryMemoryStats outside = category_memory_stats(kCpu);
  EXPECT_EQ(outside.peak, base + 4000);
  EXPECT_EQ(outside.at_peak_of(MemoryCategory::Gradients), 4000);
  EXPECT_EQ(outside.at_peak_of(MemoryCategory::Other), 0);
  EXPECT_EQ(alive(), base + 400);

  // A window that leaves more alive than the enclosing peak raises it to what is alive.
  reset_category_peak(kCpu);
  Tensor left;
  {
    const MemoryPeakWindow window(kCpu);
    left = allocate(2000, MemoryCategory::OptimizerState);
  }
  outside = category_memory_stats(kCpu);
  EXPECT_EQ(outside.peak, base + 400 + 8000);
  EXPECT_EQ(outside.at_peak_of(MemoryCategory::OptimizerState), 8000);
  EXPECT_EQ(outside.at_peak_of(MemoryCategory::Parameters), 400);
  kept = Tensor();
  left = Tensor();
  EXPECT_EQ(alive(), base);
  enable_memory_categories(false);
}
