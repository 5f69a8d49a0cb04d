#include "tessera/dist/host_process_group.h"

#include <algorithm>
#include <array>
#include <bit>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>

#include "tessera/core/allocator.h"
#include "tessera/dist/watchdog.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

namespace {
template <class T>
using Accum = std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;
}  // namespace

void reduce_into(DType dtype, ReduceOp op, void* acc, const void* in, int64_t n) {
  visit_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Accum<T>;
    T* a = static_cast<T*>(acc);
    const T* b = static_cast<const T*>(in);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        for (int64_t i = 0; i < n; ++i) a[i] = T(static_cast<A>(a[i]) + static_cast<A>(b[i]));
        break;
      case ReduceOp::Max:
        for (int64_t i = 0; i < n; ++i)
          if (static_cast<A>(b[i]) > static_cast<A>(a[i])) a[i] = b[i];
        break;
      case ReduceOp::Min:
        for (int64_t i = 0; i < n; ++i)
          if (static_cast<A>(b[i]) < static_cast<A>(a[i])) a[i] = b[i];
        break;
    }
  });
}

void scale_in_place(DType dtype, void* data, int64_t n, double factor) {
  TESSERA_CHECK(is_floating(dtype), "dist: cannot average ", dtype_name(dtype), " values");
  visit_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Accum<T>;
    T* p = static_cast<T*>(data);
    for (int64_t i = 0; i < n; ++i) p[i] = T(static_cast<A>(static_cast<A>(p[i]) * factor));
  });
}

namespace {
// Page-locked host blocks for staging device tensors (the device backend's pinned allocator):
// the copies then run as DMA at full speed instead of through the driver's pageable bounce
// buffer. Blocks (power-of-two sizes) are kept for reuse, since pinning costs milliseconds.
class PinnedPool {
 public:
  explicit PinnedPool(Allocator* allocator) : allocator_(allocator) {}

  std::shared_ptr<void> acquire(size_t nbytes) {
    const size_t size = std::bit_ceil(std::max<size_t>(nbytes, 4096));
    void* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end()) {
        block = it->second;
        free_.erase(it);
      }
    }
    if (!block) block = allocator_->allocate(size);
    return std::shared_ptr<void>(block, [this, size](void* p) {
      std::lock_guard<std::mutex> lock(mutex_);
      free_.emplace(size, p);
    });
  }

 private:
  Allocator* allocator_;
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
};

// The pool of a device type, or null when its backend has no pinned memory. Never destroyed:
// staged tensors may be released during static destruction.
PinnedPool* pinned_pool(DeviceType type) {
  static std::array<PinnedPool*, kNumDeviceTypes> pools = [] {
    std::array<PinnedPool*, kNumDeviceTypes> made{};
    for (int i = 0; i < kNumDeviceTypes; ++i) {
      const auto t = static_cast<DeviceType>(i);
      const bool device = t != DeviceType::CPU && has_device_backend(t);
      Allocator* pinned = device ? device_backend(t).pinned_host_allocator() : nullptr;
      if (pinned) made[i] = new PinnedPool(pinned);
    }
    return made;
  }();
  return pools[static_cast<int>(type)];
}

// A contiguous host copy of a device tensor (pinned where its backend offers it).
Tensor host_copy(const Tensor& t) {
  if (PinnedPool* pool = pinned_pool(t.device().type)) {
    std::shared_ptr<void> block = pool->acquire(t.nbytes());
    Tensor host = from_blob(block.get(), t.shape(), t.dtype(), Device::cpu(), block);
    ops::copy_(host, t);
    return host;
  }
  return ops::to(t, Device::cpu(), t.dtype());
}

// A host copy of t when it lives on a device, else t itself; commit() writes results back.
struct HostStaging {
  Tensor original, host;
  explicit HostStaging(const Tensor& t)
      : original(t), host(t.device().is_cpu() ? t : host_copy(t)) {}
  void* data() const { return host.raw_data(); }
  void commit() const {
    if (!host.is_same(original)) ops::copy_(original, host);
  }
};
}  // namespace

HostProcessGroup::HostProcessGroup(int rank, int size, ProcessGroupOptions options)
    : ProcessGroup(rank, size, std::move(options)), worker_([this] { worker_loop(); }) {}

HostProcessGroup::~HostProcessGroup() { stop_worker(); }

void HostProcessGroup::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

WorkPtr HostProcessGroup::enqueue(const std::string& what, const CollectiveSignature* sig,
                                  std::function<void(Deadline)> body) {
  auto job = std::make_unique<Job>();
  job->what = what;
  job->check_signature = sig != nullptr && options().debug_collectives && size() > 1;
  job->collective = sig != nullptr;
  if (sig) job->signature = *sig;
  job->body = std::move(body);
  auto done = job->done.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TESSERA_CHECK(!stopping_, "dist: ", what, " issued on a process group that is shutting down");
    queue_.push_back(std::move(job));
  }
  wake_.notify_one();
  return std::make_shared<FutureWork>(done);
}

