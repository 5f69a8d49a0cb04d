// In-process tests of dist/: environment parsing, the rendezvous store, the element-wise
// reductions the host backends use, and the single-process backend with its argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <tuple>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/file_io.h"
#include "tessera/core/random.h"
#include "tessera/core/settings.h"
#include "tessera/dist/accelerator.h"
#include "tessera/dist/ddp.h"
#include "tessera/dist/env.h"
#include "tessera/dist/host_process_group.h"
#include "tessera/dist/host_threads.h"
#include "tessera/dist/offload.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/single_process_group.h"
#include "tessera/dist/store.h"
#include "tessera/dist/watchdog.h"
#include "tessera/nn/layers.h"
#include "tessera/optim/adamw.h"
#include "tessera/optim/schedule.h"
#include "tessera/optim/sgd.h"

using namespace tessera;
using namespace tessera::dist;

namespace {

using ReduceOp = dist::ReduceOp;  // not core's kernel-level ReduceOp

const char* kDistVars[] = {"RANK",
                           "LOCAL_RANK",
                           "WORLD_SIZE",
                           "LOCAL_WORLD_SIZE",
                           "MASTER_ADDR",
                           "MASTER_PORT",
                           "OMPI_COMM_WORLD_RANK",
                           "OMPI_COMM_WORLD_SIZE",
                           "OMPI_COMM_WORLD_LOCAL_RANK",
                           "OMPI_COMM_WORLD_LOCAL_SIZE",
                           "SLURM_PROCID",
                           "SLURM_NTASKS",
                           "SLURM_LOCALID",
                           "SLURM_NTASKS_PER_NODE",
                           "SLURM_JOB_NODELIST",
                           "SLURM_NODELIST",
                           "SLURM_JOB_ID"};

// Clears the launch variables for the test and restores nothing: test_dist itself is never
// started as a distributed job.
struct CleanDistEnv : ::testing::Test {
  static void clear() {
    for (const char* v : kDistVars) unsetenv(v);
  }
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
};

using EnvTest = CleanDistEnv;

TEST_F(EnvTest, NothingSetIsRankZeroOfOne) {
  DistEnv e = read_dist_env();
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.launcher, Launcher::None);
  EXPECT_FALSE(e.has_master());
}

TEST_F(EnvTest, TorchrunVariables) {
  setenv("RANK", "5", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29555", 1);
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);  // torchrun names win
  DistEnv e = read_dist_env();
  EXPECT_EQ(e.launcher, Launcher::Torchrun);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29555);
}

TEST_F(EnvTest, MpirunVariables) {
  setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
  DistEnv e = read_dist_env();
  EXPECT_EQ(e.launcher, Launcher::Mpirun);
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
}

TEST_F(EnvTest, SlurmVariables) {
  setenv("SLURM_PROCID", "6", 1);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_LOCALID", "2", 1);
  setenv("SLURM_NTASKS_PER_NODE", "4(x2)", 1);
  DistEnv e = read_dist_env();
  EXPECT_EQ(e.launcher, Launcher::Slurm);
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 4);
}

TEST_F(EnvTest, SlurmWithoutMasterUsesTheFirstNodeOfTheJob) {
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_NTASKS", "2", 1);
  setenv("SLURM_JOB_NODELIST", "gpu[007-009,12],login1", 1);
  setenv("SLURM_JOB_ID", "123456", 1);
  DistEnv e = read_dist_env();
  EXPECT_EQ(e.master_addr, "gpu007");
  EXPECT_EQ(e.master_port, 29500 + 456);
  setenv("MASTER_ADDR", "10.0.0.1", 1);  // explicit values win
  EXPECT_EQ(read_dist_env().master_addr, "10.0.0.1");
  EXPECT_EQ(first_slurm_host("a1,b2"), "a1");
  EXPECT_EQ(first_slurm_host("solo"), "solo");
  EXPECT_EQ(first_slurm_host("n[3]"), "n3");
  EXPECT_THROW(first_slurm_host("n[3"), Error);
}

TEST_F(EnvTest, BadValuesNameTheVariable) {
  setenv("RANK", "two", 1);
  setenv("WORLD_SIZE", "4", 1);
  try {
    read_dist_env();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='two'"), std::string::npos) << e.what();
  }
  setenv("RANK", "4", 1);
  EXPECT_THROW(read_dist_env(), Error);  // rank outside the world
  setenv("RANK", "1", 1);
  setenv("MASTER_PORT", "70000", 1);
  EXPECT_THROW(read_dist_env(), Error);
}

