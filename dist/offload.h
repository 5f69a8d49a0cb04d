// ZeRO-Offload (Ren et al., 2021): the optimizer of a ZeRO rank runs on the host.
//
// For every bucket the rank owns a slice of S elements. With offload that slice's f32
// master (the value AdamW updates) and its f32 gradient live in host memory — page-locked
// when the device has pinned memory, so the copies run as DMA — and the prepared
// optimizer is re-pointed at 1-D views of those host buffers. Its moments are created
// next to them, on the host: the device keeps no optimizer state at all. The update is
// AdamW's CPU path (one fused loop per slice piece, vectorised), its elements split in
// contiguous chunks over the rank's pinned host threads (dist/host_threads.h): the ranks of
// one host share its cores.
//
// One host worker thread moves the bytes, so the training thread never waits for them:
//
//   backward   bucket b's reduction is launched    → worker: wait for it, copy the averaged
//              (the bucket comm hook)                slice device→host, round it through the
//                                                    parameter dtype, while backward goes on
//              with offload_step_during_backward   → stepper: once b's slice has landed,
//                                                    AdamW on b's pieces (step_after), while
//                                                    later buckets are still reduced/copied
//   step       clip + AdamW on the host slices (the user's opt.step()); the clip needs every
//              slice's norm, so with clipping the update waits for the end of backward. The
//              buckets not stepped yet are stepped one by one on the stepper, each one's copy
//              back queued behind its own update
//   after it   worker: each bucket's master → the device slice (stage 1/2: the flat
//              parameters, each bucket all-gathered as soon as it landed; stage 3: the
//              owned shard, in the order the next forward gathers the units, each unit's
//              gather waiting for its own upload only), in the parameter dtype
//
// On a GPU the worker's copies run on a stream of their own (registered by the CUDA
// backend, dist/cuda/offload_stream.cpp) ordered after the collective by its Work, so they
// overlap the backward kernels on the compute stream. On the CPU the same code runs with
// host-to-host copies (the path the CPU tests exercise).
//
// With offload_param (stage 3) the rank's parameter shard itself stays on the host too; a
// unit's gather first copies it to the device.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/dist/host_threads.h"
#include "tessera/dist/process_group.h"

namespace tessera::dist {

// Makes a side stream of `device` current for the calling thread while the returned guard
// lives. Registered by device backends that have streams; a device without one copies on
// whatever is current.
using CopyStreamFactory = std::function<std::shared_ptr<void>(Device device)>;
void register_copy_stream(DeviceType type, CopyStreamFactory factory);

// A host tensor for staging copies to and from `device`: page-locked where the device's
// backend offers pinned memory, ordinary host memory otherwise (and for the CPU).
Tensor pinned_host_empty(int64_t numel, DType dtype, Device device);

// One thread that runs tasks in the order they were queued (the offload copies). Its tasks
// run with the device's copy stream current.
class HostWorker {
 public:
  // Its spans go to ZeroTrace lane `trace_lane` (1: the copies).
  explicit HostWorker(Device device, int trace_lane = 1);
  ~HostWorker();
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;
  // The task's exception, if any, is rethrown by the returned Work's wait().
  WorkPtr run(std::function<void()> task);

 private:
  void loop(Device device, int trace_lane);
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

class OptimizerOffload {
 public:
  // One slice per bucket: `numel` elements of parameters of `param_dtype` on `device`.
  struct SliceLayout {
    int64_t numel = 0;
    DType param_dtype = DType::f32;
  };
  OptimizerOffload(Device device, const std::vector<SliceLayout>& slices);

  // The host f32 master and gradient of bucket b's slice ([S], contiguous).
  const Tensor& master(size_t b) const { return masters_.at(b); }
  const Tensor& gradient(size_t b) const { return gradients_.at(b); }

  // Sets bucket b's master from the slice's current parameters (any device and dtype).
  void load_master(size_t b, const Tensor& parameters);
  // Once `reduction` has completed, copies the averaged slice `averaged` (on the device,
  // f32 or the parameter dtype) into gradient(b), rounded through the parameter dtype as the
  // device's own gradient would be. Returns at once; the Work completes when the host
  // gradient is ready. The caller keeps `averaged` alive and untouched until then.
  WorkPtr download_gradient(size_t b, WorkPtr reduction, const Tensor& averaged);
  // Rounds every host gradient through its parameter dtype (after an in-place scaling, so
  // that it equals what a gradient kept in that dtype on the device would hold).
  void round_gradients();
  // Queues master(b) → targets[b] (the device slice, or a host shard under offload_param) in
  // targets[b]'s dtype for every bucket, in the given order of buckets, and returns at once:
  // works[b] completes when bucket b has landed. Bucket b's copy first waits for after[b]
  // when there is one (its step). The masters must not change before then.
  std::vector<WorkPtr> upload_parameters(const std::vector<Tensor>& targets,
                                         const std::vector<size_t>& order,
                                         const std::vector<WorkPtr>& after = {});

  // Once `landed` (a download_gradient's Work) has completed, runs `step` (AdamW on that
  // bucket's pieces) on the stepper thread, one step at a time in the order queued; returns
  // at once, and the Work completes when the step has run (rethrowing its exception).
  WorkPtr step_after(size_t b, WorkPtr landed, std::function<void()> step);
  // The rank's pinned host threads, as the optimizer's RangeRunner (set_range_runner).
  const optim::RangeRunner& host_threads() const { return threads_->runner(); }
  int host_thread_count() const { return threads_->size(); }

  // Bytes of host memory held (masters, gradients, staging).
  int64_t host_bytes() const;

 private:
  Device device_;
  std::vector<SliceLayout> slices_;
  std::vector<Tensor> masters_, gradients_;
  // Per bucket, in the parameter dtype when it is not f32: the rounding and upload staging.
  std::vector<Tensor> staging_;
  std::unique_ptr<HostThreadPool> threads_;
  HostWorker worker_;   // the copies
  HostWorker stepper_;  // the per-bucket steps: a step never holds up the next bucket's copy
};

}  // namespace tessera::dist
