// The "mpi" backend: CPU collectives over MPI (CUDA tensors are staged through
// host memory by HostProcessGroup, which is what a non-CUDA-aware MPI needs).
// Under mpirun it is also the bootstrap: when no MASTER_ADDR is set, rank 0
// tells everyone where it serves the rendezvous store (for tcp/nccl groups).
//
// Every operation is issued non-blocking and polled against the deadline, so a
// missing peer ends in a timeout error rather than a hang. float16, bfloat16
// and bool reductions use MPI user operations over Tessera's own arithmetic.
#include <mpi.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "tessera/dist/host_process_group.h"

namespace tessera::dist {
namespace {

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  TESSERA_FAIL("dist(mpi): ", what, " failed: ", text);
}

int g_thread_level = 0;

// At exit: a clean exit finalizes MPI; a failing one (status != 0) aborts the whole job, so
// the other ranks do not wait in collectives (or in MPI_Finalize) for this one.
void finish_mpi(int exit_status, void*) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (exit_status != 0) MPI_Abort(MPI_COMM_WORLD, exit_status);
  MPI_Finalize();
}

void ensure_mpi_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&g_thread_level);
    return;
  }
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &g_thread_level), "MPI_Init_thread");
  TESSERA_CHECK(g_thread_level >= MPI_THREAD_SERIALIZED,
                "dist(mpi): this MPI offers thread level ", g_thread_level,
                "; Tessera runs MPI calls on a worker thread and needs MPI_THREAD_SERIALIZED");
  on_exit(finish_mpi, nullptr);
}

int checked_count(size_t n, const char* what) {
  TESSERA_CHECK(n <= static_cast<size_t>(INT_MAX), "dist(mpi): ", what, " of ", n,
                " elements exceeds MPI's int count limit; split the tensor");
  return static_cast<int>(n);
}

template <DType D, ReduceOp O>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(D, O, inout, in, *len);
}

// MPI datatype and operation for (dtype, op); op is Sum, Max or Min.
struct MpiTypes {
  MPI_Datatype two_bytes = MPI_DATATYPE_NULL, one_byte = MPI_DATATYPE_NULL;
  MPI_Op half_ops[3], bf16_ops[3], bool_ops[3];

  MpiTypes() {
    MPI_Type_contiguous(2, MPI_BYTE, &two_bytes);
    MPI_Type_commit(&two_bytes);
    MPI_Type_contiguous(1, MPI_BYTE, &one_byte);
    MPI_Type_commit(&one_byte);
    make_ops<DType::f16>(half_ops);
    make_ops<DType::bf16>(bf16_ops);
    make_ops<DType::boolean>(bool_ops);
  }
  template <DType D>
  static void make_ops(MPI_Op* ops) {
    MPI_Op_create(&user_reduce<D, ReduceOp::Sum>, 1, &ops[0]);
    MPI_Op_create(&user_reduce<D, ReduceOp::Max>, 1, &ops[1]);
    MPI_Op_create(&user_reduce<D, ReduceOp::Min>, 1, &ops[2]);
  }

  std::pair<MPI_Datatype, MPI_Op> get(DType dtype, ReduceOp op) const {
    int index = op == ReduceOp::Max ? 1 : op == ReduceOp::Min ? 2 : 0;
    MPI_Op builtin = index == 1 ? MPI_MAX : index == 2 ? MPI_MIN : MPI_SUM;
    switch (dtype) {
      case DType::f32: return {MPI_FLOAT, builtin};
      case DType::f64: return {MPI_DOUBLE, builtin};
      case DType::i32: return {MPI_INT32_T, builtin};
      case DType::i64: return {MPI_INT64_T, builtin};
      case DType::u8: return {MPI_UINT8_T, builtin};
      case DType::f16: return {two_bytes, half_ops[index]};
      case DType::bf16: return {two_bytes, bf16_ops[index]};
      case DType::boolean: return {one_byte, bool_ops[index]};
    }
    TESSERA_FAIL("dist(mpi): unsupported dtype ", dtype_name(dtype));
  }
};

const MpiTypes& mpi_types() {
  static const MpiTypes types;  // created after MPI_Init, on first use
  return types;
}

