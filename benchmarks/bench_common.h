// What the end-to-end benchmarks share: reading integer flags and running the PyTorch
// reference script as a subprocess whose last line is a JSON object of figures.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace tessera::bench {

// The integer after argv[i] (advancing i), or exit with a message naming the flag.
inline int flag_value(int& i, int argc, char** argv) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "%s needs a value\n", argv[i]);
    std::exit(2);
  }
  return std::atoi(argv[++i]);
}

// The interpreter for PyTorch references: TESSERA_PYTHON, else Debian's /usr/bin/python3.
inline std::string python_interpreter() {
  const char* python = std::getenv("TESSERA_PYTHON");
  return python ? python : "/usr/bin/python3";
}

// Runs `cmd`, returning its output; ok is false (and the output printed) when it fails.
inline std::string run_reference(const std::string& cmd, bool& ok) {
  std::string out;
  ok = false;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return out;
  char line[4096];
  while (std::fgets(line, sizeof line, pipe)) out += line;
  ok = pclose(pipe) == 0;
  if (!ok) std::fprintf(stderr, "PyTorch reference failed: %s\n%s\n", cmd.c_str(), out.c_str());
  return out;
}

// The last `"key": number` in out, or -1.
inline double json_number(const std::string& out, const char* key) {
  const auto pos = out.rfind(std::string("\"") + key + "\": ");
  return pos == std::string::npos ? -1.0 : std::atof(out.c_str() + pos + std::strlen(key) + 4);
}

// The last `"key": "text"` in out, or "".
inline std::string json_string(const std::string& out, const char* key) {
  const std::string tag = std::string("\"") + key + "\": \"";
  const auto pos = out.rfind(tag);
  if (pos == std::string::npos) return "";
  const auto start = pos + tag.size();
  return out.substr(start, out.find('"', start) - start);
}

}  // namespace tessera::bench
