// Where this process sits in a distributed job, read from the environment that
// the job's starter left: `tessera launch` / torchrun (RANK, WORLD_SIZE, ...),
// `mpirun` (OMPI_COMM_WORLD_*) or SLURM (SLURM_PROCID, ...). A process started
// by hand with none of them is rank 0 of a world of 1.
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace tessera::dist {

enum class Launcher { None, Torchrun, Mpirun, Slurm };
const char* launcher_name(Launcher l);

struct DistEnv {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  std::string master_addr;  // empty when the starter gave none (mpirun without MASTER_ADDR)
  int master_port = 0;
  Launcher launcher = Launcher::None;

  bool has_master() const { return !master_addr.empty() && master_port > 0; }
};

// Reads the environment; torchrun names win over mpirun's, mpirun's over SLURM's.
// Malformed values (non-numbers, rank >= world size) are errors naming the variable.
// Under SLURM without MASTER_ADDR/MASTER_PORT, rank 0's node is the first host of
// SLURM_JOB_NODELIST (SLURM_NODELIST) and the port 29500 + SLURM_JOB_ID % 1000.
DistEnv read_dist_env();

// The first host name of a SLURM host list: "node[07-09,12],gpu1" -> "node07".
std::string first_slurm_host(const std::string& nodelist);

// The most ranks a job may have (1024 processes on each of 65536 nodes); a WORLD_SIZE beyond
// it is a typo or an overflow, not a job.
constexpr long long kMaxWorldSize = 1LL << 26;

// Lookups of the launch environment (RANK, MASTER_PORT, SLURM_*, HF_HOME: the variables of
// the launchers, not Tessera's settings), through tessera::environment_variable
// (core/settings.h). The value, or the fallback when unset/empty. A value that is not a
// number, or lies outside [min, max], is an error naming the variable, its text and the range
// (an integer too large for int is out of range, never wrapped). TESSERA_* settings are read
// through core/settings.h instead.
std::string env_string(const char* name, const std::string& fallback = "");
long long env_integer(const char* name, long long fallback, long long min, long long max);
int env_int(const char* name, int fallback, int min = INT_MIN, int max = INT_MAX);

// TESSERA_RENDEZVOUS_TIMEOUT (seconds, default 600): how long init_process_group waits for
// rank 0's store and for every rank to join it, printing progress, before an error naming
// the ranks that never joined.
double rendezvous_timeout_from_env();

// Opt-in NCCL settings (core/settings.h), read here so that the NCCL group (dist/cuda) and
// DDP agree and a CPU build can test the parsing. A bad value is an error naming the variable.
//
// TESSERA_NCCL_CTA_POLICY = default | efficiency | zero: the communicators are created with
// ncclCommInitRankConfig and that CTA policy (NCCL 2.27+; zero: 2.28+); unset: no config.
enum class NcclCtaPolicy : uint8_t { Default, Efficiency, Zero };
const char* nccl_cta_policy_name(NcclCtaPolicy policy);
std::optional<NcclCtaPolicy> nccl_cta_policy_from_env();
// TESSERA_NCCL_SYMMETRIC = 0 | 1 (unset: 0): DDP's gradient buckets are NCCL symmetric
// windows (ProcessGroup::allocate_communication_buffer), so NCCL can pick its symmetric
// kernels (NCCL 2.27+).
bool nccl_symmetric_from_env();
// TESSERA_PEER_ALLREDUCE = 0 | 1 (unset: 1): a group of two ranks on one host whose GPUs
// reach each other all-reduces DDP's gradient buckets through the copy engines
// (dist/cuda/peer_all_reduce.h) instead of NCCL's kernels; 0 keeps NCCL for them.
bool peer_all_reduce_from_env();

}  // namespace tessera::dist
