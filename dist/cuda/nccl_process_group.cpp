// The "nccl" backend: collectives on CUDA tensors with NCCL, on a stream of
// its own. Each call first makes that stream wait for the work already queued
// on Tessera's current compute stream (cuda::current_stream: an event, so the
// host does not block), and each Work records an event after the NCCL call:
// wait() waits for that event up to the timeout (spinning briefly first, then
// sleeping between checks; past the timeout it aborts the communicator with a clear
// message) and makes the current stream wait on it too. wait_on_device() only makes the
// current stream wait: the group keeps such works and checks them without blocking when it
// issues the next collective (a work past its deadline is waited for, so it times out as
// above) and with blocking in check_outstanding(). Tensors stay referenced by their Work
// until the current stream is ordered after it; from then on the caching allocator's
// stream order keeps their memory from being reused while NCCL reads it.
//
// While a device graph is recorded (core/graph_capture.h) the collectives are recorded
// too: the NCCL stream joins the capture through the event on the capture stream, and every
// wait is a device wait (an event of a capture cannot be queried). Replays run them again;
// their completion is not checked on the host.
//
// Rendezvous: rank 0 creates the NCCL unique id and publishes it in the store;
// sub-groups get their own id the same way. Debug mode compares signatures
// through the store before each collective.
//
// Opt-in (dist/env.h), for the world group and its sub-groups alike:
// TESSERA_NCCL_CTA_POLICY creates the communicators with ncclCommInitRankConfig and that CTA
// policy (fewer CTAs for NCCL's kernels leaves more SMs to the backward's GEMMs they overlap);
// TESSERA_NCCL_SYMMETRIC=1 makes allocate_communication_buffer return ncclMemAlloc memory
// registered as a symmetric window, which lets NCCL pick its symmetric kernels for DDP's
// buckets. The communicator is shared (NcclComm) by the group, its works and those windows,
// so that it is destroyed only after the last window was deregistered.
//
// A group of two ranks on one host (unless TESSERA_PEER_ALLREDUCE=0 or TESSERA_NCCL_SYMMETRIC=1)
// gives DDP buffers that both ranks map (dist/cuda/peer_all_reduce.h) and all-reduces them
// through the copy engines, leaving the SMs to the backward's kernels; every other collective
// (and an all-reduce of any other tensor) is NCCL's.
#include "tessera/dist/process_group.h"

#if TESSERA_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/graph_capture.h"
#include "tessera/dist/cuda/peer_all_reduce.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

// Communicator configs with a CTA policy, ncclMemAlloc'd symmetric windows.
#define TESSERA_NCCL_HAS_CTA_POLICY_AND_WINDOWS (NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0))

namespace tessera::dist {
namespace {

void check_cuda(cudaError_t rc, const char* what) {
  TESSERA_CHECK(rc == cudaSuccess, "dist(nccl): ", what, " failed: ", cudaGetErrorString(rc));
}
void check_nccl(ncclResult_t rc, const char* what) {
  TESSERA_CHECK(rc == ncclSuccess, "dist(nccl): ", what, " failed: ", ncclGetErrorString(rc));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
    case DType::boolean:
      return ncclUint8;
  }
  TESSERA_FAIL("dist(nccl): unsupported dtype ", dtype_name(t));
}

// The opt-in settings of dist/env.h, checked against the NCCL Tessera was built with and the
// one it runs with; read once for the world group and handed to its sub-groups.
struct NcclSettings {
  std::optional<NcclCtaPolicy> cta_policy;
  bool symmetric = false;
  bool peer_all_reduce = false;  // two ranks of one host: see PeerAllReduce

