#include "tessera/dist/process_group.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>

#include "tessera/core/backend_library.h"
#include "tessera/core/settings.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

const char* collective_kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce:
      return "all_reduce";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::AllGatherUneven:
      return "all_gather(uneven)";
    case CollectiveKind::Broadcast:
      return "broadcast";
    case CollectiveKind::Barrier:
      return "barrier";
  }
  return "?";
}

// ---- Work ----
void FutureWork::wait() {
  done_.get();  // rethrows the collective's error
  if (then_) std::call_once(then_once_, then_);
}

bool FutureWork::is_completed() {
  return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

WorkPtr completed_work() {
  std::promise<void> p;
  p.set_value();
  return std::make_shared<FutureWork>(p.get_future().share());
}

namespace {
// Runs `then` after the inner work completes (copy-back of staged non-contiguous tensors).
class ThenWork : public Work {
 public:
  ThenWork(WorkPtr inner, std::function<void()> then)
      : inner_(std::move(inner)), then_(std::move(then)) {}
  void wait() override {
    inner_->wait();
    std::call_once(once_, then_);
  }
  void wait_on_device() override {  // the copy-back is device work, ordered after the inner
    inner_->wait_on_device();
    std::call_once(once_, then_);
  }
  bool is_completed() override { return inner_->is_completed(); }

 private:
  WorkPtr inner_;
  std::function<void()> then_;
  std::once_flag once_;
};
}  // namespace

// ---- signatures ----
CollectiveSignature CollectiveSignature::make(CollectiveKind kind, uint64_t sequence,
                                              const Tensor& t, ReduceOp op, int root) {
  CollectiveSignature s;
  s.sequence = sequence;
  s.kind = static_cast<uint8_t>(kind);
  s.op = static_cast<uint8_t>(op);
  s.root = root;
  if (t.defined()) {
    s.dtype = static_cast<uint8_t>(t.dtype());
    s.numel = t.numel();
    s.ndim = static_cast<uint8_t>(std::min<int64_t>(t.dim(), kMaxDims));
    for (int i = 0; i < s.ndim; ++i) s.dims[i] = t.size(i);
  }
  return s;
}

std::string CollectiveSignature::str() const {
  std::ostringstream os;
  auto k = static_cast<CollectiveKind>(kind);
  os << collective_kind_name(k) << "(";
  if (k == CollectiveKind::AllReduce || k == CollectiveKind::ReduceScatter)
    os << reduce_op_name(static_cast<ReduceOp>(op)) << ", ";
  if (k == CollectiveKind::Broadcast) os << "root " << root << ", ";
  if (k != CollectiveKind::Barrier) {
    os << dtype_name(static_cast<DType>(dtype)) << ", [";
    for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << dims[i];
    os << "]" << (ndim == kMaxDims ? "..." : "");
  }
  os << ") #" << sequence;
  return os.str();
}

bool CollectiveSignature::operator==(const CollectiveSignature& o) const {
  if (sequence != o.sequence || kind != o.kind || op != o.op || root != o.root) return false;
  if (static_cast<CollectiveKind>(kind) == CollectiveKind::Barrier) return true;
  if (dtype != o.dtype) return false;
  // Uneven all-gather: each rank contributes its own size, so shapes may differ.
  if (static_cast<CollectiveKind>(kind) == CollectiveKind::AllGatherUneven) return true;
  return numel == o.numel && ndim == o.ndim && std::equal(dims, dims + ndim, o.dims);
}

ProcessGroupOptions ProcessGroupOptions::from_env() {
  ProcessGroupOptions o;
  o.timeout_s = setting_number(Setting::CollectiveTimeout);
  o.debug_collectives = setting_enabled(Setting::DebugCollectives);
  return o;
}

// ---- ProcessGroup ----
ProcessGroup::ProcessGroup(int rank, int size, ProcessGroupOptions options)
    : rank_(rank), size_(size), options_(std::move(options)) {
  TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, "ProcessGroup: rank ", rank,
                " is outside a group of ", size);
  TESSERA_CHECK(options_.timeout_s > 0, "ProcessGroup: timeout must be positive, got ",
                options_.timeout_s, " s");
}

Tensor ProcessGroup::allocate_communication_buffer(int64_t numel, DType dtype, Device device) {
  return empty({numel}, {.dtype = dtype, .device = device});
}

void ProcessGroup::check_tensor(const Tensor& t, const char* op) const {
  TESSERA_CHECK(t.defined(), "dist::", op, ": undefined tensor");
  TESSERA_CHECK(supports_device(t.device()), "dist::", op, ": the ", backend_name(),
                " backend does not handle tensors on ", t.device().str(), " (shape ",
                shape_str(t.shape()), ", ", dtype_name(t.dtype()), ")");
}