// WORLD_SIZE=99999999999999999999 was read as -1 ("world size -1"): every integer of the
// launch environment is range-checked as it is read, naming the variable, its value and the
// range.
TEST_F(EnvTest, OutOfRangeIntegersNameTheVariableTheValueAndTheRange) {
  auto error_of = [] {
    try {
      read_dist_env();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  setenv("WORLD_SIZE", "99999999999999999999", 1);
  EXPECT_NE(error_of().find("WORLD_SIZE=99999999999999999999 is out of range: it must be in [1, "),
            std::string::npos)
      << error_of();
  setenv("WORLD_SIZE", "4", 1);
  setenv("RANK", "4", 1);
  EXPECT_NE(error_of().find("RANK=4 is out of range: it must be in [0, 3] (WORLD_SIZE=4)"),
            std::string::npos)
      << error_of();
  setenv("RANK", "-1", 1);
  EXPECT_NE(error_of().find("RANK=-1 is out of range"), std::string::npos) << error_of();
  setenv("RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  setenv("LOCAL_RANK", "2", 1);
  EXPECT_NE(error_of().find("LOCAL_RANK=2 is out of range: it must be in [0, 1] "
                            "(LOCAL_WORLD_SIZE=2)"),
            std::string::npos)
      << error_of();
  setenv("LOCAL_RANK", "1", 1);
  setenv("MASTER_PORT", "4294967297", 1);  // 2^32 + 1 once wrapped to port 1
  EXPECT_NE(error_of().find("MASTER_PORT=4294967297 is out of range: it must be in [0, 65535]"),
            std::string::npos)
      << error_of();
  clear();
  setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "-2", 1);
  EXPECT_NE(error_of().find("OMPI_COMM_WORLD_SIZE=-2 is out of range"), std::string::npos)
      << error_of();
  clear();
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_NTASKS", "2", 1);
  setenv("SLURM_LOCALID", "0", 1);
  setenv("SLURM_JOB_NODELIST", "n1", 1);
  setenv("SLURM_JOB_ID", "99999999999999999999", 1);
  EXPECT_NE(error_of().find("SLURM_JOB_ID=99999999999999999999 is out of range"), std::string::npos)
      << error_of();
}

TEST(DistSettings, WatchdogAndRendezvousSettingsAreRangeChecked) {
  auto error_of = [](const char* name, const char* value, const std::function<void()>& read) {
    setenv(name, value, 1);
    std::string message = "no error";
    try {
      read();
    } catch (const Error& e) {
      message = e.what();
    }
    unsetenv(name);
    return message;
  };
  auto watchdog = [] { WatchdogOptions::from_env(); };
  EXPECT_NE(error_of("TESSERA_WATCHDOG_TIMEOUT", "-1", watchdog)
                .find("TESSERA_WATCHDOG_TIMEOUT=-1 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of("TESSERA_WATCHDOG_ACTION", "abort", watchdog)
                .find("TESSERA_WATCHDOG_ACTION='abort' is not one of end, report"),
            std::string::npos);
  EXPECT_NE(error_of("TESSERA_RENDEZVOUS_TIMEOUT", "0", [] { rendezvous_timeout_from_env(); })
                .find("TESSERA_RENDEZVOUS_TIMEOUT must be positive"),
            std::string::npos);
  setenv("TESSERA_WATCHDOG_TIMEOUT", "7", 1);
  setenv("TESSERA_WATCHDOG_ACTION", "report", 1);
  const WatchdogOptions o = WatchdogOptions::from_env();
  unsetenv("TESSERA_WATCHDOG_TIMEOUT");
  unsetenv("TESSERA_WATCHDOG_ACTION");
  EXPECT_EQ(o.timeout_s, 7);
  EXPECT_FALSE(o.end_job);
  EXPECT_EQ(WatchdogOptions::from_env().timeout_s, 60);
}

// "auto" picks NCCL only for CUDA tensors with a GPU per local rank: two CPU ranks (or two
// ranks sharing the machine's one GPU) on a machine with a GPU used to get NCCL and fail in
// ncclCommInitRank.
TEST(AutoBackendTest, NcclOnlyForCudaTensorsWithAGpuPerLocalRank) {
  std::vector<std::string> asked;
  auto built = [&](const std::string& name) {
    asked.push_back(name);
    return true;
  };
  auto job = [](int world, int local_world, Launcher launcher) {
    DistEnv e;
    e.world_size = world;
    e.local_world_size = local_world;
    e.launcher = launcher;
    return e;
  };
  const DistEnv two = job(2, 2, Launcher::Torchrun);
  EXPECT_EQ(resolve_auto_backend(two, DeviceType::CUDA, 2, built), "nccl");
  EXPECT_EQ(resolve_auto_backend(two, DeviceType::CUDA, 8, built), "nccl");
  EXPECT_EQ(resolve_auto_backend(two, DeviceType::CUDA, 1, built), "tcp");  // one shared GPU
  EXPECT_EQ(resolve_auto_backend(two, DeviceType::CPU, 2, built), "tcp");   // CPU tensors
  EXPECT_EQ(resolve_auto_backend(two, DeviceType::CUDA, 0, built), "tcp");
  // Two nodes of 4 ranks each: what counts is the ranks of one node.
  EXPECT_EQ(resolve_auto_backend(job(8, 4, Launcher::Torchrun), DeviceType::CUDA, 4, built),
            "nccl");
  EXPECT_EQ(resolve_auto_backend(job(8, 4, Launcher::Slurm), DeviceType::CUDA, 2, built), "tcp");
  const DistEnv mpi = job(3, 3, Launcher::Mpirun);
  EXPECT_EQ(resolve_auto_backend(mpi, DeviceType::CPU, 4, built), "mpi");
  EXPECT_EQ(resolve_auto_backend(mpi, DeviceType::CUDA, 1, built), "mpi");
  EXPECT_EQ(resolve_auto_backend(mpi, DeviceType::CUDA, 4, built), "nccl");
  EXPECT_EQ(resolve_auto_backend(job(1, 1, Launcher::Torchrun), DeviceType::CUDA, 4, built),
            "single");
  // A backend that is not built is passed over; nothing is asked that cannot be chosen
  // (asking loads the backend's library).
  asked.clear();
  auto without_nccl = [&](const std::string& name) {
    asked.push_back(name);
    return name != "nccl";
  };
  EXPECT_EQ(resolve_auto_backend(mpi, DeviceType::CUDA, 4, without_nccl), "mpi");
  EXPECT_EQ(asked, (std::vector<std::string>{"nccl", "mpi"}));
  asked.clear();
  EXPECT_EQ(resolve_auto_backend(two, DeviceType::CPU, 2, without_nccl), "tcp");
  EXPECT_TRUE(asked.empty());
}

TEST(StoreTest, SetGetAddWaitAcrossClients) {
  TCPStore server("127.0.0.1", 0, /*is_server=*/true, 10);
  TCPStore client("127.0.0.1", server.port(), false, 10);
  server.set("a", "alpha");
  EXPECT_EQ(client.get("a"), "alpha");
  EXPECT_EQ(client.add("n", 5), 5);
  EXPECT_EQ(server.add("n", -2), 3);
  EXPECT_FALSE(client.check({"a", "later"}));
  // A get for a missing key waits until another client sets it.
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server.set("later", std::string("x\0y", 3));
  });
  EXPECT_EQ(client.get("later"), std::string("x\0y", 3));
  setter.join();
  client.wait({"a", "later"});
  EXPECT_TRUE(client.check({"a", "later"}));
}

TEST(StoreTest, BarrierReleasesAllAndTimesOutNamingArrivals) {
  TCPStore server("127.0.0.1", 0, true, 10);
  std::vector<std::thread> ranks;
  std::atomic<int> passed{0};
  for (int r = 0; r < 3; ++r)
    ranks.emplace_back([&] {
      TCPStore c("127.0.0.1", server.port(), false, 10);
      c.barrier("three", 3);
      ++passed;
    });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(passed, 3);

  TCPStore lonely("127.0.0.1", server.port(), false, 0.3);
  try {
    lonely.barrier("two", 2);
    FAIL() << "expected a timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("only 1 of 2 ranks arrived"), std::string::npos)
        << e.what();
  }
  // The store stays usable after a timed-out request.
  EXPECT_EQ(lonely.add("after", 1), 1);
}

TEST(StoreTest, ClientsOnlyTalkToAServerOfTheirGeneration) {
  TCPStore first("127.0.0.1", 0, true, 10, /*generation=*/1);
  first.set("k", "old");
  EXPECT_THROW(TCPStore("127.0.0.1", first.port(), false, 0.3, /*generation=*/2), TimeoutError);
  TCPStore same("127.0.0.1", first.port(), false, 10, 1);
  EXPECT_EQ(same.get("k"), "old");
}

TEST(StoreTest, ConnectingToNothingTimesOut) {
  int port = find_free_port();
  EXPECT_THROW(TCPStore("127.0.0.1", port, false, 0.3), TimeoutError);
}

TEST(HostReduceTest, MatchesFloat64ReferenceForEveryDtype) {
  const int64_t n = 33;
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
      std::vector<double> a(n), b(n);
      for (int64_t i = 0; i < n; ++i) {
        a[i] = ((i * 5) % 9) - 4.0;
        b[i] = ((i * 7 + 2) % 11) - 5.0;
      }
      Tensor ta = from_vector(a, {n}, {.dtype = dtype}), tb = from_vector(b, {n}, {.dtype = dtype});
      reduce_into(dtype, op, ta.raw_data(), tb.raw_data(), n);
      std::vector<double> got = ops::to(ta, Device::cpu(), DType::f64).to_vector<double>();
      for (int64_t i = 0; i < n; ++i) {
        double want = op == ReduceOp::Sum   ? a[i] + b[i]
                      : op == ReduceOp::Max ? std::max(a[i], b[i])
                                            : std::min(a[i], b[i]);
        ASSERT_EQ(got[i], want) << dtype_name(dtype) << " " << reduce_op_name(op) << " at " << i;
      }
    }
  }
  Tensor t = from_vector(std::vector<double>{3, -6, 1.5}, {3}, {.dtype = DType::bf16});
  scale_in_place(DType::bf16, t.raw_data(), 3, 0.5);
  EXPECT_EQ(ops::to(t, Device::cpu(), DType::f64).to_vector<double>(),
            (std::vector<double>{1.5, -3, 0.75}));
  EXPECT_THROW(scale_in_place(DType::i32, t.raw_data(), 1, 0.5), Error);
}

