// GPT-2 tokenizer throughput: Tessera's encoder on one thread and on every core, next to
// tiktoken's (encode_ordinary, and encode_ordinary_batch over as many threads) measured in
// the same run by benchmarks/tokenizer_tiktoken.py; the tiktoken columns are left out when
// Python cannot import tiktoken.
//   bench_tokenizer [FILE] [REPEATS]   FILE defaults to Debian's fortunes, concatenated
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "tessera/core/file_io.h"
#include "tessera/data/tokenizer.h"

namespace fs = std::filesystem;
using namespace tessera;

namespace {

fs::path gpt2_dir() {
  const char* env = std::getenv("TESSERA_GPT2_DIR");
  return env && *env ? fs::path(env) : fs::path(TESSERA_SOURCE_DIR) / ".deps" / "gpt2";
}

std::string default_corpus() {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator("/usr/share/games/fortunes"))
    if (e.is_regular_file() && e.path().extension() != ".dat" && e.path().extension() != ".u8")
      files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) text += tessera::read_file(f);
  return text;
}

template <class F>
double best_seconds(F&& fn, int repeats) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// tiktoken's figures from the Python helper, or null when it cannot run.
nlohmann::json tiktoken_figures(const fs::path& file, int threads, int repeats) {
  const char* env = std::getenv("TESSERA_PYTHON");
  const std::string python = env && *env ? env : "/usr/bin/python3";
  if (std::system((python + " -c 'import tiktoken' >/dev/null 2>&1").c_str()) != 0) return nullptr;
  const std::string cmd =
      python + " " + TESSERA_SOURCE_DIR + "/benchmarks/tokenizer_tiktoken.py '" +
      (gpt2_dir() / "encoder.json").string() + "' '" + (gpt2_dir() / "vocab.bpe").string() + "' '" +
      file.string() + "' " + std::to_string(threads) + " " + std::to_string(repeats);
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return nullptr;
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), pipe)) out += buf;
  if (::pclose(pipe) != 0) return nullptr;
  return nlohmann::json::parse(out, nullptr, false);
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::exists(gpt2_dir() / "encoder.json")) {
    std::cerr << "bench_tokenizer: GPT-2's files are not in " << gpt2_dir()
              << " (run scripts/setup.sh)\n";
    return 1;
  }
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::string text = argc > 1 ? tessera::read_file(argv[1]) : default_corpus();
  const fs::path file =
      argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "bench_tokenizer_corpus.txt";
  if (argc <= 1) tessera::write_file_atomically(file, text);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  const auto tok =
      data::BpeTokenizer::from_gpt2_files(gpt2_dir() / "encoder.json", gpt2_dir() / "vocab.bpe");
  const std::vector<uint32_t> ids = tok.encode(text, 1);
  const bool same = tok.encode(text, cores) == ids;
  const double mb = static_cast<double>(text.size()) / 1e6;
  const double single = mb / best_seconds([&] { (void)tok.encode(text, 1); }, repeats);
  const double all = mb / best_seconds([&] { (void)tok.encode(text, cores); }, repeats);
  const nlohmann::json tiktoken = tiktoken_figures(file, cores, repeats);
  if (argc <= 1) fs::remove(file);

  std::printf("GPT-2 tokenizer, %.2f MB, %zu tokens, best of %d\n", mb, ids.size(), repeats);
  std::printf("%-28s %12s %12s\n", "", "1 thread",
              std::to_string(cores).append(" threads").c_str());
  std::printf("%-28s %9.2f MB/s %9.2f MB/s  (ids equal across threads: %s)\n", "tessera", single,
              all, same ? "yes" : "NO");
  if (tiktoken.is_object()) {
    std::printf("%-28s %9.2f MB/s %9.2f MB/s  (tokens equal: %s)\n", "tiktoken encode_ordinary",
                tiktoken["single_mb_s"].get<double>(), tiktoken["threads_mb_s"].get<double>(),
                tiktoken["tokens"].get<size_t>() == ids.size() ? "yes" : "NO");
  } else {
    std::printf("(tiktoken not importable: its columns are left out)\n");
  }
  return same ? 0 : 1;
}