void ProcessGroup::check_signatures(const std::vector<CollectiveSignature>& all) const {
  // Group ranks by what they called; all equal is the only good outcome.
  std::vector<std::pair<CollectiveSignature, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == all[r]; });
    if (it == groups.end())
      groups.push_back({all[r], {r}});
    else
      it->second.push_back(r);
  }
  if (groups.size() <= 1) return;
  std::ostringstream os;
  os << "dist: collective mismatch in group '" << options_.name << "' (backend " << backend_name()
     << ", seen by rank " << rank_ << "): ";
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& ranks = groups[g].second;
    os << (g ? "; " : "") << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
    os << " called " << groups[g].first.str();
  }
  TESSERA_FAIL(os.str());
}

std::string ProcessGroup::timeout_message(const std::string& what) const {
  return detail::concat("dist: ", what, " in group '", options_.name, "' (backend ", backend_name(),
                        ") on rank ", rank_, " of ", size_, " timed out after ", options_.timeout_s,
                        " s: another rank may have failed or called a different collective "
                        "(TESSERA_DEBUG_COLLECTIVES=1 checks; TESSERA_COLLECTIVE_TIMEOUT sets "
                        "the limit)");
}

namespace {
// Runs `run` on a contiguous version of `t`; a non-contiguous `t` gets the result copied
// back when the work is waited on.
WorkPtr with_contiguous(const Tensor& t, const std::function<WorkPtr(const Tensor&)>& run) {
  if (t.is_contiguous()) return run(t);
  Tensor staged = ops::contiguous(t);
  return std::make_shared<ThenWork>(run(staged), [t, staged] { ops::copy_(t, staged); });
}
}  // namespace

WorkPtr ProcessGroup::all_reduce(const Tensor& tensor, ReduceOp op) {
  check_tensor(tensor, "all_reduce");
  TESSERA_CHECK(op != ReduceOp::Avg || is_floating(tensor.dtype()),
                "dist::all_reduce: avg needs a floating dtype, got ", dtype_name(tensor.dtype()));
  auto sig = CollectiveSignature::make(CollectiveKind::AllReduce, next_sequence(), tensor, op);
  return with_contiguous(tensor, [&](const Tensor& t) { return do_all_reduce(sig, t, op); });
}

WorkPtr ProcessGroup::reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op) {
  check_tensor(output, "reduce_scatter");
  check_tensor(input, "reduce_scatter");
  TESSERA_CHECK(input.numel() == output.numel() * size_ && input.dtype() == output.dtype() &&
                    input.device() == output.device(),
                "dist::reduce_scatter: input ", shape_str(input.shape()), " ",
                dtype_name(input.dtype()), " on ", input.device().str(), " must hold ", size_,
                " chunks of output ", shape_str(output.shape()), " ", dtype_name(output.dtype()),
                " on ", output.device().str());
  TESSERA_CHECK(op != ReduceOp::Avg || is_floating(input.dtype()),
                "dist::reduce_scatter: avg needs a floating dtype, got ",
                dtype_name(input.dtype()));
  auto sig = CollectiveSignature::make(CollectiveKind::ReduceScatter, next_sequence(), input, op);
  Tensor in = ops::contiguous(input);
  return with_contiguous(output,
                         [&](const Tensor& out) { return do_reduce_scatter(sig, out, in, op); });
}

WorkPtr ProcessGroup::all_gather(const Tensor& output, const Tensor& input) {
  check_tensor(output, "all_gather");
  check_tensor(input, "all_gather");
  TESSERA_CHECK(output.numel() == input.numel() * size_ && input.dtype() == output.dtype() &&
                    input.device() == output.device(),
                "dist::all_gather: output ", shape_str(output.shape()), " ",
                dtype_name(output.dtype()), " on ", output.device().str(), " must hold ", size_,
                " copies of input ", shape_str(input.shape()), " ", dtype_name(input.dtype()),
                " on ", input.device().str());
  auto sig = CollectiveSignature::make(CollectiveKind::AllGather, next_sequence(), input);
  Tensor in = ops::contiguous(input);
  return with_contiguous(output, [&](const Tensor& out) {
    Tensor flat = ops::view(out, {out.numel()});
    std::vector<Tensor> chunks;
    for (int r = 0; r < size_; ++r)
      chunks.push_back(ops::narrow(flat, 0, r * in.numel(), in.numel()));
    return do_all_gather(sig, chunks, in);
  });
}