struct SingleBackendTest : CleanDistEnv {
  void SetUp() override {
    CleanDistEnv::SetUp();
    init_process_group();
  }
  void TearDown() override {
    destroy_process_group();
    CleanDistEnv::TearDown();
  }
};

TEST_F(SingleBackendTest, CollectivesOfOneRankAreIdentities) {
  ProcessGroup& pg = world();
  EXPECT_EQ(pg.backend_name(), "single");
  EXPECT_EQ(pg.size(), 1);
  Tensor t = from_vector(std::vector<float>{1.5f, -2, 7}, {3});
  pg.all_reduce(t, ReduceOp::Avg)->wait();
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1.5f, -2, 7}));
  Tensor out = zeros({3});
  pg.all_gather(out, t)->wait();
  EXPECT_EQ(out.to_vector<float>(), t.to_vector<float>());
  Tensor rs = zeros({3});
  pg.reduce_scatter(rs, t)->wait();
  EXPECT_EQ(rs.to_vector<float>(), t.to_vector<float>());
  pg.broadcast(t, 0)->wait();
  pg.barrier()->wait();
  auto sub = pg.new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
}

TEST_F(SingleBackendTest, BadArgumentsAreClearErrors) {
  ProcessGroup& pg = world();
  Tensor f = zeros({4});
  Tensor i = zeros({4}, {.dtype = DType::i32});
  auto message_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message_of([&] { pg.all_reduce(i, ReduceOp::Avg); }).find("avg needs a floating"),
            std::string::npos);
  EXPECT_NE(message_of([&] { pg.all_gather(zeros({3}), f); }).find("must hold 1 copies"),
            std::string::npos);
  EXPECT_NE(message_of([&] { pg.reduce_scatter(zeros({4}), i); }).find("reduce_scatter"),
            std::string::npos);
  EXPECT_NE(message_of([&] { pg.send(f, 0); }).find("another rank"), std::string::npos);
  EXPECT_NE(message_of([&] { pg.broadcast(f, 1); }).find("root 1"), std::string::npos);
  EXPECT_NE(message_of([&] { pg.new_group({1, 0}); }).find("sorted"), std::string::npos);
  EXPECT_NE(message_of([&] { pg.all_reduce(Tensor()); }).find("undefined"), std::string::npos);
  EXPECT_NE(message_of([] { init_process_group(); }).find("already initialized"),
            std::string::npos);
}

TEST(SignatureTest, DescribesTheCallAndComparesWhatMustMatch) {
  Tensor t = zeros({2, 3}, {.dtype = DType::bf16});
  auto a = CollectiveSignature::make(CollectiveKind::AllReduce, 4, t, ReduceOp::Max);
  EXPECT_EQ(a.str(), "all_reduce(max, bfloat16, [2, 3]) #4");
  auto b = CollectiveSignature::make(CollectiveKind::AllReduce, 4,
                                     zeros({3, 2}, {.dtype = DType::bf16}), ReduceOp::Max);
  EXPECT_FALSE(a == b);
  auto c = CollectiveSignature::make(CollectiveKind::AllGatherUneven, 1, zeros({5}));
  auto d = CollectiveSignature::make(CollectiveKind::AllGatherUneven, 1, zeros({9}));
  EXPECT_TRUE(c == d);  // uneven sizes are the point of this collective
  auto e = CollectiveSignature::make(CollectiveKind::AllGatherUneven, 2, zeros({9}));
  EXPECT_FALSE(d == e);  // but the sequence numbers must agree
}

struct TwoLayers : nn::Module {
  nn::Linear a{5, 7, true, 0.5}, b{7, 3, true, 0.5};
  TwoLayers() {
    register_module("a", a);
    register_module("b", b);
  }
  Tensor forward(const Tensor& x) override { return b(tanh(a(x))); }
};

std::vector<std::vector<float>> grads_of(nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : m.parameters())
    out.push_back(ops::contiguous(ops::to(p.grad(), Device::cpu(), DType::f32)).to_vector<float>());
  return out;
}

using DdpTest = SingleBackendTest;

TEST_F(DdpTest, BucketsAreReverseOrderFlatBuffersHoldingTheGradients) {
  default_generator().manual_seed(3);
  TwoLayers plain;
  default_generator().manual_seed(3);
  TwoLayers wrapped;
  // 7*3 + 3 floats = 96 bytes fill the first bucket; the rest go to the second.
  dist::DistributedDataParallel ddp(wrapped, nullptr, {.bucket_bytes = 96});
  ASSERT_EQ(ddp.buckets().size(), 2u);
  EXPECT_EQ(ddp.buckets()[0].params, (std::vector<size_t>{3, 2}));  // b.bias, b.weight
  EXPECT_EQ(ddp.buckets()[1].params, (std::vector<size_t>{1, 0}));
  EXPECT_EQ(ddp.buckets()[1].gradients.numel(), 5 * 7 + 7);

  Generator g(11);
  Tensor x = randn({4, 5}, {}, &g);
  Tensor y = from_vector(std::vector<int64_t>{0, 2, 1, 2}, {4}, {.dtype = DType::i64});
  cross_entropy(plain(x), y).backward();
  ddp.backward(cross_entropy(ddp(x), y));
  EXPECT_EQ(grads_of(wrapped), grads_of(plain));
  for (size_t i = 0; i < ddp.parameters().size(); ++i) {
    const Tensor grad = ddp.parameters()[i].grad();
    EXPECT_TRUE(grad.shares_storage(ddp.buckets()[i < 2 ? 1 : 0].gradients))
        << ddp.parameter_names()[i];
    EXPECT_EQ(grad.raw_data(), ddp.gradient_slot(i).raw_data());
  }
}

TEST_F(DdpTest, Bf16GradientsAreReducedThroughAnF32Buffer) {
  default_generator().manual_seed(4);
  TwoLayers plain;
  default_generator().manual_seed(4);
  TwoLayers wrapped;
  plain.to(DType::bf16);
  wrapped.to(DType::bf16);
  dist::DistributedDataParallel ddp(wrapped);
  ASSERT_EQ(ddp.buckets().size(), 1u);
  EXPECT_EQ(ddp.buckets()[0].gradients.dtype(), DType::bf16);
  ASSERT_TRUE(ddp.buckets()[0].reduce_buffer.defined());
  EXPECT_EQ(ddp.buckets()[0].reduce_buffer.dtype(), DType::f32);
  Generator g(12);
  Tensor x = ops::to(randn({4, 5}, {}, &g), Device::cpu(), DType::bf16);
  Tensor y = from_vector(std::vector<int64_t>{0, 2, 1, 2}, {4}, {.dtype = DType::i64});
  cross_entropy(plain(x), y).backward();
  ddp.backward(cross_entropy(ddp(x), y));
  // One rank: the average is the gradient itself, and bf16 -> f32 -> bf16 is exact.
  EXPECT_EQ(grads_of(wrapped), grads_of(plain));
  // Opting out keeps the reduction in bf16.
  TwoLayers other;
  other.to(DType::bf16);
  dist::DistributedDataParallel narrow(other, nullptr, {.reduce_dtype = DType::bf16});
  EXPECT_FALSE(narrow.buckets()[0].reduce_buffer.defined());
}

