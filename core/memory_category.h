// Bytes by what they hold: ZeRO's memory formula counts parameters, gradients and optimizer
// state; a training step adds activations and communication buffers. The code that allocates
// says which with a scope (thread-local, innermost wins):
//
//   MemoryCategoryScope tag(MemoryCategory::Gradients);   // flat gradient buckets
//   Tensor g = zeros({n});                                  // counted as gradients
//
// and every tensor storage remembers its category until it is freed, so the counters below
// hold the bytes alive now per category and device type, and the split at the moment the
// total was highest. Counting is off until enable_memory_categories(true) (the memory report
// and `tessera plan` turn it on): then every allocation and free takes one short lock.
// Storages alive before that are not counted.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

#include "tessera/core/device.h"

namespace tessera {

enum class MemoryCategory : uint8_t {
  Other,
  Parameters,
  Gradients,
  OptimizerState,
  Activations,
  Communication,
};
inline constexpr int kNumMemoryCategories = 6;
const char* memory_category_name(MemoryCategory category);

// The category of what this thread allocates while the scope lives.
class MemoryCategoryScope {
 public:
  explicit MemoryCategoryScope(MemoryCategory category);
  ~MemoryCategoryScope();
  MemoryCategoryScope(const MemoryCategoryScope&) = delete;
  MemoryCategoryScope& operator=(const MemoryCategoryScope&) = delete;

 private:
  MemoryCategory previous_;
};
MemoryCategory current_memory_category();

struct CategoryMemoryStats {
  std::array<int64_t, kNumMemoryCategories> in_use{};   // bytes alive now, by category
  std::array<int64_t, kNumMemoryCategories> at_peak{};  // the split when `peak` was reached
  int64_t peak = 0;                                     // most bytes alive at once (counted ones)
  int64_t total_in_use() const;
  int64_t of(MemoryCategory c) const { return in_use[static_cast<int>(c)]; }
  int64_t at_peak_of(MemoryCategory c) const { return at_peak[static_cast<int>(c)]; }
};

// Host memory of a device run, in a size-only dry run (core/size_only.h): there every
// storage is a CPU one, so what the real run keeps in host memory (ZeRO-Offload's masters,
// gradients and moments, the optimizer's work on them) is filed apart by the code that
// allocates it, with this scope (innermost wins; `false` files as device memory again). Its
// bytes are counted in host_memory_stats_of_dry_run(), not in the CPU type's counters that
// stand for the device. Outside a dry run the scope changes nothing: storages are filed by
// their own device.
class HostMemoryScope {
 public:
  explicit HostMemoryScope(bool host = true);
  ~HostMemoryScope();
  HostMemoryScope(const HostMemoryScope&) = delete;
  HostMemoryScope& operator=(const HostMemoryScope&) = delete;

 private:
  bool previous_;
};
CategoryMemoryStats host_memory_stats_of_dry_run();

void enable_memory_categories(bool on);
bool memory_categories_enabled();
CategoryMemoryStats category_memory_stats(DeviceType type);
// Peak windows. `peak` and `at_peak` above are those of the current window: since counting
// began, or since the last reset_category_peak, which ends a phase for good and starts a new
// window at the bytes alive now (of the dry run's host counters too when type is the CPU):
// `tessera train --memory-report` ends its construction phase so.
void reset_category_peak(DeviceType type);
// A phase nested inside the current window, measured apart without ending it (the memory
// report's save phase: a checkpoint written between training steps, and `tessera plan`'s dry
// run of it). While the window lives, category_memory_stats(type)'s peak is its own, starting
// at the bytes alive when it opened; when it closes, the enclosing window's peak and split are
// put back as they were (raised only to the bytes alive at the close, if those are more), so
// what happened inside is reported by stats() alone and the enclosing peak stays that of what
// ran outside it. Windows nest as scopes do; the dry run's host counters take part as in
// reset_category_peak.
class MemoryPeakWindow {
 public:
  explicit MemoryPeakWindow(DeviceType type);
  ~MemoryPeakWindow();
  MemoryPeakWindow(const MemoryPeakWindow&) = delete;
  MemoryPeakWindow& operator=(const MemoryPeakWindow&) = delete;
  // Since the window opened: its peak and the split there; in_use: the bytes alive now.
  CategoryMemoryStats stats() const;

 private:
  DeviceType type_;
  CategoryMemoryStats enclosing_, enclosing_host_;
};
// Re-files a live storage under another category (memory allocated before its role was
// known: a model's parameters are built before the data-parallel strategy adopts them).
void set_memory_category(const class Storage& storage, MemoryCategory category);

namespace detail {
// Called by Storage for the memory it allocates.
void record_storage_allocated(const void* storage, size_t nbytes, DeviceType type);
void record_storage_freed(const void* storage);
}  // namespace detail

}  // namespace tessera
