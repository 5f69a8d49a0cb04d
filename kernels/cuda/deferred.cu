// Work off the critical path (core/fused_dispatch.h's run_deferred / join_deferred): a
// backward's weight gradient feeds nothing the rest of the backward needs, so its GEMM goes to a
// second stream of the device and runs beside the input-gradient chain (the next GEMM, the
// GELU and layer-norm backwards), filling the SMs those leave idle, e.g. the last wave of a
// GEMM. The operands stay referenced until the join, so the caching allocator cannot hand
// their memory to later work on the main stream while the second stream still reads it; after
// the join that later work is ordered after the deferred work anyway. Inside a CUDA graph
// capture the two streams become two branches of the graph (the events are the edges).
// TESSERA_DEFERRED_WORK=0 runs the work in order on the current stream.
// TESSERA_DEFERRED_WORK_DELAY_US=N (a testing aid) holds the second stream N microseconds
// before each piece: a read of a gradient that was not joined then sees it unwritten.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace tessera::cuda {

namespace {

std::atomic<bool> deferral_on{[] {
  const char* v = std::getenv("TESSERA_DEFERRED_WORK");
  return v == nullptr || std::strcmp(v, "0") != 0;
}()};

std::atomic<int64_t> delay_us{[] {
  const char* v = std::getenv("TESSERA_DEFERRED_WORK_DELAY_US");
  return v == nullptr ? int64_t{0} : std::atoll(v);
}()};

// Waits `ns` nanoseconds of the device's global timer (one thread).
__global__ void delay_kernel(int64_t ns) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<int64_t>(now - start) < ns);
}

// One device's second stream as one thread uses it (streams are current per thread).
struct DeferredLane {
  explicit DeferredLane(int device) : stream(device) {}
  Stream stream;
  Event fork{false}, done{false};
  bool pending = false;          // work queued on `stream` that the current stream did not join
  std::vector<Tensor> operands;  // kept alive until the join
};

// Never destroyed: a thread's lanes may outlive the CUDA context at process exit.
DeferredLane* lane(int device, bool create) {
  thread_local std::vector<DeferredLane*> lanes;
  if (lanes.size() <= static_cast<size_t>(device)) {
    if (!create) return nullptr;
    lanes.resize(device + 1, nullptr);
  }
  if (lanes[device] == nullptr && create) {
    DeviceGuard guard(device);
    lanes[device] = new DeferredLane(device);
  }
  return lanes[device];
}

}  // namespace

void set_deferred_work(bool enabled, int64_t delay_microseconds) {
  deferral_on = enabled;
  delay_us = delay_microseconds;
}

void run_deferred(int device, const std::function<void()>& work, std::vector<Tensor> operands) {
  if (!deferral_on) {
    work();
    return;
  }
  DeferredLane& l = *lane(device, true);
  DeviceGuard guard(device);
  join_deferred(device);
  const cudaStream_t main = current_stream(device);
  l.fork.record(main);
  l.fork.block(l.stream.handle());
  {
    StreamGuard side(l.stream.handle(), device);
    if (const int64_t us = delay_us; us > 0) {
      delay_kernel<<<1, 1, 0, l.stream.handle()>>>(us * 1000);
      TESSERA_KERNEL_CHECK("delay_kernel");
    }
    work();
  }
  l.done.record(l.stream.handle());
  l.pending = true;
  l.operands = std::move(operands);
}

void join_deferred(int device) {
  DeferredLane* l = lane(device, false);
  if (l == nullptr || !l->pending) return;
  DeviceGuard guard(device);
  l->done.block(current_stream(device));
  l->pending = false;
  l->operands.clear();
}

}  // namespace tessera::cuda
