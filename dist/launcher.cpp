#include "tessera/dist/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <iterator>
#include <optional>
#include <set>
#include <thread>

#include "tessera/core/error.h"
#include "tessera/core/settings.h"
#include "tessera/dist/deepspeed_config.h"
#include "tessera/dist/env.h"
#include "tessera/dist/socket.h"

namespace tessera::dist {
namespace {

using Clock = std::chrono::steady_clock;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// The launcher's signal handler only records: the first signal and how many arrived.
std::atomic<int> g_stop_signal{0};
std::atomic<int> g_stop_signal_count{0};
void on_stop_signal(int sig) {
  int none = 0;
  g_stop_signal.compare_exchange_strong(none, sig);
  g_stop_signal_count.fetch_add(1);
}
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGUSR1};

struct Rank {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;                        // waitpid status once exited
  int out_fd = -1, err_fd = -1;          // read ends of its stdout/stderr pipes (-1: inherited)
  std::string out_partial, err_partial;  // text after the last newline
};

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return detail::concat("was killed by signal ", WTERMSIG(status), " (",
                          strsignal(WTERMSIG(status)), ")");
  return "ended abnormally";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ",") + std::to_string(r);
  return text;
}

// Writes complete lines from `chunk` prefixed with the rank; keeps the unfinished tail.
void forward_output(int rank, std::string& partial, const char* chunk, size_t n, std::ostream& os,
                    bool flush_all) {
  partial.append(chunk, n);
  size_t start = 0, newline;
  while ((newline = partial.find('\n', start)) != std::string::npos) {
    os << "[rank " << rank << "] " << partial.substr(start, newline - start + 1);
    start = newline + 1;
  }
  partial.erase(0, start);
  if (flush_all && !partial.empty()) {
    os << "[rank " << rank << "] " << partial << "\n";
    partial.clear();
  }
  os.flush();
}

// Reads what is available on a rank's pipe; closes it at end of file.
void drain(Rank& r, int& fd, std::string& partial, std::ostream& os) {
  char buffer[65536];
  ssize_t n = ::read(fd, buffer, sizeof buffer);
  if (n > 0) {
    forward_output(r.rank, partial, buffer, n, os, false);
  } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
    forward_output(r.rank, partial, nullptr, 0, os, true);
    ::close(fd);
    fd = -1;
  }
}

// ---- descendants that left their rank's process group ----

// /proc/<pid>/stat, or "" when the process is gone. A process may exit between the open and
// the read, which then fails with ESRCH: read(2) reports it, where std::ifstream's buffer
// throws from inside the library (a launcher that had just seen its ranks exit died of it).
std::string read_proc_stat(const char* pid) {
  const std::string path = std::string("/proc/") + pid + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string stat;
  char buffer[512];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      stat.append(buffer, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      if (n < 0) stat.clear();
      break;
    }
  }
  ::close(fd);
  return stat;
}

// This process's children other than `known` (ranks, and children it had before the job):
// with PR_SET_CHILD_SUBREAPER set, orphaned descendants of the ranks are re-parented here.
std::vector<pid_t> stray_children(const std::set<pid_t>& known) {
  std::vector<pid_t> strays;
  DIR* proc = ::opendir("/proc");
  if (!proc) return strays;
  const pid_t self = ::getpid();
  while (dirent* entry = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (pid <= 0 || *end != '\0' || known.count(static_cast<pid_t>(pid))) continue;
    const std::string stat = read_proc_stat(entry->d_name);
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so parse from the last
    // ')'.
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    char state = 0;
    long ppid = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %ld", &state, &ppid) == 2 && ppid == self)
      strays.push_back(static_cast<pid_t>(pid));
  }
  ::closedir(proc);
  return strays;
}

// Kills and reaps every stray child, round after round, since killing one re-parents its
// own children here.
void kill_strays(const std::set<pid_t>& known) {
  for (int round = 0; round < 1000; ++round) {
    const std::vector<pid_t> strays = stray_children(known);
    if (strays.empty()) return;
    for (pid_t pid : strays) {
      if (::getpgid(pid) == pid) ::kill(-pid, SIGKILL);  // it may lead a group of its own
      ::kill(pid, SIGKILL);
    }
    for (pid_t pid : strays) ::waitpid(pid, nullptr, 0);
  }
}

// ---- starting one rank ----

struct JobShape {
  int world_size = 1;
  int master_port = 0;
  int restart_count = 0;
};

