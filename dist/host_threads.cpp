#include "tessera/dist/host_threads.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "tessera/core/error.h"
#include "tessera/core/settings.h"
#include "tessera/dist/env.h"

namespace tessera::dist {

std::vector<int> rank_cpu_share(const std::vector<int>& allowed, int local_rank,
                                int local_world_size) {
  TESSERA_CHECK(!allowed.empty(), "rank_cpu_share: no cores to share");
  TESSERA_CHECK(local_world_size >= 1 && local_rank >= 0 && local_rank < local_world_size,
                "rank_cpu_share: local rank ", local_rank, " of a local world of ",
                local_world_size);
  const int64_t n = static_cast<int64_t>(allowed.size());
  if (n < local_world_size) return {allowed[local_rank % n]};
  const int64_t begin = n * local_rank / local_world_size;
  const int64_t end = n * (local_rank + 1) / local_world_size;
  return {allowed.begin() + begin, allowed.begin() + end};
}

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    for (int c = 0; c < std::max(1L, online); ++c) cpus.push_back(c);
  }
  return cpus;
}

int offload_thread_count(size_t share) {
  const long long threads = setting_integer(Setting::OffloadThreads);
  return threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::max<size_t>(share, 1));
}

std::unique_ptr<HostThreadPool> HostThreadPool::for_this_rank() {
  const DistEnv env = read_dist_env();
  std::vector<int> share = rank_cpu_share(allowed_cpus(), env.local_rank, env.local_world_size);
  const int threads = offload_thread_count(share.size());
  return std::make_unique<HostThreadPool>(threads, std::move(share));
}

HostThreadPool::HostThreadPool(int threads, std::vector<int> cpus) : cpus_(std::move(cpus)) {
  TESSERA_CHECK(threads >= 1, "HostThreadPool: needs at least one thread, got ", threads);
  runner_ = [this](int64_t n, const optim::RangeBody& body) { run(n, body); };
  for (int t = 0; t < threads; ++t) threads_.emplace_back([this, t] { loop(t); });
}

HostThreadPool::~HostThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void HostThreadPool::run(int64_t n, const optim::RangeBody& body) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> one_call(call_);
  std::unique_lock<std::mutex> lock(mutex_);
  constexpr int64_t kLine = 16;  // f32 elements in a 64-byte cache line
  const int64_t threads = size();
  const int64_t even = (n + threads - 1) / threads;
  chunk_ = (even + kLine - 1) / kLine * kLine;
  n_ = n;
  body_ = &body;
  error_ = nullptr;
  pending_ = size();
  ++generation_;
  wake_.notify_all();
  done_.wait(lock, [this] { return pending_ == 0; });
  body_ = nullptr;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void HostThreadPool::loop(int index) {
  if (!cpus_.empty()) {
    // Pinned to one core of the rank's share; a refusal (a container's narrower mask) leaves
    // the thread where the scheduler puts it: slower, never wrong.
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus_[static_cast<size_t>(index) % cpus_.size()], &set);
    (void)sched_setaffinity(0, sizeof(set), &set);
  }
  uint64_t seen = 0;
  for (;;) {
    int64_t begin = 0, end = 0;
    const optim::RangeBody* body = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      body = body_;
      begin = std::min(n_, index * chunk_);
      end = std::min(n_, begin + chunk_);
    }
    std::exception_ptr error;
    if (begin < end) {
      try {
        (*body)(begin, end);
      } catch (...) {
        error = std::current_exception();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (error && !error_) error_ = error;
    if (--pending_ == 0) done_.notify_one();
  }
}

}  // namespace tessera::dist
