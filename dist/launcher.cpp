#include "tessera/dist/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <map>
#include <thread>

#include "tessera/core/error.h"
#include "tessera/dist/socket.h"

namespace tessera::dist {
namespace {

std::atomic<int> g_stop_signal{0};
void on_stop_signal(int sig) { g_stop_signal = sig; }

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;              // waitpid status once exited
  int out_fd = -1, err_fd = -1;  // read ends of its stdout/stderr pipes (-1: inherited)
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

void signal_all(std::vector<Rank>& ranks, int sig) {
  for (Rank& r : ranks)
    if (r.running) ::kill(-r.pid, sig);  // the rank's whole process group
}

pid_t spawn(const LaunchOptions& o, int local_rank, int world_size, int master_port, Rank& r) {
  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  const bool prefixed = r.rank != 0;
  if (prefixed) {
    TESSERA_CHECK(::pipe2(out_pipe, O_CLOEXEC) == 0 && ::pipe2(err_pipe, O_CLOEXEC) == 0,
                  "tessera launch: pipe failed: ", std::strerror(errno));
  }
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  TESSERA_CHECK(pid >= 0, "tessera launch: fork failed: ", std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);  // own process group, so stopping a rank stops its children too
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a launcher that was killed
    if (::getppid() != parent) ::_exit(127);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    if (prefixed) {
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
    }
    auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
    set("RANK", std::to_string(r.rank));
    set("LOCAL_RANK", std::to_string(local_rank));
    set("WORLD_SIZE", std::to_string(world_size));
    set("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node));
    set("GROUP_RANK", std::to_string(o.node_rank));
    set("MASTER_ADDR", o.master_addr);
    set("MASTER_PORT", std::to_string(master_port));
    if (!o.mixed_precision.empty()) set("TESSERA_MIXED_PRECISION", o.mixed_precision);
    // Like torchrun: ranks sharing a node share its cores, so each one's OpenMP pool gets
    // its part (oversubscribed spinning pools slow every rank's host thread down).
    if (!::getenv("OMP_NUM_THREADS") && o.nproc_per_node > 1) {
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
  ::setpgid(pid, pid);  // also from the parent, so signal_all never races the child's setpgid
  if (prefixed) {
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    r.out_fd = out_pipe[0];
    r.err_fd = err_pipe[0];
  }
  return pid;
}

}  // namespace

int launch(const LaunchOptions& o) {
  TESSERA_CHECK(!o.command.empty(), "tessera launch: no program given");
  TESSERA_CHECK(o.nproc_per_node >= 1 && o.nnodes >= 1 && o.node_rank >= 0 &&
                    o.node_rank < o.nnodes,
                "tessera launch: need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < "
                "--nnodes; got ", o.nproc_per_node, ", ", o.nnodes, ", ", o.node_rank);
  const int world_size = o.nproc_per_node * o.nnodes;
  int master_port = o.master_port;
  if (master_port == 0) master_port = o.nnodes == 1 ? find_free_port() : 29500;

  g_stop_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  struct sigaction old_int {}, old_term {};
  sigaction(SIGINT, &action, &old_int);
  sigaction(SIGTERM, &action, &old_term);

  std::vector<Rank> ranks(o.nproc_per_node);
  for (int local = 0; local < o.nproc_per_node; ++local) {
    Rank& r = ranks[local];
    r.rank = o.node_rank * o.nproc_per_node + local;
    r.pid = spawn(o, local, world_size, master_port, r);
    r.running = true;
  }

  // Ranks that failed on their own, before the launcher began stopping the job. Peers of
  // a failed rank often fail a moment later (or even sooner: the failed rank's sockets
  // close before its process has finished exiting), so failures seen within a short
  // settling time are all reported, and the job is stopped after it.
  std::vector<const Rank*> failures;
  constexpr double kSettle_s = 0.5;
  std::chrono::steady_clock::time_point settle_until;
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_at;
  int running = o.nproc_per_node;
  while (running > 0 || std::any_of(ranks.begin(), ranks.end(),
                                    [](const Rank& r) { return r.out_fd >= 0 || r.err_fd >= 0; })) {
    // Forward output.
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, bool>> owners;  // (rank, is stderr)
    for (Rank& r : ranks) {
      if (r.out_fd >= 0) fds.push_back({r.out_fd, POLLIN, 0}), owners.push_back({&r, false});
      if (r.err_fd >= 0) fds.push_back({r.err_fd, POLLIN, 0}), owners.push_back({&r, true});
    }
    if (!fds.empty() && ::poll(fds.data(), fds.size(), 50) > 0) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Rank& r = *owners[i].first;
        if (owners[i].second) drain(r, r.err_fd, r.err_partial, std::cerr);
        else drain(r, r.out_fd, r.out_partial, std::cout);
      }
    } else if (fds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    // Reap ranks that ended; the first failure stops the others.
    for (Rank& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      r.status = status;
      --running;
      ::kill(-r.pid, SIGKILL);  // leftovers of the rank's own children
      if (exit_code_of(status) != 0 && !stopping) {
        if (failures.empty())
          settle_until = std::chrono::steady_clock::now() +
                         std::chrono::milliseconds(static_cast<int>(kSettle_s * 1000));
        failures.push_back(&r);
      }
    }
    const bool settled = !failures.empty() && (std::chrono::steady_clock::now() >= settle_until ||
                                                running == 0);
    if (!stopping && (settled || g_stop_signal)) {
      stopping = true;
      for (const Rank* f : failures)
        std::cerr << "tessera launch: rank " << f->rank << " (pid " << f->pid << ") "
                  << describe_exit(f->status) << "\n";
      if (!failures.empty() && running > 0)
        std::cerr << "tessera launch: stopping the other ranks\n";
      if (failures.empty())
        std::cerr << "tessera launch: interrupted (signal " << g_stop_signal.load()
                  << "); stopping all ranks\n";
      signal_all(ranks, SIGTERM);
      kill_at = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(o.stop_grace_s));
    }
    if (stopping && std::chrono::steady_clock::now() >= kill_at) {
      signal_all(ranks, SIGKILL);
      // Ranks' pipes may be held open by grandchildren that ignore us; stop reading them.
      for (Rank& r : ranks) {
        if (r.running) continue;
        for (int* fd : {&r.out_fd, &r.err_fd})
          if (*fd >= 0) ::close(*fd), *fd = -1;
      }
    }
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);

  if (!failures.empty()) {
    for (const Rank* f : failures)
      std::cerr << "tessera launch: job failed: rank " << f->rank << " " << describe_exit(f->status)
                << "\n";
    return exit_code_of(failures.front()->status);
  }
  if (g_stop_signal) return 128 + g_stop_signal;
  return 0;
}

}  // namespace tessera::dist