TEST(MixedPrecisionPolicy, GradientsAreAveragedInF32OrInTheParametersOwnDtype) {
  using dist::MixedPrecisionPolicy;
  EXPECT_EQ(MixedPrecisionPolicy::from_name("bf16").reduce_dtype, DType::bf16);
  EXPECT_EQ(MixedPrecisionPolicy::from_name("fp16").reduce_dtype, DType::f32);
  EXPECT_EQ(MixedPrecisionPolicy::from_name("bf16", "fp32").reduce_dtype, DType::f32);
  EXPECT_EQ(MixedPrecisionPolicy::from_name("bf16", "bf16").reduce_dtype, DType::bf16);
  EXPECT_EQ(MixedPrecisionPolicy::from_name("fp16", "fp16").reduce_dtype, DType::f16);
  EXPECT_EQ(MixedPrecisionPolicy::from_name("bf16", "bf16").master_dtype, DType::f32);
  try {
    MixedPrecisionPolicy::from_name("bf16", "fp16");
    ADD_FAILURE() << "reduce_dtype fp16 with bf16 parameters was accepted";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("reduce_dtype must be fp32 or the parameters' dtype (bf16"),
        std::string::npos)
        << e.what();
  }
  EXPECT_THROW(MixedPrecisionPolicy::from_name("no", "bf16"), Error);
  // The Accelerator's DDP buckets follow the policy: no f32 reduce buffer for bf16.
  dist::Accelerator acc({.mixed_precision = "bf16", .cpu = true});
  default_generator().manual_seed(6);
  TwoLayers model;
  acc.prepare(model);
  auto& ddp = dynamic_cast<dist::DistributedDataParallel&>(*acc.strategy_of(model));
  EXPECT_EQ(ddp.buckets()[0].gradients.dtype(), DType::bf16);
  EXPECT_FALSE(ddp.buckets()[0].reduce_buffer.defined());
}

TEST_F(DdpTest, NoSyncAccumulatesAndZeroGradToNoneIsAdoptedAgain) {
  default_generator().manual_seed(5);
  TwoLayers plain;
  default_generator().manual_seed(5);
  TwoLayers wrapped;
  dist::DistributedDataParallel ddp(wrapped);
  Generator g(2);
  Tensor x = randn({3, 5}, {}, &g);
  Tensor y = from_vector(std::vector<int64_t>{1, 0, 2}, {3}, {.dtype = DType::i64});
  for (int k = 0; k < 3; ++k) cross_entropy(plain(x), y).backward();
  {
    auto guard = ddp.no_sync();
    EXPECT_FALSE(ddp.sync_enabled());
    cross_entropy(ddp(x), y).backward();
    ddp.finish_gradient_sync();  // nothing to do inside no_sync
    cross_entropy(ddp(x), y).backward();
  }
  EXPECT_TRUE(ddp.sync_enabled());
  ddp.backward(cross_entropy(ddp(x), y));
  auto got = grads_of(wrapped), want = grads_of(plain);
  for (size_t i = 0; i < want.size(); ++i)
    for (size_t j = 0; j < want[i].size(); ++j) ASSERT_NEAR(got[i][j], want[i][j], 1e-6);
  // An optimizer's zero_grad(set_to_none) drops the views; the next backward re-adopts them.
  wrapped.zero_grad(true);
  ddp.backward(cross_entropy(ddp(x), y));
  EXPECT_EQ(wrapped.parameters()[0].grad().raw_data(), ddp.gradient_slot(0).raw_data());
}

TEST_F(DdpTest, UnusedParameterIsNamed) {
  TwoLayers m;
  nn::Linear extra(3, 3);
  m.register_module("extra", extra);
  dist::DistributedDataParallel ddp(m);
  Tensor x = ones({2, 5});
  Tensor y = from_vector(std::vector<int64_t>{1, 0}, {2}, {.dtype = DType::i64});
  try {
    ddp.backward(cross_entropy(ddp(x), y));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'extra.weight', 'extra.bias'"), std::string::npos)
        << e.what();
  }
}

// ---- communication buffers from the group (TESSERA_NCCL_SYMMETRIC's path, on the CPU) ----

// A world of one that counts allocate_communication_buffer (the NCCL group answers it with
// symmetric windows) and records which memory its all-reduces were given. `backend` stands in
// for the name DDP looks at.
class CountingGroup final : public SingleProcessGroup {
 public:
  explicit CountingGroup(std::string backend = "counting") : backend_(std::move(backend)) {}
  std::string backend_name() const override { return backend_; }
  bool offers_communication_buffers() const override { return offers; }
  Tensor allocate_communication_buffer(int64_t numel, DType dtype, Device device) override {
    Tensor t = ProcessGroup::allocate_communication_buffer(numel, dtype, device);
    allocated.push_back({t.raw_data(), numel, dtype});
    return t;
  }
  struct Allocation {
    const void* data;
    int64_t numel;
    DType dtype;
  };
  std::vector<Allocation> allocated;
  std::vector<const void*> reduced;
  bool offers = false;  // what offers_communication_buffers() says

  bool was_allocated(const Tensor& t) const {
    for (const Allocation& a : allocated)
      if (a.data == t.raw_data()) return true;
    return false;
  }

 protected:
  WorkPtr do_all_reduce(const CollectiveSignature& sig, const Tensor& t, ReduceOp op) override {
    reduced.push_back(t.raw_data());
    return SingleProcessGroup::do_all_reduce(sig, t, op);
  }

 private:
  std::string backend_;
};

// Unsets the NCCL opt-in variables around each test.
struct NcclEnvTest : ::testing::Test {
  static void clear() {
    unsetenv("TESSERA_NCCL_CTA_POLICY");
    unsetenv("TESSERA_NCCL_SYMMETRIC");
    unsetenv("TESSERA_PEER_ALLREDUCE");
  }
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// With communication_buffers_from_group, the buffer each bucket communicates (the gradients,
// or the f32 reduce buffer of bf16 gradients) comes from the group once, at construction, and
// is what the all-reduces get; the gradients are bit for bit those of buckets without it.
TEST(FlatBucketsTest, CommunicationBuffersComeFromTheGroupOncePerBucket) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    default_generator().manual_seed(7);
    TwoLayers plain;
    default_generator().manual_seed(7);
    TwoLayers windowed;
    plain.to(dtype);
    windowed.to(dtype);
    auto plain_group = std::make_shared<CountingGroup>();
    auto group = std::make_shared<CountingGroup>();
    // b.bias and b.weight fill the first bucket, a.bias and a.weight the second.
    auto make = [&](nn::Module& m, std::shared_ptr<ProcessGroup> g, bool from_group) {
      auto [params, names] = trainable_parameters(m);
      FlatBucketsOptions o;
      o.bucket_bytes = 24 * dtype_size(dtype);
      o.communication_buffers_from_group = from_group;
      return std::make_unique<FlatBuckets>(std::move(params), std::move(names), std::move(g), o);
    };
    auto plain_buckets = make(plain, plain_group, false);
    auto buckets = make(windowed, group, true);
    ASSERT_EQ(buckets->buckets().size(), 2u);
    ASSERT_EQ(group->allocated.size(), 2u);
    EXPECT_TRUE(plain_group->allocated.empty());
    // Allocated in the parameters' order (the same on every rank): a.weight's bucket first.
    for (size_t k = 0; k < 2; ++k) {
      const FlatBuckets::Bucket& b = buckets->buckets()[1 - k];
      const CountingGroup::Allocation& a = group->allocated[k];
      EXPECT_EQ(a.data, b.communication_buffer().raw_data());
      EXPECT_EQ(a.numel, b.padded_numel);
      EXPECT_EQ(a.dtype, DType::f32);  // bf16 gradients are reduced in f32 (the default)
      // bf16: the gradients themselves are not communicated; they come from the allocator.
      EXPECT_EQ(group->was_allocated(b.gradients), dtype == DType::f32);
      EXPECT_EQ(b.reduce_buffer.defined(), dtype == DType::bf16);
    }

