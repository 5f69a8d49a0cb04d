// The Python interpreter the reference scripts run with: /usr/bin/python3 (torch CPU on
// the development machines), or TESSERA_PYTHON where torch lives elsewhere (GPU machines).
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace tessera::test {

inline std::string python_interpreter() {
  const char* env = std::getenv("TESSERA_PYTHON");
  return env && *env ? env : "/usr/bin/python3";
}

// True when the interpreter can import every module in `modules` ("torch, numpy").
inline bool python_can_import(const std::string& modules) {
  const std::string cmd = python_interpreter() + " -c 'import " + modules + "' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

// An empty folder test_scratch/<name> under the build folder.
inline std::filesystem::path scratch_dir(const std::string& name) {
  auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Runs `script args` with the interpreter. A script exits 3 when what it needs (transformers)
// is not importable: then false, for the caller to skip; any other failure is a test failure.
inline bool run_reference_script(const std::string& script, const std::string& args) {
  const std::string cmd = python_interpreter() + " " + script + " " + args;
  const int status = std::system(cmd.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) return false;
  EXPECT_EQ(status, 0) << "reference failed: " << cmd;
  return status == 0;
}

}  // namespace tessera::test
