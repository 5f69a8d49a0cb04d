// A kernel's error flag read back on the host (indexing.cu, cross_entropy.cu: an index or a
// target out of range).
#pragma once
#include <string>

#include "tessera/core/graph_capture.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {

// Reads a device error flag back (one small synchronous copy) and raises `message` if it was
// set. Inside a CUDA graph capture the flag cannot be read back (core/graph_capture.h): no check.
inline void check_flag(const int* flag, cudaStream_t stream, const std::string& message) {
  if (graph_capture_underway()) return;
  int host = 0;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  TESSERA_CHECK(host == 0, message);
}

}  // namespace tessera::cuda
