// Helper program run as a multi-process job (by tessera launch or mpirun) from test_dist:
// every collective of the chosen backend against a reference each rank computes locally
// in float64. Rank r's element i is a small multiple of 1/4 that depends on r and i, so
// sums of a few ranks are exact in every float dtype. Prints "rank R: N checks passed"
// and exits 0, or prints the first failure and exits 1.
//
// usage: dist_collectives_check [auto|tcp|mpi|nccl] [cuda]   (cuda: tensors on the GPU)
#include <cmath>
#include <iostream>

#include "tessera/dist/process_group.h"
#include "tessera/kernels/ops.h"

using namespace tessera;
using namespace tessera::dist;

namespace {

int g_checks = 0;
Device g_device = Device::cpu();  // cuda:<local rank> with "cuda" on the command line

TensorOptions opts(DType dtype) { return {.dtype = dtype, .device = g_device}; }

double value_of(int rank, int64_t i, DType dtype) {
  int64_t v = (rank * 13 + i * 7 + 3) % 17 - 8;  // -8..8, never all zero
  return is_floating(dtype) ? v / 4.0 : static_cast<double>(v);
}

Tensor rank_tensor(int rank, int64_t n, DType dtype, int64_t offset = 0) {
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = value_of(rank, i + offset, dtype);
  return ops::to(from_vector(v, {n}, {.dtype = dtype}), g_device, dtype);
}

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::f16:
      return 2e-3;
    case DType::bf16:
      return 1e-2;
    case DType::f32:
      return 1e-6;
    default:
      return 1e-12;
  }
}

void expect_close(const Tensor& got, const std::vector<double>& want, const std::string& what) {
  std::vector<double> g = ops::to(got, Device::cpu(), DType::f64).to_vector<double>();
  TESSERA_CHECK(g.size() == want.size(), what, ": got ", g.size(), " values, want ", want.size());
  for (size_t i = 0; i < g.size(); ++i) {
    double tol = tolerance(got.dtype()) * std::max(1.0, std::fabs(want[i]));
    TESSERA_CHECK(std::fabs(g[i] - want[i]) <= tol, what, " (", dtype_name(got.dtype()),
                  "): element ", i, " is ", g[i], ", want ", want[i]);
  }
  ++g_checks;
}

double combine(dist::ReduceOp op, const std::vector<double>& xs) {
  double acc = xs[0];
  for (size_t r = 1; r < xs.size(); ++r) {
    if (op == dist::ReduceOp::Max)
      acc = std::max(acc, xs[r]);
    else if (op == dist::ReduceOp::Min)
      acc = std::min(acc, xs[r]);
    else
      acc += xs[r];
  }
  return op == dist::ReduceOp::Avg ? acc / xs.size() : acc;
}

std::vector<double> reduced_reference(dist::ReduceOp op, int world, int64_t n, DType dtype,
                                      int64_t offset = 0) {
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> xs;
    for (int r = 0; r < world; ++r) xs.push_back(value_of(r, i + offset, dtype));
    want[i] = combine(op, xs);
  }
  return want;
}

void check_all_reduce(ProcessGroup& pg, DType dtype, int64_t n) {
  for (dist::ReduceOp op :
       {dist::ReduceOp::Sum, dist::ReduceOp::Avg, dist::ReduceOp::Max, dist::ReduceOp::Min}) {
    if (op == dist::ReduceOp::Avg && !is_floating(dtype)) continue;
    Tensor t = rank_tensor(pg.rank(), n, dtype);
    pg.all_reduce(t, op)->wait();
    expect_close(t, reduced_reference(op, pg.size(), n, dtype),
                 std::string("all_reduce ") + reduce_op_name(op) + " n=" + std::to_string(n));
  }
  // A non-contiguous view: the [n, 3] transpose of a [3, n] tensor.
  Tensor base = ops::view(rank_tensor(pg.rank(), 3 * n, dtype), {3, n});
  Tensor view = ops::transpose(base, 0, 1);
  pg.all_reduce(view, dist::ReduceOp::Sum)->wait();
  expect_close(ops::view(base, {3 * n}),
               reduced_reference(dist::ReduceOp::Sum, pg.size(), 3 * n, dtype),
               "all_reduce of a transposed view n=" + std::to_string(n));
}

void check_reduce_scatter(ProcessGroup& pg, DType dtype, int64_t n) {
  for (dist::ReduceOp op : {dist::ReduceOp::Sum, dist::ReduceOp::Max}) {
    Tensor in = rank_tensor(pg.rank(), n * pg.size(), dtype);
    Tensor out = empty({n}, opts(dtype));
    pg.reduce_scatter(out, in, op)->wait();
    expect_close(out, reduced_reference(op, pg.size(), n, dtype, n * pg.rank()),
                 std::string("reduce_scatter ") + reduce_op_name(op) + " n=" + std::to_string(n));
  }
}

