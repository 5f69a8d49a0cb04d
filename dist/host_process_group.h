// The part shared by the backends that move bytes with the host CPU (tcp and
// mpi): collectives run in issue order on one worker thread per group (so
// every call is asynchronous and returns a Work), debug-mode signature checks
// run in that same order, CUDA tensors are staged through pinned host memory, avg is
// a sum divided on the host, and errors/timeouts get the collective named.
// A backend implements only blocking byte/element primitives on host buffers.
#pragma once
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "tessera/dist/process_group.h"
#include "tessera/dist/socket.h"

namespace tessera::dist {

// acc[i] = op(acc[i], in[i]) for n elements of dtype (f16/bf16 computed in float; Avg is
// not an element-wise op here: callers sum and then divide).
void reduce_into(DType dtype, ReduceOp op, void* acc, const void* in, int64_t n);
// data[i] *= factor (float dtypes).
void scale_in_place(DType dtype, void* data, int64_t n, double factor);

class HostProcessGroup : public ProcessGroup {
 public:
  HostProcessGroup(int rank, int size, ProcessGroupOptions options);
  ~HostProcessGroup() override;

 protected:
  // ---- primitives, called on the worker thread with host pointers ----
  // In place over `count` elements; op is Sum, Max or Min.
  virtual void host_all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, Deadline d) = 0;
  // `in` holds size() chunks of `count` elements; chunk rank() of the reduction goes to `out`.
  virtual void host_reduce_scatter(const void* in, void* out, int64_t count, DType dtype,
                                   ReduceOp op, Deadline d) = 0;
  // outs[r] (out_bytes[r] bytes) receives rank r's `in` (out_bytes[rank()] bytes).
  virtual void host_all_gather(const void* in, const std::vector<void*>& outs,
                               const std::vector<size_t>& out_bytes, Deadline d) = 0;
  virtual void host_broadcast(void* data, size_t bytes, int root, Deadline d) = 0;
  virtual void host_barrier(Deadline d) = 0;
  virtual void host_send(const void* data, size_t bytes, int dst, int tag, Deadline d) = 0;
  virtual void host_recv(void* data, size_t bytes, int src, int tag, Deadline d) = 0;

  // Runs fn on the worker thread after everything queued before it and waits for it
  // (sub-group creation must not overtake pending collectives).
  void run_on_worker(const std::string& what, const std::function<void(Deadline)>& fn);
  // Backends call this first in their destructor: the worker must stop before the
  // backend's members (sockets, communicators) go away.
  void stop_worker();

  bool supports_device(Device d) const override { return true; }
  WorkPtr do_all_reduce(const CollectiveSignature& sig, const Tensor& t, ReduceOp op) override;
  WorkPtr do_reduce_scatter(const CollectiveSignature& sig, const Tensor& output,
                            const Tensor& input, ReduceOp op) override;
  WorkPtr do_all_gather(const CollectiveSignature& sig, const std::vector<Tensor>& outputs,
                        const Tensor& input) override;
  WorkPtr do_broadcast(const CollectiveSignature& sig, const Tensor& t, int root) override;
  WorkPtr do_barrier(const CollectiveSignature& sig) override;
  WorkPtr do_send(const Tensor& t, int dst, int tag) override;
  WorkPtr do_recv(const Tensor& t, int src, int tag) override;

 private:
  struct Job {
    std::string what;                 // for error messages
    bool check_signature = false;
    bool collective = false;          // has a signature: the watchdog tracks it
    CollectiveSignature signature;
    std::function<void(Deadline)> body;
    std::promise<void> done;
  };
  WorkPtr enqueue(const std::string& what, const CollectiveSignature* sig,
                  std::function<void(Deadline)> body);
  void worker_loop();
  void run_job(Job& job);

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Job>> queue_;
  bool stopping_ = false;
  // After a failed collective the byte streams between ranks may be out of step, so later
  // calls fail at once with the first error instead of reading garbage.
  std::string broken_reason_;
  std::thread worker_;
};

}  // namespace tessera::dist