  static NcclSettings from_env() {
    NcclSettings s{nccl_cta_policy_from_env(), nccl_symmetric_from_env(), false};
    s.peer_all_reduce = !s.symmetric && peer_all_reduce_from_env();
    if (!s.cta_policy && !s.symmetric) return s;
    const std::string what = s.cta_policy ? "TESSERA_NCCL_CTA_POLICY" : "TESSERA_NCCL_SYMMETRIC";
#if !TESSERA_NCCL_HAS_CTA_POLICY_AND_WINDOWS
    TESSERA_FAIL("dist(nccl): ", what, " needs NCCL 2.27 or newer; Tessera was built with NCCL ",
                 NCCL_MAJOR, ".", NCCL_MINOR, ".", NCCL_PATCH);
#endif
#ifndef NCCL_CTA_POLICY_ZERO
    TESSERA_CHECK(s.cta_policy != NcclCtaPolicy::Zero,
                  "dist(nccl): TESSERA_NCCL_CTA_POLICY=zero needs NCCL 2.28 or newer; Tessera was "
                  "built with NCCL ",
                  NCCL_MAJOR, ".", NCCL_MINOR, ".", NCCL_PATCH);
#endif
    // The library loaded may be older than the headers.
    int version = 0;
    check_nccl(ncclGetVersion(&version), "ncclGetVersion");
    TESSERA_CHECK(version >= NCCL_VERSION(2, 27, 0), "dist(nccl): ", what,
                  " needs NCCL 2.27 or newer; the NCCL library loaded is version code ", version);
    return s;
  }
};

#if TESSERA_NCCL_HAS_CTA_POLICY_AND_WINDOWS
int nccl_cta_policy(NcclCtaPolicy policy) {
  switch (policy) {
    case NcclCtaPolicy::Default:
      return NCCL_CTA_POLICY_DEFAULT;
    case NcclCtaPolicy::Efficiency:
      return NCCL_CTA_POLICY_EFFICIENCY;
    case NcclCtaPolicy::Zero:
#ifdef NCCL_CTA_POLICY_ZERO
      return NCCL_CTA_POLICY_ZERO;
#else
      break;  // refused by NcclSettings::from_env
#endif
  }
  TESSERA_FAIL("dist(nccl): CTA policy ", nccl_cta_policy_name(policy),
               " is not supported by this NCCL");
}
#endif

// The communicator, shared by its group, the group's works and the windows registered with it:
// a window must be deregistered while the communicator lives, and a window's buffer can
// outlive the group (the parameters' .grad are views into DDP's buckets).
class NcclComm {
 public:
  explicit NcclComm(ncclComm_t comm) : comm_(comm) {}
  ~NcclComm() {
    if (!aborted_) ncclCommDestroy(comm_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  // After a lost peer the communicator cannot be trusted; NCCL frees it, so nothing may use
  // it afterwards (nor destroy it).
  void abort() {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }
  bool aborted() const { return aborted_; }

 private:
  ncclComm_t comm_;
  std::atomic<bool> aborted_{false};
};

#if TESSERA_NCCL_HAS_CTA_POLICY_AND_WINDOWS
// The deleter of a buffer from allocate_communication_buffer. It must not throw: a failure is
// reported on stderr (and the memory left registered rather than freed under NCCL's feet).
void release_window(NcclComm& comm, ncclWindow_t window, void* data, int device) noexcept {
  try {
    int previous = 0;
    // At process exit the runtime may be gone already; the driver reclaims everything then.
    if (cudaGetDevice(&previous) == cudaErrorCudartUnloading) return;
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    // Queued work (a collective on the NCCL stream, a kernel on the compute stream) may still
    // use the buffer: it is not stream-ordered as the caching allocator's memory is.
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (!comm.aborted())  // an aborted communicator took its windows with it
      check_nccl(ncclCommWindowDeregister(comm.get(), window), "ncclCommWindowDeregister");
    check_nccl(ncclMemFree(data), "ncclMemFree");
    check_cuda(cudaSetDevice(previous), "cudaSetDevice");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
  }
}
#endif

ncclRedOp_t nccl_op(ReduceOp op, DType t) {
  // A sum of booleans is their "or", which for 0/1 bytes is the max.
  if (t == DType::boolean && op == ReduceOp::Sum) return ncclMax;
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  return ncclSum;
}

class NcclWork : public Work {
 public:
  NcclWork(cudaEvent_t done, int device, std::shared_ptr<NcclComm> comm,
           std::vector<Tensor> keep_alive, std::string what, std::string timeout_message,
           double timeout_s)
      : done_(done),
        device_(device),
        comm_(std::move(comm)),
        keep_alive_(std::move(keep_alive)),
        what_(std::move(what)),
        timeout_message_(std::move(timeout_message)),
        deadline_(Deadline::after(timeout_s)) {}
  ~NcclWork() override { cudaEventDestroy(done_); }

  void wait() override {
    if (graph_capture_underway()) return wait_on_device();
    // Small collectives finish within microseconds: spin on the event for the first
    // 200 us (yielding the core), then back off to 50 us sleeps while the deadline runs.
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (!is_completed()) {
      if (std::chrono::steady_clock::now() < spin_until) {
        std::this_thread::yield();
        continue;
      }
      TESSERA_CHECK(!comm_->aborted(), "dist(nccl): ", what_,
                    " cannot complete: the communicator was aborted after a timeout");
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_->get(), &async_error);
      if (async_error != ncclSuccess && async_error != ncclInProgress)
        TESSERA_FAIL("dist(nccl): ", what_, " failed: ", ncclGetErrorString(async_error));
      if (deadline_.expired()) {
        comm_->abort();  // the communicator cannot be trusted after a lost peer
        throw TimeoutError(timeout_message_);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    wait_on_device();
  }
  void wait_on_device() override {
    check_cuda(cudaStreamWaitEvent(cuda::current_stream(device_), done_, 0), "cudaStreamWaitEvent");
    keep_alive_.clear();
  }
  bool overdue() const { return deadline_.expired(); }
  uint64_t sequence() const { return sequence_; }
  void set_sequence(uint64_t n) { sequence_ = n; }
  bool is_completed() override {
    cudaError_t rc = cudaEventQuery(done_);
    if (rc == cudaErrorNotReady) return false;
    check_cuda(rc, "cudaEventQuery");
    return true;
  }

 private:
  cudaEvent_t done_;
  int device_;
  std::shared_ptr<NcclComm> comm_;
  std::vector<Tensor> keep_alive_;
  std::string what_, timeout_message_;
  Deadline deadline_;
  uint64_t sequence_ = 0;  // its place among the group's works issued outside captures
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(int rank, int size, ProcessGroupOptions options, std::shared_ptr<Store> store,
                   std::string prefix, int device, NcclSettings settings)
      : ProcessGroup(rank, size, std::move(options)),
        store_(std::move(store)),
        prefix_(std::move(prefix)),
        device_(device),
        settings_(settings) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    const std::string key = prefix_ + "/nccl_id";
    if (rank == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store_->set(key, std::string(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      std::string text = store_->get(key);
      TESSERA_CHECK(text.size() == sizeof id, "dist(nccl): corrupt unique id in the store");
      std::memcpy(&id, text.data(), sizeof id);
    }
    ncclComm_t comm = nullptr;
    if (settings_.cta_policy) {
#if TESSERA_NCCL_HAS_CTA_POLICY_AND_WINDOWS
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.CTAPolicy = nccl_cta_policy(*settings_.cta_policy);
      check_nccl(ncclCommInitRankConfig(&comm, size, id, rank, &config), "ncclCommInitRankConfig");
#endif
    } else {
      check_nccl(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
    }
    comm_ = std::make_shared<NcclComm>(comm);
    // The highest priority (as PyTorch's NCCL streams have): while backward kernels fill the
    // GPU, the collectives' blocks are scheduled first, so they overlap instead of queueing
    // behind the compute and landing, exposed, after the last backward kernel.
    int least_priority = 0, greatest_priority = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority),
               "cudaDeviceGetStreamPriorityRange");
    check_cuda(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest_priority),
               "cudaStreamCreateWithPriority");
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    if (settings_.peer_all_reduce && size == 2) {
      std::string why_not;
      peer_ = PeerAllReduce::connect(*store_, prefix_, rank, device_, &why_not);
      if (peer_)
        for (cudaStream_t& s : peer_streams_)
          check_cuda(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest_priority),
                     "cudaStreamCreateWithPriority");
      if (rank == 0)
        std::fprintf(stderr, "dist: NCCL group %s: %s%s\n", prefix_.c_str(),
                     peer_ ? "2 ranks of one host, DDP's buckets all-reduced through the copy "
                             "engines (TESSERA_PEER_ALLREDUCE=0: NCCL)"
                           : "NCCL all-reduces DDP's buckets; no copy-engine all-reduce: ",
                     peer_ ? "" : why_not.c_str());
    }
  }
  ~NcclProcessGroup() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
    for (cudaStream_t s : peer_streams_)
      if (s) {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
      }
    // comm_ is destroyed with the last window (and work) that shares it.
  }
  std::string backend_name() const override { return "nccl"; }
  bool records_in_graphs() const override { return true; }