class MpiProcessGroup final : public HostProcessGroup {
 public:
  MpiProcessGroup(MPI_Comm comm, ProcessGroupOptions options)
      : HostProcessGroup(comm_rank(comm), comm_size(comm), std::move(options)), comm_(comm) {}
  ~MpiProcessGroup() override {
    stop_worker();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  std::string backend_name() const override { return "mpi"; }

 protected:
  void host_all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, Deadline d) override {
    auto [type, mpi_op] = mpi_types().get(dtype, op);
    MPI_Request req;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, checked_count(count, "all_reduce"), type, mpi_op,
                             comm_, &req),
              "MPI_Iallreduce");
    wait(req, d);
  }

  void host_reduce_scatter(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                           Deadline d) override {
    auto [type, mpi_op] = mpi_types().get(dtype, op);
    MPI_Request req;
    check_mpi(MPI_Ireduce_scatter_block(in, out, checked_count(count, "reduce_scatter"), type,
                                        mpi_op, comm_, &req),
              "MPI_Ireduce_scatter_block");
    wait(req, d);
  }

  void host_all_gather(const void* in, const std::vector<void*>& outs,
                       const std::vector<size_t>& out_bytes, Deadline d) override {
    // MPI gathers into one buffer at displacements: use the caller's when its outputs are
    // adjacent (the equal-size all_gather), else a temporary one.
    std::vector<int> counts(size()), displs(size());
    size_t total = 0;
    bool adjacent = true;
    for (int r = 0; r < size(); ++r) {
      counts[r] = checked_count(out_bytes[r], "all_gather bytes");
      displs[r] = checked_count(total, "all_gather bytes");
      adjacent &= static_cast<char*>(outs[r]) == static_cast<char*>(outs[0]) + total;
      total += out_bytes[r];
    }
    std::vector<char> temporary(adjacent ? 0 : total);
    char* buffer = adjacent ? static_cast<char*>(outs[0]) : temporary.data();
    MPI_Request req;
    check_mpi(MPI_Iallgatherv(in, counts[rank()], MPI_BYTE, buffer, counts.data(), displs.data(),
                              MPI_BYTE, comm_, &req),
              "MPI_Iallgatherv");
    wait(req, d);
    if (!adjacent)
      for (int r = 0; r < size(); ++r) std::memcpy(outs[r], buffer + displs[r], out_bytes[r]);
  }

  void host_broadcast(void* data, size_t bytes, int root, Deadline d) override {
    MPI_Request req;
    check_mpi(MPI_Ibcast(data, checked_count(bytes, "broadcast bytes"), MPI_BYTE, root, comm_, &req),
              "MPI_Ibcast");
    wait(req, d);
  }

  void host_barrier(Deadline d) override {
    MPI_Request req;
    check_mpi(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    wait(req, d);
  }

  void host_send(const void* data, size_t bytes, int dst, int tag, Deadline d) override {
    MPI_Request req;
    check_mpi(MPI_Isend(data, checked_count(bytes, "send bytes"), MPI_BYTE, dst, tag, comm_, &req),
              "MPI_Isend");
    wait(req, d);
  }

  void host_recv(void* data, size_t bytes, int src, int tag, Deadline d) override {
    MPI_Request req;
    check_mpi(MPI_Irecv(data, checked_count(bytes, "recv bytes"), MPI_BYTE, src, tag, comm_, &req),
              "MPI_Irecv");
    MPI_Status status;
    wait(req, d, &status);
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    TESSERA_CHECK(static_cast<size_t>(got) == bytes, "dist(mpi): recv from rank ", src,
                  " expected ", bytes, " bytes but got ", got);
  }

  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks, uint64_t,
                                             ProcessGroupOptions options) override {
    TESSERA_CHECK(g_thread_level >= MPI_THREAD_MULTIPLE,
                  "dist(mpi): sub-groups run MPI from several threads and need "
                  "MPI_THREAD_MULTIPLE; this MPI offers level ", g_thread_level);
    auto it = std::find(ranks.begin(), ranks.end(), rank());
    bool member = it != ranks.end();
    MPI_Comm sub = MPI_COMM_NULL;
    run_on_worker("new_group", [&](Deadline) {
      check_mpi(MPI_Comm_split(comm_, member ? 0 : MPI_UNDEFINED,
                               member ? static_cast<int>(it - ranks.begin()) : 0, &sub),
                "MPI_Comm_split");
    });
    if (!member) return nullptr;
    return std::make_shared<MpiProcessGroup>(sub, std::move(options));
  }

 private:
  static int comm_rank(MPI_Comm c) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
  }
  static int comm_size(MPI_Comm c) {
    int s = 0;
    MPI_Comm_size(c, &s);
    return s;
  }

  // Polls the request until it completes or the deadline passes (then TimeoutError); polls
  // back off to short sleeps so waiting ranks leave the CPU to the ones still computing.
  void wait(MPI_Request& req, Deadline d, MPI_Status* status = MPI_STATUS_IGNORE) {
    for (int polls = 0;; ++polls) {
      int done = 0;
      check_mpi(MPI_Test(&req, &done, status), "MPI_Test");
      if (done) return;
      if (d.expired()) throw TimeoutError("dist(mpi): operation timed out");
      if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  MPI_Comm comm_;
};

std::pair<std::string, int> mpi_bootstrap(const DistEnv& env) {
  ensure_mpi_initialized();
  struct {
    char address[256];
    int port;
  } where{};
  if (env.rank == 0) {
    std::string address = "127.0.0.1";
    if (env.local_world_size < env.world_size) {  // several nodes: peers need a real name
      char host[256] = {};
      gethostname(host, sizeof host - 1);
      address = host;
    }
    std::strncpy(where.address, address.c_str(), sizeof where.address - 1);
    where.port = find_free_port();
  }
  check_mpi(MPI_Bcast(&where, sizeof where, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast(bootstrap)");
  return {where.address, where.port};
}

const bool registered = [] {
  register_backend("mpi", [](const BackendContext& ctx) -> std::shared_ptr<ProcessGroup> {
    ensure_mpi_initialized();
    MPI_Comm comm;
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
    auto group = std::make_shared<MpiProcessGroup>(comm, ctx.options);
    TESSERA_CHECK(group->size() == ctx.env.world_size && group->rank() == ctx.env.rank,
                  "dist(mpi): MPI says rank ", group->rank(), " of ", group->size(),
                  " but the environment says rank ", ctx.env.rank, " of ", ctx.env.world_size,
                  " (was the job started by mpirun?)");
    return group;
  });
  register_bootstrapper(mpi_bootstrap);
  return true;
}();

}  // namespace
}  // namespace tessera::dist