    Generator g(13);
    Tensor x = ops::to(randn({4, 5}, {}, &g), Device::cpu(), dtype);
    Tensor y = from_vector(std::vector<int64_t>{0, 2, 1, 2}, {4}, {.dtype = DType::i64});
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(step);
      group->reduced.clear();
      cross_entropy(plain(x), y).backward();
      plain_buckets->finish();
      cross_entropy(windowed(x), y).backward();
      buckets->finish();
      EXPECT_EQ(grads_of(windowed), grads_of(plain));
      ASSERT_EQ(group->reduced.size(), 2u);
      for (const void* data : group->reduced)
        EXPECT_TRUE(std::any_of(group->allocated.begin(), group->allocated.end(),
                                [&](const auto& a) { return a.data == data; }));
      if (step == 1) {  // as an optimizer's zero_grad(set_to_none) does
        plain.zero_grad(true);
        windowed.zero_grad(true);
      }
    }
    EXPECT_EQ(group->allocated.size(), 2u);  // never again after construction

    const std::string message =
        error_of([&] { buckets->release_gradients(buckets->buckets()[0]); });
    EXPECT_NE(
        message.find("release_gradients cannot be used with communication_buffers_from_group"),
        std::string::npos)
        << message;
    EXPECT_NO_THROW(plain_buckets->release_gradients(plain_buckets->buckets()[0]));
  }
}

// DDP takes its buckets from the group exactly when the group offers buffers of its own (the
// NCCL group: symmetric windows with TESSERA_NCCL_SYMMETRIC=1, or the shared buffers of two
// ranks of one host; on two GPUs, GpuJobs.* check which one it takes).
TEST_F(NcclEnvTest, DdpTakesItsBucketsFromAGroupThatOffersThem) {
  auto ddp_allocations = [](bool offers) {
    auto group = std::make_shared<CountingGroup>("nccl");
    group->offers = offers;
    TwoLayers m;
    dist::DistributedDataParallel ddp(m, group, {.bucket_bytes = 96});
    EXPECT_EQ(ddp.buckets().size(), 2u);
    return group->allocated.size();
  };
  EXPECT_EQ(ddp_allocations(false), 0u);
  EXPECT_EQ(ddp_allocations(true), 2u);
}

// A group of two ranks whose other rank mirrors this one (it contributes what this one does):
// an all-reduce's sum doubles, its average, max and min keep the value, and an all-gather
// repeats the input in every part. DDP over it computes what one process does, through the
// paths that need two ranks (the sparse embedding rows' gather among them).
class MirrorGroup final : public ProcessGroup {
 public:
  MirrorGroup() : ProcessGroup(0, 2, {}) {}
  std::string backend_name() const override { return "mirror"; }
  bool offers_communication_buffers() const override { return offers; }
  Tensor allocate_communication_buffer(int64_t numel, DType dtype, Device device) override {
    ++allocations;
    return ProcessGroup::allocate_communication_buffer(numel, dtype, device);
  }
  bool offers = false;  // what offers_communication_buffers() says
  int allocations = 0;
  std::vector<const void*> gathered_into;  // outputs of every all-gather

 protected:
  bool supports_device(Device) const override { return true; }
  WorkPtr do_all_reduce(const CollectiveSignature&, const Tensor& t, ReduceOp op) override {
    if (op == ReduceOp::Sum) ops::binary_(BinaryOp::Mul, t, 2.0);
    return completed_work();
  }
  WorkPtr do_reduce_scatter(const CollectiveSignature&, const Tensor& output, const Tensor& input,
                            ReduceOp op) override {
    ops::copy_(output, ops::narrow(ops::view(input, {input.numel()}), 0, 0, output.numel()));
    if (op == ReduceOp::Sum) ops::binary_(BinaryOp::Mul, output, 2.0);
    return completed_work();
  }
  WorkPtr do_all_gather(const CollectiveSignature&, const std::vector<Tensor>& outputs,
                        const Tensor& input) override {
    gathered_into.push_back(outputs[0].raw_data());
    for (const Tensor& out : outputs) ops::copy_(out, ops::view(input, out.shape()));
    return completed_work();
  }
  WorkPtr do_broadcast(const CollectiveSignature&, const Tensor&, int) override {
    return completed_work();
  }
  WorkPtr do_barrier(const CollectiveSignature&) override { return completed_work(); }
  WorkPtr do_send(const Tensor&, int, int) override { TESSERA_FAIL("MirrorGroup: no send"); }
  WorkPtr do_recv(const Tensor&, int, int) override { TESSERA_FAIL("MirrorGroup: no recv"); }
  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>&, uint64_t,
                                             ProcessGroupOptions) override {
    TESSERA_FAIL("MirrorGroup: no subgroups");
  }
};

struct LookupHead : nn::Module {
  nn::Embedding emb{50, 6, 0.5};
  nn::Linear head{6, 4, true, 0.5};
  LookupHead() {
    register_module("emb", emb);
    register_module("head", head);
  }
  Tensor forward(const Tensor& idx) override { return head(tanh(emb(idx))); }
};

// DDP's sparse embedding rows go into memory from the group when it offers some (two GPUs of
// one host then gather them through the copy engines): one pair of buffers (indices, rows) per
// lookup and size, made at the first step of a size and reused at every later one; none from
// a group that offers nothing. The gradients stay those of one process either way.
TEST_F(DdpTest, SparseEmbeddingRowsGatherIntoBuffersFromAGroupThatOffersThem) {
  for (bool offers : {false, true}) {
    SCOPED_TRACE(offers ? "offers buffers" : "offers none");
    default_generator().manual_seed(21);
    LookupHead plain;
    default_generator().manual_seed(21);
    LookupHead wrapped;
    auto group = std::make_shared<MirrorGroup>();
    group->offers = offers;
    dist::DistributedDataParallel ddp(wrapped, group);
    const int buckets = offers ? static_cast<int>(ddp.buckets().size()) : 0;
    EXPECT_EQ(group->allocations, buckets);
    Generator g(22);
    std::vector<const void*> first_gather;
    const std::vector<std::pair<int64_t, int>> steps = {{12, 2}, {12, 2}, {7, 4}, {12, 4}};
    for (const auto& [n, gather_buffers] : steps) {  // lookup size, buffers made by then
      SCOPED_TRACE(n);
      Tensor idx = randint(0, 50, {n}, {.dtype = DType::i64}, &g);
      Tensor y = randint(0, 4, {n}, {.dtype = DType::i64}, &g);
      plain.zero_grad(true);
      wrapped.zero_grad(true);
      cross_entropy(plain(idx), y).backward();
      group->gathered_into.clear();
      ddp.backward(cross_entropy(ddp(idx), y));
      const auto want = grads_of(plain), got = grads_of(wrapped);
      ASSERT_EQ(got.size(), want.size());
      for (size_t p = 0; p < want.size(); ++p)
        for (size_t i = 0; i < want[p].size(); ++i)
          ASSERT_NEAR(got[p][i], want[p][i], 1e-6 * (1 + std::fabs(want[p][i])))
              << ddp.parameter_names()[p] << "[" << i << "]";
      ASSERT_EQ(group->gathered_into.size(), 2u);  // the lookup's indices and rows
      // The first size's pair is made once and used again after the second size's.
      EXPECT_EQ(group->allocations, buckets + (offers ? gather_buffers : 0));
      if (n == 12 && first_gather.empty()) first_gather = group->gathered_into;
      if (offers && n == 12) EXPECT_EQ(group->gathered_into, first_gather);
    }
    EXPECT_EQ(ddp.sparse_embedding_stats().sparse_lookups, 4);
  }
}

