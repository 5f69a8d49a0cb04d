// `tessera prepare`: text -> tokenizer.json + train.bin + val.bin (llm.c token files).
#include <chrono>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/data/file_io.h"
#include "tessera/data/token_file.h"
#include "tessera/data/tokenizer.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;

struct PrepareArgs {
  std::vector<std::string> inputs;
  std::string tokenizer = "byte";
  int64_t vocab = 512;
  std::string out;
  double val_fraction = 0.1;
};

void prepare(const PrepareArgs& a) {
  TESSERA_CHECK(a.tokenizer == "byte" || a.tokenizer == "bpe", "tessera prepare: --tokenizer must be byte or bpe, got '",
                a.tokenizer, "'");
  TESSERA_CHECK(a.val_fraction >= 0 && a.val_fraction < 1, "tessera prepare: --val-fraction must be in [0, 1), got ",
                a.val_fraction);
  std::string text;
  for (const auto& input : a.inputs) text += data::read_file(input);
  TESSERA_CHECK(text.size() >= 2, "tessera prepare: the input has ", text.size(), " bytes; nothing to train on");
  // The last val_fraction of the text (cut at a line break when there is one near) is validation.
  size_t split = text.size() - static_cast<size_t>(static_cast<double>(text.size()) * a.val_fraction);
  if (a.val_fraction > 0) {
    const size_t newline = text.find('\n', split);
    if (newline != std::string::npos && newline + 1 < text.size()) split = newline + 1;
  }
  const std::string_view train_text = std::string_view(text).substr(0, split);
  const std::string_view val_text = std::string_view(text).substr(split);

  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<data::Tokenizer> tok;
  if (a.tokenizer == "bpe") {
    TESSERA_CHECK(a.vocab >= 256, "tessera prepare: --vocab must be at least 256 for bpe, got ", a.vocab);
    tok = std::make_unique<data::BpeTokenizer>(data::BpeTokenizer::train(train_text, a.vocab));
  } else {
    tok = std::make_unique<data::ByteTokenizer>();
  }
  const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::vector<uint32_t> train_ids = tok->encode(train_text);
  const std::vector<uint32_t> val_ids = tok->encode(val_text);

  const fs::path out(a.out);
  fs::create_directories(out);
  tok->save(out / "tokenizer.json");
  data::write_token_file(out / "train.bin", train_ids, tok->vocab_size());
  if (!val_ids.empty()) data::write_token_file(out / "val.bin", val_ids, tok->vocab_size());
  std::cout << nlohmann::json{{"tokenizer", tok->type()},
                              {"vocab_size", tok->vocab_size()},
                              {"bytes", text.size()},
                              {"train_tokens", train_ids.size()},
                              {"val_tokens", val_ids.size()},
                              {"tokenizer_seconds", train_seconds},
                              {"out", out.string()}}
                   .dump()
            << "\n";
}

const RegisterCommand reg("prepare", "Tokenize text into train/val token files and a tokenizer", [](CLI::App& sub) {
  auto args = std::make_shared<PrepareArgs>();
  sub.add_option("--input", args->inputs, "text file(s) to tokenize (concatenated in order)")->required();
  sub.add_option("--tokenizer", args->tokenizer, "byte (256 ids) or bpe (byte-level BPE trained here)")
      ->check(CLI::IsMember({"byte", "bpe"}));
  sub.add_option("--vocab", args->vocab, "BPE vocabulary size (default 512)");
  sub.add_option("--out", args->out, "output directory: tokenizer.json, train.bin, val.bin")->required();
  sub.add_option("--val-fraction", args->val_fraction, "share of the text kept for validation (default 0.1)");
  sub.callback([args] { prepare(*args); });
});

}  // namespace
}  // namespace tessera::cli
