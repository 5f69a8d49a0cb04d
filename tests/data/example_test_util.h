// Shared by the dataset, sampler and collator tests: a small BERT tokenizer, scratch files
// and running tests/data/dataset_reference.py.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/data/wordpiece.h"
#include "tests/nn/python_reference.h"

namespace tessera::test {

namespace fs = std::filesystem;

// A lower-casing BERT vocabulary of a few words; anything else is [UNK].
inline data::WordPieceTokenizer small_bert(const std::vector<std::string>& extra_words = {}) {
  std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                    "the",   "a",     "cat",   "dog",   "sat",
                                    "on",    "mat",   "good",  "bad",   "film",
                                    "!",     ",",     ".",     "##s",   "café"};
  vocab.insert(vocab.end(), extra_words.begin(), extra_words.end());
  return data::WordPieceTokenizer(data::WordPieceTokenizer::bert_config(vocab, true));
}

// A fresh folder per test program and name.
inline fs::path example_scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("tessera_test_examples_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

inline void write_text(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Runs dataset_reference.py with `args`; true on success.
inline bool run_dataset_reference(const std::string& args) {
  const std::string cmd = python_interpreter() + " " + TESSERA_SOURCE_DIR +
                          "/tests/data/dataset_reference.py " + args;
  return std::system(cmd.c_str()) == 0;
}

inline std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace tessera::test