  // With TESSERA_NCCL_SYMMETRIC=1, on this group's GPU: ncclMemAlloc memory registered as a
  // symmetric window (collective). Not the caching allocator's memory: memory reports and the
  // category counters do not see it.
  Tensor allocate_communication_buffer(int64_t numel, DType dtype, Device device) override {
    if (peer_ && supports_device(device)) return peer_->allocate(numel, dtype);
    if (!settings_.symmetric || !supports_device(device))
      return ProcessGroup::allocate_communication_buffer(numel, dtype, device);
    TESSERA_CHECK(!graph_capture_underway(),
                  "dist(nccl): allocate_communication_buffer cannot be called while a device graph "
                  "is recorded (registering an NCCL window is a collective outside any stream)");
    TESSERA_CHECK(numel >= 0, "dist(nccl): allocate_communication_buffer of ", numel, " elements");
#if TESSERA_NCCL_HAS_CTA_POLICY_AND_WINDOWS
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const size_t alignment = NCCL_WIN_REQUIRED_ALIGNMENT;
    const size_t bytes = static_cast<size_t>(numel) * dtype_size(dtype);
    const size_t rounded = std::max<size_t>(1, (bytes + alignment - 1) / alignment) * alignment;
    void* data = nullptr;
    check_nccl(ncclMemAlloc(&data, rounded), "ncclMemAlloc");
    ncclWindow_t window = nullptr;
    ncclResult_t rc =
        ncclCommWindowRegister(comm_->get(), data, rounded, &window, NCCL_WIN_COLL_SYMMETRIC);
    if (rc != ncclSuccess) ncclMemFree(data);
    check_nccl(rc, "ncclCommWindowRegister");
    std::shared_ptr<void> owner(data, [comm = comm_, window, device = device_](void* p) {
      release_window(*comm, window, p, device);
    });
    return from_blob(data, {numel}, dtype, device, std::move(owner));
#else
    TESSERA_FAIL("dist(nccl): TESSERA_NCCL_SYMMETRIC needs NCCL 2.27 or newer");
#endif
  }

