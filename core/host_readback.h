// Reading a few device values on the host without draining the device's queue.
//
// Tensor::item() waits for everything queued on the device so far, including work issued
// after the value was computed. A HostReadback queues its copies when start() is called —
// right behind the work that computes the values — into page-locked memory, and wait()
// blocks only until those copies are done. The trainer starts reading step N's loss right
// after queueing step N and waits for it after queueing step N + 1, so the device always has
// a step to run while the host logs. Where the device has no asynchronous copy (the CPU),
// start() reads at once.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera {

class HostReadback {
 public:
  HostReadback() = default;
  HostReadback(const HostReadback&) = delete;
  HostReadback& operator=(const HostReadback&) = delete;
  ~HostReadback();

  // Queues the read of `values` (each one element of any dtype, on any device; host values
  // are read at once, an undefined tensor reads as NaN). A read in flight is waited for first.
  void start(const std::vector<Tensor>& values);
  bool pending() const { return pending_; }
  // The values started last, as doubles in their order; blocks until their copies are done.
  std::vector<double> wait();

 private:
  std::vector<Tensor> sources_;  // f64 copies on the device, alive until copied
  std::vector<std::function<void()>> waits_;
  std::vector<double> values_;      // one per value; the asynchronous ones at wait()
  std::vector<size_t> async_;       // which values come through pinned_
  std::shared_ptr<double> pinned_;  // page-locked destination
  size_t capacity_ = 0;
  bool pending_ = false;
};

}  // namespace tessera