void check_all_gather(ProcessGroup& pg, DType dtype, int64_t n) {
  Tensor out = empty({pg.size(), n}, opts(dtype));
  pg.all_gather(out, rank_tensor(pg.rank(), n, dtype))->wait();
  std::vector<double> want;
  for (int r = 0; r < pg.size(); ++r)
    for (int64_t i = 0; i < n; ++i) want.push_back(value_of(r, i, dtype));
  expect_close(out.view({pg.size() * n}), want, "all_gather n=" + std::to_string(n));

  // Uneven: rank r contributes n + 2r elements (rank 0 with n = 1 sends one element).
  std::vector<Tensor> outs;
  for (int r = 0; r < pg.size(); ++r) outs.push_back(empty({n + 2 * r}, opts(dtype)));
  pg.all_gather(outs, rank_tensor(pg.rank(), n + 2 * pg.rank(), dtype))->wait();
  for (int r = 0; r < pg.size(); ++r) {
    std::vector<double> w;
    for (int64_t i = 0; i < n + 2 * r; ++i) w.push_back(value_of(r, i, dtype));
    expect_close(outs[r], w, "uneven all_gather from rank " + std::to_string(r));
  }
}

void check_broadcast_and_p2p(ProcessGroup& pg, DType dtype, int64_t n) {
  const int root = pg.size() - 1;
  Tensor t = rank_tensor(pg.rank(), n, dtype);
  pg.broadcast(t, root)->wait();
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = value_of(root, i, dtype);
  expect_close(t, want, "broadcast from the last rank n=" + std::to_string(n));

  // A ring: even ranks send first, odd ranks receive first, so nothing waits on itself.
  const int next = (pg.rank() + 1) % pg.size(), prev = (pg.rank() + pg.size() - 1) % pg.size();
  Tensor mine = rank_tensor(pg.rank(), n, dtype), got = empty({n}, opts(dtype));
  if (pg.rank() % 2 == 0) {
    pg.send(mine, next, 5)->wait();
    pg.recv(got, prev, 5)->wait();
  } else {
    pg.recv(got, prev, 5)->wait();
    pg.send(mine, next, 5)->wait();
  }
  for (int64_t i = 0; i < n; ++i) want[i] = value_of(prev, i, dtype);
  expect_close(got, want, "recv from the previous rank n=" + std::to_string(n));
}

void check_async_and_subgroups(ProcessGroup& pg) {
  // Several collectives in flight, waited on afterwards in reverse order.
  std::vector<Tensor> ts;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 4; ++k) {
    ts.push_back(rank_tensor(pg.rank(), 33 + k, DType::f32, k));
    works.push_back(pg.all_reduce(ts.back(), dist::ReduceOp::Sum));
  }
  for (int k = 3; k >= 0; --k) works[k]->wait();
  for (int k = 0; k < 4; ++k)
    expect_close(ts[k], reduced_reference(dist::ReduceOp::Sum, pg.size(), 33 + k, DType::f32, k),
                 "async all_reduce " + std::to_string(k));
  pg.barrier()->wait();

  // Even ranks form a sub-group; its all_reduce sums only them.
  std::vector<int> evens;
  for (int r = 0; r < pg.size(); r += 2) evens.push_back(r);
  auto sub = pg.new_group(evens);
  TESSERA_CHECK((sub != nullptr) == (pg.rank() % 2 == 0), "new_group membership is wrong");
  if (sub) {
    TESSERA_CHECK(sub->size() == static_cast<int>(evens.size()) && sub->rank() == pg.rank() / 2,
                  "sub-group rank ", sub->rank(), " of ", sub->size());
    Tensor t = rank_tensor(pg.rank(), 7, DType::f64);
    sub->all_reduce(t, dist::ReduceOp::Sum)->wait();
    std::vector<double> want(7, 0.0);
    for (int r : evens)
      for (int i = 0; i < 7; ++i) want[i] += value_of(r, i, DType::f64);
    expect_close(t, want, "sub-group all_reduce");
  }
  pg.barrier()->wait();
}

