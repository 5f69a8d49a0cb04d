// `tessera prepare-fortunes`: a topic-classification data set from the `fortune` program's
// corpus (Debian's fortunes-min/fortunes packages, /usr/share/games/fortunes): one class per
// fortune file, the fortunes split on their `%` lines, a held-out split fixed by a seeded
// hash of each text (so it does not depend on the file order), written as train.jsonl and
// val.jsonl ({"text", "label" (class id), "topic" (file name)}; the training rows in a seeded
// random order, the validation rows by class), with a WordPiece vocabulary
// counted from the training text (data/wordpiece_vocab.h) saved as a BERT tokenizer, and the
// training fortunes as plain text (train.txt, a blank line between them) for pretraining a
// language model on them with `tessera prepare` + `tessera train`.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/data/sampler.h"
#include "tessera/data/wordpiece.h"
#include "tessera/data/wordpiece_vocab.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;

struct FortuneArgs {
  std::string dir = "/usr/share/games/fortunes";
  std::vector<std::string> files = {"computers", "definitions", "politics", "songs-poems", "startrek", "zippy"};
  double val_fraction = 0.15;
  uint64_t seed = 0;
  int64_t max_per_class = 0;  // 0: all
  int64_t vocab_size = 4000;  // 0: no tokenizer
  std::string out;
};

// The fortunes of one file: the stretches between lines holding only "%", trimmed, with
// bytes that are not UTF-8 replaced (U+FFFD), so every text is a valid JSON string.
std::vector<std::string> read_fortunes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "tessera prepare-fortunes: cannot read fortune file '", path.string(),
                "' (install the fortunes package: scripts/setup.sh)");
  std::vector<std::string> fortunes;
  std::string line, current;
  const auto finish = [&] {
    const size_t first = current.find_first_not_of(" \t\n");
    if (first != std::string::npos) {
      current.erase(current.find_last_not_of(" \t\n") + 1);
      const std::string valid = nlohmann::json(current.substr(first))
                                    .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      fortunes.push_back(nlohmann::json::parse(valid).get<std::string>());
    }
    current.clear();
  };
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == "%") {
      finish();
    } else {
      current += line + "\n";
    }
  }
  finish();
  return fortunes;
}

// FNV-1a of the seed and the text, as a fraction in [0, 1): the same text always lands in the
// same split.
double split_hash(uint64_t seed, const std::string& text) {
  uint64_t h = 1469598103934665603ULL ^ (seed * 0x9E3779B97F4A7C15ULL);
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
  h ^= h >> 33;
  return static_cast<double>(h >> 11) / static_cast<double>(1ULL << 53);
}

void prepare_fortunes(const FortuneArgs& a) {
  TESSERA_CHECK(a.val_fraction > 0 && a.val_fraction < 1,
                "tessera prepare-fortunes: --val-fraction must be in (0, 1), got ", a.val_fraction);
  TESSERA_CHECK(!a.files.empty(), "tessera prepare-fortunes: --files names no fortune file");
  std::vector<std::vector<std::string>> classes;
  for (const std::string& name : a.files) {
    classes.push_back(read_fortunes(fs::path(a.dir) / name));
    TESSERA_CHECK(classes.back().size() >= 10, "tessera prepare-fortunes: '", (fs::path(a.dir) / name).string(),
                  "' holds ", classes.back().size(), " fortunes; a class needs at least 10");
    if (a.max_per_class > 0 && static_cast<int64_t>(classes.back().size()) > a.max_per_class)
      classes.back().resize(a.max_per_class);
  }
  fs::create_directories(a.out);
  std::ofstream train(fs::path(a.out) / "train.jsonl"), val(fs::path(a.out) / "val.jsonl");
  TESSERA_CHECK(train.good() && val.good(), "tessera prepare-fortunes: cannot write into '", a.out, "'");
  std::vector<std::string> train_texts, train_rows;
  nlohmann::json counts = nlohmann::json::object();
  for (size_t label = 0; label < classes.size(); ++label) {
    int64_t in_train = 0, in_val = 0;
    for (const std::string& text : classes[label]) {
      const bool held_out = split_hash(a.seed, text) < a.val_fraction;
      const std::string row = nlohmann::json{{"text", text}, {"label", label}, {"topic", a.files[label]}}.dump();
      if (held_out) {
        val << row << "\n";
      } else {
        train_texts.push_back(text);
        train_rows.push_back(row);
      }
      ++(held_out ? in_val : in_train);
    }
    counts[a.files[label]] = {{"train", in_train}, {"val", in_val}};
  }
  // The training rows in a seeded random order, so that a reader in file order (a script, a
  // loader without shuffling) does not see one class at a time.
  std::ofstream text(fs::path(a.out) / "train.txt");
  for (int64_t i : data::seeded_permutation(static_cast<int64_t>(train_rows.size()), a.seed, 0)) {
    train << train_rows[i] << "\n";
    text << train_texts[i] << "\n\n";
  }
  train.close();
  val.close();
  TESSERA_CHECK(!train.fail() && !val.fail(), "tessera prepare-fortunes: writing into '", a.out, "' failed");
  int64_t vocab_entries = 0;
  if (a.vocab_size > 0) {
    const std::vector<std::string> vocab = data::build_wordpiece_vocab(train_texts, {.vocab_size = a.vocab_size});
    vocab_entries = static_cast<int64_t>(vocab.size());
    data::WordPieceTokenizer(data::WordPieceTokenizer::bert_config(vocab, /*lowercase=*/true))
        .save_files(a.out);  // tokenizer.json, vocab.txt, tokenizer_config.json, ...
  }
  std::cout << nlohmann::json{{"classes", counts}, {"vocab_size", vocab_entries}, {"out", a.out}}.dump() << "\n";
}

const RegisterCommand reg(
    "prepare-fortunes",
    "Write a topic-classification data set (train.jsonl, val.jsonl, a WordPiece vocab.txt) from the fortune files",
    [](CLI::App& sub) {
      auto args = std::make_shared<FortuneArgs>();
      sub.add_option("--fortunes-dir", args->dir, "folder of the fortune files (default /usr/share/games/fortunes)");
      sub.add_option("--files", args->files, "the fortune files, one class each, in label order")
          ->delimiter(',');
      sub.add_option("--val-fraction", args->val_fraction, "share held out for validation (default 0.15)");
      sub.add_option("--seed", args->seed, "seed of the split's hash (default 0)");
      sub.add_option("--max-per-class", args->max_per_class,
                     "keep at most this many fortunes of each file, the first ones (default all)");
      sub.add_option("--vocab-size", args->vocab_size,
                     "WordPiece vocabulary counted from the training text; 0 = none (default 4000)");
      sub.add_option("--out", args->out, "output folder")->required();
      sub.callback([args] { prepare_fortunes(*args); });
    });

}  // namespace
}  // namespace tessera::cli
