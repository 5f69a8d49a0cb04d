// All-reduce bandwidth of the world process group, the way nccl-tests reports it:
// algorithm bandwidth = bytes / time and bus bandwidth = algbw · 2(n-1)/n (what each
// link carries in a ring), for float32 buffers from 1 MiB up to --max-mib.
//
//   tessera launch --nproc-per-node 2 example_allreduce_bandwidth [--max-mib 1024] [--iters 20]
//
// Tensors live on this rank's GPU when one is visible (nccl), else on the CPU.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/dist/process_group.h"

using namespace tessera;

int main(int argc, char** argv) {
  int64_t max_mib = 1024, iters = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--max-mib") max_mib = std::stoll(argv[i + 1]);
    else if (flag == "--iters") iters = std::stoll(argv[i + 1]);
  }
  dist::init_process_group();
  dist::ProcessGroup& pg = dist::world();
  const Device device = cuda_is_available()
                            ? Device::cuda(dist::read_dist_env().local_rank % cuda_device_count())
                            : Device::cpu();
  if (pg.rank() == 0)
    std::printf("# %d ranks, backend %s, %s\n# %12s %12s %12s %12s\n", pg.size(),
                pg.backend_name().c_str(), device.str().c_str(), "bytes", "time_us", "algbw_GB/s",
                "busbw_GB/s");
  for (int64_t mib = 1; mib <= max_mib; mib *= 4) {
    const int64_t n = mib * (1 << 20) / 4;
    Tensor buffer = ones({n}, {.dtype = DType::f32, .device = device});
    for (int w = 0; w < 3; ++w) pg.all_reduce(buffer)->wait();  // warm up (and NCCL set-up)
    pg.barrier()->wait();
    auto start = std::chrono::steady_clock::now();
    // Issued back to back and waited for at the end, as a training loop's buckets are.
    std::vector<dist::WorkPtr> works;
    for (int64_t k = 0; k < iters; ++k) works.push_back(pg.all_reduce(buffer));
    for (auto& w : works) w->wait();
    if (device.is_cuda()) device_backend(DeviceType::CUDA).synchronize(device.index);
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
    double bytes = static_cast<double>(n) * 4;
    double algbw = bytes / seconds / 1e9;
    if (pg.rank() == 0)
      std::printf("  %12.0f %12.1f %12.2f %12.2f\n", bytes, seconds * 1e6, algbw,
                  algbw * 2.0 * (pg.size() - 1) / pg.size());
  }
  dist::destroy_process_group();
  return 0;
}
