// ProcessGroup: the collective operations one group of processes performs
// together, in PyTorch's vocabulary (all_reduce, reduce_scatter, all_gather,
// broadcast, barrier, send/recv), each returning a Work handle to wait on.
//
// Backends: "nccl" (CUDA tensors, dist/cuda/), "mpi" (CPU tensors, CUDA staged
// through host memory; dist/mpi/), "tcp" (CPU tensors over sockets, needs only
// the rendezvous store; what `tessera launch` uses on CPU) and "single" (world
// of one). init_process_group() picks one from the launch environment.
//
// Every collective has a timeout (TESSERA_COLLECTIVE_TIMEOUT seconds, default
// 1800) and ends in a clear error instead of hanging; well before it, the watchdog
// (dist/watchdog.h, 60 s) names the rank a hung job waits for. With
// TESSERA_DEBUG_COLLECTIVES=1 the ranks first compare what they are about to
// call (op, dtype, shape, sequence number) and raise an error naming the ranks
// that differ.
#pragma once
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/dist/env.h"
#include "tessera/dist/store.h"
#include "tessera/dist/watchdog.h"

namespace tessera::dist {

enum class ReduceOp : uint8_t { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);

// A collective in flight. wait() blocks until its result is in the output tensors (for
// CUDA tensors: until the device has finished it) and rethrows its error, if any.
// wait_on_device() only orders the caller's current device stream after the collective,
// so that the host can go on queueing work (DDP's end of backward, a reduced loss): for
// collectives the device runs (NCCL) the host does not block; the group checks such works
// later (ProcessGroup::check_outstanding), so a lost peer still ends in a timeout. For
// host backends (TCP, MPI) it is wait().
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual void wait_on_device() { wait(); }
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// A Work completed by a host thread through a future; `then` runs once, on the waiting
// thread, after success (copying staged results back into the caller's tensors).
class FutureWork : public Work {
 public:
  explicit FutureWork(std::shared_future<void> done, std::function<void()> then = {})
      : done_(std::move(done)), then_(std::move(then)) {}
  void wait() override;
  bool is_completed() override;

 private:
  std::shared_future<void> done_;
  std::function<void()> then_;
  std::once_flag then_once_;
};
// A Work that is already finished.
WorkPtr completed_work();

enum class CollectiveKind : uint8_t {
  AllReduce, ReduceScatter, AllGather, AllGatherUneven, Broadcast, Barrier
};
const char* collective_kind_name(CollectiveKind k);

// What a rank is about to call; ranks compare these in debug mode. Fixed size so that any
// backend can exchange it with one all-gather of bytes.
struct CollectiveSignature {
  static constexpr int kMaxDims = 6;
  uint64_t sequence = 0;
  uint8_t kind = 0;
  uint8_t op = 0;
  uint8_t dtype = 0;
  uint8_t ndim = 0;
  int32_t root = -1;
  int64_t numel = 0;
  int64_t dims[kMaxDims] = {};

  static CollectiveSignature make(CollectiveKind kind, uint64_t sequence, const Tensor& t,
                                  ReduceOp op = ReduceOp::Sum, int root = -1);
  std::string str() const;  // "all_reduce(sum, float32, [7, 3]) #4"
  bool operator==(const CollectiveSignature& o) const;
};

struct ProcessGroupOptions {
  double timeout_s = 1800;          // per collective
  bool debug_collectives = false;
  std::string name = "world";       // used in error messages
  // From TESSERA_COLLECTIVE_TIMEOUT and TESSERA_DEBUG_COLLECTIVES.
  static ProcessGroupOptions from_env();
};

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  ProcessGroup(int rank, int size, ProcessGroupOptions options);
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const ProcessGroupOptions& options() const { return options_; }
  virtual std::string backend_name() const = 0;

