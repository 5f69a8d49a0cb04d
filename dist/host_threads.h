// The host threads of one rank: its share of the host's cores, and a pool of threads pinned
// to that share that runs a loop's contiguous chunks (ZeRO-Offload's host AdamW).
//
// The ranks of one host split the cores this process may run on (sched_getaffinity) into
// local_world_size contiguous blocks; local rank r takes block r. The pool runs one thread per
// core of the block — or TESSERA_OFFLOAD_THREADS threads (core/settings.h), laid over the
// block's cores round robin — each pinned (sched_setaffinity) to its core, so ranks do not
// fight over cores and a thread's chunk stays in its core's caches.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/optim/host_parallel.h"

namespace tessera::dist {

// The cores of block `local_rank` of `allowed` split into `local_world_size` contiguous blocks
// (sizes differ by one at most). With fewer cores than ranks, rank r shares core r mod n.
std::vector<int> rank_cpu_share(const std::vector<int>& allowed, int local_rank,
                                int local_world_size);
// The cores this process may run on, in increasing order (every online core where the
// platform has no affinity mask).
std::vector<int> allowed_cpus();
// How many threads the rank's host optimizer runs: TESSERA_OFFLOAD_THREADS when set (> 0),
// else the size of its share.
int offload_thread_count(size_t share);

class HostThreadPool {
 public:
  // `threads` workers, worker t pinned to cpus[t % cpus.size()] (no pinning when cpus is
  // empty). threads >= 1.
  HostThreadPool(int threads, std::vector<int> cpus);
  // The rank's pool: offload_thread_count threads over rank_cpu_share of allowed_cpus for
  // this process's local rank (dist/env.h).
  static std::unique_ptr<HostThreadPool> for_this_rank();
  ~HostThreadPool();
  HostThreadPool(const HostThreadPool&) = delete;
  HostThreadPool& operator=(const HostThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  const std::vector<int>& cpus() const { return cpus_; }
  // Splits [0, n) into size() contiguous chunks (each a multiple of 16 elements but the last,
  // so no two threads write one cache line of a float array), runs chunk t on worker t and
  // returns when all have run; rethrows the first exception a chunk threw. One call at a time
  // (a second caller waits).
  void run(int64_t n, const optim::RangeBody& body);
  // run() as an optim::RangeRunner (for optim::RangeRunnerScope); lives as long as the pool.
  const optim::RangeRunner& runner() const { return runner_; }

 private:
  void loop(int index);
  std::vector<int> cpus_;
  std::vector<std::thread> threads_;
  optim::RangeRunner runner_;
  std::mutex call_;  // one run() at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const optim::RangeBody* body_ = nullptr;
  int64_t n_ = 0, chunk_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
};

}  // namespace tessera::dist
