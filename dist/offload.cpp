#include "tessera/dist/offload.h"

#include <array>

#include "tessera/core/allocator.h"
#include "tessera/core/memory_category.h"
#include "tessera/dist/zero_trace.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

namespace {

std::array<CopyStreamFactory, kNumDeviceTypes>& copy_streams() {
  static std::array<CopyStreamFactory, kNumDeviceTypes> table;
  return table;
}

bool is_low_precision(DType t) { return t == DType::f16 || t == DType::bf16; }

// dst <- src for contiguous tensors of one dtype on different devices: the bytes move once,
// on the calling thread's current stream (ops::copy_ would first pack a copy on the device).
void copy_across(const Tensor& dst, const Tensor& src) {
  if (dst.device() == src.device() || dst.dtype() != src.dtype() || !dst.is_contiguous() ||
      !src.is_contiguous()) {
    ops::copy_(dst, src);
    return;
  }
  const Device gpu = dst.device().is_cpu() ? src.device() : dst.device();
  device_backend(gpu.type).copy_bytes(dst.raw_data(), dst.device(), src.raw_data(), src.device(),
                                      dst.nbytes());
  ++dst.impl().version;
}

}  // namespace

void register_copy_stream(DeviceType type, CopyStreamFactory factory) {
  copy_streams()[static_cast<int>(type)] = std::move(factory);
}

Tensor pinned_host_empty(int64_t numel, DType dtype, Device device) {
  Allocator* pinned =
      device.is_cpu() ? nullptr : device_backend(device.type).pinned_host_allocator();
  if (!pinned || numel == 0) {
    const HostMemoryScope host;  // a size-only dry run files it as the host memory it is
    return empty({numel}, {.dtype = dtype});
  }
  const size_t nbytes = static_cast<size_t>(numel) * dtype_size(dtype);
  void* data = pinned->allocate(nbytes);
  std::shared_ptr<void> owner(data, [pinned, nbytes](void* p) { pinned->deallocate(p, nbytes); });
  return from_blob(data, {numel}, dtype, Device::cpu(), std::move(owner));
}

// ---- the worker ----

HostWorker::HostWorker(Device device, int trace_lane)
    : thread_([this, device, trace_lane] { loop(device, trace_lane); }) {}

HostWorker::~HostWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

WorkPtr HostWorker::run(std::function<void()> task) {
  std::packaged_task<void()> packaged(std::move(task));
  std::shared_future<void> done = packaged.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(packaged));
  }
  wake_.notify_one();
  return std::make_shared<FutureWork>(std::move(done));
}

void HostWorker::loop(Device device, int trace_lane) {
  ZeroTrace::set_thread_lane(trace_lane);
  std::shared_ptr<void> stream;  // the device's copy stream, current for this thread
  if (const CopyStreamFactory& make = copy_streams()[static_cast<int>(device.type)]) {
    try {
      stream = make(device);
    } catch (...) {  // copies then run on the default stream: slower, still correct
    }
  }
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // exceptions go to the task's future
  }
}

// ---- the offloaded optimizer state ----

OptimizerOffload::OptimizerOffload(Device device, const std::vector<SliceLayout>& slices)
    : device_(device),
      slices_(slices),
      threads_(HostThreadPool::for_this_rank()),
      worker_(device, /*trace_lane=*/1),
      stepper_(Device::cpu(), /*trace_lane=*/3) {
  for (const SliceLayout& s : slices_) {
    masters_.push_back(pinned_host_empty(s.numel, DType::f32, device_));
    gradients_.push_back(pinned_host_empty(s.numel, DType::f32, device_));
    ops::fill_(gradients_.back(), 0.0);
    staging_.push_back(is_low_precision(s.param_dtype)
                           ? pinned_host_empty(s.numel, s.param_dtype, device_)
                           : Tensor());
  }
}

void OptimizerOffload::load_master(size_t b, const Tensor& parameters) {
  TESSERA_CHECK(parameters.numel() == slices_.at(b).numel, "OptimizerOffload: bucket ", b,
                " has a slice of ", slices_[b].numel, " elements, got ", parameters.numel());
  ops::copy_(masters_[b], ops::contiguous(parameters));
}

