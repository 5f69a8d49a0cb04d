// Multi-node jobs on one machine: two `tessera launch` processes as two nodes of 2 ranks each
// (Tessera's and Accelerate's spellings) train the same weights, bit for bit, as one launcher
// of 4 ranks; killing one node's launcher ends the other node's job naming the node; and
// ranks started by SLURM's srun (its environment set by hand) train what the launcher does;
// mpirun's ranks placed as two nodes train what one node of them does.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/data/token_file.h"

#include "run_job.h"

namespace fs = std::filesystem;

namespace {

using tessera::test_jobs::JobResult;
using tessera::test_jobs::run_job;

fs::path scratch() {
  static const fs::path dir = tessera::test_jobs::fresh_scratch_folder("tessera_test_launch_nodes");
  return dir;
}

// A port nothing listens on now, from `first` up (0: any the kernel picks).
int free_port(int first = 0) {
  for (int port = first; port < first + 1000; ++port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(port));
    socklen_t size = sizeof address;
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                       ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0;
    ::close(fd);
    if (bound) return ntohs(address.sin_port);
  }
  return -1;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// `tessera train` of a tiny model on a structured token stream, 4 optimizer steps, into `out`.
std::string tiny_training(const fs::path& out, int steps = 4) {
  const fs::path data = scratch() / "train.bin";
  if (!fs::exists(data)) {
    std::vector<uint32_t> tokens(4000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>((i * 7 + i / 5) % 90);
    tessera::data::write_token_file(data.string(), tokens);
  }
  return std::string(TESSERA_CLI) + " train --data " + data.string() +
         " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 2 --eval-every 0 --eval-batches 1 --steps " +
         std::to_string(steps) + " --out " + out.string();
}

std::string launcher(const std::string& flags) {
  return "env OMP_NUM_THREADS=1 HF_HOME=" + (scratch() / "hf").string() + " " + TESSERA_CLI + " launch " + flags;
}

const std::string& one_node_weights() {
  static const std::string weights = [] {
    const fs::path out = scratch() / "one_node";
    const JobResult r = run_job(launcher("--nproc-per-node 4 " + tiny_training(out)), 240);
    EXPECT_EQ(r.status, 0) << r.output;
    return slurp(out / "model" / "model.safetensors");
  }();
  return weights;
}

// Runs node 0 and node 1 (the flags of each, given the port) at once; both must succeed.
std::string two_node_weights(const std::string& name,
                             const std::function<std::string(int node, int port)>& flags) {
  const fs::path out = scratch() / name;
  const int port = free_port();
  const std::string node0 = launcher(flags(0, port) + " " + tiny_training(out));
  const std::string node1 = launcher(flags(1, port) + " " + tiny_training(scratch() / (name + "_node1")));
  const JobResult r = run_job("sh -c '" + node1 + " & other=$!; " + node0 +
                                  "; first=$?; wait $other; echo node0=$first node1=$?'",
                              240);
  EXPECT_NE(r.output.find("node0=0 node1=0"), std::string::npos) << r.output;
  return slurp(out / "model" / "model.safetensors");
}

TEST(LaunchNodes, TwoLaunchersAsTwoNodesTrainTheWeightsOfOneLauncherOfFourRanks) {
  const std::string want = one_node_weights();
  ASSERT_FALSE(want.empty());
  const std::string got = two_node_weights("tessera_flags", [](int node, int port) {
    return "--nnodes 2 --node-rank " + std::to_string(node) + " --nproc-per-node 2 --master-addr 127.0.0.1 "
           "--master-port " + std::to_string(port);
  });
  EXPECT_TRUE(got == want) << "2 nodes x 2 ranks trained other weights than 1 node x 4 ranks";
}

TEST(LaunchNodes, AccelerateSpellingsOfTwoNodesTrainTheSameWeights) {
  const std::string want = one_node_weights();
  ASSERT_FALSE(want.empty());
  const std::string got = two_node_weights("accelerate_flags", [](int node, int port) {
    return "--num_processes 4 --num_machines 2 --machine_rank " + std::to_string(node) +
           " --main_process_ip 127.0.0.1 --main_process_port " + std::to_string(port);
  });
  EXPECT_TRUE(got == want) << "Accelerate's spellings trained other weights than 1 node x 4 ranks";
}

TEST(LaunchNodes, KillingOneNodesLauncherEndsTheOtherNamingTheNode) {
  const int port = free_port();
  const fs::path out = scratch() / "killed";
  auto node = [&](int rank) {
    return launcher("--nnodes 2 --node-rank " + std::to_string(rank) +
                    " --nproc-per-node 2 --master-addr 127.0.0.1 --master-port " + std::to_string(port) + " " +
                    tiny_training(out / std::to_string(rank), 100000));
  };
  // Node 1's launcher is killed (-9, as a lost machine) once training runs; node 0's must
  // end within 10 s (`timeout 10 tail --pid` waits for it: 124 when it did not end).
  const JobResult r = run_job(
      "sh -c '" + node(0) + " & zero=$!; " + node(1) + " & one=$!; "
      "until grep -qs \"\\\"step\\\"\" " + (out / "0" / "metrics.jsonl").string() +
          "; do sleep 0.1; done; kill -9 $one; timeout 10 tail --pid=$zero -f /dev/null; echo ended=$?; "
          "kill -9 $zero 2>/dev/null; wait $zero; echo node0=$?'",
      120);
  EXPECT_NE(r.output.find("ended=0"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("node0=0"), std::string::npos) << r.output;
  // Node 0's ranks name the rank they lost, and node 0's launcher the node that rank ran on.
  EXPECT_NE(r.output.find("lost the connection to rank "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("this is node 0 of 2; ranks by node: node 0 = ranks 0-1, node 1 = ranks 2-3"),
            std::string::npos)
      << r.output;
}

TEST(LaunchNodes, RanksStartedBySrunTrainWhatTheLauncherTrains) {
  // What `srun --ntasks-per-node 2 tessera train ...` gives each task (examples/slurm_multinode.sbatch);
  // the rendezvous port comes from the job id (29500 + SLURM_JOB_ID % 1000).
  const int port = free_port(29500);
  ASSERT_GT(port, 0);
  const fs::path srun_out = scratch() / "srun", launch_out = scratch() / "launched";
  auto task = [&](int rank) {
    return "env -u MASTER_ADDR -u MASTER_PORT OMP_NUM_THREADS=1 SLURM_PROCID=" + std::to_string(rank) +
           " SLURM_LOCALID=" + std::to_string(rank) +
           " SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 SLURM_JOB_NODELIST=localhost SLURM_JOB_ID=" +
           std::to_string(port - 29500) + " " + tiny_training(srun_out);
  };
  const JobResult r =
      run_job("sh -c '" + task(1) + " & other=$!; " + task(0) + "; first=$?; wait $other; echo tasks=$first,$?'", 240);
  ASSERT_NE(r.output.find("tasks=0,0"), std::string::npos) << r.output;
  const JobResult launched = run_job(launcher("--nproc-per-node 2 " + tiny_training(launch_out)), 240);
  ASSERT_EQ(launched.status, 0) << launched.output;
  const std::string want = slurp(launch_out / "model" / "model.safetensors");
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(slurp(srun_out / "model" / "model.safetensors") == want)
      << "the srun-started ranks trained other weights than `tessera launch --nproc-per-node 2`";
}

// Over MPI there is one starter for every node (mpirun), so a second machine cannot be
// simulated by a second launcher: here mpirun's 4 local ranks are told they sit on two nodes
// of 2 (OMPI_COMM_WORLD_LOCAL_RANK/LOCAL_SIZE as mpirun sets them on two machines), and the
// MPI backend's run must equal one node of 4 bit for bit.
TEST(LaunchNodes, MpirunRanksPlacedOnTwoNodesTrainTheWeightsOfOneNodeOfFour) {
  if (std::string(DIST_MPIRUN).empty()) GTEST_SKIP() << "built without MPI";
  auto mpirun = [](const std::string& placement, const fs::path& out) {
    return "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 " +
           std::string(DIST_MPIRUN) + " --oversubscribe --bind-to none -np 4 sh -c '" + placement +
           " exec " + tiny_training(out) + "'";
  };
  const fs::path one = scratch() / "mpi_one_node", two = scratch() / "mpi_two_nodes";
  const JobResult a = run_job(mpirun("", one), 240);
  ASSERT_EQ(a.status, 0) << a.output;
  const JobResult b = run_job(
      mpirun("OMPI_COMM_WORLD_LOCAL_RANK=$((OMPI_COMM_WORLD_RANK % 2)) OMPI_COMM_WORLD_LOCAL_SIZE=2", two), 240);
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(a.output.find("over 4 processes"), std::string::npos) << a.output;
  const std::string want = slurp(one / "model" / "model.safetensors");
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(slurp(two / "model" / "model.safetensors") == want)
      << "MPI ranks on two nodes of 2 trained other weights than one node of 4";
}

TEST(LaunchNodes, TrainRefusesAnAccumulationOnlyTheLaunchAskedFor) {
  const JobResult r = run_job(launcher("--gradient_accumulation_steps 2 " + tiny_training(scratch() / "accum")), 120);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("the launch environment asks for 2 gradient accumulation steps"), std::string::npos)
      << r.output;
}

}  // namespace
