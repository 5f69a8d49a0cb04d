// ZeRO-Offload's host AdamW (optim::AdamW's CPU loop on the rank's pinned host threads,
// dist/host_threads.h) over one f32 parameter of N elements with f32 gradient and moments, on
// 1..T threads, next to the machine's memcpy bandwidth on the same threads in the same run.
//
//   bench_host_adamw [--elements N] [--threads T] [--steps S]
//     N: elements (default 64M = 67,108,864: 1 GiB of parameter, gradient and moments)
//     T: the most threads (default: every core this process may run on)
//     S: timed steps per thread count, after one untimed step that creates the moments (5)
//
// Bytes per element, counted as moved between the cores and memory: AdamW reads the
// parameter, the gradient and both moments (16 bytes) and writes the parameter and both
// moments (12 bytes): 28 bytes. memcpy's GB/s counts what it reads plus what it writes (two
// buffers of N f32 each, every thread copying its contiguous chunk), so the two columns are
// the same measure: the AdamW column near the memcpy one means the update is bound by memory.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/bench_common.h"
#include "tessera/core/random.h"
#include "tessera/core/tensor.h"
#include "tessera/dist/host_threads.h"
#include "tessera/optim/adamw.h"

using namespace tessera;
using Clock = std::chrono::steady_clock;

namespace {

constexpr double kAdamWBytesPerElement = 16 + 12;  // reads p, g, m, v; writes p, m, v

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The best of `repeats` copies of src into dst, split over the pool: seconds.
double time_memcpy(dist::HostThreadPool& pool, float* dst, const float* src, int64_t n,
                   int repeats) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const Clock::time_point t = Clock::now();
    pool.run(n, [&](int64_t begin, int64_t end) {
      std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin) * sizeof(float));
    });
    best = std::min(best, seconds_since(t));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t{64} << 20;
  const std::vector<int> cpus = dist::allowed_cpus();
  int max_threads = static_cast<int>(cpus.size());
  int steps = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--elements") && i + 1 < argc) {
      n = std::atoll(argv[++i]);
    } else if (!std::strcmp(argv[i], "--threads")) {
      max_threads = bench::flag_value(i, argc, argv);
    } else if (!std::strcmp(argv[i], "--steps")) {
      steps = bench::flag_value(i, argc, argv);
    } else {
      std::fprintf(stderr, "usage: %s [--elements N] [--threads T] [--steps S]\n", argv[0]);
      return 2;
    }
  }
  if (n < 1 || max_threads < 1 || steps < 1) {
    std::fprintf(stderr, "--elements, --threads and --steps must be positive (got %lld, %d, %d)\n",
                 static_cast<long long>(n), max_threads, steps);
    return 2;
  }

  Generator gen(1);
  Tensor p = normal({n}, 0, 1, {}, &gen);
  p.requires_grad_(true);
  p.set_grad(normal({n}, 0, 1, {}, &gen));
  optim::AdamW opt(std::vector<optim::ParamGroup>{{.params = {p}, .lr = 1e-3, .weight_decay = 0.01}},
                   {});
  std::vector<float> src(static_cast<size_t>(n), 1.0f), dst(static_cast<size_t>(n), 0.0f);

  std::printf("host AdamW: %lld f32 elements (f32 gradient and moments), %d allowed cores, "
              "%d timed steps\n",
              static_cast<long long>(n), static_cast<int>(cpus.size()), steps);
  std::printf("AdamW bytes/element: %.0f (reads p, g, m, v; writes p, m, v); memcpy GB/s counts "
              "read + write\n",
              kAdamWBytesPerElement);
  std::printf("%7s %12s %14s %11s %14s %8s\n", "threads", "ms/step", "elements/s", "AdamW GB/s",
              "memcpy GB/s", "ratio");
  for (int threads = 1; threads <= max_threads; ++threads) {
    dist::HostThreadPool pool(threads, cpus);
    opt.set_range_runner(&pool.runner());
    opt.step();  // the first creates the moments (and warms the pages)
    double best = 1e30;
    for (int s = 0; s < steps; ++s) {
      const Clock::time_point t = Clock::now();
      opt.step();
      best = std::min(best, seconds_since(t));
    }
    const double copy = time_memcpy(pool, dst.data(), src.data(), n, steps);
    const double elements_per_s = static_cast<double>(n) / best;
    const double adamw_gbs = elements_per_s * kAdamWBytesPerElement / 1e9;
    const double memcpy_gbs = 2.0 * static_cast<double>(n) * sizeof(float) / copy / 1e9;
    std::printf("%7d %12.2f %14.4g %11.2f %14.2f %8.2f\n", threads, best * 1e3, elements_per_s,
                adamw_gbs, memcpy_gbs, adamw_gbs / memcpy_gbs);
    opt.set_range_runner(nullptr);
  }
  return 0;
}
