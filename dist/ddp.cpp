#include "tessera/dist/ddp.h"

#include <sstream>

namespace tessera::dist {

DistributedDataParallel::DistributedDataParallel(nn::Module& module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DDPOptions options)
    : module_(module), group_(group ? std::move(group) : world_ptr()), options_(options) {
  TESSERA_CHECK(options_.bucket_bytes > 0, "DistributedDataParallel: bucket_bytes must be > 0");
  for (auto& [name, p] : module_.named_parameters()) {
    if (!p.requires_grad()) continue;
    names_.push_back(name);
    params_.push_back(p);
  }
  if (options_.broadcast_parameters) broadcast_from_rank0();
  build_buckets();
  for (size_t i = 0; i < params_.size(); ++i)
    hooks_.push_back(autograd::register_grad_ready_hook(
        params_[i], [this, i](const Tensor&) { on_grad_ready(i); }));
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& h : hooks_) h.remove();
  for (auto& b : buckets_)
    if (b.work) {
      try {
        b.work->wait();
      } catch (...) {  // a destructor must not throw; the error was reported to the waiter
      }
    }
}

void DistributedDataParallel::broadcast_from_rank0() {
  std::vector<WorkPtr> works;
  for (const Tensor& p : module_.parameters()) works.push_back(group_->broadcast(p.detach(), 0));
  for (auto& [name, b] : module_.named_buffers()) works.push_back(group_->broadcast(b.detach(), 0));
  for (auto& w : works) w->wait();
}

void DistributedDataParallel::build_buckets() {
  bucket_of_.assign(params_.size(), 0);
  index_in_bucket_.assign(params_.size(), 0);
  ready_.assign(params_.size(), false);
  // Reverse registration order; a new bucket when the current one is full or the
  // dtype/device changes (one buffer holds one dtype on one device).
  std::vector<std::vector<size_t>> groups;
  size_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const Tensor& p = params_[k];
    bool fits = !groups.empty() && bytes < options_.bucket_bytes &&
                params_[groups.back().front()].dtype() == p.dtype() &&
                params_[groups.back().front()].device() == p.device();
    if (!fits) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(k);
    bytes += p.nbytes();
  }
  for (auto& members : groups) {
    Bucket b;
    int64_t total = 0;
    for (size_t k : members) {
      bucket_of_[k] = buckets_.size();
      index_in_bucket_[k] = b.params.size();
      b.params.push_back(k);
      b.offsets.push_back(total);
      total += params_[k].numel();
    }
    const Tensor& first = params_[members.front()];
    b.gradients = zeros({total}, {.dtype = first.dtype(), .device = first.device()});
    const bool low_precision = first.dtype() == DType::f16 || first.dtype() == DType::bf16;
    if (low_precision && options_.reduce_low_precision_in_f32)
      b.reduce_buffer = zeros({total}, {.dtype = DType::f32, .device = first.device()});
    b.pending = members.size();
    buckets_.push_back(std::move(b));
  }
  // Gradients live in the buckets from the start, so backward accumulates into them.
  for (size_t k = 0; k < params_.size(); ++k) adopt_gradient(k, /*zero_when_missing=*/true);
}

Tensor DistributedDataParallel::gradient_slot(size_t i) const {
  const Bucket& b = buckets_.at(bucket_of_.at(i));
  const Tensor& p = params_[i];
  return raw::view(raw::narrow(b.gradients, 0, b.offsets[index_in_bucket_[i]], p.numel()),
                   p.shape());
}

void DistributedDataParallel::adopt_gradient(size_t i, bool zero_when_missing) {
  const Tensor& p = params_[i];
  Tensor slot = gradient_slot(i);
  Tensor grad = p.grad();
  if (grad.defined() && grad.raw_data() == slot.raw_data() && grad.strides() == slot.strides()) {
    return;  // already accumulated in place
  }
  if (grad.defined()) raw::copy_(slot, grad);
  else if (zero_when_missing) raw::fill_(slot, 0.0);
  p.set_grad(slot);
}

void DistributedDataParallel::on_grad_ready(size_t i) {
  if (!sync_) return;  // no_sync: gradients just accumulate where they are
  TESSERA_CHECK(!ready_[i], "DistributedDataParallel: the gradient of '", names_[i],
                "' was reported final twice in one backward (is it used both inside and "
                "outside a checkpoint region, or was backward run twice without "
                "finish_gradient_sync?)");
  ready_[i] = true;
  adopt_gradient(i, true);
  Bucket& b = buckets_[bucket_of_[i]];
  if (--b.pending == 0) launch_ready_buckets();
}

void DistributedDataParallel::launch_ready_buckets() {
  // Strictly in bucket order, so every rank issues the same sequence of all_reduces.
  while (next_bucket_to_launch_ < buckets_.size() && buckets_[next_bucket_to_launch_].pending == 0) {
    Bucket& b = buckets_[next_bucket_to_launch_++];
    if (b.reduce_buffer.defined()) {
      raw::copy_(b.reduce_buffer, b.gradients);
      b.work = group_->all_reduce(b.reduce_buffer, ReduceOp::Avg);
    } else {
      b.work = group_->all_reduce(b.gradients, ReduceOp::Avg);
    }
  }
}

void DistributedDataParallel::finish_gradient_sync() {
  if (!sync_) return;
  std::vector<std::string> unused;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!ready_[i]) unused.push_back(names_[i]);
  if (!unused.empty() && !options_.find_unused_parameters) {
    std::ostringstream os;
    for (size_t k = 0; k < unused.size() && k < 8; ++k) os << (k ? ", " : "") << "'" << unused[k] << "'";
    if (unused.size() > 8) os << " and " << unused.size() - 8 << " more";
    reset_backward_state();
    TESSERA_FAIL("DistributedDataParallel: ", unused.size(),
                 " parameter(s) got no gradient in this backward: ", os.str(),
                 ". Every parameter must take part in the loss on every rank, or wrap with "
                 "find_unused_parameters = true");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    ready_[i] = true;
    adopt_gradient(i, true);  // what earlier no_sync steps accumulated, else zero
    --buckets_[bucket_of_[i]].pending;
  }
  launch_ready_buckets();
  std::exception_ptr error;
  for (auto& b : buckets_) {
    try {
      if (b.work) {
        b.work->wait();
        if (b.reduce_buffer.defined()) raw::copy_(b.gradients, b.reduce_buffer);
      }
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  reset_backward_state();
  if (error) std::rethrow_exception(error);
}

void DistributedDataParallel::reset_backward_state() {
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
  }
  next_bucket_to_launch_ = 0;
}

void DistributedDataParallel::backward(const Tensor& loss) {
  loss.backward();
  finish_gradient_sync();
}

}  // namespace tessera::dist