  bool offers_communication_buffers() const override { return settings_.symmetric || peer_; }

  void check_outstanding(uint64_t up_to) override {
    std::vector<std::shared_ptr<NcclWork>> due;
    {
      std::lock_guard lock(outstanding_mutex_);
      while (!outstanding_.empty() && outstanding_.front()->sequence() <= up_to) {
        due.push_back(std::move(outstanding_.front()));
        outstanding_.pop_front();
      }
    }
    for (auto& w : due) w->wait();
  }
  uint64_t issued_count() const override {
    std::lock_guard lock(outstanding_mutex_);
    return issued_;
  }

 protected:
  bool supports_device(Device d) const override { return d.is_cuda() && d.index == device_; }

  WorkPtr do_all_reduce(const CollectiveSignature& sig, const Tensor& t, ReduceOp op) override {
    // The copy-engine exchanges take turns on two streams: a bucket's copies run while the
    // previous one waits for the peer's flags.
    if (peer_ && peer_->serves(t, op)) {
      cudaStream_t s = peer_streams_[peer_turn_++ % 2];
      return issue(
          &sig, sig.str(), {t}, [&] { peer_->enqueue(t, op, s); }, s);
    }
    return issue(&sig, sig.str(), {t}, [&] {
      check_nccl(ncclAllReduce(t.raw_data(), t.raw_data(), t.numel(), nccl_type(t.dtype()),
                               nccl_op(op, t.dtype()), comm_->get(), stream_),
                 "ncclAllReduce");
    });
  }

