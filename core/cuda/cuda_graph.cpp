#include "tessera/core/cuda/cuda_graph.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "tessera/core/cuda/caching_allocator.h"
#include "tessera/core/cuda/cuda_check.h"
#include "tessera/core/cuda/graph_copy_nodes.h"
#include "tessera/core/graph_capture.h"

namespace tessera::cuda {
namespace {

std::atomic<uint64_t> next_pool_id{1};

// What a graph keeps: its pool id (released with it) and the staged host bytes.
struct GraphResources {
  int device = 0;
  uint64_t pool = 0;
  std::vector<PinnedBuffer> staged;
  ~GraphResources() {
    if (pool != 0) caching_allocator(device).release_graph_pool(pool);
  }
};

// The capture under way on this thread (one at a time), or null.
struct Capture {
  int device = 0;
  cudaStream_t previous_stream = nullptr;
  cudaStream_t stream = nullptr;
  std::shared_ptr<GraphResources> resources;
};
thread_local Capture* active = nullptr;

// One capture stream per device for the process (a replay runs there too).
cudaStream_t capture_stream(int device) {
  static std::vector<cudaStream_t>* streams =
      new std::vector<cudaStream_t>(device_count(), nullptr);
  cudaStream_t& s = streams->at(device);
  if (!s) {
    DeviceGuard guard(device);
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  return s;
}

// Makes `waiter` wait for the work queued so far on `before` (no host wait).
void order_after(cudaStream_t waiter, cudaStream_t before) {
  if (waiter == before) return;
  cudaEvent_t e = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  TESSERA_CUDA_CHECK(cudaEventRecord(e, before));
  TESSERA_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
  TESSERA_CUDA_CHECK(cudaEventDestroy(e));
}

class CudaGraph final : public DeviceGraph {
 public:
  CudaGraph(cudaGraphExec_t exec, std::shared_ptr<GraphResources> resources)
      : exec_(exec), resources_(std::move(resources)) {}
  ~CudaGraph() override {
    DeviceGuard guard(resources_->device);
    cudaStreamSynchronize(capture_stream(resources_->device));  // its replays are done
    cudaGraphExecDestroy(exec_);
  }
  void replay() override {
    const int device = resources_->device;
    DeviceGuard guard(device);
    cudaStream_t caller = current_stream(device), stream = capture_stream(device);
    order_after(stream, caller);
    TESSERA_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
    order_after(caller, stream);
  }

 private:
  cudaGraphExec_t exec_;
  std::shared_ptr<GraphResources> resources_;
};

// Ends this thread's capture: the stream, the allocator pool and the flag go back.
cudaGraph_t finish(Capture& c) {
  cudaGraph_t graph = nullptr;
  const cudaError_t status = cudaStreamEndCapture(c.stream, &graph);
  caching_allocator(c.device).end_graph_pool();
  set_current_stream(c.previous_stream, c.device);
  ::tessera::detail::set_graph_capture_underway(false);
  active = nullptr;
  if (status != cudaSuccess) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    TESSERA_FAIL("CUDA graph capture on cuda:", c.device, " failed: ", cudaGetErrorString(status),
                 " (the step did something a graph cannot record, e.g. a host synchronisation)");
  }
  return graph;
}

class CudaGraphBackend final : public GraphBackend {
 public:
  void begin_capture(Device device) override {
    TESSERA_CHECK(device.is_cuda(), "CUDA graph capture: ", device.str(), " is not a CUDA device");
    TESSERA_CHECK(active == nullptr, "CUDA graph capture: one is already under way on this thread");
    auto c = std::make_unique<Capture>();
    c->device = device.index;
    DeviceGuard guard(device.index);
    c->previous_stream = current_stream(device.index);
    c->stream = capture_stream(device.index);
    c->resources = std::make_shared<GraphResources>();
    c->resources->device = device.index;
    order_after(c->stream, c->previous_stream);
    const uint64_t pool = next_pool_id++;
    caching_allocator(device.index).begin_graph_pool(pool, c->previous_stream);
    c->resources->pool = pool;
    // Relaxed: cudaMalloc (the allocator's pool growing, cuBLAS workspaces) may run while
    // capturing; what truly conflicts (a synchronisation, a read-back) still fails it.
    const cudaError_t status = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed);
    if (status != cudaSuccess) {
      cudaGetLastError();
      caching_allocator(device.index).end_graph_pool();
      TESSERA_FAIL("CUDA graph capture on ", device.str(),
                   " could not start: ", cudaGetErrorString(status));
    }
    set_current_stream(c->stream, device.index);
    ::tessera::detail::set_graph_capture_underway(true);
    active = c.release();
  }

  std::unique_ptr<DeviceGraph> end_capture(Device device) override {
    std::unique_ptr<Capture> c = take(device);
    DeviceGuard guard(c->device);
    cudaGraph_t graph = finish(*c);
    if (graph_copy_kernels_enabled()) {
      try {
        replace_copy_nodes_with_kernels(graph);  // graph_copy_nodes.h says why
      } catch (...) {
        cudaGraphDestroy(graph);
        throw;
      }
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (status != cudaSuccess) {
      cudaGetLastError();
      TESSERA_FAIL("CUDA graph on cuda:", c->device,
                   " could not be instantiated: ", cudaGetErrorString(status));
    }
    return std::make_unique<CudaGraph>(exec, std::move(c->resources));
  }

  void abort_capture(Device device) override {
    if (active == nullptr) return;
    std::unique_ptr<Capture> c = take(device);
    DeviceGuard guard(c->device);
    try {
      cudaGraph_t graph = finish(*c);
      if (graph) cudaGraphDestroy(graph);
    } catch (const Error&) {  // the capture was broken already: that is why it is aborted
    }
  }

 private:
  static std::unique_ptr<Capture> take(Device device) {
    TESSERA_CHECK(active != nullptr && device.is_cuda() && active->device == device.index,
                  "CUDA graph capture: none is under way on ", device.str(), " in this thread");
    std::unique_ptr<Capture> c(active);
    return c;
  }
};

const bool registered = [] {
  static CudaGraphBackend backend;
  register_graph_backend(DeviceType::CUDA, &backend);
  return true;
}();

}  // namespace

bool capturing(int device) { return active != nullptr && active->device == device; }

const void* stage_for_capture(int device, const void* host, size_t n) {
  TESSERA_CHECK(capturing(device),
                "cuda::stage_for_capture: no capture under way on cuda:", device);
  // cudaMallocHost is not stream work: allowed in relaxed mode while capturing.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  PinnedBuffer staged;
  try {
    staged = PinnedBuffer(n);
  } catch (...) {
    cudaThreadExchangeStreamCaptureMode(&mode);
    throw;
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  std::memcpy(staged.data(), host, n);
  const void* p = staged.data();
  active->resources->staged.push_back(std::move(staged));
  return p;
}

}  // namespace tessera::cuda