[[noreturn]] void exec_rank(const LaunchOptions& o, const Rank& r, const JobShape& job,
                            const int out_pipe[2], const int err_pipe[2], pid_t parent) {
  ::setpgid(0, 0);  // own process group, so stopping a rank stops its children too
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a launcher that was killed
  if (::getppid() != parent) ::_exit(127);
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);  // not inherited, but say so: ranks reap nothing of ours
  for (int sig : kForwardedSignals) ::signal(sig, SIG_DFL);
  if (out_pipe[1] >= 0) {
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
  }
  auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
  set("RANK", std::to_string(r.rank));
  set("LOCAL_RANK", std::to_string(r.local_rank));
  set("WORLD_SIZE", std::to_string(job.world_size));
  set("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node));
  set("GROUP_RANK", std::to_string(o.node_rank));
  set("MASTER_ADDR", o.master_addr);
  set("MASTER_PORT", std::to_string(job.master_port));
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(job.restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts));
  set("TESSERA_RESTART_COUNT", std::to_string(job.restart_count));
  if (!o.mixed_precision.empty()) set("TESSERA_MIXED_PRECISION", o.mixed_precision);
  if (!o.reduce_dtype.empty()) set("TESSERA_REDUCE_DTYPE", o.reduce_dtype);
  if (o.watchdog_timeout_s) set("TESSERA_WATCHDOG_TIMEOUT", detail::concat(*o.watchdog_timeout_s));
  if (!o.watchdog_action.empty()) set("TESSERA_WATCHDOG_ACTION", o.watchdog_action);
  if (o.zero_stage) set("TESSERA_ZERO_STAGE", std::to_string(*o.zero_stage));
  if (!o.deepspeed_config_file.empty()) set("TESSERA_DEEPSPEED_CONFIG", o.deepspeed_config_file);
  if (!o.fsdp_sharding_strategy.empty())
    set("TESSERA_FSDP_SHARDING_STRATEGY", o.fsdp_sharding_strategy);
  if (o.gradient_accumulation_steps)
    set("TESSERA_GRADIENT_ACCUMULATION_STEPS", std::to_string(*o.gradient_accumulation_steps));
  if (o.use_cpu) set("TESSERA_USE_CPU", "1");
  if (o.tp_size) set("TESSERA_TP_SIZE", std::to_string(*o.tp_size));
  if (o.pp_size) set("TESSERA_PP_SIZE", std::to_string(*o.pp_size));
  if (!o.gpu_ids.empty() && o.gpu_ids != "all") set("CUDA_VISIBLE_DEVICES", o.gpu_ids);
  // Like torchrun: ranks sharing a node share its cores, so each one's OpenMP pool gets
  // its part (oversubscribed spinning pools slow every rank's host thread down).
  if (!environment_variable("OMP_NUM_THREADS") && o.nproc_per_node > 1) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    set("OMP_NUM_THREADS", std::to_string(std::max<unsigned>(1, cores / o.nproc_per_node)));
  }
  std::vector<char*> argv;
  for (const std::string& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "tessera launch: cannot run '%s': %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

// Forks rank `r`; its output goes through pipes unless it is rank 0. Throws (leaving no
// descriptor open) when a pipe or the fork fails.
void spawn(const LaunchOptions& o, const JobShape& job, Rank& r) {
  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  auto close_pipes = [&] {
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]})
      if (fd >= 0) ::close(fd);
  };
  if (r.rank != 0 && (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)) {
    const int error = errno;
    close_pipes();
    TESSERA_FAIL("tessera launch: cannot start rank ", r.rank,
                 ": pipe failed: ", std::strerror(error));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    close_pipes();
    TESSERA_FAIL("tessera launch: cannot start rank ", r.rank,
                 ": fork failed: ", std::strerror(error));
  }
  if (pid == 0) exec_rank(o, r, job, out_pipe, err_pipe, parent);
  ::setpgid(pid, pid);  // also from the parent, so signals never race the child's setpgid
  r.pid = pid;
  r.running = true;
  if (r.rank != 0) {
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    r.out_fd = out_pipe[0];
    r.err_fd = err_pipe[0];
  }
}

// ---- one attempt of the job ----

enum class Outcome { kSucceeded, kRankFailed, kExitBarrierTimedOut, kInterrupted };

class Attempt {
 public:
  Attempt(const LaunchOptions& o, const JobShape& job, const std::set<pid_t>& known)
      : o_(o), job_(job), known_(known), ranks_(o.nproc_per_node) {}
  ~Attempt() { kill_everything(); }

  // Starts every rank and runs until all have ended; on a failure to start, stops the
  // ranks already started and rethrows.
  Outcome run();
  int exit_code() const;
  void report_failures() const;

