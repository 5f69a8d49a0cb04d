// Links Tessera::cuda and calls the backend's own API; runs without a GPU too.
#include <tessera/core/allocator.h>
#include <tessera/kernels/cuda/linear.h>

#include <iostream>

int main() {
  std::cout << "consumer_cuda ok: " << tessera::cuda_device_count()
            << " CUDA device(s), cuBLASLt epilogues "
            << (tessera::cuda::linear_epilogues_enabled() ? "on" : "off") << "\n";
  return 0;
}