  // In place: every rank ends with op over all ranks' `tensor`. Avg needs a float dtype.
  WorkPtr all_reduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  // input holds size() equal chunks (flattened); rank r receives op over chunk r into output.
  WorkPtr reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::Sum);
  // output holds size() chunks (flattened); chunk r receives rank r's input.
  WorkPtr all_gather(const Tensor& output, const Tensor& input);
  // Uneven sizes: outputs[r] receives rank r's input (numel must match on every rank).
  WorkPtr all_gather(const std::vector<Tensor>& outputs, const Tensor& input);
  WorkPtr broadcast(const Tensor& tensor, int root);
  WorkPtr barrier();
  // Point to point; pair each send with a recv of the same size on the peer, in order.
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0);
  WorkPtr recv(const Tensor& tensor, int src, int tag = 0);

  // Waits on the host (under the timeout) for the collectives that were only waited on by
  // the device so far (Work::wait_on_device), rethrowing a failure or a timeout; called
  // before the host reads results it did not wait for. `up_to` (a value of issued_count())
  // limits the wait to the collectives issued until then, so that a host reading an older
  // result does not also wait for work queued since (draining the device's queue). Host
  // backends have none.
  virtual void check_outstanding(uint64_t up_to = UINT64_MAX) { (void)up_to; }
  // The number of collectives issued so far outside graph captures: a mark for
  // check_outstanding.
  virtual uint64_t issued_count() const { return 0; }
  // Whether this group's collectives can be recorded in a device graph (and replayed).
  virtual bool records_in_graphs() const { return false; }
  // Whether the collectives take tensors on `device` (NCCL: its own GPU only).
  bool handles(Device device) const { return supports_device(device); }
  // A contiguous buffer of `numel` elements that will be communicated over and over (DDP's
  // gradient buckets), in memory the backend may prefer for its collectives: with
  // TESSERA_NCCL_SYMMETRIC=1 the NCCL group allocates it with ncclMemAlloc and registers it as
  // a symmetric window; two ranks of one host share it with each other through CUDA IPC.
  // Collective: every rank calls it in the same order with the same sizes, and should drop the
  // buffers in the same order too (freeing may deregister the window). Not while a device graph is
  // recorded. The base returns empty({numel}).
  virtual Tensor allocate_communication_buffer(int64_t numel, DType dtype, Device device);
  // Whether allocate_communication_buffer gives memory of the backend's own (DDP then takes
  // its buckets from it): NCCL symmetric windows, or the buffers of a two-rank copy-engine
  // all-reduce (dist/env.h).
  virtual bool offers_communication_buffers() const { return false; }

  // Collective over this group: every member calls it with the same sorted ranks. Returns
  // the sub-group (ranks renumbered 0..n-1 in the given order) on members, null elsewhere.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);

 protected:
  // Backend hooks. Tensors arrive contiguous, on one device, dtypes checked; outputs of
  // all_gather are separate contiguous tensors (views of one buffer when the caller gave
  // one). The backend runs `sig` through check_signatures() first in debug mode, in the
  // order collectives were issued, and bounds every wait by options().timeout_s.
  virtual bool supports_device(Device d) const = 0;
  virtual WorkPtr do_all_reduce(const CollectiveSignature& sig, const Tensor& t, ReduceOp op) = 0;
  virtual WorkPtr do_reduce_scatter(const CollectiveSignature& sig, const Tensor& output,
                                    const Tensor& input, ReduceOp op) = 0;
  virtual WorkPtr do_all_gather(const CollectiveSignature& sig, const std::vector<Tensor>& outputs,
                                const Tensor& input) = 0;
  virtual WorkPtr do_broadcast(const CollectiveSignature& sig, const Tensor& t, int root) = 0;
  virtual WorkPtr do_barrier(const CollectiveSignature& sig) = 0;
  virtual WorkPtr do_send(const Tensor& t, int dst, int tag) = 0;
  virtual WorkPtr do_recv(const Tensor& t, int src, int tag) = 0;
  // Creates the sub-group; `group_id` is the same on every member and unique in this group.
  virtual std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks,
                                                     uint64_t group_id,
                                                     ProcessGroupOptions options) = 0;

  // Given every rank's signature (index = rank), throws an error naming the ranks that
  // differ from rank 0's call. Used by backends in debug mode.
  void check_signatures(const std::vector<CollectiveSignature>& all) const;
  // The message for a collective that ran past the timeout.
  std::string timeout_message(const std::string& what) const;

 private:
  void check_tensor(const Tensor& t, const char* op) const;
  uint64_t next_sequence() { return sequence_++; }

  int rank_;
  int size_;
  ProcessGroupOptions options_;
  uint64_t sequence_ = 0;
  uint64_t groups_created_ = 0;
};

// ---- the default (world) group ----
struct InitOptions {
  std::string backend = "auto";  // auto | nccl | mpi | tcp | single
  // Where this rank's tensors live, for "auto" (NCCL moves CUDA tensors only); unset =
  // CUDA when a GPU is visible. A job that gives each rank its own GPU through
  // CUDA_VISIBLE_DEVICES (every rank sees one device) names "nccl": "auto" cannot tell it
  // from ranks that share one GPU.
  std::optional<DeviceType> device;
  ProcessGroupOptions group = ProcessGroupOptions::from_env();
  // The hang watchdog of a job with a rendezvous store (dist/watchdog.h).
  WatchdogOptions watchdog = WatchdogOptions::from_env();
  // How long ranks wait for each other to join (dist/env.h).
  double rendezvous_timeout_s = rendezvous_timeout_from_env();
};
// Reads the launch environment (dist/env.h), meets the other ranks (join_rendezvous, with
// progress and an error naming the ranks that never came) and creates the world group with
// the backend named, or for "auto" the one resolve_auto_backend picks; then starts the
// watchdog.
void init_process_group(const InitOptions& options = {});
// What "auto" means: single for a world of one; nccl when the tensors are on CUDA, each
// local rank has a GPU of its own (local_world_size <= cuda_devices: NCCL refuses two
// ranks on one GPU) and NCCL is built; else mpi when started by mpirun and MPI is built;
// else tcp. `built` says whether a backend is available (asked only when it matters).
std::string resolve_auto_backend(const DistEnv& env, DeviceType device, int cuda_devices,
                                 const std::function<bool(const std::string&)>& built);
bool is_initialized();
ProcessGroup& world();
std::shared_ptr<ProcessGroup> world_ptr();
// The rendezvous store of this job (null under MPI bootstrap without MASTER_ADDR).
std::shared_ptr<Store> world_store();
// Meets at a barrier so no rank tears down the store while others still use it, then
// releases the world group and the store. A later init_process_group starts afresh.
void destroy_process_group();

// ---- backend registry (backends register themselves at start-up) ----
struct BackendContext {
  DistEnv env;
  std::shared_ptr<Store> store;  // may be null for backends that bootstrap themselves (mpi)
  ProcessGroupOptions options;
};
using BackendFactory = std::function<std::shared_ptr<ProcessGroup>(const BackendContext&)>;
void register_backend(const std::string& name, BackendFactory factory);
bool has_backend(const std::string& name);
// When a job has no MASTER_ADDR (plain mpirun), a registered bootstrapper (MPI) tells
// every rank where rank 0 serves the store: it returns {address, port}.
using Bootstrapper = std::function<std::pair<std::string, int>(const DistEnv&)>;
void register_bootstrapper(Bootstrapper b);

}  // namespace tessera::dist