WorkPtr ProcessGroup::all_gather(const std::vector<Tensor>& outputs, const Tensor& input) {
  check_tensor(input, "all_gather");
  TESSERA_CHECK(static_cast<int>(outputs.size()) == size_, "dist::all_gather: got ", outputs.size(),
                " output tensors for a group of ", size_);
  for (int r = 0; r < size_; ++r) {
    check_tensor(outputs[r], "all_gather");
    TESSERA_CHECK(outputs[r].dtype() == input.dtype() && outputs[r].device() == input.device(),
                  "dist::all_gather: output ", r, " is ", dtype_name(outputs[r].dtype()), " on ",
                  outputs[r].device().str(), " but the input is ", dtype_name(input.dtype()),
                  " on ", input.device().str());
  }
  TESSERA_CHECK(outputs[rank_].numel() == input.numel(), "dist::all_gather: output ", rank_, " ",
                shape_str(outputs[rank_].shape()), " must have this rank's input size ",
                shape_str(input.shape()));
  auto sig = CollectiveSignature::make(CollectiveKind::AllGatherUneven, next_sequence(), input);
  std::vector<Tensor> staged;
  bool any_staged = false;
  for (const Tensor& o : outputs) {
    staged.push_back(o.is_contiguous() ? o : ops::contiguous(o));
    any_staged |= !o.is_contiguous();
  }
  WorkPtr work = do_all_gather(sig, staged, ops::contiguous(input));
  if (!any_staged) return work;
  return std::make_shared<ThenWork>(work, [outputs, staged] {
    for (size_t i = 0; i < outputs.size(); ++i)
      if (!outputs[i].is_same(staged[i])) ops::copy_(outputs[i], staged[i]);
  });
}

WorkPtr ProcessGroup::broadcast(const Tensor& tensor, int root) {
  check_tensor(tensor, "broadcast");
  TESSERA_CHECK(root >= 0 && root < size_, "dist::broadcast: root ", root,
                " is outside the group of ", size_);
  auto sig = CollectiveSignature::make(CollectiveKind::Broadcast, next_sequence(), tensor,
                                       ReduceOp::Sum, root);
  return with_contiguous(tensor, [&](const Tensor& t) { return do_broadcast(sig, t, root); });
}

WorkPtr ProcessGroup::barrier() {
  return do_barrier(CollectiveSignature::make(CollectiveKind::Barrier, next_sequence(), Tensor()));
}

WorkPtr ProcessGroup::send(const Tensor& tensor, int dst, int tag) {
  check_tensor(tensor, "send");
  TESSERA_CHECK(dst >= 0 && dst < size_ && dst != rank_, "dist::send: destination ", dst,
                " must be another rank of the group of ", size_, " (this is rank ", rank_, ")");
  return do_send(ops::contiguous(tensor), dst, tag);
}

WorkPtr ProcessGroup::recv(const Tensor& tensor, int src, int tag) {
  check_tensor(tensor, "recv");
  TESSERA_CHECK(src >= 0 && src < size_ && src != rank_, "dist::recv: source ", src,
                " must be another rank of the group of ", size_, " (this is rank ", rank_, ")");
  return with_contiguous(tensor, [&](const Tensor& t) { return do_recv(t, src, tag); });
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  TESSERA_CHECK(!ranks.empty(), "dist::new_group: empty rank list");
  for (size_t i = 0; i < ranks.size(); ++i)
    TESSERA_CHECK(ranks[i] >= 0 && ranks[i] < size_ && (i == 0 || ranks[i] > ranks[i - 1]),
                  "dist::new_group: ranks must be sorted, unique and in [0, ", size_, "); got ",
                  ranks[i], " at position ", i);
  uint64_t id = groups_created_++;
  ProcessGroupOptions sub = options_;
  sub.name = options_.name + "/sub" + std::to_string(id);
  return do_new_group(ranks, id, sub);
}

// ---- registry and the world group ----
namespace {
struct Registry {
  std::mutex mutex;
  std::map<std::string, BackendFactory> backends;
  Bootstrapper bootstrapper;
  std::shared_ptr<ProcessGroup> world;
  std::shared_ptr<Store> store;
  uint64_t generation = 0;             // init_process_group calls so far in this process
  std::unique_ptr<Watchdog> watchdog;  // last: stops before the group and store go
};
Registry& registry() {
  static Registry r;
  return r;
}

// Rank 0 serves the store, the others wait for it to come up; then every rank joins the
// rendezvous, so a missing rank is named within the rendezvous timeout, not found out by a
// silent collective timeout later.
std::shared_ptr<Store> meet_the_other_ranks(const DistEnv& env, double store_timeout_s,
                                            double rendezvous_timeout_s, uint64_t generation) {
  if (env.rank != 0)
    wait_for_store(env.master_addr, env.master_port, env.rank, rendezvous_timeout_s);
  auto store = std::make_shared<TCPStore>(env.master_addr, env.master_port, env.rank == 0,
                                          store_timeout_s, generation);
  join_rendezvous(*store, env.rank, env.world_size,
                  detail::concat(env.master_addr, ":", store->port()), rendezvous_timeout_s);
  return store;
}

std::string choose_backend(const DistEnv& env, const InitOptions& options) {
  if (options.backend != "auto") return options.backend;
  const int gpus = cuda_device_count();
  const DeviceType device = options.device.value_or(gpus > 0 ? DeviceType::CUDA : DeviceType::CPU);
  return resolve_auto_backend(env, device, gpus, has_backend);
}
}  // namespace

