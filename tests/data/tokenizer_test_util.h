// Shared by the tokenizer tests: the GPT-2 files (fetched by scripts/setup.sh), a
// generated corpus that exercises every branch of GPT-2's pre-tokenizer, and running
// tests/data/tokenizer_reference.py.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tessera/data/pretokenizer.h"
#include "tests/nn/python_reference.h"

namespace tessera::test {

namespace fs = std::filesystem;

// Folder holding encoder.json + vocab.bpe: $TESSERA_GPT2_DIR, else the checkout's .deps/gpt2.
inline fs::path gpt2_dir() {
  const char* env = std::getenv("TESSERA_GPT2_DIR");
  const fs::path dir =
      env && *env ? fs::path(env) : fs::path(TESSERA_SOURCE_DIR) / ".deps" / "gpt2";
  return fs::exists(dir / "encoder.json") && fs::exists(dir / "vocab.bpe") ? dir : fs::path();
}

inline fs::path scratch_dir() {
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_test_gpt2_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

inline void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline std::vector<uint32_t> read_ids(const fs::path& path) {
  const std::string bytes = read_bytes(path);
  std::vector<uint32_t> ids(bytes.size() / 4);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<uint32_t>(static_cast<unsigned char>(bytes[4 * i])) |
             static_cast<uint32_t>(static_cast<unsigned char>(bytes[4 * i + 1])) << 8 |
             static_cast<uint32_t>(static_cast<unsigned char>(bytes[4 * i + 2])) << 16 |
             static_cast<uint32_t>(static_cast<unsigned char>(bytes[4 * i + 3])) << 24;
  return ids;
}

// Runs tokenizer_reference.py with `args`; true on success.
inline bool run_reference(const std::string& args) {
  const std::string cmd = python_interpreter() + " " + TESSERA_SOURCE_DIR +
                          "/tests/data/tokenizer_reference.py " + args;
  return std::system(cmd.c_str()) == 0;
}

inline std::string quoted(const fs::path& p) { return "'" + p.string() + "'"; }

using data::append_utf8;

// About `bytes` bytes of text mixing scripts, emoji (ZWJ sequences, flags, skin tones),
// digits of several kinds, contractions, punctuation, whitespace runs of every White_Space
// character (some hundreds long), random code points from all planes, long runs of one
// letter, and (when `invalid_utf8`) ill-formed UTF-8.
inline std::string generated_corpus(uint32_t seed, size_t bytes, bool invalid_utf8) {
  std::mt19937 rng(seed);
  const std::vector<std::string> words = {
      "the",   "The",    "THE",      "naïve",  "café",     "Ünïcödé", "straße", "İstanbul",
      "ǅemal", "日本語", "中文字符", "한국어", "Привет",   "мир",     "γειά",   "σου",
      "مرحبا", "שלום",   "नमस्ते",     "ไทย",    "ﬁne",      "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ᏣᎳᎩ",    "ⴰⵣⵓⵍ",
      "a",     "I",      "hello",    "world",  "tokenizer"};
  const std::vector<std::string> emoji = {"😀",  "👍🏽",       "👨‍👩‍👧‍👦",
                                          "🇫🇷", "❤️",         "🤖",
                                          "✨",  "🏳️‍🌈", "🫠"};
  const std::vector<std::string> numbers = {"٣٤٥", "１２３", "²³", "½", "Ⅻ",
                                            "①②",  "𝟙𝟚",     "߁߂", "〇"};
  const std::vector<std::string> contractions = {"'s",    "'t", "'re", "'ve", "'m",    "'ll",
                                                 "'d",    "'S", "'LL", "’s",  "don't", "I'm",
                                                 "we'll", "'",  "''s", "'x"};
  const std::string punctuation = "!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~";
  const std::vector<char32_t> spaces = {' ',    '\t',   '\n',   '\r',   '\v',   '\f',   0x85,
                                        0xA0,   0x1680, 0x2003, 0x200A, 0x2028, 0x2029, 0x202F,
                                        0x205F, 0x3000, 0x1C,   0x180E, 0x200B};
  std::uniform_int_distribution<int> kind(0, 99);
  const auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  std::string out;
  while (out.size() < bytes) {
    const int k = kind(rng);
    if (k < 30) {
      out += words[pick(words.size())];
    } else if (k < 36) {
      out += emoji[pick(emoji.size())];
    } else if (k < 44) {
      for (size_t n = 1 + pick(k < 42 ? 6 : 40); n > 0; --n)
        out += static_cast<char>('0' + pick(10));
    } else if (k < 47) {
      out += numbers[pick(numbers.size())];
    } else if (k < 54) {
      out += contractions[pick(contractions.size())];
    } else if (k < 62) {
      for (size_t n = 1 + pick(5); n > 0; --n) out += punctuation[pick(punctuation.size())];
    } else if (k < 76) {
      const size_t n = pick(10) == 0 ? 1 + pick(600) : 1 + pick(4);
      for (size_t i = 0; i < n; ++i)
        append_utf8(out, pick(3) ? spaces[pick(3)] : spaces[pick(spaces.size())]);
    } else if (k < 86) {
      for (size_t n = 1 + pick(4); n > 0; --n) {
        char32_t c = static_cast<char32_t>(pick(3) ? pick(0x3400) : pick(0x110000));
        if (c >= 0xD800 && c <= 0xDFFF) c = 0xFFFD;
        append_utf8(out, c);
      }
    } else if (k < 89) {
      out.append(pick(2) ? 130 + pick(2000) : 2 + pick(120), "aeiou 1"[pick(7)]);  // long runs
    } else if (k < 92 && invalid_utf8) {
      for (size_t n = 1 + pick(4); n > 0; --n) out += static_cast<char>(0x80 + pick(128));
      if (pick(2)) out += "\xE2\x82";  // a truncated sequence
    } else {
      out += '\n';
    }
    out += pick(3) ? " " : "";
  }
  return out;
}

}  // namespace tessera::test
