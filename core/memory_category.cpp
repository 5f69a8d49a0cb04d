#include "tessera/core/memory_category.h"

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/core/size_only.h"

namespace tessera {

namespace {

thread_local MemoryCategory g_current = MemoryCategory::Other;
thread_local bool g_host_scope = false;
std::atomic<bool> g_enabled{false};

struct Entry {
  size_t nbytes;
  DeviceType type;
  MemoryCategory category;
  bool host_of_dry_run;  // filed under HostMemoryScope in a size-only dry run
};

struct Ledger {
  std::mutex mutex;
  std::unordered_map<const void*, Entry> storages;
  std::array<CategoryMemoryStats, kNumDeviceTypes> stats{};
  CategoryMemoryStats dry_run_host;

  void add(const Entry& e, int64_t sign) {
    CategoryMemoryStats& s = e.host_of_dry_run ? dry_run_host : stats[static_cast<int>(e.type)];
    s.in_use[static_cast<int>(e.category)] += sign * static_cast<int64_t>(e.nbytes);
    const int64_t total = s.total_in_use();
    if (total > s.peak) {
      s.peak = total;
      s.at_peak = s.in_use;
    }
  }
};

Ledger& ledger() {
  static Ledger* l = new Ledger;  // never destroyed: storages may be freed during exit
  return *l;
}

}  // namespace

const char* memory_category_name(MemoryCategory category) {
  static const char* names[] = {"other",     "parameters",  "gradients",
                                "optimizer", "activations", "communication"};
  return names[static_cast<int>(category)];
}

MemoryCategoryScope::MemoryCategoryScope(MemoryCategory category) : previous_(g_current) {
  g_current = category;
}
MemoryCategoryScope::~MemoryCategoryScope() { g_current = previous_; }
MemoryCategory current_memory_category() { return g_current; }

HostMemoryScope::HostMemoryScope(bool host) : previous_(g_host_scope) { g_host_scope = host; }
HostMemoryScope::~HostMemoryScope() { g_host_scope = previous_; }

CategoryMemoryStats host_memory_stats_of_dry_run() {
  std::lock_guard lock(ledger().mutex);
  return ledger().dry_run_host;
}

int64_t CategoryMemoryStats::total_in_use() const {
  int64_t total = 0;
  for (int64_t b : in_use) total += b;
  return total;
}

void enable_memory_categories(bool on) { g_enabled = on; }
bool memory_categories_enabled() { return g_enabled.load(std::memory_order_relaxed); }

CategoryMemoryStats category_memory_stats(DeviceType type) {
  std::lock_guard lock(ledger().mutex);
  return ledger().stats[static_cast<int>(type)];
}

namespace {

// The counters a window of `type` covers: the type's, and the dry run's host ones with the CPU.
std::vector<CategoryMemoryStats*> windowed(DeviceType type) {
  std::vector<CategoryMemoryStats*> counters{&ledger().stats[static_cast<int>(type)]};
  if (type == DeviceType::CPU) counters.push_back(&ledger().dry_run_host);
  return counters;
}

void start_window(CategoryMemoryStats& s) {
  s.peak = s.total_in_use();
  s.at_peak = s.in_use;
}

}  // namespace

void reset_category_peak(DeviceType type) {
  std::lock_guard lock(ledger().mutex);
  for (CategoryMemoryStats* s : windowed(type)) start_window(*s);
}

MemoryPeakWindow::MemoryPeakWindow(DeviceType type) : type_(type) {
  std::lock_guard lock(ledger().mutex);
  enclosing_ = ledger().stats[static_cast<int>(type)];
  enclosing_host_ = ledger().dry_run_host;
  for (CategoryMemoryStats* s : windowed(type)) start_window(*s);
}

MemoryPeakWindow::~MemoryPeakWindow() {
  std::lock_guard lock(ledger().mutex);
  const std::vector<CategoryMemoryStats*> counters = windowed(type_);
  const CategoryMemoryStats* saved[] = {&enclosing_, &enclosing_host_};
  for (size_t i = 0; i < counters.size(); ++i) {
    CategoryMemoryStats& s = *counters[i];
    s.peak = saved[i]->peak;
    s.at_peak = saved[i]->at_peak;
    if (s.total_in_use() > s.peak) start_window(s);  // what the window left alive is more
  }
}

CategoryMemoryStats MemoryPeakWindow::stats() const { return category_memory_stats(type_); }

void set_memory_category(const Storage& storage, MemoryCategory category) {
  if (!memory_categories_enabled()) return;
  std::lock_guard lock(ledger().mutex);
  auto it = ledger().storages.find(&storage);
  if (it == ledger().storages.end() || it->second.category == category) return;
  ledger().add(it->second, -1);
  it->second.category = category;
  ledger().add(it->second, +1);
}

namespace detail {

void record_storage_allocated(const void* storage, size_t nbytes, DeviceType type) {
  if (!memory_categories_enabled() || nbytes == 0) return;
  const Entry e{nbytes, type, g_current,
                g_host_scope && type == DeviceType::CPU && SizeOnlyMode::active()};
  std::lock_guard lock(ledger().mutex);
  ledger().storages[storage] = e;
  ledger().add(e, +1);
}

void record_storage_freed(const void* storage) {
  if (!memory_categories_enabled()) return;
  std::lock_guard lock(ledger().mutex);
  auto it = ledger().storages.find(storage);
  if (it == ledger().storages.end()) return;
  ledger().add(it->second, -1);
  ledger().storages.erase(it);
}

}  // namespace detail

}  // namespace tessera