 private:
  void start();
  void forward_available_output();
  void reap_exited();
  void decide_whether_to_stop();
  void forward_further_signals();
  void begin_stopping(int sig);
  void signal_all(int sig);
  void kill_everything();
  bool pipes_open() const;

  const LaunchOptions& o_;
  JobShape job_;
  std::set<pid_t> known_;
  std::vector<Rank> ranks_;
  int running_ = 0;
  // Ranks that failed on their own, before the launcher began stopping the job. Peers of
  // a failed rank often fail a moment later (or even sooner: the failed rank's sockets
  // close before its process has finished exiting), so failures seen within a short
  // settling time are all reported, and the job is stopped after it.
  std::vector<const Rank*> failures_;
  Clock::time_point settle_until_;
  std::optional<Clock::time_point> barrier_deadline_;  // set when the first rank exits 0
  int first_finished_rank_ = -1;
  bool stopping_ = false;
  // A signal reached the launcher and was forwarded to every rank: they stop in their own
  // time (`tessera train` saves a checkpoint first), so their exits are not failures.
  bool interrupted_ = false;
  int signals_forwarded_ = 0;
  Clock::time_point kill_at_;
  Outcome outcome_ = Outcome::kSucceeded;
};

void Attempt::start() {
  for (int local = 0; local < o_.nproc_per_node; ++local) {
    Rank& r = ranks_[local];
    r.local_rank = local;
    r.rank = o_.node_rank * o_.nproc_per_node + local;
    try {
      spawn(o_, job_, r);
    } catch (const Error&) {
      std::cerr << "tessera launch: starting the ranks failed after " << local
                << " of them; stopping those\n";
      kill_everything();
      throw;
    }
    known_.insert(r.pid);
    ++running_;
  }
}

Outcome Attempt::run() {
  start();
  bool strays_killed = false;
  while (running_ > 0 || pipes_open()) {
    forward_available_output();
    reap_exited();
    if (interrupted_ && !stopping_) forward_further_signals();
    if (!stopping_ && !interrupted_) decide_whether_to_stop();
    if (running_ == 0 && !strays_killed) {
      kill_strays(known_);  // they may hold the ranks' pipes open
      strays_killed = true;
    }
    if (stopping_ && Clock::now() >= kill_at_) {
      signal_all(SIGKILL);
      kill_strays(known_);
      // Ranks' pipes may be held open by descendants that ignore us; stop reading them.
      for (Rank& r : ranks_) {
        if (r.running) continue;
        for (int* fd : {&r.out_fd, &r.err_fd})
          if (*fd >= 0) ::close(*fd), *fd = -1;
      }
    }
  }
  kill_strays(known_);
  return outcome_;
}

int Attempt::exit_code() const {
  switch (outcome_) {
    case Outcome::kSucceeded:
      return 0;
    case Outcome::kRankFailed:
      return exit_code_of(failures_.front()->status);
    case Outcome::kExitBarrierTimedOut:
      return 1;
    case Outcome::kInterrupted:
      if (std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
            return exit_code_of(r.status) == kPreemptedExitStatus;
          }))
        return kPreemptedExitStatus;
      return 128 + g_stop_signal;
  }
  return 1;
}

void Attempt::report_failures() const {
  if (outcome_ != Outcome::kRankFailed) return;
  for (const Rank* f : failures_)
    std::cerr << "tessera launch: job failed: rank " << f->rank << " " << describe_exit(f->status)
              << "\n";
  // A rank that lost another node names the peer rank it lost; say which node that is.
  if (o_.nnodes > 1) {
    std::cerr << "tessera launch: this is node " << o_.node_rank << " of " << o_.nnodes
              << "; ranks by node:";
    for (int node = 0; node < o_.nnodes && node < 16; ++node)
      std::cerr << (node ? "," : "") << " node " << node << " = ranks " << node * o_.nproc_per_node
                << "-" << (node + 1) * o_.nproc_per_node - 1;
    std::cerr << (o_.nnodes > 16 ? ", ...\n" : "\n");
  }
}

bool Attempt::pipes_open() const {
  return std::any_of(ranks_.begin(), ranks_.end(),
                     [](const Rank& r) { return r.out_fd >= 0 || r.err_fd >= 0; });
}

