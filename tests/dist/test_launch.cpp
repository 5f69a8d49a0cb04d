// `tessera launch` as a user meets it, with real processes: bad job shapes, the exit
// barrier, whole-job restarts with TORCHELASTIC_RESTART_COUNT, a training run that resumes
// by itself after a rank fails, and that nothing a rank started outlives the job (also
// when starting the ranks fails part-way). Every job runs under coreutils `timeout`, so a
// hang fails the test instead of stalling the suite.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tessera/data/token_file.h"

#include "run_job.h"

namespace fs = std::filesystem;

namespace {

using tessera::test_jobs::JobResult;
using tessera::test_jobs::run_job;

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A value no other process carries: ranks get it in their environment (through the
// launcher's), so /proc/*/environ finds every process the job started.
std::string unique_marker(const std::string& name) {
  std::random_device device;
  return "TESSERA_LAUNCH_TEST_MARKER=" + name + "_" + std::to_string(::getpid()) + "_" +
         std::to_string(device());
}

// Processes (not zombies) whose environment holds `marker`.
std::vector<int> processes_with(const std::string& marker) {
  std::vector<int> found;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream environ(entry.path() / "environ", std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(environ)), {});
    for (size_t start = 0; start < text.size();) {
      size_t end = text.find('\0', start);
      if (end == std::string::npos) end = text.size();
      if (text.compare(start, end - start, marker) == 0) {
        found.push_back(std::stoi(name));
        break;
      }
      start = end + 1;
    }
  }
  return found;
}

std::string launch(const std::string& marker, const std::string& flags,
                   const std::string& program) {
  return "env " + marker + " " + TESSERA_CLI + " launch " + flags + " " + program;
}

fs::path scratch() {
  static const fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("tessera_test_launch_" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

TEST(Launch, BadJobShapesAreClearErrorsWithTheValidRange) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--nproc-per-node 0", "--nproc-per-node must be in [1, 1024]; got 0"},
      {"--nproc-per-node -3", "--nproc-per-node must be in [1, 1024]; got -3"},
      {"--nproc-per-node 100000", "--nproc-per-node must be in [1, 1024]; got 100000"},
      {"--nnodes 0", "--nnodes must be in [1, 65536]; got 0"},
      {"--nnodes 2 --node-rank 2", "--node-rank must be in [0, 1]; got 2"},
      {"--max-restarts -1", "--max-restarts must be in [0, 1000]; got -1"},
      {"--exit-barrier-timeout -5", "--exit-barrier-timeout must be in [0, 1e+09]; got -5"},
      {"--master-port 70000", "--master-port must be in [0, 65535]; got 70000"},
  };
  for (const auto& [flags, message] : cases) {
    JobResult r = run_job(std::string(TESSERA_CLI) + " launch " + flags + " true", 20);
    EXPECT_EQ(r.status, 1) << flags << ":\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << flags << ":\n" << r.output;
    EXPECT_LT(r.output.size(), 200u) << flags << ":\n" << r.output;
  }
  // A number too large for the option's type is refused by the parser, naming the value.
  JobResult r =
      run_job(std::string(TESSERA_CLI) + " launch --nproc-per-node 99999999999999 true", 20);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("99999999999999"), std::string::npos) << r.output;
}

// The "address already in use" error says "set MASTER_PORT": `tessera launch` takes
// MASTER_ADDR and MASTER_PORT from its environment, and its flags win over them.
TEST(Launch, MasterAddrAndPortComeFromTheEnvironmentUnlessFlagsGiveThem) {
  const std::string show = " sh -c 'echo at $MASTER_ADDR:$MASTER_PORT'";
  const std::string launch = std::string(TESSERA_CLI) + " launch --nproc-per-node 2";
  JobResult from_env = run_job("env MASTER_ADDR=localhost MASTER_PORT=29517 " + launch + show, 20);
  EXPECT_EQ(from_env.status, 0) << from_env.output;
  EXPECT_EQ(count(from_env.output, "at localhost:29517\n"), 2) << from_env.output;
  JobResult flags = run_job("env MASTER_ADDR=localhost MASTER_PORT=29517 " + launch +
                                " --master-addr 127.0.0.1 --master-port 29518" + show,
                            20);
  EXPECT_EQ(flags.status, 0) << flags.output;
  EXPECT_EQ(count(flags.output, "at 127.0.0.1:29518\n"), 2) << flags.output;
  JobResult bad = run_job("env MASTER_PORT=70000 " + launch + show, 20);
  EXPECT_EQ(bad.status, 1) << bad.output;
  EXPECT_NE(bad.output.find("MASTER_PORT=70000 is out of range: it must be in [0, 65535]"),
            std::string::npos)
      << bad.output;
}

