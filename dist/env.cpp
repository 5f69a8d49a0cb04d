#include "tessera/dist/env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "tessera/core/error.h"

namespace tessera::dist {

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::None: return "none";
    case Launcher::Torchrun: return "tessera launch/torchrun";
    case Launcher::Mpirun: return "mpirun";
    case Launcher::Slurm: return "slurm";
  }
  return "?";
}

std::string env_string(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

namespace {
bool has_env(const char* name) { return !env_string(name).empty(); }

long parse_long(const char* name, const std::string& text) {
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  TESSERA_CHECK(end && *end == '\0' && !text.empty(), "dist environment: ", name, "='", text,
                "' is not an integer");
  return value;
}
}  // namespace

int env_int(const char* name, int fallback) {
  std::string v = env_string(name);
  return v.empty() ? fallback : static_cast<int>(parse_long(name, v));
}

double env_double(const char* name, double fallback) {
  std::string v = env_string(name);
  if (v.empty()) return fallback;
  char* end = nullptr;
  double value = std::strtod(v.c_str(), &end);
  TESSERA_CHECK(end && *end == '\0', "dist environment: ", name, "='", v, "' is not a number");
  return value;
}

bool env_flag(const char* name) {
  std::string v = env_string(name);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

const char* nccl_cta_policy_name(NcclCtaPolicy policy) {
  switch (policy) {
    case NcclCtaPolicy::Default:
      return "default";
    case NcclCtaPolicy::Efficiency:
      return "efficiency";
    case NcclCtaPolicy::Zero:
      return "zero";
  }
  return "?";
}

std::optional<NcclCtaPolicy> nccl_cta_policy_from_env() {
  const std::string v = env_string("TESSERA_NCCL_CTA_POLICY");
  if (v.empty()) return std::nullopt;
  for (NcclCtaPolicy p : {NcclCtaPolicy::Default, NcclCtaPolicy::Efficiency, NcclCtaPolicy::Zero})
    if (v == nccl_cta_policy_name(p)) return p;
  TESSERA_FAIL("dist environment: TESSERA_NCCL_CTA_POLICY='", v,
               "' is not one of default, efficiency, zero (or unset for NCCL's own choice)");
}

namespace {
// A switch that is 0 or 1 (anything else is an error naming it), `unset` when not set.
bool zero_or_one(const char* name, bool unset) {
  const std::string v = env_string(name);
  TESSERA_CHECK(v.empty() || v == "0" || v == "1", "dist environment: ", name, "='", v,
                "' must be 0 or 1");
  return v.empty() ? unset : v == "1";
}
}  // namespace

bool nccl_symmetric_from_env() { return zero_or_one("TESSERA_NCCL_SYMMETRIC", false); }

bool peer_all_reduce_from_env() { return zero_or_one("TESSERA_PEER_ALLREDUCE", true); }

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at a comma outside brackets; a bracket holds numbers or ranges
  // whose first number (with its zero padding) completes the name.
  size_t bracket = nodelist.find('[');
  size_t comma = nodelist.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket))
    return nodelist.substr(0, comma);
  size_t end = nodelist.find_first_of("-,]", bracket + 1);
  TESSERA_CHECK(end != std::string::npos, "dist environment: cannot read SLURM node list '",
                nodelist, "'");
  return nodelist.substr(0, bracket) + nodelist.substr(bracket + 1, end - bracket - 1);
}

DistEnv read_dist_env() {
  DistEnv env;
  if (has_env("RANK") || has_env("WORLD_SIZE")) {
    env.launcher = Launcher::Torchrun;
    env.rank = env_int("RANK", 0);
    env.world_size = env_int("WORLD_SIZE", 1);
    env.local_rank = env_int("LOCAL_RANK", env.rank);
    env.local_world_size = env_int("LOCAL_WORLD_SIZE", env.world_size);
  } else if (has_env("OMPI_COMM_WORLD_RANK")) {
    env.launcher = Launcher::Mpirun;
    env.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    env.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    env.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env.rank);
    env.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", env.world_size);
  } else if (has_env("SLURM_PROCID")) {
    env.launcher = Launcher::Slurm;
    env.rank = env_int("SLURM_PROCID", 0);
    env.world_size = env_int("SLURM_NTASKS", 1);
    env.local_rank = env_int("SLURM_LOCALID", 0);
    // SLURM_NTASKS_PER_NODE may read "4" or "4(x2)"; the leading number is what we want.
    std::string per_node = env_string("SLURM_NTASKS_PER_NODE");
    env.local_world_size = per_node.empty() ? env.world_size : std::atoi(per_node.c_str());
    if (env.local_world_size <= 0) env.local_world_size = env.world_size;
  }
  env.master_addr = env_string("MASTER_ADDR");
  env.master_port = env_int("MASTER_PORT", 0);
  if (env.launcher == Launcher::Slurm) {
    if (env.master_addr.empty())
      env.master_addr = first_slurm_host(env_string("SLURM_JOB_NODELIST", env_string("SLURM_NODELIST")));
    if (env.master_port == 0 && !env.master_addr.empty())
      env.master_port = 29500 + env_int("SLURM_JOB_ID", 0) % 1000;
  }
  TESSERA_CHECK(env.world_size >= 1, "dist environment: world size ", env.world_size,
                " must be >= 1 (launcher: ", launcher_name(env.launcher), ")");
  TESSERA_CHECK(env.rank >= 0 && env.rank < env.world_size, "dist environment: rank ", env.rank,
                " is outside the world of ", env.world_size, " (launcher: ",
                launcher_name(env.launcher), ")");
  TESSERA_CHECK(env.local_rank >= 0 && env.local_rank < std::max(env.local_world_size, 1),
                "dist environment: local rank ", env.local_rank, " is outside the ",
                env.local_world_size, " local processes (launcher: ", launcher_name(env.launcher),
                ")");
  TESSERA_CHECK(env.master_port >= 0 && env.master_port < 65536, "dist environment: MASTER_PORT=",
                env.master_port, " is not a TCP port");
  return env;
}

}  // namespace tessera::dist
