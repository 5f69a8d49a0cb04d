// The Python interpreter the reference scripts run with: /usr/bin/python3 (torch CPU on
// the development machines), or TESSERA_PYTHON where torch lives elsewhere (GPU machines).
#pragma once
#include <cstdlib>
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

}  // namespace tessera::test