void Attempt::forward_available_output() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, bool>> owners;  // (rank, is stderr)
  for (Rank& r : ranks_) {
    if (r.out_fd >= 0) fds.push_back({r.out_fd, POLLIN, 0}), owners.push_back({&r, false});
    if (r.err_fd >= 0) fds.push_back({r.err_fd, POLLIN, 0}), owners.push_back({&r, true});
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return;
  }
  if (::poll(fds.data(), fds.size(), 50) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    Rank& r = *owners[i].first;
    if (owners[i].second)
      drain(r, r.err_fd, r.err_partial, std::cerr);
    else
      drain(r, r.out_fd, r.out_partial, std::cout);
  }
}

// Reaps ranks that ended: failures start the settling time, the first success the exit
// barrier.
void Attempt::reap_exited() {
  for (Rank& r : ranks_) {
    if (!r.running) continue;
    int status = 0;
    if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
    r.running = false;
    r.status = status;
    --running_;
    ::kill(-r.pid, SIGKILL);  // leftovers of the rank's own children
    if (stopping_ || interrupted_) continue;
    if (exit_code_of(status) != 0) {
      if (failures_.empty()) settle_until_ = Clock::now() + std::chrono::milliseconds(500);
      failures_.push_back(&r);
    } else if (!barrier_deadline_) {
      barrier_deadline_ = Clock::now() + seconds(o_.exit_barrier_timeout_s);
      first_finished_rank_ = r.rank;
    }
  }
}

void Attempt::decide_whether_to_stop() {
  const Clock::time_point now = Clock::now();
  if (!failures_.empty() && (now >= settle_until_ || running_ == 0)) {
    outcome_ = Outcome::kRankFailed;
    for (const Rank* f : failures_)
      std::cerr << "tessera launch: rank " << f->rank << " (pid " << f->pid << ") "
                << describe_exit(f->status) << "\n";
    if (running_ > 0) std::cerr << "tessera launch: stopping the other ranks\n";
  } else if (failures_.empty() && g_stop_signal) {
    outcome_ = Outcome::kInterrupted;
    interrupted_ = true;
    signals_forwarded_ = g_stop_signal_count;
    std::cerr << "tessera launch: interrupted (SIG" << sigabbrev_np(g_stop_signal.load())
              << "): forwarded to every rank; waiting for them to exit (a second signal stops "
                 "them at once)\n";
    signal_all(g_stop_signal);
    return;
  } else if (failures_.empty() && barrier_deadline_ && now >= *barrier_deadline_ && running_ > 0) {
    outcome_ = Outcome::kExitBarrierTimedOut;
    std::vector<int> late;
    for (const Rank& r : ranks_)
      if (r.running) late.push_back(r.rank);
    std::cerr << "tessera launch: rank" << (late.size() > 1 ? "s " : " ") << join_ranks(late)
              << " did not exit within the exit barrier timeout (" << o_.exit_barrier_timeout_s
              << " s) after rank " << first_finished_rank_ << " exited 0; stopping "
              << (late.size() > 1 ? "them" : "it") << "\n";
  } else {
    return;
  }
  begin_stopping(SIGTERM);
}

// After the first forwarded signal: a further one is forwarded too (a rank of `tessera train`
// then ends at once) and the ranks are killed if they have not ended within the stop grace.
void Attempt::forward_further_signals() {
  if (g_stop_signal_count <= signals_forwarded_) return;
  std::cerr << "tessera launch: signalled again; stopping all ranks now\n";
  begin_stopping(g_stop_signal);
}

void Attempt::begin_stopping(int sig) {
  stopping_ = true;
  signal_all(sig);
  signal_all(SIGCONT);  // a stopped rank (SIGSTOP, a debugger let go) gets its signal now
  kill_at_ = Clock::now() + seconds(o_.stop_grace_s);
}

void Attempt::signal_all(int sig) {
  for (Rank& r : ranks_)
    if (r.running) ::kill(-r.pid, sig);  // the rank's whole process group
}

// Kills every rank's group and every stray descendant, and reaps them (no zombies, no
// orphans), closing the output pipes.
void Attempt::kill_everything() {
  for (Rank& r : ranks_) {
    if (r.running) {
      ::kill(-r.pid, SIGKILL);
      ::waitpid(r.pid, &r.status, 0);
      r.running = false;
    }
    for (int* fd : {&r.out_fd, &r.err_fd})
      if (*fd >= 0) ::close(*fd), *fd = -1;
  }
  running_ = 0;
  kill_strays(known_);
}

