#include "tessera/core/compute_share.h"

#include <atomic>

namespace tessera {

namespace {
std::atomic<int> g_reserve{0};
}

void set_communication_sm_reserve(int multiprocessors) {
  g_reserve.store(multiprocessors > 0 ? multiprocessors : 0, std::memory_order_relaxed);
}

int communication_sm_reserve() { return g_reserve.load(std::memory_order_relaxed); }

}  // namespace tessera