TEST(Launch, WatchdogFlagsReachTheRanksAndAreChecked) {
  const std::string launch = std::string(TESSERA_CLI) + " launch --nproc-per-node 1";
  JobResult r = run_job(launch + " --watchdog-timeout 7.5 --watchdog-action report sh -c 'echo "
                                 "$TESSERA_WATCHDOG_TIMEOUT $TESSERA_WATCHDOG_ACTION'",
                        20);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("7.5 report\n"), std::string::npos) << r.output;
  JobResult bad = run_job(launch + " --watchdog-timeout -1 true", 20);
  EXPECT_EQ(bad.status, 1) << bad.output;
  EXPECT_NE(bad.output.find("--watchdog-timeout must be in [0, 1e+09]; got -1"), std::string::npos)
      << bad.output;
}

TEST(Launch, ExitBarrierStopsARankThatHangsAfterTheOthersExitedAndNamesIt) {
  const std::string marker = unique_marker("barrier");
  // Ranks 1 and 3 hang (a child sleep in their group, as a stuck shutdown would); ranks 0
  // and 2 meet at a file barrier first, so they exit together however loaded the machine is.
  const std::string dir = (scratch() / "barrier").string();
  fs::create_directories(dir);
  const std::string meet = "touch " + dir + "/$RANK; until [ -e " + dir + "/0 ] && [ -e " + dir +
                           "/2 ]; do sleep 0.05; done";
  JobResult r = run_job(
      launch(marker, "--nproc-per-node 4 --exit-barrier-timeout 2",
             "sh -c 'case $RANK in 1|3) sleep 60 ;; *) " + meet + " ;; esac; echo done $RANK'"),
      30);
  EXPECT_EQ(r.status, 1) << r.output;
  // Ranks 0 and 2 race to be the first to exit 0; either one starts the barrier.
  const std::string late =
      "tessera launch: ranks 1,3 did not exit within the exit barrier "
      "timeout (2 s) after rank ";
  const size_t at = r.output.find(late);
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string first = r.output.substr(at + late.size(), 1);
  EXPECT_TRUE(first == "0" || first == "2") << r.output;
  const std::string rest = " exited 0; stopping them\n";
  EXPECT_EQ(r.output.compare(at + late.size() + 1, rest.size(), rest), 0) << r.output;
  EXPECT_NE(r.output.find("done 0"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("done 1"), std::string::npos) << r.output;
  EXPECT_TRUE(processes_with(marker).empty()) << "processes of the job outlived it";
}

TEST(Launch, RanksThatFollowWithinTheExitBarrierSucceed) {
  const std::string marker = unique_marker("barrier_ok");
  JobResult r = run_job(launch(marker, "--nproc-per-node 3 --exit-barrier-timeout 20",
                               "sh -c 'sleep $RANK; echo done $RANK'"),
                        30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(count(r.output, "done "), 3) << r.output;
}

TEST(Launch, SpawnFailingPartWayStopsTheStartedRanksAndTheirDescendants) {
  // 64 descriptors cannot hold 200 ranks' output pipes: starting fails part-way. Each rank
  // started a descendant that left the rank's process group (setsid) and one inside it;
  // none of them may survive the launcher.
  const std::string marker = unique_marker("spawn");
  JobResult r =
      run_job("prlimit --nofile=64:64 " + launch(marker, "--nproc-per-node 200",
                                                 "sh -c 'setsid sleep 60 & sleep 60 & wait'"),
              60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("pipe failed: Too many open files"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("starting the ranks failed after"), std::string::npos) << r.output;
  EXPECT_TRUE(processes_with(marker).empty()) << "processes of the job outlived it:\n" << r.output;
}

TEST(Launch, DescendantsThatLeftTheirRanksGroupDieWithTheJob) {
  // Every rank exits 0 at once but leaves a daemon (setsid: its own session and group).
  const std::string marker = unique_marker("daemon");
  JobResult r = run_job(launch(marker, "--nproc-per-node 3",
                               "sh -c 'setsid sleep 60 > /dev/null 2>&1 & echo started $RANK'"),
                        30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(count(r.output, "started "), 3) << r.output;
  EXPECT_TRUE(processes_with(marker).empty()) << "a daemon of a rank outlived the job";
}

TEST(Launch, MaxRestartsRestartsAllRanksWithTheRestartCount) {
  // Attempts 0 and 1: rank 1 fails while rank 0 would sleep for a minute (so it must be
  // stopped); attempt 2 succeeds.
  const std::string marker = unique_marker("restart");
  const std::string program =
      "sh -c 'echo attempt $TORCHELASTIC_RESTART_COUNT/$TESSERA_RESTART_COUNT of "
      "$TORCHELASTIC_MAX_RESTARTS rank $RANK; "
      "if [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then "
      "if [ $RANK = 1 ]; then exit 3; else sleep 60; fi; fi'";
  JobResult r = run_job(launch(marker, "--nproc-per-node 2 --max-restarts 5", program), 40);
  EXPECT_EQ(r.status, 0) << r.output;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string a = std::to_string(attempt);
    EXPECT_EQ(count(r.output, "attempt " + a + "/" + a + " of 5 rank 0\n"), 1) << r.output;
    EXPECT_EQ(count(r.output, "[rank 1] attempt " + a + "/" + a + " of 5 rank 1\n"), 1) << r.output;
  }
  EXPECT_EQ(count(r.output, "attempt 3/"), 0) << r.output;
  EXPECT_EQ(count(r.output, "rank 1 (pid"), 2) << r.output;
  EXPECT_NE(r.output.find("restarting all ranks (restart 1 of at most 5)"), std::string::npos);
  EXPECT_NE(r.output.find("restarting all ranks (restart 2 of at most 5)"), std::string::npos);
  EXPECT_TRUE(processes_with(marker).empty());
}

TEST(Launch, ExhaustedRestartsFailWithTheLastFailure) {
  const std::string marker = unique_marker("exhausted");
  JobResult r =
      run_job(launch(marker, "--nproc-per-node 2 --max-restarts 2",
                     "sh -c 'echo attempt $TORCHELASTIC_RESTART_COUNT; [ $RANK = 0 ] || exit 3'"),
              40);
  EXPECT_EQ(r.status, 3) << r.output;
  EXPECT_EQ(count(r.output, "[rank 1] attempt"), 3) << r.output;
  EXPECT_EQ(count(r.output, "restarting all ranks"), 2) << r.output;
  EXPECT_NE(r.output.find("tessera launch: job failed: rank 1 exited with status 3"),
            std::string::npos)
      << r.output;
}

TEST(Launch, InterruptDuringRestartsStopsTheJobWithoutRestarting) {
  const std::string marker = unique_marker("interrupt");
  // The signal is sent once both ranks run (the launcher's handler is in place by then).
  const std::string started = (scratch() / "interrupt_started").string();
  JobResult r =
      run_job("sh -c '" +
                  launch(marker, "--nproc-per-node 2 --max-restarts 5",
                         "sh -c \"touch " + started + ".\\$RANK; sleep 60\"") +
                  " & pid=$!; until [ -e " + started + ".0 ] && [ -e " + started +
                  ".1 ]; do sleep 0.05; done; kill -TERM $pid; wait $pid; echo launcher=$?'",
              30);
  EXPECT_NE(r.output.find("interrupted"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("launcher=143"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
  EXPECT_TRUE(processes_with(marker).empty());
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// `tessera train` on a small structured token stream, up to --out.
std::string tiny_training(int steps) {
  const fs::path data = scratch() / "train.bin";
  if (!fs::exists(data)) {
    std::vector<uint32_t> tokens(5000);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<uint32_t>((i * 7 + i / 5) % 90);
    tessera::data::write_token_file(data.string(), tokens);
  }
  return std::string(TESSERA_CLI) + " train --data " + data.string() +
         " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 4 --steps " + std::to_string(steps) +
         " --eval-every 0 --save-every 10 --schedule cosine --out ";
}

TEST(Launch, ResumeLatestBeforeAnyCheckpointStartsAFreshRun) {
  const fs::path out = scratch() / "fresh";
  JobResult r = run_job(tiny_training(3) + out.string() + " --resume", 120);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("no checkpoint under '" + out.string() +
                          "' yet; starting a fresh run"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(out / "model" / "model.safetensors")) << r.output;
  // A named checkpoint that does not exist is still an error.
  JobResult named = run_job(tiny_training(3) + (scratch() / "other").string() + " --resume " +
                                (scratch() / "missing").string(),
                            120);
  EXPECT_EQ(named.status, 1) << named.output;
}

TEST(Launch, TrainingRestartedAfterAFailureResumesByItselfAndMatchesAnUninterruptedRun) {
  const std::string train = tiny_training(60);
  const fs::path straight = scratch() / "straight", restarted = scratch() / "restarted";
  JobResult s = run_job("env OMP_NUM_THREADS=1 " + train + straight.string(), 120);
  ASSERT_EQ(s.status, 0) << s.output;

  // The first attempt is killed (-9) once its step-30 checkpoint is complete, as a crash would;
  // the launcher restarts it and `tessera train` (the same command) resumes from there. The
  // poll accepts any later checkpoint too: a fast run may have rotated checkpoint-30 away
  // before the first look (waiting for it alone then never ended).
  const std::string marker = unique_marker("train");
  const std::string script = scratch() / "rank.sh";
  std::ofstream(script) << "#!/bin/sh\n"
                        << "export OMP_NUM_THREADS=1\n"
                        << train << restarted.string() << " &\n"
                        << "pid=$!\n"
                        << "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then\n"
                        << "  until ls " << restarted.string()
                        << " 2>/dev/null | grep -v partial"
                        << " | grep -qE '^checkpoint-([3-9][0-9]|[0-9]{3,})$'; do sleep 0.05; done\n"
                        << "  kill -9 $pid; exit 1\n"
                        << "fi\n"
                        << "wait $pid\n";
  JobResult r = run_job(launch(marker, "--max-restarts 1", "sh " + script), 180);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("restarting all ranks (restart 1 of at most 1)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  const std::string want = slurp(straight / "model" / "model.safetensors");
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(want == slurp(restarted / "model" / "model.safetensors"))
      << "the restarted run's final weights differ from the uninterrupted run's";
}

}  // namespace
