#include "tessera/dist/flat_buckets.h"

#include "tessera/core/memory_category.h"
#include "tessera/kernels/ops.h"

#include <algorithm>
#include <sstream>

namespace tessera::dist {

namespace {
bool is_low_precision(DType t) { return t == DType::f16 || t == DType::bf16; }
}  // namespace

FlatBuckets::FlatBuckets(std::vector<Tensor> params, std::vector<std::string> names,
                         std::shared_ptr<ProcessGroup> group, FlatBucketsOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(std::move(options)) {
  TESSERA_CHECK(options_.bucket_bytes > 0, "FlatBuckets: bucket_bytes must be > 0");
  TESSERA_CHECK(options_.shards >= 1, "FlatBuckets: shards must be >= 1, got ", options_.shards);
  TESSERA_CHECK(params_.size() == names_.size(), "FlatBuckets: ", params_.size(),
                " parameters but ", names_.size(), " names");
  std::vector<std::vector<size_t>> groups =
      options_.groups.empty() ? groups_by_size() : options_.groups;
  for (size_t k : options_.solo) groups.push_back({k});
  build(groups);
  ordered_buckets_ = buckets_.size() - options_.solo.size();
  for (size_t b = ordered_buckets_; b < buckets_.size(); ++b) buckets_[b].solo = true;
  register_comm_hook({}, {});
  for (size_t i = 0; i < params_.size(); ++i)
    hooks_.push_back(autograd::register_grad_ready_hook(
        params_[i], [this, i](const Tensor&) { on_grad_ready(i); }));
}

FlatBuckets::~FlatBuckets() {
  for (auto& h : hooks_) h.remove();
  // The parameters outlive the buckets: their gradients go back to memory of their own.
  for (const Tensor& p : params_) {
    try {
      autograd::set_grad_destination(p, Tensor());
    } catch (...) {  // a destructor must not throw (only a backward still running refuses)
    }
  }
  for (auto& b : buckets_)
    if (b.work) {
      try {
        b.work->wait();
      } catch (...) {  // a destructor must not throw; the error was reported to the waiter
      }
    }
}

std::vector<std::vector<size_t>> FlatBuckets::groups_by_size() const {
  // Reverse registration order; a new bucket when the current one is full or the
  // dtype/device changes (one buffer holds one dtype on one device).
  auto solo = [&](size_t k) {
    return std::find(options_.solo.begin(), options_.solo.end(), k) != options_.solo.end();
  };
  auto same_buffer = [&](size_t a, size_t b) {
    return params_[a].dtype() == params_[b].dtype() && params_[a].device() == params_[b].device();
  };
  // The last bucket first, from the front: the first parameters up to last_bucket_bytes.
  std::vector<size_t> last;
  size_t first_rest = 0, bytes = 0;
  if (options_.last_bucket_bytes > 0 && options_.last_bucket_bytes < options_.bucket_bytes) {
    for (; first_rest < params_.size() && bytes < options_.last_bucket_bytes; ++first_rest) {
      if (solo(first_rest)) continue;
      if (!last.empty() && !same_buffer(last.front(), first_rest)) break;
      last.insert(last.begin(), first_rest);  // reverse order inside, as in the others
      bytes += params_[first_rest].nbytes();
    }
  }
  std::vector<std::vector<size_t>> groups;
  bytes = 0;
  for (size_t k = params_.size(); k-- > first_rest;) {
    if (solo(k)) continue;
    const Tensor& p = params_[k];
    bool fits =
        !groups.empty() && bytes < options_.bucket_bytes && same_buffer(groups.back().front(), k);
    if (!fits) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(k);
    bytes += p.nbytes();
  }
  if (!last.empty()) groups.push_back(std::move(last));
  return groups;
}

void FlatBuckets::build(const std::vector<std::vector<size_t>>& groups) {
  bucket_of_.assign(params_.size(), SIZE_MAX);
  index_in_bucket_.assign(params_.size(), 0);
  ready_.assign(params_.size(), false);
  for (auto& members : groups) {
    TESSERA_CHECK(!members.empty(), "FlatBuckets: an empty bucket group");
    Bucket b;
    b.shards = options_.shards;
    const Tensor& first = params_.at(members.front());
    b.dtype = first.dtype();
    b.device = first.device();
    for (size_t k : members) {
      TESSERA_CHECK(k < params_.size() && bucket_of_[k] == SIZE_MAX, "FlatBuckets: parameter ", k,
                    " is missing or listed twice in the bucket groups");
      TESSERA_CHECK(params_[k].dtype() == b.dtype && params_[k].device() == b.device,
                    "FlatBuckets: '", names_[k], "' (", dtype_name(params_[k].dtype()), " on ",
                    params_[k].device().str(), ") cannot share a bucket with '",
                    names_[members.front()], "' (", dtype_name(b.dtype), " on ", b.device.str(),
                    ")");
      bucket_of_[k] = buckets_.size();
      index_in_bucket_[k] = b.params.size();
      b.params.push_back(k);
      b.offsets.push_back(b.numel);
      b.numel += params_[k].numel();
    }
    b.padded_numel = (b.numel + b.shards - 1) / b.shards * b.shards;
    b.pending = members.size();
    buckets_.push_back(std::move(b));
  }
  for (size_t k = 0; k < params_.size(); ++k)
    TESSERA_CHECK(bucket_of_[k] != SIZE_MAX, "FlatBuckets: parameter '", names_[k],
                  "' is in no bucket group");
  // Gradients live in the buckets from the start: one a parameter already has is moved in (a
  // backward adds into it there); a missing one is written there by the first backward (the
  // slot is the parameter's gradient destination), so it is not zero-filled first. Bounded
  // buckets (ZeRO-2/3) take their memory only with their first gradient: allocating them all
  // here would hold the full gradient (and its reduce buffers) once at setup.
  for (size_t k = 0; k < params_.size(); ++k)
    if (options_.max_buckets_in_flight == 0 || params_[k].grad().defined())
      adopt_gradient(k, /*zero_when_missing=*/false);
}

void FlatBuckets::register_comm_hook(CommHook hook, CompletionHook done, bool done_on_device) {
  if (hook) {
    hook_ = std::move(hook);
    done_ = std::move(done);
    done_on_device_ = done_on_device;
    return;
  }
  done_on_device_ = true;
  // The default: every rank ends with the average, in the gradients' own buffer.
  hook_ = [this](Bucket& b) { return group_->all_reduce(b.communication_buffer(), ReduceOp::Avg); };
  done_ = [](Bucket& b) {
    if (b.reduce_buffer.defined()) ops::copy_(b.gradients, b.reduce_buffer);
  };
}

Tensor FlatBuckets::slot_view(const Bucket& b, size_t index_in_bucket) const {
  const Tensor& p = params_[b.params[index_in_bucket]];
  return ops::view(ops::narrow(b.gradients, 0, b.offsets[index_in_bucket], p.numel()), p.shape());
}

void FlatBuckets::make_room_for_a_buffer() {
  const size_t bound = options_.max_buckets_in_flight;
  if (bound == 0 || !sync_) return;
  auto held = [&] {
    return static_cast<size_t>(std::count_if(
        buckets_.begin(), buckets_.end(), [](const Bucket& b) { return b.gradients.defined(); }));
  };
  while (completed_ < launch_order_.size() && held() >= bound)
    complete(buckets_[launch_order_[completed_++]]);
}

void FlatBuckets::complete(Bucket& b, bool run_extension) {
  if (!b.work) return;
  if (done_on_device_)
    b.work->wait_on_device();
  else
    b.work->wait();
  if (run_extension && extension_.bucket_reduced) extension_.bucket_reduced(b);
  if (done_) done_(b);
}

void FlatBuckets::ensure_gradient_buffer(Bucket& b) {
  if (b.gradients.defined()) return;
  make_room_for_a_buffer();
  const bool reduce_elsewhere =
      is_low_precision(b.dtype) && options_.reduce_dtype && *options_.reduce_dtype != b.dtype;
  // The buffer that is communicated may come from the group (an NCCL symmetric window). Such
  // memory is not the caching allocator's: the category counters do not see it (the
  // strategies' own byte counts, gradient_bytes() and reduce_buffer_bytes(), still do).
  auto allocate = [&](bool communicated, DType dtype) {
    if (communicated && options_.communication_buffers_from_group)
      return group_->allocate_communication_buffer(b.padded_numel, dtype, b.device);
    return empty({b.padded_numel}, {.dtype = dtype, .device = b.device});
  };
  MemoryCategoryScope tag(MemoryCategory::Gradients);
  // Not zero-filled: every slot is written before the bucket is launched (by backward, by
  // adopt_gradient, or zeros for a parameter without a gradient); only the padding is zeroed.
  b.gradients = allocate(!reduce_elsewhere, b.dtype);
  if (b.padded_numel > b.numel)
    ops::fill_(ops::narrow(b.gradients, 0, b.numel, b.padded_numel - b.numel), 0.0);
  // Backward writes the parameters' first gradients straight into their slots.
  for (size_t j = 0; j < b.params.size(); ++j)
    autograd::set_grad_destination(params_[b.params[j]], slot_view(b, j));
  MemoryCategoryScope reduce_tag(MemoryCategory::Communication);
  if (reduce_elsewhere) b.reduce_buffer = allocate(true, *options_.reduce_dtype);
}

void FlatBuckets::release_gradients(Bucket& b) {
  TESSERA_CHECK(!options_.communication_buffers_from_group,
                "FlatBuckets: release_gradients cannot be used with "
                "communication_buffers_from_group (the buffers are allocated once, collectively: "
                "releasing them would register them again every step)");
  for (size_t k : b.params) {
    autograd::set_grad_destination(params_[k], Tensor());  // it would keep the buffer alive
    const Tensor grad = params_[k].grad();
    if (grad.defined() && grad.shares_storage(b.gradients)) params_[k].set_grad(Tensor());
  }
  b.gradients = Tensor();
  b.reduce_buffer = Tensor();
}

int64_t FlatBuckets::offset_of(size_t i) const {
  const Bucket& b = buckets_.at(bucket_of_.at(i));
  return b.offsets[index_in_bucket_[i]];
}

Tensor FlatBuckets::gradient_slot(size_t i) {
  Bucket& b = buckets_.at(bucket_of_.at(i));
  ensure_gradient_buffer(b);
  return slot_view(b, index_in_bucket_[i]);
}

int64_t FlatBuckets::gradient_bytes() const {
  int64_t bytes = 0;
  for (const Bucket& b : buckets_)
    if (b.gradients.defined()) bytes += b.gradients.nbytes();
  return bytes;
}

int64_t FlatBuckets::reduce_buffer_bytes() const {
  int64_t bytes = 0;
  for (const Bucket& b : buckets_)
    if (b.reduce_buffer.defined()) bytes += b.reduce_buffer.nbytes();
  return bytes;
}

void FlatBuckets::adopt_gradient(size_t i, bool zero_when_missing) {
  const Tensor& p = params_[i];
  Tensor slot = gradient_slot(i);
  Tensor grad = p.grad();
  if (grad.defined() && grad.raw_data() == slot.raw_data() && grad.strides() == slot.strides()) {
    ++adoption_counts_.in_place;  // written or accumulated in place
    return;
  }
  if (grad.defined()) {
    ops::copy_(slot, grad);
    ++adoption_counts_.copied;
  } else if (zero_when_missing) {
    ops::fill_(slot, 0.0);
    ++adoption_counts_.zero_filled;
  } else {
    return;  // the slot (also its gradient destination) is allocated; .grad stays undefined
  }
  p.set_grad(slot);
}

void FlatBuckets::on_grad_ready(size_t i) {
  if (!sync_) {
    adopt_gradient(i, true);  // accumulate in the bucket (a released buffer comes back)
    return;
  }
  if (!backward_started_) {
    backward_started_ = true;
    if (extension_.backward_started) extension_.backward_started();
    if (ready_[i]) return;  // the extension reported it
  }
  TESSERA_CHECK(!ready_[i], "FlatBuckets: the gradient of '", names_[i],
                "' was reported final twice in one backward (is it used both inside and "
                "outside a checkpoint region, or was backward run twice without "
                "finishing the gradient sync?)");
  ready_[i] = true;
  adopt_gradient(i, true);
  Bucket& b = buckets_[bucket_of_[i]];
  if (--b.pending > 0) return;
  if (b.solo)
    launch(b);
  else
    launch_ready_buckets();
}

void FlatBuckets::launch_ready_buckets() {
  // Strictly in bucket order, so every rank issues the same sequence of collectives.
  const size_t end =
      hold_last_bucket_ && ordered_buckets_ > 0 ? ordered_buckets_ - 1 : ordered_buckets_;
  while (next_bucket_to_launch_ < end && buckets_[next_bucket_to_launch_].pending == 0) {
    launch(buckets_[next_bucket_to_launch_++]);
  }
}

void FlatBuckets::launch(Bucket& b) {
  ensure_gradient_buffer(b);
  if (b.reduce_buffer.defined()) ops::copy_(b.reduce_buffer, b.gradients);
  b.launched = true;
  launch_order_.push_back(static_cast<size_t>(&b - buckets_.data()));
  b.work = hook_(b);
}

void FlatBuckets::finish() {
  if (!sync_) return;
  std::vector<std::string> unused;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!ready_[i]) unused.push_back(names_[i]);
  if (!unused.empty() && !options_.find_unused_parameters) {
    std::ostringstream os;
    for (size_t k = 0; k < unused.size() && k < 8; ++k)
      os << (k ? ", " : "") << "'" << unused[k] << "'";
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
  hold_last_bucket_ = false;
  launch_ready_buckets();
  for (size_t k = ordered_buckets_; k < buckets_.size(); ++k)
    if (!buckets_[k].launched) launch(buckets_[k]);
  std::exception_ptr error;
  // In launch order: the device waits for each collective in the order the NCCL stream runs
  // them, so a bucket reduced early (a solo one) is finished without waiting for later ones.
  // Those make_room_for_a_buffer completed during backward are done already.
  for (; completed_ < launch_order_.size(); ++completed_) {
    try {
      complete(buckets_[launch_order_[completed_]], /*run_extension=*/!error);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  reset_backward_state();
  if (error) std::rethrow_exception(error);
}

void FlatBuckets::reset_backward_state() {
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
    b.launched = false;
  }
  next_bucket_to_launch_ = 0;
  launch_order_.clear();
  completed_ = 0;
  hold_last_bucket_ = false;
  backward_started_ = false;
}

}  // namespace tessera::dist