// The last bucket (the first parameters) is capped at last_bucket_bytes; the others fill up to
// bucket_bytes in reverse order as before. TwoLayers: a.weight 35, a.bias 7, b.weight 21,
// b.bias 3 floats.
TEST_F(DdpTest, TheLastBucketIsCappedAtLastBucketBytes) {
  TwoLayers m;
  dist::DistributedDataParallel ddp(m, nullptr, {.bucket_bytes = 1000, .last_bucket_bytes = 100});
  ASSERT_EQ(ddp.buckets().size(), 2u);
  EXPECT_EQ(ddp.buckets()[0].params, (std::vector<size_t>{3, 2, 1}));
  EXPECT_EQ(ddp.buckets()[1].params, (std::vector<size_t>{0}));  // 140 bytes >= 100: alone
  dist::DistributedDataParallel uncapped(m, nullptr,
                                         {.bucket_bytes = 1000, .last_bucket_bytes = 1000});
  ASSERT_EQ(uncapped.buckets().size(), 1u);
  EXPECT_EQ(uncapped.buckets()[0].params, (std::vector<size_t>{3, 2, 1, 0}));
}

TEST_F(NcclEnvTest, BadValuesNameTheVariable) {
  EXPECT_EQ(nccl_cta_policy_from_env(), std::nullopt);
  for (NcclCtaPolicy p : {NcclCtaPolicy::Default, NcclCtaPolicy::Efficiency, NcclCtaPolicy::Zero}) {
    setenv("TESSERA_NCCL_CTA_POLICY", nccl_cta_policy_name(p), 1);
    EXPECT_EQ(nccl_cta_policy_from_env(), p);
  }
  setenv("TESSERA_NCCL_CTA_POLICY", "Efficiency", 1);  // the names are lower case
  std::string message = error_of([] { nccl_cta_policy_from_env(); });
  EXPECT_NE(message.find("TESSERA_NCCL_CTA_POLICY='Efficiency' is not one of default, "
                         "efficiency, zero"),
            std::string::npos)
      << message;
  // The two 0/1 switches: unset, 1, 0 and a bad value.
  struct Switch {
    const char* name;
    bool (*read)();
    bool unset;
  };
  for (const Switch& s : {Switch{"TESSERA_NCCL_SYMMETRIC", nccl_symmetric_from_env, false},
                          Switch{"TESSERA_PEER_ALLREDUCE", peer_all_reduce_from_env, true}}) {
    EXPECT_EQ(s.read(), s.unset) << s.name;
    setenv(s.name, "1", 1);
    EXPECT_TRUE(s.read()) << s.name;
    setenv(s.name, "0", 1);
    EXPECT_FALSE(s.read()) << s.name;
    setenv(s.name, "true", 1);
    message = error_of([&] { s.read(); });
    EXPECT_NE(message.find(std::string(s.name) + "='true' must be 0 or 1"), std::string::npos)
        << message;
  }
}

TEST_F(CleanDistEnv, AcceleratorRefusesADamagedState) {
  const std::string dir = ::testing::TempDir() + "tessera_damaged_state";
  {
    dist::Accelerator acc({.cpu = true});
    TwoLayers m;
    optim::AdamW opt(m.parameters());
    acc.prepare(m, opt);
    EXPECT_EQ(acc.num_processes(), 1);
    EXPECT_TRUE(acc.is_main_process());
    EXPECT_EQ(acc.split_between_processes(std::vector<int>{1, 2, 3}), (std::vector<int>{1, 2, 3}));
    acc.save_state(dir);
    std::string text = tessera::read_file(dir + "/accelerator_state.json");
    text.replace(text.find("\"micro_step\": 0"), 15, "\"micro_step\": 9");
    tessera::write_file_atomically(dir + "/accelerator_state.json", text);
    try {
      acc.load_state(dir);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is damaged: CRC-32"), std::string::npos) << e.what();
    }
    acc.end_training();
  }
  EXPECT_FALSE(dist::is_initialized());
  EXPECT_THROW(dist::Accelerator({.gradient_accumulation_steps = 0}), Error);
  EXPECT_THROW(dist::Accelerator({.mixed_precision = "fp8"}), Error);
}

// ---- step gating (the training template calls opt.step() on every micro-step) ----