  WorkPtr do_reduce_scatter(const CollectiveSignature& sig, const Tensor& output,
                            const Tensor& input, ReduceOp op) override {
    return issue(&sig, sig.str(), {output, input}, [&] {
      check_nccl(ncclReduceScatter(input.raw_data(), output.raw_data(), output.numel(),
                                   nccl_type(output.dtype()), nccl_op(op, output.dtype()),
                                   comm_->get(), stream_),
                 "ncclReduceScatter");
    });
  }

  WorkPtr do_all_gather(const CollectiveSignature& sig, const std::vector<Tensor>& outputs,
                        const Tensor& input) override {
    std::vector<Tensor> keep = outputs;
    keep.push_back(input);
    // Into a buffer both ranks of one host map (DDP's sparse embedding rows): the copy engines.
    if (peer_ && peer_->serves_all_gather(outputs, input)) {
      cudaStream_t s = peer_streams_[peer_turn_++ % 2];
      return issue(
          &sig, sig.str(), keep, [&] { peer_->enqueue_all_gather(outputs, input, s); }, s);
    }
    // Equal chunks laid out one after another: one ncclAllGather; otherwise each rank
    // broadcasts its part (grouped so NCCL runs them together).
    bool adjacent = true;
    const char* base = static_cast<const char*>(outputs[0].raw_data());
    for (int r = 0; r < size(); ++r)
      adjacent &= outputs[r].nbytes() == input.nbytes() &&
                  static_cast<const char*>(outputs[r].raw_data()) == base + r * input.nbytes();
    return issue(&sig, sig.str(), keep, [&] {
      if (adjacent) {
        check_nccl(ncclAllGather(input.raw_data(), outputs[0].raw_data(), input.nbytes(), ncclUint8,
                                 comm_->get(), stream_),
                   "ncclAllGather");
        return;
      }
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < size(); ++r) {
        const void* send = r == rank() ? input.raw_data() : outputs[r].raw_data();
        check_nccl(ncclBroadcast(send, outputs[r].raw_data(), outputs[r].nbytes(), ncclUint8, r,
                                 comm_->get(), stream_),
                   "ncclBroadcast");
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  WorkPtr do_broadcast(const CollectiveSignature& sig, const Tensor& t, int root) override {
    return issue(&sig, sig.str(), {t}, [&] {
      check_nccl(ncclBroadcast(t.raw_data(), t.raw_data(), t.nbytes(), ncclUint8, root,
                               comm_->get(), stream_),
                 "ncclBroadcast");
    });
  }

  WorkPtr do_barrier(const CollectiveSignature& sig) override {
    Tensor token = zeros({1}, {.dtype = DType::f32, .device = Device::cuda(device_)});
    return issue(&sig, sig.str(), {token}, [&] {
      check_nccl(ncclAllReduce(token.raw_data(), token.raw_data(), 1, ncclFloat32, ncclSum,
                               comm_->get(), stream_),
                 "ncclAllReduce(barrier)");
    });
  }

  WorkPtr do_send(const Tensor& t, int dst, int tag) override {
    return issue(nullptr, detail::concat("send to rank ", dst), {t}, [&] {
      check_nccl(ncclSend(t.raw_data(), t.nbytes(), ncclUint8, dst, comm_->get(), stream_),
                 "ncclSend");
    });
  }

  WorkPtr do_recv(const Tensor& t, int src, int tag) override {
    return issue(nullptr, detail::concat("recv from rank ", src), {t}, [&] {
      check_nccl(ncclRecv(t.raw_data(), t.nbytes(), ncclUint8, src, comm_->get(), stream_),
                 "ncclRecv");
    });
  }

  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks, uint64_t group_id,
                                             ProcessGroupOptions options) override {
    auto it = std::find(ranks.begin(), ranks.end(), rank());
    if (it == ranks.end()) return nullptr;
    return std::make_shared<NcclProcessGroup>(
        static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()), std::move(options),
        store_, prefix_ + "/sub" + std::to_string(group_id), device_, settings_);
  }

 private:
  // Orders the NCCL stream after the current compute stream, checks signatures in debug mode,
  // enqueues the NCCL call and returns a Work on an event after it.
  WorkPtr issue(const CollectiveSignature* sig, const std::string& what,
                std::vector<Tensor> keep_alive, const std::function<void()>& enqueue,
                cudaStream_t stream = nullptr) {
    if (!stream) stream = stream_;
    TESSERA_CHECK(!comm_->aborted(), "dist(nccl): cannot run ", what, ": the communicator of ",
                  options().name, " was aborted after a collective timed out");
    if (sig && options().debug_collectives && size() > 1) check_through_store(*sig);
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    if (!graph_capture_underway()) check_finished_outstanding();
    check_cuda(cudaEventRecord(ready_, cuda::current_stream(device_)), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream, ready_, 0), "cudaStreamWaitEvent");
    enqueue();
    cudaEvent_t done;
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(done, stream), "cudaEventRecord");
    auto work = std::make_shared<NcclWork>(done, device_, comm_, std::move(keep_alive), what,
                                           timeout_message(what), options().timeout_s);
    if (!graph_capture_underway()) {
      std::lock_guard lock(outstanding_mutex_);
      work->set_sequence(++issued_);
      outstanding_.push_back(work);
    }
    return work;
  }

