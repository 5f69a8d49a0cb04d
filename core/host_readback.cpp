#include "tessera/core/host_readback.h"

#include <cmath>
#include <limits>

#include "tessera/core/allocator.h"

namespace tessera {

HostReadback::~HostReadback() {
  try {
    if (pending_) wait();
  } catch (...) {  // a destructor must not throw; the device error resurfaces elsewhere
  }
}

void HostReadback::start(const std::vector<Tensor>& values) {
  if (pending_) wait();
  sources_.clear();
  waits_.clear();
  values_.assign(values.size(), std::numeric_limits<double>::quiet_NaN());
  pending_ = true;
  for (size_t i = 0; i < values.size(); ++i) {
    const Tensor& v = values[i];
    if (!v.defined()) continue;
    TESSERA_CHECK(v.numel() == 1, "HostReadback: values must have one element, got shape ",
                  shape_str(v.shape()));
    Allocator* pinned =
        v.device().is_cpu() ? nullptr : device_backend(v.device().type).pinned_host_allocator();
    if (pinned == nullptr) {  // on the host already, or no page-locked memory: read now
      values_[i] = v.item();
      continue;
    }
    if (capacity_ < values.size()) {
      const size_t bytes = values.size() * sizeof(double);
      pinned_ =
          std::shared_ptr<double>(static_cast<double*>(pinned->allocate(bytes)),
                                  [pinned, bytes](double* p) { pinned->deallocate(p, bytes); });
      capacity_ = values.size();
    }
    Tensor f64 = raw::contiguous(raw::to(v, v.device(), DType::f64));
    std::function<void()> done =
        device_backend(v.device().type)
            .copy_to_host_async(pinned_.get() + i, f64.raw_data(), v.device(), sizeof(double));
    if (done) waits_.push_back(std::move(done));  // else the copy has been made
    sources_.push_back(std::move(f64));
    async_.push_back(i);
  }
}

std::vector<double> HostReadback::wait() {
  TESSERA_CHECK(pending_, "HostReadback::wait: no read was started");
  pending_ = false;
  for (auto& done : waits_) done();
  for (size_t i : async_) values_[i] = pinned_.get()[i];
  sources_.clear();
  waits_.clear();
  async_.clear();
  return std::move(values_);
}

}  // namespace tessera