// Installs the launcher's signal handlers and makes it a child subreaper for the job's
// duration; restores both afterwards, also when launching throws.
class JobScope {
 public:
  JobScope() {
    g_stop_signal = 0;
    g_stop_signal_count = 0;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i)
      sigaction(kForwardedSignals[i], &action, &old_actions_[i]);
    ::prctl(PR_GET_CHILD_SUBREAPER, &old_subreaper_);
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  }
  ~JobScope() {
    ::prctl(PR_SET_CHILD_SUBREAPER, old_subreaper_);
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i)
      sigaction(kForwardedSignals[i], &old_actions_[i], nullptr);
  }

 private:
  struct sigaction old_actions_[std::size(kForwardedSignals)] {};
  int old_subreaper_ = 0;
};

}  // namespace

void validate(const LaunchOptions& o) {
  TESSERA_CHECK(!o.command.empty(), "tessera launch: no program given");
  auto check_range = [](const char* name, double value, double low, double high) {
    TESSERA_CHECK(value >= low && value <= high, "tessera launch: ", name, " must be in [", low,
                  ", ", high, "]; got ", value);
  };
  check_range("--nproc-per-node", o.nproc_per_node, 1, kMaxProcsPerNode);
  check_range("--nnodes", o.nnodes, 1, kMaxNodes);
  check_range("--node-rank", o.node_rank, 0, o.nnodes - 1);
  check_range("--max-restarts", o.max_restarts, 0, kMaxRestarts);
  check_range("--exit-barrier-timeout", o.exit_barrier_timeout_s, 0, 1e9);
  check_range("--master-port", o.master_port, 0, 65535);
  if (o.watchdog_timeout_s) check_range("--watchdog-timeout", *o.watchdog_timeout_s, 0, 1e9);
  if (o.zero_stage) check_range("--zero_stage", *o.zero_stage, 0, 3);
  if (o.tp_size) check_range("--tp-size", *o.tp_size, 1, 65536);
  if (o.pp_size) check_range("--pp-size", *o.pp_size, 1, 65536);
  {
    const long long model = static_cast<long long>(o.tp_size.value_or(1)) * o.pp_size.value_or(1);
    const long long world = static_cast<long long>(o.nproc_per_node) * o.nnodes;
    TESSERA_CHECK(world % model == 0, "tessera launch: --tp-size ", o.tp_size.value_or(1),
                  " x --pp-size ", o.pp_size.value_or(1), " = ", model,
                  " does not divide the world size ", world, " (--nproc-per-node ",
                  o.nproc_per_node, " x --nnodes ", o.nnodes, ")");
  }
  if (o.gradient_accumulation_steps)
    check_range("--gradient_accumulation_steps", *o.gradient_accumulation_steps, 1, 1e6);
  if (!o.fsdp_sharding_strategy.empty()) {
    try {
      fsdp_sharding_stage(o.fsdp_sharding_strategy);
    } catch (const Error& e) {
      TESSERA_FAIL("tessera launch: --fsdp_sharding_strategy: ", e.what());
    }
  }
  TESSERA_CHECK(o.gpu_ids.find_first_not_of("0123456789,") == std::string::npos ||
                    o.gpu_ids == "all",
                "tessera launch: --gpu_ids must be all or a comma-separated list of device "
                "numbers; got '", o.gpu_ids, "'");
  TESSERA_CHECK(o.watchdog_action.empty() || o.watchdog_action == "end" ||
                    o.watchdog_action == "report",
                "tessera launch: --watchdog-action must be end or report; got '",
                o.watchdog_action, "'");
}

void take_master_from_environment(LaunchOptions& o, bool addr_flag_given, bool port_flag_given) {
  if (!addr_flag_given) o.master_addr = env_string("MASTER_ADDR", o.master_addr);
  if (!port_flag_given) o.master_port = env_int("MASTER_PORT", o.master_port, 0, 65535);
}

int launch(const LaunchOptions& o) {
  validate(o);
  JobScope scope;
  const std::vector<pid_t> before = stray_children({});
  const std::set<pid_t> known(before.begin(), before.end());  // children from before the job
  JobShape job;
  job.world_size = o.nproc_per_node * o.nnodes;
  for (job.restart_count = 0;; ++job.restart_count) {
    job.master_port = o.master_port;
    if (job.master_port == 0) job.master_port = o.nnodes == 1 ? find_free_port() : 29500;
    Attempt attempt(o, job, known);
    const Outcome outcome = attempt.run();
    if (outcome == Outcome::kRankFailed && job.restart_count < o.max_restarts && !g_stop_signal) {
      std::cerr << "tessera launch: restarting all ranks (restart " << job.restart_count + 1
                << " of at most " << o.max_restarts << ")\n";
      continue;
    }
    attempt.report_failures();
    return attempt.exit_code();
  }
}

}  // namespace tessera::dist