// Buffers from allocate_communication_buffer, as DDP's buckets take them (with NCCL on two GPUs
// of one host: memory both ranks map, all-reduced through the copy engines): Sum and Avg at odd
// sizes, each buffer reduced again and again (its flags are reused), and a view of part of one
// (16 bytes in), which is not the buffer and goes the ordinary way. (NCCL 2.28.3's symmetric
// kernels, TESSERA_NCCL_SYMMETRIC=1, returned garbage for a bf16 view 2 bytes into a window.)
// The million-element size, many blocks of the copy-engine path's add kernel, only on GPUs:
// host groups' buffers are ordinary tensors, and under the sanitizers' slow unwinder (the
// mpirun jobs of scripts/sanitize.sh) its 54 host all-reduces took minutes.
void check_communication_buffers(ProcessGroup& pg) {
  std::vector<int64_t> sizes = {1, 2, 1001};
  if (g_device.is_cuda()) sizes.push_back((int64_t{1} << 20) + 3);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t n : sizes) {
      Tensor buffer = pg.allocate_communication_buffer(n, dtype, g_device);
      TESSERA_CHECK(buffer.numel() == n && buffer.dtype() == dtype && buffer.device() == g_device,
                    "allocate_communication_buffer gave ", shape_str(buffer.shape()), " ",
                    dtype_name(buffer.dtype()), " on ", buffer.device().str());
      for (int64_t round = 0; round < 3; ++round) {
        for (dist::ReduceOp op : {dist::ReduceOp::Sum, dist::ReduceOp::Avg}) {
          ops::copy_(buffer, rank_tensor(pg.rank(), n, dtype, round));
          pg.all_reduce(buffer, op)->wait();
          expect_close(buffer, reduced_reference(op, pg.size(), n, dtype, round),
                       std::string("all_reduce of a communication buffer, ") + reduce_op_name(op) +
                           " n=" + std::to_string(n) + " round " + std::to_string(round));
        }
      }
      const int64_t skip = 16 / int64_t(dtype_size(dtype));
      if (n > 2 * skip) {
        Tensor part = ops::narrow(buffer, 0, skip, n - 2 * skip);
        ops::copy_(part, rank_tensor(pg.rank(), n - 2 * skip, dtype, 5));
        pg.all_reduce(part, dist::ReduceOp::Sum)->wait();
        expect_close(part,
                     reduced_reference(dist::ReduceOp::Sum, pg.size(), n - 2 * skip, dtype, 5),
                     "all_reduce of part of a communication buffer n=" + std::to_string(n));
      }
    }
  }
  // All-gathers into a buffer (DDP's sparse embedding rows: through the copy engines on two
  // GPUs of one host): every rank's part in its place, three rounds on one buffer (the peer
  // writes into it again only after this rank read it), and on GPUs once from its own part
  // where that part starts 16-byte aligned (NCCL 2.28.3's symmetric kernels,
  // TESSERA_NCCL_SYMMETRIC=1, gathered garbage from a part at 4004 bytes into a window).
  const int world = pg.size();
  std::vector<int64_t> gather_sizes = sizes;
  gather_sizes.push_back(1024);
  for (DType dtype : {DType::f32, DType::bf16, DType::i64}) {
    for (int64_t n : gather_sizes) {
      Tensor buffer = pg.allocate_communication_buffer(world * n, dtype, g_device);
      auto gathered = [&](int64_t round) {
        std::vector<double> want;
        for (int r = 0; r < world; ++r)
          for (int64_t i = 0; i < n; ++i) want.push_back(value_of(r, i + round, dtype));
        return want;
      };
      for (int64_t round = 0; round < 3; ++round) {
        pg.all_gather(buffer, rank_tensor(pg.rank(), n, dtype, round))->wait();
        expect_close(buffer, gathered(round),
                     "all_gather into a communication buffer, n=" + std::to_string(n) + " round " +
                         std::to_string(round));
      }
      if (g_device.is_cuda() && n * int64_t(dtype_size(dtype)) % 16 == 0) {
        Tensor own = ops::narrow(buffer, 0, pg.rank() * n, n);
        ops::copy_(own, rank_tensor(pg.rank(), n, dtype, 7));
        pg.all_gather(buffer, own)->wait();
        expect_close(
            buffer, gathered(7),
            "all_gather into a communication buffer from its own part, n=" + std::to_string(n));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  InitOptions init;
  if (argc > 1) init.backend = argv[1];
  int rank = -1;
  try {
    if (argc > 2 && std::string(argv[2]) == "cuda")
      g_device = Device::cuda(read_dist_env().local_rank % std::max(1, cuda_device_count()));
    init.device = g_device.type;  // what "auto" chooses by
    init_process_group(init);
    ProcessGroup& pg = world();
    rank = pg.rank();
    for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64}) {
      for (int64_t n : {1, 7, 33, 257}) {
        check_all_reduce(pg, dtype, n);
        check_reduce_scatter(pg, dtype, n);
        check_all_gather(pg, dtype, n);
        check_broadcast_and_p2p(pg, dtype, n);
      }
    }
    check_async_and_subgroups(pg);
    check_communication_buffers(pg);
    std::cout << "rank " << rank << " of " << pg.size() << " (" << pg.backend_name()
              << "): " << g_checks << " checks passed\n";
    destroy_process_group();
  } catch (const std::exception& e) {
    // One write, so the line does not interleave with other ranks' output.
    std::cerr << ("rank " + std::to_string(rank) + ": FAILED: " + e.what() + "\n") << std::flush;
    return 1;
  }
  return 0;
}