TEST(StepGate, ShutGateSkipsStepZeroGradAndScheduleStep) {
  Tensor w = from_vector(std::vector<float>{1.0f, -2.0f, 0.5f}, {3}).requires_grad_(true);
  optim::SGD opt({w}, {.lr = 0.1});
  optim::LinearSchedule sched(opt, {.warmup = 2, .total = 6});
  bool open = false;
  opt.set_step_gate([&] { return open; });
  sched.set_step_gate([&] { return open; });
  sum(w * w).backward();  // grad 2w
  const double lr0 = opt.lr();
  opt.step();
  sched.step();
  opt.zero_grad();
  EXPECT_EQ(w.detach().to_vector<float>(), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(sched.current_step(), 0);
  EXPECT_EQ(opt.lr(), lr0);
  open = true;
  opt.step();
  sched.step();
  // SGD with the warmup lr of step 0 (0.1 / 2): w - lr * 2w.
  std::vector<float> got = w.detach().to_vector<float>();
  std::vector<double> want{1.0, -2.0, 0.5};
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(got[i], want[i] * (1 - 2 * lr0), 1e-6);
  EXPECT_EQ(sched.current_step(), 1);
  EXPECT_DOUBLE_EQ(opt.lr(), 0.1);
  opt.zero_grad();
  EXPECT_FALSE(w.grad().defined());
  opt.set_step_gate({});  // no gate: always steps
  EXPECT_TRUE(opt.step_gate_open());
}

Tensor template_batch(int step, int64_t rows) {
  Generator g(500 + step);
  return randn({rows, 5}, {}, &g);
}

Tensor template_targets(int step, int64_t rows) {
  std::vector<int64_t> y(rows);
  for (int64_t i = 0; i < rows; ++i) y[i] = (step + 2 * i) % 3;
  return from_vector(y, {rows}, {.dtype = DType::i64});
}

TEST_F(CleanDistEnv, AcceleratorGatesTheTemplateLoopWhileAccumulating) {
  dist::Accelerator acc({.gradient_accumulation_steps = 2, .cpu = true});
  default_generator().manual_seed(3);
  TwoLayers m;
  optim::AdamW opt(m.parameters(), {.lr = 0.05});
  optim::LinearSchedule sched(opt, {.warmup = 2, .total = 8});
  acc.prepare(m, opt, sched);
  for (int micro = 0; micro < 4; ++micro) {
    std::vector<float> before = m.a.weight.detach().to_vector<float>();
    auto scope = acc.accumulate(m);
    acc.backward(cross_entropy(m(template_batch(micro, 4)), template_targets(micro, 4)));
    EXPECT_EQ(acc.clip_grad_norm_(m.parameters(), 1e9) > 0, scope.sync_gradients());
    opt.step();
    sched.step();
    opt.zero_grad();
    const bool changed = m.a.weight.detach().to_vector<float>() != before;
    EXPECT_EQ(changed, scope.sync_gradients()) << "micro-step " << micro;
    EXPECT_EQ(m.a.weight.grad().defined(), !scope.sync_gradients()) << "micro-step " << micro;
    EXPECT_EQ(sched.current_step(), (micro + 1) / 2);
  }
  acc.end_training();
  // Ungated again once training ended.
  sched.step();
  EXPECT_EQ(sched.current_step(), 3);
}

// ---- mixed precision ----

std::vector<float> as_floats(const Tensor& t) {
  return ops::contiguous(ops::to(t.detach(), Device::cpu(), DType::f32)).to_vector<float>();
}

struct MixedRun {
  std::vector<double> losses;
  bool autocast_inside = false, autocast_after = true;
  DType param_dtype = DType::f32, grad_dtype = DType::f32;
  std::vector<DType> master_dtypes;  // of the optimizer's "master" state tensors
  std::vector<int> updates_before;   // optimizer updates made before each step
  bool skipped = false;
};

MixedRun train_mixed(const std::string& precision, int steps) {
  dist::Accelerator acc({.mixed_precision = precision, .cpu = true});
  default_generator().manual_seed(11);
  TwoLayers m;
  optim::AdamW opt(m.parameters(), {.lr = 0.02});
  acc.prepare(m, opt);
  MixedRun run;
  for (int s = 0; s < steps; ++s) {
    {
      auto scope = acc.accumulate(m);
      run.autocast_inside = autograd::autocast_dtype().has_value();
      Tensor loss = cross_entropy(m(template_batch(0, 16)), template_targets(0, 16));
      run.losses.push_back(loss.item());
      run.updates_before.push_back(s == 0 ? 0 : run.updates_before.back() + (run.skipped ? 0 : 1));
      acc.backward(loss);
      acc.clip_grad_norm_(m.parameters(), 1.0);
      run.param_dtype = m.a.weight.dtype();
      run.skipped = acc.optimizer_step_was_skipped();  // fp16: the loss scale overflowed
      if (!run.skipped) run.grad_dtype = m.a.weight.grad().dtype();
      opt.step();
      opt.zero_grad();
    }
    run.autocast_after = autograd::autocast_dtype().has_value();
  }
  for (const auto& [key, t] : opt.state_dict().tensors)
    if (key.size() > 7 && key.substr(key.size() - 7) == ".master")
      run.master_dtypes.push_back(t.dtype());
  acc.end_training();
  return run;
}

// The policy: parameters (and gradients) in the low dtype from prepare() on, f32 masters
// in the optimizer, one per parameter. The losses track the f32 run: bf16 keeps 8
// significant bits (relative rounding 2^-9 = 0.2% per value), so logits computed from
// rounded weights and activations differ by a few 0.1%, and over 6 steps at lr 0.02 the
// masters (f32, updated from gradients accurate to ~1%) stay close; 3% is well above that.
// fp16 keeps 11 bits: 1%. fp16 steps skipped while the loss scale backs off make no
// update, so each fp16 loss is compared with the f32 loss after as many updates.
TEST_F(CleanDistEnv, Bf16AndFp16PoliciesTrackTheFp32LossWithF32Masters) {
  MixedRun fp32 = train_mixed("no", 6);
  EXPECT_FALSE(fp32.autocast_inside);
  EXPECT_EQ(fp32.param_dtype, DType::f32);
  EXPECT_TRUE(fp32.master_dtypes.empty());
  EXPECT_LT(fp32.losses.back(), fp32.losses.front());  // it trains
  for (auto [precision, dtype, rtol] :
       {std::tuple{"bf16", DType::bf16, 0.03}, std::tuple{"fp16", DType::f16, 0.01}}) {
    MixedRun low = train_mixed(precision, 6);
    EXPECT_TRUE(low.autocast_inside) << precision;
    EXPECT_FALSE(low.autocast_after) << precision;
    EXPECT_EQ(low.param_dtype, dtype) << precision;
    EXPECT_EQ(low.grad_dtype, dtype) << precision;
    EXPECT_EQ(low.master_dtypes, std::vector<DType>(4, DType::f32)) << precision;
    bool any_difference = false;
    EXPECT_GE(low.updates_before.back(), 3) << precision;
    for (size_t i = 0; i < low.losses.size(); ++i) {
      const double want = fp32.losses[low.updates_before[i]];
      EXPECT_NEAR(low.losses[i], want, rtol * std::fabs(want)) << precision << " step " << i;
      any_difference = any_difference || low.losses[i] != want;
    }
    EXPECT_TRUE(any_difference) << precision << " products must round differently from f32";
  }
}

TEST_F(CleanDistEnv, MixedPrecisionNeedsAnOptimizerWithMasters) {
  dist::Accelerator acc({.mixed_precision = "bf16", .cpu = true});
  TwoLayers m;
  optim::SGD opt(m.parameters(), {.lr = 0.1});
  try {
    acc.prepare(m, opt);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("SGD keeps no f32 master weights"), std::string::npos)
        << e.what();
  }
}

TEST_F(CleanDistEnv, Fp16LossScalingUnscalesAndSkipsNonFiniteSteps) {
  dist::Accelerator acc({.mixed_precision = "fp16", .cpu = true});
  default_generator().manual_seed(5);
  TwoLayers m;
  optim::AdamW opt(m.parameters(), {.lr = 0.1});
  Tensor x = template_batch(0, 8), y = template_targets(0, 8);
  // Reference: a plain f32 backward, unscaled (before the DDP hooks are attached).
  cross_entropy(m(x), y).backward();
  std::vector<std::vector<float>> want = grads_of(m);
  autograd::zero_grad(m.parameters());
  acc.prepare(m, opt);
  EXPECT_EQ(acc.loss_scale(), 65536.0);

  std::vector<float> before = as_floats(m.b.weight);
  // The f16 loss times 65536 overflows (f16 tops out at 65504): dynamic scaling skips
  // that step and halves the scale until the scaled gradients fit.
  int skipped = 0;
  for (bool stepped = false; !stepped;) {
    ASSERT_LT(skipped, 4) << "loss scaling never found a scale that fits";
    auto scope = acc.accumulate(m);
    acc.backward(cross_entropy(m(x), y));
    stepped = !acc.optimizer_step_was_skipped();
    if (stepped) {
      // Unscaled again: the f32 gradient to f16 accuracy (not `scale` times it).
      std::vector<std::vector<float>> got = grads_of(m);
      ASSERT_EQ(got.size(), want.size());
      for (size_t t = 0; t < want.size(); ++t) {
        double scale = 0, worst = 0;
        for (size_t i = 0; i < want[t].size(); ++i) {
          scale = std::max(scale, std::fabs(double(want[t][i])));
          worst = std::max(worst, std::fabs(double(got[t][i]) - want[t][i]));
        }
        EXPECT_LE(worst, 1e-2 * scale) << "parameter " << t;
      }
    } else {
      ++skipped;
      EXPECT_FALSE(m.b.weight.grad().defined());
      EXPECT_EQ(acc.loss_scale(), 65536.0 / (1 << skipped));
    }
    opt.step();
    opt.zero_grad();
    if (!stepped) EXPECT_EQ(as_floats(m.b.weight), before);
  }
  EXPECT_NE(as_floats(m.b.weight), before);

  // A loss so large that its scaled gradients overflow: the step is skipped, the
  // gradients dropped and the scale halved.
  before = as_floats(m.b.weight);
  {
    auto scope = acc.accumulate(m);
    acc.backward(cross_entropy(m(x), y) * 1e36);
    EXPECT_TRUE(acc.optimizer_step_was_skipped());
    EXPECT_EQ(acc.clip_grad_norm_(m.parameters(), 1.0), 0.0);
    opt.step();
    opt.zero_grad();
  }
  EXPECT_EQ(as_floats(m.b.weight), before);
  EXPECT_FALSE(m.b.weight.grad().defined());
  EXPECT_EQ(acc.loss_scale(), 65536.0 / (2 << skipped));
  acc.end_training();
}

