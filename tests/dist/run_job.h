// Runs a shell command as a job under coreutils `timeout`, so that a hang fails the test
// instead of stalling the suite; shared by the multi-process tests of dist/.
#pragma once
#include <sys/wait.h>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

namespace tessera::test_jobs {

struct JobResult {
  int status = -1;  // exit status of the job (124/137: killed by the timeout)
  std::string output;  // stdout and stderr together
};

inline JobResult run_job(const std::string& command, int timeout_s) {
  const std::string full = "timeout -k 2 " + std::to_string(timeout_s) + " " + command + " 2>&1";
  JobResult result;
  FILE* pipe = popen(full.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// A fresh folder for this test process, /tmp/<name>_<pid>, with an empty hf/ inside (an
// HF_HOME with no Accelerate default config in it).
inline std::filesystem::path fresh_scratch_folder(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "hf");
  return dir;
}

}  // namespace tessera::test_jobs
