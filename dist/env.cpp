#include "tessera/dist/env.h"

#include <cerrno>
#include <cstdlib>

#include "tessera/core/error.h"
#include "tessera/core/settings.h"

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
  const std::string value = environment_variable(name).value_or("");
  return value.empty() ? fallback : value;
}

namespace {
bool has_env(const char* name) { return !env_string(name).empty(); }

// `text` (the value of variable `name`) as an integer in [min, max]; `note` says where the
// range comes from when another variable sets it.
long long parse_integer(const char* name, const std::string& text, long long min, long long max,
                        const std::string& note = "") {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TESSERA_CHECK(end && *end == '\0' && !text.empty(), "dist environment: ", name, "='", text,
                "' is not an integer");
  TESSERA_CHECK(errno != ERANGE && value >= min && value <= max, "dist environment: ", name, "=",
                text, " is out of range: it must be in [", min, ", ", max, "]", note);
  return value;
}

long long bounded(const char* name, long long fallback, long long min, long long max,
                  const std::string& note = "") {
  const std::string v = env_string(name);
  return v.empty() ? fallback : parse_integer(name, v, min, max, note);
}
}  // namespace

long long env_integer(const char* name, long long fallback, long long min, long long max) {
  return bounded(name, fallback, min, max);
}

int env_int(const char* name, int fallback, int min, int max) {
  return static_cast<int>(bounded(name, fallback, min, max));
}

double rendezvous_timeout_from_env() {
  const double seconds = setting_number(Setting::RendezvousTimeout);
  TESSERA_CHECK(seconds > 0, "dist environment: TESSERA_RENDEZVOUS_TIMEOUT must be positive");
  return seconds;
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
  const std::string v = setting_text(Setting::NcclCtaPolicy);  // validated: one of the three
  for (NcclCtaPolicy p : {NcclCtaPolicy::Default, NcclCtaPolicy::Efficiency, NcclCtaPolicy::Zero})
    if (v == nccl_cta_policy_name(p)) return p;
  return std::nullopt;
}

bool nccl_symmetric_from_env() { return setting_enabled(Setting::NcclSymmetric); }

bool peer_all_reduce_from_env() { return setting_enabled(Setting::PeerAllReduce); }

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

namespace {
// The variables one starter uses for a process's place in the job.
struct PlaceVariables {
  Launcher launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;  // null: read specially (SLURM)
};
constexpr PlaceVariables kTorchrun{Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                   "LOCAL_WORLD_SIZE"};
constexpr PlaceVariables kMpirun{Launcher::Mpirun, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
constexpr PlaceVariables kSlurm{Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                nullptr};

// SLURM_NTASKS_PER_NODE may read "4" or "4(x2)" (or "2,1" on uneven nodes); the leading
// number is what we want.
int slurm_tasks_per_node(int world_size) {
  const std::string text = env_string("SLURM_NTASKS_PER_NODE");
  const std::string leading = text.substr(0, text.find_first_not_of("0123456789"));
  if (leading.empty()) return world_size;
  return static_cast<int>(parse_integer("SLURM_NTASKS_PER_NODE", leading, 1, kMaxWorldSize));
}

// Every value is range-checked as it is read, so a value too large for an int is named as
// out of range instead of wrapping (WORLD_SIZE=99999999999999999999 once read as -1).
void read_place(const PlaceVariables& v, DistEnv& env) {
  env.launcher = v.launcher;
  env.world_size = static_cast<int>(bounded(v.world_size, 1, 1, kMaxWorldSize));
  const std::string world = detail::concat(" (", v.world_size, "=", env.world_size, ")");
  env.rank = static_cast<int>(bounded(v.rank, 0, 0, env.world_size - 1, world));
  env.local_world_size = v.local_world_size
                             ? static_cast<int>(bounded(v.local_world_size, env.world_size, 1,
                                                        kMaxWorldSize))
                             : slurm_tasks_per_node(env.world_size);
  const std::string local =
      v.local_world_size
          ? detail::concat(" (", v.local_world_size, "=", env.local_world_size, ")")
          : detail::concat(" (", env.local_world_size, " tasks per node)");
  // A starter that gives no local rank runs every rank on one node (torchrun, mpirun) or
  // says so (SLURM always sets SLURM_LOCALID).
  const long long local_fallback = v.launcher == Launcher::Slurm ? 0 : env.rank;
  env.local_rank =
      static_cast<int>(bounded(v.local_rank, local_fallback, 0, env.local_world_size - 1, local));
  TESSERA_CHECK(env.local_rank < env.local_world_size, "dist environment: ", v.local_rank,
                " is not set and rank ", env.rank, " is outside the ", env.local_world_size,
                " local processes", local, " (launcher: ", launcher_name(v.launcher), ")");
}
}  // namespace

DistEnv read_dist_env() {
  DistEnv env;
  if (has_env("RANK") || has_env("WORLD_SIZE")) {
    read_place(kTorchrun, env);
  } else if (has_env("OMPI_COMM_WORLD_RANK")) {
    read_place(kMpirun, env);
  } else if (has_env("SLURM_PROCID")) {
    read_place(kSlurm, env);
  }
  env.master_addr = env_string("MASTER_ADDR");
  env.master_port = env_int("MASTER_PORT", 0, 0, 65535);
  if (env.launcher == Launcher::Slurm) {
    if (env.master_addr.empty())
      env.master_addr = first_slurm_host(env_string("SLURM_JOB_NODELIST", env_string("SLURM_NODELIST")));
    if (env.master_port == 0 && !env.master_addr.empty())
      env.master_port = 29500 + static_cast<int>(env_integer("SLURM_JOB_ID", 0, 0, LLONG_MAX) % 1000);
  }
  return env;
}

}  // namespace tessera::dist
