// Bandwidth of the world process group's all-reduce and reduce-scatter, the way nccl-tests
// reports it: algorithm bandwidth = bytes / time, where bytes is the whole buffer (for
// reduce-scatter the input, all ranks' shards together), and bus bandwidth = what each link
// carries in a ring: algbw · 2(n-1)/n for all-reduce, algbw · (n-1)/n for reduce-scatter.
// float32 buffers from 1 MiB up to --max-mib, x4 per row.
//
//   tessera launch --nproc-per-node 2 example_allreduce_bandwidth [--max-mib 1024] [--iters 20]
//       [--op all_reduce|reduce_scatter|both]
//
// Rank 0 prints one row per size: op bytes time_us algbw_GB/s busbw_GB/s.
// Tensors live on this rank's GPU when one is visible (nccl), else on the CPU.
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/dist/process_group.h"

using namespace tessera;

namespace {

// Seconds per call of `collective`, issued back to back and waited for at the end, as a
// training loop's buckets are.
double seconds_per_call(dist::ProcessGroup& pg, Device device, int64_t iters,
                        const std::function<dist::WorkPtr()>& collective) {
  for (int w = 0; w < 3; ++w) collective()->wait();  // warm up (and NCCL set-up)
  pg.barrier()->wait();
  const auto start = std::chrono::steady_clock::now();
  std::vector<dist::WorkPtr> works;
  for (int64_t k = 0; k < iters; ++k) works.push_back(collective());
  for (auto& w : works) w->wait();
  if (device.is_cuda()) device_backend(DeviceType::CUDA).synchronize(device.index);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
         static_cast<double>(iters);
}

void print_row(const dist::ProcessGroup& pg, const char* op, double bytes, double seconds,
               double bus_factor) {
  const double algbw = bytes / seconds / 1e9;
  if (pg.rank() == 0)
    std::printf("  %-14s %12.0f %12.1f %12.2f %12.2f\n", op, bytes, seconds * 1e6, algbw,
                algbw * bus_factor);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t max_mib = 1024, iters = 20;
  std::string op = "all_reduce";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--max-mib")
      max_mib = std::stoll(argv[i + 1]);
    else if (flag == "--iters")
      iters = std::stoll(argv[i + 1]);
    else if (flag == "--op")
      op = argv[i + 1];
    else {
      std::fprintf(stderr, "example_allreduce_bandwidth: unknown flag '%s'\n", flag.c_str());
      return 2;
    }
  }
  if (op != "all_reduce" && op != "reduce_scatter" && op != "both") {
    std::fprintf(stderr,
                 "example_allreduce_bandwidth: --op must be all_reduce, reduce_scatter or "
                 "both; got '%s'\n",
                 op.c_str());
    return 2;
  }
  const Device device = cuda_is_available()
                            ? Device::cuda(dist::read_dist_env().local_rank % cuda_device_count())
                            : Device::cpu();
  dist::InitOptions init;
  init.device = device.type;
  dist::init_process_group(init);
  dist::ProcessGroup& pg = dist::world();
  const double n = pg.size();
  if (pg.rank() == 0)
    std::printf("# %d ranks, backend %s, %s\n# %-14s %12s %12s %12s %12s\n", pg.size(),
                pg.backend_name().c_str(), device.str().c_str(), "op", "bytes", "time_us",
                "algbw_GB/s", "busbw_GB/s");
  for (int64_t mib = 1; mib <= max_mib; mib *= 4) {
    const int64_t elements = mib * (1 << 20) / 4;
    const double bytes = static_cast<double>(elements) * 4;
    Tensor buffer = ones({elements}, {.dtype = DType::f32, .device = device});
    if (op != "reduce_scatter")
      print_row(pg, "all_reduce", bytes,
                seconds_per_call(pg, device, iters, [&] { return pg.all_reduce(buffer); }),
                2 * (n - 1) / n);
    if (op != "all_reduce" && elements % pg.size() == 0) {
      Tensor shard = empty({elements / pg.size()}, {.dtype = DType::f32, .device = device});
      print_row(
          pg, "reduce_scatter", bytes,
          seconds_per_call(pg, device, iters, [&] { return pg.reduce_scatter(shard, buffer); }),
          (n - 1) / n);
    }
  }
  dist::destroy_process_group();
  return 0;
}