// ---- ZeRO-Offload's host side (dist/offload.h) ----

TEST(HostWorker, RunsTasksInOrderAndReportsEachTasksError) {
  HostWorker worker(Device::cpu());
  std::vector<int> ran;
  std::vector<WorkPtr> works;
  for (int i = 0; i < 50; ++i) {
    if (i == 20) works.push_back(worker.run([] { throw Error("task 20 failed"); }));
    works.push_back(worker.run([&ran, i] { ran.push_back(i); }));
  }
  works.back()->wait();
  std::vector<int> want(50);
  for (int i = 0; i < 50; ++i) want[i] = i;
  EXPECT_EQ(ran, want);
  try {
    works[20]->wait();
    ADD_FAILURE() << "the failing task's Work did not rethrow";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("task 20 failed"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(works[21]->wait());
}

// ---- the rank's host threads (dist/host_threads.h) ----

TEST(HostThreadPool, RanksOfOneHostSplitItsCoresIntoContiguousBlocks) {
  const std::vector<int> eight = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(rank_cpu_share(eight, 0, 1), eight);
  EXPECT_EQ(rank_cpu_share(eight, 0, 3), (std::vector<int>{0, 1}));
  EXPECT_EQ(rank_cpu_share(eight, 1, 3), (std::vector<int>{2, 3, 4}));
  EXPECT_EQ(rank_cpu_share(eight, 2, 3), (std::vector<int>{5, 6, 7}));
  EXPECT_EQ(rank_cpu_share({4, 9}, 2, 3), (std::vector<int>{4}));  // fewer cores than ranks
  EXPECT_THROW(rank_cpu_share(eight, 3, 3), Error);
  EXPECT_FALSE(allowed_cpus().empty());
}

TEST(HostThreadPool, ThreadCountIsTheShareUnlessTheSettingSaysOtherwise) {
  clear_setting_option(Setting::OffloadThreads);
  EXPECT_EQ(offload_thread_count(6), 6);
  set_setting_option(Setting::OffloadThreads, "3");
  EXPECT_EQ(offload_thread_count(6), 3);
  clear_setting_option(Setting::OffloadThreads);
  try {
    set_setting_option(Setting::OffloadThreads, "-2");
    ADD_FAILURE() << "a negative thread count was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("TESSERA_OFFLOAD_THREADS"), std::string::npos) << e.what();
  }
  clear_setting_option(Setting::OffloadThreads);
}

TEST(HostThreadPool, ChunksAreContiguousCoverTheRangeAndRethrow) {
  HostThreadPool pool(3, allowed_cpus());
  ASSERT_EQ(pool.size(), 3);
  const int64_t n = 1001;
  std::vector<int> hits(n, 0);
  std::mutex m;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  pool.run(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ++hits[i];
    std::lock_guard<std::mutex> lock(m);
    chunks.push_back({begin, end});
  });
  EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), n);
  std::sort(chunks.begin(), chunks.end());
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0], (std::pair<int64_t, int64_t>{0, 336}));  // 334 rounded up to 16s
  EXPECT_EQ(chunks[1], (std::pair<int64_t, int64_t>{336, 672}));
  EXPECT_EQ(chunks[2], (std::pair<int64_t, int64_t>{672, 1001}));
  EXPECT_THROW(pool.run(n,
                        [](int64_t begin, int64_t) {
                          if (begin > 0) throw Error("chunk failed");
                        }),
               Error);
  int64_t covered = 0;  // still usable after an error
  pool.run(40, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(m);
    covered += end - begin;
  });
  EXPECT_EQ(covered, 40);
}

// The host AdamW (f32 parameters, and bf16 ones with f32 masters) over 100,003 elements —
// above parallel_ranges' inline threshold, not a multiple of a chunk — on 1, 2, 3 and 5
// pinned threads: the same bits after 3 steps, whatever the split.
TEST(HostThreadPool, HostAdamWOnAnyThreadCountMatchesOneThreadBitForBit) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    auto train = [&](int threads) {
      Generator gen(5);
      Tensor p = normal({100003, 1}, 0, 1, {.dtype = dtype}, &gen);
      p.requires_grad_(true);
      optim::AdamW opt({p},
                       {.lr = 1e-2, .weight_decay = 0.1, .master_weights = dtype == DType::bf16});
      HostThreadPool pool(threads, allowed_cpus());
      opt.set_range_runner(&pool.runner());
      for (int step = 0; step < 3; ++step) {
        p.set_grad(normal(p.shape(), 0, 1, {.dtype = dtype}, &gen));
        opt.step();
      }
      return ops::to(p, Device::cpu(), DType::f32).to_vector<float>();
    };
    const std::vector<float> one = train(1);
    for (int threads : {2, 3, 5}) {
      const std::vector<float> many = train(threads);
      ASSERT_EQ(many.size(), one.size());
      EXPECT_EQ(std::memcmp(many.data(), one.data(), one.size() * sizeof(float)), 0)
          << dtype_name(dtype) << " on " << threads << " threads";
    }
  }
}

// Two buckets: bf16 parameters (5 elements: the f32 average is rounded through bf16, as the
// device's bf16 gradient would be) and f32 (3 elements: copied as they are); then the masters
// go back in each target's dtype, and a reduction that failed fails the download.
TEST(OptimizerOffload, RoundsGradientsThroughTheParameterDtypeAndUploadsMasters) {
  OptimizerOffload offload(Device::cpu(), {{5, DType::bf16}, {3, DType::f32}});
  const std::vector<float> g0 = {0.1f, -1.0f / 3, 1e-3f, 2.7182817f, -123.456f};
  const std::vector<float> g1 = {0.1f, -1.0f / 3, 3.14159f};
  Tensor average0 = from_vector(g0, {5}), average1 = from_vector(g1, {3});
  WorkPtr d0 = offload.download_gradient(0, completed_work(), average0);
  WorkPtr d1 = offload.download_gradient(1, completed_work(), average1);
  d0->wait();
  d1->wait();
  const std::vector<float> rounded =
      ops::to(ops::to(average0, Device::cpu(), DType::bf16), Device::cpu(), DType::f32)
          .to_vector<float>();
  EXPECT_EQ(offload.gradient(0).to_vector<float>(), rounded);
  EXPECT_NE(rounded, g0);  // the rounding did something
  EXPECT_EQ(offload.gradient(1).to_vector<float>(), g1);

  offload.load_master(0, ops::to(from_vector(g0, {5}), Device::cpu(), DType::bf16));
  EXPECT_EQ(offload.master(0).to_vector<float>(), rounded);
  ops::copy_(offload.master(0), from_vector(g0, {5}));
  ops::copy_(offload.master(1), from_vector(g1, {3}));
  Tensor target0 = zeros({5}, {.dtype = DType::bf16}), target1 = zeros({3});
  std::vector<WorkPtr> uploads = offload.upload_parameters({target0, target1}, {1, 0});
  for (auto& w : uploads) w->wait();
  EXPECT_EQ(ops::to(target0, Device::cpu(), DType::f32).to_vector<float>(), rounded);
  EXPECT_EQ(target1.to_vector<float>(), g1);

  std::promise<void> failed;
  failed.set_exception(std::make_exception_ptr(Error("reduce_scatter timed out")));
  WorkPtr broken = std::make_shared<FutureWork>(failed.get_future().share());
  EXPECT_THROW(offload.download_gradient(1, broken, average1)->wait(), Error);
  EXPECT_THROW(offload.download_gradient(1, completed_work(), zeros({4})), Error);
}

}  // namespace