  // Drops the finished works from the front of the outstanding ones; one past its deadline
  // is waited for on the host, which ends in its timeout error (or its NCCL error).
  void check_finished_outstanding() {
    std::shared_ptr<NcclWork> late;
    {
      std::lock_guard lock(outstanding_mutex_);
      while (!outstanding_.empty() && outstanding_.front()->is_completed())
        outstanding_.pop_front();
      if (!outstanding_.empty() && outstanding_.front()->overdue()) late = outstanding_.front();
    }
    if (late) late->wait();
  }

  void check_through_store(const CollectiveSignature& sig) {
    const std::string base = prefix_ + "/sig/" + std::to_string(sig.sequence) + "/";
    store_->set(base + std::to_string(rank()),
                std::string(reinterpret_cast<const char*>(&sig), sizeof sig));
    std::vector<CollectiveSignature> all(size());
    for (int r = 0; r < size(); ++r) {
      std::string text;
      try {
        text = store_->get(base + std::to_string(r));
      } catch (const TimeoutError&) {
        throw TimeoutError(
            timeout_message(sig.str() + " (rank " + std::to_string(r) + " never reached it)"));
      }
      TESSERA_CHECK(text.size() == sizeof sig, "dist(nccl): corrupt signature in the store");
      std::memcpy(&all[r], text.data(), sizeof sig);
    }
    check_signatures(all);
  }

  std::shared_ptr<Store> store_;
  std::string prefix_;
  int device_;
  NcclSettings settings_;
  std::shared_ptr<NcclComm> comm_;
  std::unique_ptr<PeerAllReduce> peer_;  // two ranks of one host (see the top)
  cudaStream_t peer_streams_[2] = {nullptr, nullptr};
  uint64_t peer_turn_ = 0;
  cudaStream_t stream_ = nullptr;
  // Works issued outside a graph capture and not yet seen complete (oldest first), and how
  // many were issued (their sequence numbers count from 1).
  mutable std::mutex outstanding_mutex_;
  std::deque<std::shared_ptr<NcclWork>> outstanding_;
  uint64_t issued_ = 0;
  cudaEvent_t ready_ = nullptr;
};

const bool registered = [] {
  register_backend("nccl", [](const BackendContext& ctx) -> std::shared_ptr<ProcessGroup> {
    TESSERA_CHECK(ctx.store, "dist: the nccl backend needs the rendezvous store");
    int devices = 0;
    check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    TESSERA_CHECK(devices > 0, "dist: the nccl backend needs a CUDA device; none is visible");
    return std::make_shared<NcclProcessGroup>(ctx.env.rank, ctx.env.world_size, ctx.options,
                                              ctx.store, "nccl/world", ctx.env.local_rank % devices,
                                              NcclSettings::from_env());
  });
  return true;
}();

}  // namespace
}  // namespace tessera::dist

#endif  // TESSERA_WITH_NCCL
