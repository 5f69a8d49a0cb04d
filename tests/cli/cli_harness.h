// Shared by the tests that run the built `tessera` program: running it (through the
// shell, so a test can set limits first), a per-process scratch folder removed at the
// end, and small prepared data sets.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera_cli_test {

namespace fs = std::filesystem;

struct RunResult {
  int rc;
  std::string output;
};

inline std::string tessera_binary() {
  if (const char* env = std::getenv("TESSERA_BINARY")) return env;
  return (fs::path(TESSERA_BINARY_DIR) / "tessera").string();
}

// Runs a shell command line (/bin/sh) and collects what it prints to stdout.
inline RunResult run_command_line(const std::string& cmd) {
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (pipe && fgets(buf, sizeof(buf), pipe)) out += buf;
  const int status = pipe ? pclose(pipe) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Runs `tessera args` with stderr folded into the output. `shell_prefix` (e.g. a
// `ulimit`) runs first in the same shell, so its limits apply to the program.
inline RunResult run(const std::string& args, const std::string& shell_prefix = "") {
  return run_command_line(shell_prefix + " OMP_NUM_THREADS=2 " + tessera_binary() + " " + args +
                          " 2>&1");
}

inline fs::path scratch() {
  static const fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("tessera_test_cli_" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

// Removes this process's scratch folder when the tests are done.
class ScratchCleanup : public ::testing::Environment {
 public:
  void TearDown() override { fs::remove_all(scratch()); }
};
inline const auto* const kScratchCleanup = ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

// A small deterministic corpus with learnable structure (repeated phrases).
inline std::string generated_corpus(size_t sentences) {
  const std::vector<std::string> subjects = {"The cat", "A dog", "My friend", "The old man", "She"};
  const std::vector<std::string> verbs = {"sees", "likes", "finds", "wants", "reads"};
  const std::vector<std::string> objects = {"the moon.", "a book.", "green tea.", "the sea.",
                                            "a red ball."};
  std::mt19937 rng(7);
  std::string text;
  for (size_t i = 0; i < sentences; ++i) {
    text += subjects[rng() % subjects.size()] + " " + verbs[rng() % verbs.size()] + " " +
            objects[rng() % objects.size()] + (i % 4 == 3 ? "\n" : " ");
  }
  return text;
}

// prepare once per tokenizer kind; returns the data directory.
inline fs::path prepared(const std::string& tokenizer) {
  const fs::path dir = scratch() / ("data_" + tokenizer);
  if (!fs::exists(dir / "train.bin")) {
    const fs::path corpus = scratch() / "corpus.txt";
    std::ofstream(corpus) << generated_corpus(3000);
    const auto r = run("prepare --input " + corpus.string() + " --tokenizer " + tokenizer +
                       " --vocab 300 --out " + dir.string());
    EXPECT_EQ(r.rc, 0) << r.output;
  }
  return dir;
}

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The lines of a run's metrics.jsonl.
inline std::vector<nlohmann::json> read_metrics(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// (loss or eval_loss) of every metrics line with step > after, as exact doubles.
inline std::vector<std::pair<int64_t, double>> losses_after(const fs::path& run_dir, int64_t after) {
  std::vector<std::pair<int64_t, double>> out;
  for (const auto& j : read_metrics(run_dir)) {
    const int64_t step = j["step"];
    if (step <= after) continue;
    out.emplace_back(step, j.contains("loss") ? j["loss"].get<double>() : -j["eval_loss"].get<double>());
  }
  return out;
}

// The `count` numbers printed after the first `label` in `text` (-1 for each when it is
// missing, which fails the test naming the label).
inline std::vector<double> numbers_after(const std::string& text, const std::string& label, int count) {
  const size_t at = text.find(label);
  EXPECT_NE(at, std::string::npos) << label << "\n" << text;
  std::vector<double> values(count, -1);
  if (at == std::string::npos) return values;
  std::istringstream row(text.substr(at + label.size()));
  for (double& v : values) row >> v;
  return values;
}

}  // namespace tessera_cli_test