void HostProcessGroup::run_on_worker(const std::string& what,
                                     const std::function<void(Deadline)>& fn) {
  enqueue(what, nullptr, fn)->wait();
}

void HostProcessGroup::worker_loop() {
  while (true) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    run_job(*job);
  }
}

void HostProcessGroup::run_job(Job& job) {
  try {
    TESSERA_CHECK(broken_reason_.empty(), "dist: ", job.what, " on rank ", rank(),
                  " cannot run: an earlier collective in group '", options().name,
                  "' failed: ", broken_reason_);
    Deadline deadline = Deadline::after(options().timeout_s);
    std::optional<TrackedCollective> tracked;  // where the watchdog's heartbeat says we are
    if (job.collective) tracked.emplace(options().name, job.signature);
    try {
      if (job.check_signature) {
        std::vector<CollectiveSignature> all(size());
        std::vector<void*> outs;
        for (auto& s : all) outs.push_back(&s);
        host_all_gather(&job.signature, outs,
                        std::vector<size_t>(size(), sizeof(CollectiveSignature)), deadline);
        check_signatures(all);
      }
      job.body(deadline);
    } catch (const TimeoutError&) {
      throw TimeoutError(timeout_message(job.what));
    } catch (const PeerClosedError& e) {
      throw PeerClosedError(detail::concat("dist: ", job.what, " in group '", options().name,
                                           "' on rank ", rank(), ": ", e.what()));
    }
    // The body's captures hold the collective's tensors: they are dropped before the waiter
    // wakes, so that what the caller frees next is freed then, not whenever this thread gets
    // to it (the allocator's peak would otherwise vary from run to run).
    job.body = nullptr;
    job.done.set_value();
  } catch (const std::exception& e) {
    if (broken_reason_.empty()) broken_reason_ = e.what();
    job.body = nullptr;
    job.done.set_exception(std::current_exception());
  }
}

WorkPtr HostProcessGroup::do_all_reduce(const CollectiveSignature& sig, const Tensor& t,
                                        ReduceOp op) {
  return enqueue(sig.str(), &sig, [this, t, op](Deadline d) {
    HostStaging s(t);
    host_all_reduce(s.data(), t.numel(), t.dtype(), op == ReduceOp::Avg ? ReduceOp::Sum : op, d);
    if (op == ReduceOp::Avg) scale_in_place(t.dtype(), s.data(), t.numel(), 1.0 / size());
    s.commit();
  });
}

WorkPtr HostProcessGroup::do_reduce_scatter(const CollectiveSignature& sig, const Tensor& output,
                                            const Tensor& input, ReduceOp op) {
  return enqueue(sig.str(), &sig, [this, output, input, op](Deadline d) {
    HostStaging in(input), out(output);
    host_reduce_scatter(in.data(), out.data(), output.numel(), output.dtype(),
                        op == ReduceOp::Avg ? ReduceOp::Sum : op, d);
    if (op == ReduceOp::Avg)
      scale_in_place(output.dtype(), out.data(), output.numel(), 1.0 / size());
    out.commit();
  });
}

WorkPtr HostProcessGroup::do_all_gather(const CollectiveSignature& sig,
                                        const std::vector<Tensor>& outputs, const Tensor& input) {
  return enqueue(sig.str(), &sig, [this, outputs, input](Deadline d) {
    HostStaging in(input);
    std::vector<HostStaging> outs;
    std::vector<void*> ptrs;
    std::vector<size_t> bytes;
    for (const Tensor& o : outputs) {
      outs.emplace_back(o);
      ptrs.push_back(outs.back().data());
      bytes.push_back(o.nbytes());
    }
    host_all_gather(in.data(), ptrs, bytes, d);
    for (const auto& o : outs) o.commit();
  });
}

WorkPtr HostProcessGroup::do_broadcast(const CollectiveSignature& sig, const Tensor& t, int root) {
  return enqueue(sig.str(), &sig, [this, t, root](Deadline d) {
    HostStaging s(t);
    host_broadcast(s.data(), t.nbytes(), root, d);
    if (rank() != root) s.commit();
  });
}

WorkPtr HostProcessGroup::do_barrier(const CollectiveSignature& sig) {
  return enqueue(sig.str(), &sig, [this](Deadline d) { host_barrier(d); });
}

WorkPtr HostProcessGroup::do_send(const Tensor& t, int dst, int tag) {
  return enqueue(
      detail::concat("send(", shape_str(t.shape()), " to rank ", dst, ", tag ", tag, ")"), nullptr,
      [this, t, dst, tag](Deadline d) {
        HostStaging s(t);
        host_send(s.data(), t.nbytes(), dst, tag, d);
      });
}

WorkPtr HostProcessGroup::do_recv(const Tensor& t, int src, int tag) {
  return enqueue(
      detail::concat("recv(", shape_str(t.shape()), " from rank ", src, ", tag ", tag, ")"),
      nullptr, [this, t, src, tag](Deadline d) {
        HostStaging s(t);
        host_recv(s.data(), t.nbytes(), src, tag, d);
        s.commit();
      });
}

}  // namespace tessera::dist