WorkPtr OptimizerOffload::download_gradient(size_t b, WorkPtr reduction, const Tensor& averaged) {
  TESSERA_CHECK(averaged.numel() == slices_.at(b).numel, "OptimizerOffload: bucket ", b,
                " has a slice of ", slices_[b].numel, " elements, got a gradient of ",
                averaged.numel());
  return worker_.run(
      [this, b, reduction = std::move(reduction), averaged, step = ZeroTrace::current_step()] {
        ZeroTrace::Span span("offload_d2h", static_cast<int>(b), step);
        // On a GPU: the copy stream (current on this thread) waits for the collective.
        if (reduction) reduction->wait();
        const Tensor& host = gradients_[b];
        if (averaged.dtype() == DType::f32) {
          copy_across(host, averaged);
        } else {
          copy_across(staging_[b], averaged);
          ops::copy_(host, staging_[b]);
        }
        // The device keeps parameter-dtype gradients: an f32 average is rounded to that dtype
        // once (as the device's completion hook would) before the f32 master's update reads it.
        if (averaged.dtype() == DType::f32 && staging_[b].defined()) {
          ops::copy_(staging_[b], host);
          ops::copy_(host, staging_[b]);
        }
      });
}

void OptimizerOffload::round_gradients() {
  for (size_t b = 0; b < slices_.size(); ++b) {
    if (!staging_[b].defined()) continue;
    ops::copy_(staging_[b], gradients_[b]);
    ops::copy_(gradients_[b], staging_[b]);
  }
}

std::vector<WorkPtr> OptimizerOffload::upload_parameters(const std::vector<Tensor>& targets,
                                                         const std::vector<size_t>& order,
                                                         const std::vector<WorkPtr>& after) {
  TESSERA_CHECK(targets.size() == slices_.size() && order.size() == slices_.size() &&
                    (after.empty() || after.size() == slices_.size()),
                "OptimizerOffload: ", targets.size(), " upload targets, ", order.size(),
                " positions and ", after.size(), " steps to wait for, for ", slices_.size(),
                " buckets");
  // The targets were last read by kernels of the compute stream (forward, backward): the
  // copy stream must not overwrite them before those finished.
  if (!device_.is_cpu()) device_backend(device_.type).synchronize(device_.index);
  std::vector<WorkPtr> works(targets.size());
  for (size_t b : order) {
    WorkPtr updated = after.empty() ? nullptr : after[b];
    works.at(b) = worker_.run([this, b, target = targets[b], updated = std::move(updated),
                               step = ZeroTrace::current_step()] {
      if (updated) updated->wait();  // the bucket's step, on the stepper
      ZeroTrace::Span span("offload_h2d", static_cast<int>(b), step);
      if (target.device().is_cpu()) {
        ops::copy_(target, masters_[b]);  // a host shard (offload_param, or a CPU run)
        return;
      }
      if (target.dtype() == DType::f32) {
        copy_across(target, masters_[b]);
        return;
      }
      TESSERA_CHECK(target.dtype() == slices_[b].param_dtype, "OptimizerOffload: bucket ", b,
                    " holds ", dtype_name(slices_[b].param_dtype), " parameters, not ",
                    dtype_name(target.dtype()));
      ops::copy_(staging_[b], masters_[b]);  // rounded on the host: half the bytes to move
      copy_across(target, staging_[b]);
    });
  }
  return works;
}

WorkPtr OptimizerOffload::step_after(size_t b, WorkPtr landed, std::function<void()> step) {
  TESSERA_CHECK(b < slices_.size(), "OptimizerOffload: bucket ", b, " of ", slices_.size());
  return stepper_.run([b, landed = std::move(landed), step = std::move(step),
                       trace_step = ZeroTrace::current_step()] {
    if (landed) landed->wait();
    ZeroTrace::Span span("offload_step", static_cast<int>(b), trace_step);
    // Host work on host slices: a size-only dry run files the moments it creates as host
    // memory, as it does when the training thread steps (dist/memory_plan.cpp).
    const HostMemoryScope host;
    step();
  });
}

int64_t OptimizerOffload::host_bytes() const {
  int64_t bytes = 0;
  for (const auto* list : {&masters_, &gradients_, &staging_})
    for (const Tensor& t : *list)
      if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

}  // namespace tessera::dist