std::string resolve_auto_backend(const DistEnv& env, DeviceType device, int cuda_devices,
                                 const std::function<bool(const std::string&)>& built) {
  if (env.world_size == 1) return "single";
  const bool gpu_per_rank = cuda_devices > 0 && env.local_world_size <= cuda_devices;
  if (device == DeviceType::CUDA && gpu_per_rank && built("nccl")) return "nccl";
  if (env.launcher == Launcher::Mpirun && built("mpi")) return "mpi";
  return "tcp";
}

void register_backend(const std::string& name, BackendFactory factory) {
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().backends[name] = std::move(factory);
}

bool has_backend(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    if (registry().backends.count(name) > 0) return true;
  }
  // nccl and mpi live in backend libraries of their own (core/backend_library.h) that
  // register them when loaded.
  const char* library = name == "nccl" ? "cuda" : name == "mpi" ? "mpi" : nullptr;
  if (library == nullptr || !load_backend_library(library)) return false;
  std::lock_guard<std::mutex> lock(registry().mutex);
  return registry().backends.count(name) > 0;
}

void register_bootstrapper(Bootstrapper b) {
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().bootstrapper = std::move(b);
}

void init_process_group(const InitOptions& options) {
  Registry& reg = registry();
  TESSERA_CHECK(!reg.world,
                "dist::init_process_group: already initialized (call "
                "destroy_process_group first)");
  BackendContext ctx{read_dist_env(), nullptr, options.group};
  ++reg.generation;
  // Under mpirun the MPI library also bootstraps the other backends' rendezvous.
  if (ctx.env.launcher == Launcher::Mpirun) has_backend("mpi");
  std::string backend = choose_backend(ctx.env, options);
  TESSERA_CHECK(has_backend(backend), "dist::init_process_group: backend '", backend,
                "' is not available in this build (mpi needs MPI, nccl needs CUDA and NCCL)");
  // The store: from MASTER_ADDR/PORT, else from the MPI bootstrap; mpi itself needs none.
  if (ctx.env.world_size > 1 && backend != "mpi") {
    if (!ctx.env.has_master() && reg.bootstrapper && ctx.env.launcher == Launcher::Mpirun) {
      auto [addr, port] = reg.bootstrapper(ctx.env);
      ctx.env.master_addr = addr;
      ctx.env.master_port = port;
    }
    TESSERA_CHECK(ctx.env.has_master(), "dist::init_process_group: backend '", backend, "' with ",
                  ctx.env.world_size,
                  " ranks needs MASTER_ADDR and MASTER_PORT (run under `tessera launch`, or "
                  "set them)");
    ctx.store = meet_the_other_ranks(ctx.env, ctx.options.timeout_s, options.rendezvous_timeout_s,
                                     reg.generation);
  } else if (ctx.env.world_size == 1) {
    ctx.store = std::make_shared<LocalStore>();
  }
  BackendFactory factory;
  {
    std::lock_guard<std::mutex> lock(reg.mutex);
    factory = reg.backends.at(backend);
  }
  reg.world = factory(ctx);
  reg.store = ctx.store;
  auto* tcp_store = dynamic_cast<TCPStore*>(ctx.store.get());
  if (tcp_store && ctx.env.world_size > 1 && options.watchdog.timeout_s > 0)
    reg.watchdog =
        std::make_unique<Watchdog>(options.watchdog, ctx.env.rank, ctx.env.world_size,
                                   ctx.env.master_addr, tcp_store->port(), reg.generation);
}

bool is_initialized() { return registry().world != nullptr; }

ProcessGroup& world() { return *world_ptr(); }

std::shared_ptr<ProcessGroup> world_ptr() {
  TESSERA_CHECK(registry().world,
                "dist: the process group is not initialized (call "
                "dist::init_process_group, or use an Accelerator)");
  return registry().world;
}

std::shared_ptr<Store> world_store() { return registry().store; }

void destroy_process_group() {
  Registry& reg = registry();
  if (!reg.world) return;
  reg.world->barrier()->wait();
  reg.watchdog.reset();
  reg.world.reset();
  reg.store.reset();
}

}  // namespace tessera::dist
