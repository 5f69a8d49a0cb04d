// A CUDA program with a known set of GPU activities, run under libtessera_kernel_trace.so
// by check_kernel_trace.py, which then looks for exactly these in the trace:
//   probe_scale<3> x5 on stream A, probe_add x4 on stream B,
//   a CUDA graph of probe_graph_first -> probe_graph_second replayed 3 times on stream A,
//   probe_spin on stream A and ncclProbeSpin (named so the tracer counts it as communication)
//   on stream B, both spinning about 5 ms at the same time,
//   one memset, one host-to-device and one device-to-host copy.
// Exit 77 when there is no CUDA device (the test is then reported as skipped).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void check(cudaError_t result, const char* what) {
  if (result == cudaSuccess) return;
  std::fprintf(stderr, "kernel_trace_probe: %s failed: %s\n", what, cudaGetErrorString(result));
  std::exit(1);
}

}  // namespace

template <int kFactor>
__global__ void probe_scale(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= static_cast<float>(kFactor);
}

__global__ void probe_add(float* x, const float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

__global__ void probe_graph_first(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * 0.5f + 1.0f;
}

__global__ void probe_graph_second(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] - 1.0f;
}

// Spins for `ns` nanoseconds of the GPU's global timer, whatever the SM clock runs at (a
// cycle count against cudaDevAttrClockRate depends on that attribute being the real clock).
__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void spin(long long ns, float* sink) {
  const unsigned long long begin = global_ns();
  while (global_ns() - begin < static_cast<unsigned long long>(ns)) {
  }
  if (threadIdx.x == 0) sink[blockIdx.x] = static_cast<float>(global_ns() - begin);
}

__global__ void probe_spin(long long ns, float* sink) { spin(ns, sink); }
__global__ void ncclProbeSpin(long long ns, float* sink) { spin(ns, sink); }

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("kernel_trace_probe: no CUDA device, skipping\n");
    return 77;
  }
  constexpr int n = 1 << 16;
  constexpr int threads = 256, blocks = (n + threads - 1) / threads;
  std::vector<float> host(n, 1.0f);
  float *x = nullptr, *y = nullptr, *sink = nullptr;
  check(cudaMalloc(&x, n * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&y, n * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&sink, 2 * sizeof(float)), "cudaMalloc");
  cudaStream_t a, b;
  check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "cudaStreamCreate");

  check(cudaMemsetAsync(y, 0, n * sizeof(float), b), "cudaMemsetAsync");
  check(cudaMemcpyAsync(x, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, a),
        "cudaMemcpyAsync");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (int i = 0; i < 5; ++i) probe_scale<3><<<blocks, threads, 0, a>>>(x, n);
  for (int i = 0; i < 4; ++i) probe_add<<<blocks, threads, 0, b>>>(y, y, n);
  check(cudaGetLastError(), "kernel launch");

  cudaGraph_t graph;
  cudaGraphExec_t graph_exec;
  check(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  probe_graph_first<<<blocks, threads, 0, a>>>(x, n);
  probe_graph_second<<<blocks, threads, 0, a>>>(x, n);
  check(cudaStreamEndCapture(a, &graph), "cudaStreamEndCapture");
  check(cudaGraphInstantiate(&graph_exec, graph, 0), "cudaGraphInstantiate");
  for (int i = 0; i < 3; ++i) check(cudaGraphLaunch(graph_exec, a), "cudaGraphLaunch");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  const long long five_ms = 5'000'000;
  // Load both spinning kernels before launching either: under CUDA's lazy loading (the default
  // since CUDA 12.2) the first launch of a kernel loads it, and that load waited for the other
  // stream's spin to end, so the two never ran side by side.
  cudaFuncAttributes attributes;
  check(cudaFuncGetAttributes(&attributes, probe_spin), "cudaFuncGetAttributes");
  check(cudaFuncGetAttributes(&attributes, ncclProbeSpin), "cudaFuncGetAttributes");
  probe_spin<<<1, 32, 0, a>>>(five_ms, sink);
  ncclProbeSpin<<<1, 32, 0, b>>>(five_ms, sink + 1);
  check(cudaGetLastError(), "kernel launch");
  check(cudaMemcpyAsync(host.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost, a),
        "cudaMemcpyAsync");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  check(cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy");
  check(cudaGraphDestroy(graph), "cudaGraphDestroy");
  check(cudaStreamDestroy(a), "cudaStreamDestroy");
  check(cudaStreamDestroy(b), "cudaStreamDestroy");
  check(cudaFree(x), "cudaFree");
  check(cudaFree(y), "cudaFree");
  check(cudaFree(sink), "cudaFree");
  // x went 1 -> 243 (scale by 3 five times) -> 243 * 0.5^3 after three graph replays.
  const float expected = 243.0f / 8.0f;
  if (host[n - 1] != expected) {
    std::fprintf(stderr, "kernel_trace_probe: x = %g, expected %g\n", host[n - 1], expected);
    return 1;
  }
  std::printf("kernel_trace_probe: done\n");
  return 0;
}
