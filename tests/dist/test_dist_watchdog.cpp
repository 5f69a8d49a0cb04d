// A hung job names the rank it waits for: the watchdog's report from heartbeats (in
// process), and real jobs through `tessera launch` with one rank stopped by SIGSTOP; the
// rendezvous that names the ranks which never joined. Every job runs under coreutils
// `timeout`, and the test kills what it stopped, so nothing outlives a test.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tessera/dist/socket.h"
#include "tessera/dist/store.h"
#include "tessera/dist/watchdog.h"

#include "run_job.h"

using namespace tessera;
using namespace tessera::dist;
namespace fs = std::filesystem;

namespace {

// ---- the report, from heartbeats ----

CollectivePosition position(uint64_t sequence, bool in_flight, int64_t since_ms) {
  return {"world", "all_reduce", sequence, 16, in_flight, since_ms};
}

Heartbeat heartbeat(int64_t pid, int64_t wall_ms, CollectivePosition p) {
  Heartbeat h;
  h.pid = pid;
  h.host = "h";
  h.beat = 7;
  h.wall_ms = wall_ms;
  h.positions.push_back(std::move(p));
  return h;
}

constexpr int64_t kNow = 1'700'000'000'000;

TEST(WatchdogReport, NamesTheRankThatHasNotArrivedAndWhereTheOthersWait) {
  std::vector<std::optional<Heartbeat>> beats(3);
  beats[0] = heartbeat(1233, kNow, position(57, true, kNow - 62'000));
  beats[1] = heartbeat(1234, kNow - 61'000, position(56, false, kNow - 61'500));
  beats[2] = heartbeat(1235, kNow - 1'000, position(57, true, kNow - 61'000));
  const std::string report = hang_report(0, *beats[0]->oldest_in_flight(), beats, kNow, 3, 60);
  EXPECT_EQ(report,
            "tessera watchdog: rank 0 has waited 62 s in all_reduce #57 of group 'world' (16 bytes; "
            "watchdog timeout 60 s)\n"
            "  rank 1 (pid 1234, host h) has not reached all_reduce #57 (others waiting there for "
            "62 s); rank 1's last heartbeat 61 s ago at all_reduce #56\n"
            "  rank 0 (pid 1233, host h): waiting in all_reduce #57 for 62 s (16 bytes); heartbeat "
            "0 s ago\n"
            "  rank 2 (pid 1235, host h): waiting in all_reduce #57 for 61 s (16 bytes); heartbeat "
            "1 s ago\n");
}

TEST(WatchdogReport, TellsAStoppedRankInsideTheCollectiveFromABusyOne) {
  std::vector<std::optional<Heartbeat>> beats(3);
  beats[0] = heartbeat(10, kNow, position(9, true, kNow - 20'000));
  beats[1] = heartbeat(11, kNow - 15'000, position(9, true, kNow - 20'000));  // stopped inside
  beats[2] = heartbeat(12, kNow - 1'000, position(8, false, kNow - 25'000));  // alive, busy
  const std::string report = hang_report(0, *beats[0]->oldest_in_flight(), beats, kNow, 3, 10);
  EXPECT_NE(report.find("  rank 1 (pid 11, host h) is in all_reduce #9 but its heartbeat stopped "
                        "15 s ago (the process is stopped or hung)\n"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("  rank 2 (pid 12, host h) has not reached all_reduce #9 (others waiting "
                        "there for 20 s); its heartbeat is alive (1 s ago) at all_reduce #8: it is "
                        "busy outside the collectives\n"),
            std::string::npos)
      << report;
}

TEST(WatchdogReport, ManyRanksInOnePlaceShareALine) {
  std::vector<std::optional<Heartbeat>> beats(40);
  for (int r = 0; r < 40; ++r)
    beats[r] = heartbeat(100 + r, kNow, position(3, true, kNow - 70'000));
  beats[7] = heartbeat(107, kNow - 65'000, position(2, false, kNow - 65'000));
  beats[30].reset();  // never published one
  const std::string report = hang_report(0, *beats[0]->oldest_in_flight(), beats, kNow, 3, 60);
  EXPECT_NE(report.find("  rank 7 (pid 107, host h) has not reached all_reduce #3"), std::string::npos)
      << report;
  EXPECT_NE(report.find("  rank 30 has published no heartbeat"), std::string::npos) << report;
  EXPECT_NE(report.find("  ranks 0-6,8-29,31-39: waiting in all_reduce #3\n"), std::string::npos)
      << report;
}

TEST(WatchdogReport, HeartbeatsSurviveTheStore) {
  Heartbeat h = heartbeat(42, kNow, position(5, true, kNow - 3));
  h.positions.push_back({"world/sub0", "all_gather(uneven)", 2, 0, false, kNow - 9});
  const std::optional<Heartbeat> back = Heartbeat::decode(h.encode());
  ASSERT_TRUE(back);
  EXPECT_EQ(back->pid, 42);
  EXPECT_EQ(back->host, "h");
  EXPECT_EQ(back->wall_ms, kNow);
  ASSERT_EQ(back->positions.size(), 2u);
  EXPECT_EQ(back->positions[1].group, "world/sub0");
  EXPECT_EQ(back->positions[1].str(), "all_gather(uneven) #2");
  EXPECT_FALSE(back->positions[1].in_flight);
  EXPECT_EQ(back->oldest_in_flight()->sequence, 5u);
  EXPECT_FALSE(Heartbeat::decode("not a heartbeat"));
}

// ---- the rendezvous, in process ----

TEST(Rendezvous, AMissingRankIsNamedAfterTheTimeoutWithProgressBefore) {
  LocalStore store;
  testing::internal::CaptureStderr();
  try {
    join_rendezvous(store, 0, 3, "127.0.0.1:29500", 2.5);
    testing::internal::GetCapturedStderr();
    FAIL() << "expected a timeout";
  } catch (const TimeoutError& e) {
    const std::string progress = testing::internal::GetCapturedStderr();
    EXPECT_NE(std::string(e.what()).find("the rendezvous at 127.0.0.1:29500 timed out after 2.5 "
                                         "s: 1 of 3 ranks joined; ranks 1,2 never joined"),
              std::string::npos)
        << e.what();
    EXPECT_NE(progress.find("dist: rank 0 waiting for 2 of 3 ranks at 127.0.0.1:29500 ("),
              std::string::npos)
        << progress;
    EXPECT_NE(progress.find(" s of 2.5 s): ranks 1,2 not joined yet\n"), std::string::npos)
        << progress;
  }
}

TEST(Rendezvous, TwoProcessesWithOneRankAreAnError) {
  LocalStore store;
  store.add("rendezvous/rank/1", 1);  // someone joined as rank 1 already
  EXPECT_THROW(
      {
        try {
          join_rendezvous(store, 1, 2, "h:1", 5);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("two processes joined the rendezvous at h:1 as "
                                               "rank 1"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
}

// ---- real jobs ----

using tessera::test_jobs::JobResult;
using tessera::test_jobs::run_job;

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("tessera_test_watchdog_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A `tessera launch` of dist_fault_check's loop in the background, its output in a file.
class LoopJob {
 public:
  // `env` holds VAR=value words for the launcher's environment, `flags` its own flags.
  LoopJob(const std::string& env, const std::string& flags, int nproc, const fs::path& dir)
      : dir_(dir), output_(dir / "output.txt") {
    const std::string command = "exec timeout -k 2 120 env " + env + " " +
                                std::string(TESSERA_CLI) + " launch --nproc-per-node " +
                                std::to_string(nproc) + " " + flags + " " + DIST_FAULT_CHECK
                                " loop " + dir.string() + " > " + output_.string() + " 2>&1";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  // A job that has not ended is stopped: its stopped ranks killed (still the launcher's
  // children, so the pids are theirs), then the launcher through `timeout`, which passes
  // SIGTERM on; the launcher takes every rank down with it.
  ~LoopJob() {
    if (ended_) return;
    for (pid_t p : stopped_) ::kill(p, SIGKILL);
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
  }

  // The pid rank `rank` wrote once the job was running, or -1 if the job ended first.
  pid_t rank_pid(int rank) {
    const fs::path file = dir_ / ("pid." + std::to_string(rank));
    while (!fs::exists(file)) {
      if (ended_within(0.05)) return -1;
    }
    return std::stoi(slurp(file));
  }
  void stop(pid_t rank_pid) {
    stopped_.push_back(rank_pid);
    ::kill(rank_pid, SIGSTOP);
  }
  void resume_and_finish() {
    for (pid_t p : stopped_) ::kill(p, SIGCONT);
    stopped_.clear();
    std::ofstream(dir_ / "stop") << "\n";
  }
  // Whether the launcher exited within `seconds` (its status in status()).
  bool ended_within(double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    do {
      int status = 0;
      if (!ended_ && ::waitpid(pid_, &status, WNOHANG) == pid_) {
        ended_ = true;
        status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (ended_) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (std::chrono::steady_clock::now() < until);
    return false;
  }
  int status() const { return status_; }
  std::string output() const { return slurp(output_); }

 private:
  fs::path dir_, output_;
  pid_t pid_ = -1;
  bool ended_ = false;
  int status_ = -1;
  std::vector<pid_t> stopped_;
};

bool process_exists(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

constexpr double kWatchdogTimeout = 5;

// Stops `victim` of an `nproc`-rank job and expects the job to end, naming it, within the
// watchdog timeout + 10 s; returns the output.
std::string stopped_rank_is_named(const std::string& env, const std::string& flags, int nproc,
                                  int victim, const std::string& name) {
  LoopJob job(env, flags, nproc, fresh_dir(name));
  const pid_t pid = job.rank_pid(victim);
  for (int r = 0; r < nproc; ++r) EXPECT_GT(job.rank_pid(r), 0) << job.output();
  if (pid <= 0) return job.output();
  // Three heartbeat intervals (timeout / 5 each) first, so that every watchdog has read the
  // victim's heartbeat before it stops, also on a loaded machine under the sanitizers (a
  // stopped rank 0 is then named with its last heartbeat, not "never read").
  std::this_thread::sleep_for(std::chrono::duration<double>(3 * kWatchdogTimeout / 5));
  job.stop(pid);
  EXPECT_TRUE(job.ended_within(kWatchdogTimeout + 10))
      << "the job still waits " << kWatchdogTimeout + 10 << " s after rank " << victim
      << " was stopped:\n"
      << job.output();
  EXPECT_EQ(job.status(), 1) << job.output();
  EXPECT_FALSE(process_exists(pid)) << "the stopped rank outlived the job";
  const std::string output = job.output();
  EXPECT_NE(output.find("tessera watchdog: ending the job"), std::string::npos) << output;
  EXPECT_NE(output.find("rank " + std::to_string(victim) + " (pid " + std::to_string(pid) +
                        ", host "),
            std::string::npos)
      << output;
  return output;
}

TEST(WatchdogJobs, RankStoppedInA2RankJobIsNamedWithinTheTimeout) {
  const std::string out = stopped_rank_is_named(
      "", "--watchdog-timeout " + std::to_string(int(kWatchdogTimeout)), 2, 1, "two");
  // Rank 1 either never reached rank 0's collective or stopped inside it.
  const bool named = out.find(") has not reached all_reduce #") != std::string::npos ||
                     out.find(" but its heartbeat stopped ") != std::string::npos;
  EXPECT_TRUE(named) << out;
  EXPECT_NE(out.find("  rank 0 (pid "), std::string::npos) << out;
  EXPECT_NE(out.find("waiting in all_reduce #"), std::string::npos) << out;
}

TEST(WatchdogJobs, RankStoppedInA3RankJobIsNamedWithinTheTimeout) {
  const std::string out = stopped_rank_is_named(
      "TESSERA_WATCHDOG_TIMEOUT=" + std::to_string(int(kWatchdogTimeout)), "", 3, 2, "three");
  const bool named = out.find(") has not reached all_reduce #") != std::string::npos ||
                     out.find(" but its heartbeat stopped ") != std::string::npos;
  EXPECT_TRUE(named) << out;
  EXPECT_NE(out.find("  rank 1 (pid "), std::string::npos) << out;  // where rank 1 waits
}

TEST(WatchdogJobs, StoppedRank0WhoseStoreGoesSilentIsNamed) {
  const std::string out = stopped_rank_is_named(
      "TESSERA_WATCHDOG_TIMEOUT=" + std::to_string(int(kWatchdogTimeout)), "", 3, 0, "rank0");
  EXPECT_NE(out.find(") does not answer; rank 0's last heartbeat "), std::string::npos) << out;
  EXPECT_NE(out.find(", which rank 0 serves, has not answered for "), std::string::npos) << out;
}

TEST(WatchdogJobs, ReportActionKeepsWaitingAndTheJobFinishesOnceTheRankResumes) {
  LoopJob job("TESSERA_WATCHDOG_TIMEOUT=3", "--watchdog-action report", 2, fresh_dir("report"));
  const pid_t pid = job.rank_pid(1);
  ASSERT_GT(pid, 0) << job.output();
  job.stop(pid);
  // The report comes, and the job is still there after it.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3 + 10);
  while (job.output().find("tessera watchdog: waiting on") == std::string::npos &&
         std::chrono::steady_clock::now() < until && !job.ended_within(0.1)) {
  }
  const std::string report = job.output();
  ASSERT_NE(report.find("tessera watchdog: waiting on"), std::string::npos) << report;
  EXPECT_NE(report.find("rank 1 (pid " + std::to_string(pid) + ", host "), std::string::npos)
      << report;
  EXPECT_FALSE(job.ended_within(0)) << job.output();
  job.resume_and_finish();
  ASSERT_TRUE(job.ended_within(60)) << job.output();
  EXPECT_EQ(job.status(), 0) << job.output();
}

TEST(WatchdogJobs, ARankBusyOutsideTheCollectivesIsReportedButTheJobGoesOn) {
  JobResult r = run_job(std::string(TESSERA_CLI) + " launch --nproc-per-node 2 --watchdog-timeout 3 " +
                            DIST_FAULT_CHECK " busy",
                        60);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every rank's heartbeat is alive"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("ending the job"), std::string::npos) << r.output;
}

// A rank of a 2-rank job started alone: it says what it waits for, then fails with `error`.
void lone_rank_waits_then_fails(int rank, const std::string& progress, const std::string& error) {
  const int port = find_free_port();
  const std::string where = "127.0.0.1:" + std::to_string(port);
  JobResult r = run_job("env RANK=" + std::to_string(rank) +
                            " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                            std::to_string(port) + " TESSERA_RENDEZVOUS_TIMEOUT=3 " +
                            DIST_FAULT_CHECK " loop " + fresh_dir("lone").string(),
                        30);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("dist: rank " + std::to_string(rank) + " waiting for " + progress +
                          " at " + where + " ("),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("the rendezvous at " + where + " timed out after 3 s: " + error),
            std::string::npos)
      << r.output;
}

TEST(RendezvousJobs, Rank0WithoutItsPeerSaysSoAndEndsNamingIt) {
  lone_rank_waits_then_fails(0, "1 of 2 ranks", "1 of 2 ranks joined; rank 1 never joined");
}

TEST(RendezvousJobs, RankWithoutRank0SaysSoAndEnds) {
  lone_rank_waits_then_fails(1, "rank 0's store", "rank 0 never served its store there");
}

}  // namespace
