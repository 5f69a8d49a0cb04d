// `tessera prepare`: text -> tokenizer files + train.bin + val.bin (llm.c token files).
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/core/settings.h"
#include "tessera/data/token_file.h"
#include "tessera/data/tokenizer.h"
#include "tessera/dist/env.h"

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

// Everything one prepare writes: a run replaces all of these or none of them.
constexpr const char* kOutputs[] = {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                                     "train.bin", "val.bin"};

// `write_all(folder)` writes the outputs into a staging folder inside `out`; only when
// it has succeeded are the previous outputs removed and the new ones renamed into
// place (renames need no space, so a full disk fails while staging, before anything
// changed). So a failure leaves the previous set untouched, and a changed option
// (--val-fraction 0: no val.bin) leaves no file of the previous set behind.
void write_outputs_as_one_set(const fs::path& out, const std::function<void(const fs::path&)>& write_all) {
  fs::create_directories(out);
  const fs::path staging = out / (".prepare.tmp." + std::to_string(::getpid()));
  fs::remove_all(staging);
  fs::create_directory(staging);
  try {
    write_all(staging);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
  for (const char* name : kOutputs) fs::remove(out / name);
  for (const auto& entry : fs::directory_iterator(staging)) fs::rename(entry.path(), out / entry.path().filename());
  fs::remove(staging);
  fsync_directory(out);
}

// GPT-2's encoder.json + vocab.bpe: $TESSERA_GPT2_DIR, ./.deps/gpt2, or .deps/gpt2 next to
// the build folder of this program (where scripts/setup.sh puts them).
std::unique_ptr<data::Tokenizer> gpt2_tokenizer() {
  std::vector<fs::path> places;
  if (const std::string env = setting_text(Setting::Gpt2Dir); !env.empty()) {
    // Set means meant: a wrong folder is an error, not a quiet fall-back to another copy.
    const fs::path dir(env);
    TESSERA_CHECK(fs::exists(dir / "encoder.json") && fs::exists(dir / "vocab.bpe"),
                  "tessera prepare: TESSERA_GPT2_DIR is '", env, "', which ",
                  fs::is_directory(dir) ? "holds no encoder.json + vocab.bpe" : "is not a folder",
                  "; point it at GPT-2's files or unset it");
    places.emplace_back(dir);
  }
  places.emplace_back(fs::path(".deps") / "gpt2");
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    places.push_back(exe.parent_path().parent_path() / ".deps" / "gpt2");
    places.push_back(exe.parent_path().parent_path() / "share" / "tessera" / "gpt2");
  }
  std::string tried;
  for (const fs::path& dir : places) {
    if (fs::exists(dir / "encoder.json") && fs::exists(dir / "vocab.bpe"))
      return std::make_unique<data::BpeTokenizer>(
          data::BpeTokenizer::from_gpt2_files(dir / "encoder.json", dir / "vocab.bpe"));
    tried += " " + dir.string();
  }
  TESSERA_FAIL(
      "tessera prepare: --tokenizer gpt2 needs GPT-2's encoder.json and vocab.bpe; not found in",
      tried, " (scripts/setup.sh fetches them into .deps/gpt2, or set TESSERA_GPT2_DIR)");
}

// byte, bpe (trained on the training text), gpt2, or a tokenizer file/folder.
std::unique_ptr<data::Tokenizer> make_tokenizer(const PrepareArgs& a, std::string_view train_text) {
  if (a.tokenizer == "byte") return std::make_unique<data::ByteTokenizer>();
  if (a.tokenizer == "bpe") {
    TESSERA_CHECK(a.vocab >= 256, "tessera prepare: --vocab must be at least 256 for bpe, got ",
                  a.vocab);
    auto tok = std::make_unique<data::BpeTokenizer>(data::BpeTokenizer::train(train_text, a.vocab));
    if (tok->vocab_size() < a.vocab)
      std::cerr << "tessera prepare: warning: BPE training found only " << tok->vocab_size() - 256
                << " merges (no other pair repeats in the training text), so the vocabulary has "
                << tok->vocab_size() << " entries, not the " << a.vocab << " asked for with --vocab\n";
    return tok;
  }
  if (a.tokenizer == "gpt2") return gpt2_tokenizer();
  TESSERA_CHECK(fs::exists(a.tokenizer), "tessera prepare: --tokenizer '", a.tokenizer,
                "' is not byte, bpe, gpt2 or an existing tokenizer file or folder");
  auto tok = data::load_tokenizer_from(a.tokenizer);
  TESSERA_CHECK(tok != nullptr, "tessera prepare: folder '", a.tokenizer,
                "' holds no tokenizer.json, vocab.json + merges.txt, encoder.json + vocab.bpe or vocab.txt");
  return tok;
}

// Each --input must be a text file that this run does not replace.
void check_input(const fs::path& input, const fs::path& out) {
  TESSERA_CHECK(fs::exists(input), "tessera prepare: --input '", input.string(), "' does not exist");
  TESSERA_CHECK(!fs::is_directory(input), "tessera prepare: --input '", input.string(),
                "' is a directory; name the text file(s) in it");
  for (const char* name : kOutputs) {
    std::error_code ec;
    TESSERA_CHECK(!fs::equivalent(input, out / name, ec), "tessera prepare: --input '", input.string(),
                  "' is one of the files this prepare writes into --out '", out.string(),
                  "' and would be overwritten; give another --out");
  }
  int32_t magic = 0;
  std::ifstream(input, std::ios::binary).read(reinterpret_cast<char*>(&magic), sizeof(magic));
  TESSERA_CHECK(magic != data::kTokenFileMagic, "tessera prepare: --input '", input.string(),
                "' is a token file (llm.c layout, already tokenized), not text; train on it with "
                "`tessera train --data` or prepare from the original text");
}

void prepare(const PrepareArgs& a) {
  TESSERA_CHECK(a.val_fraction >= 0 && a.val_fraction < 1,
                "tessera prepare: --val-fraction must be in [0, 1), got ", a.val_fraction);
  for (const auto& input : a.inputs) check_input(input, a.out);
  std::string text;
  for (const auto& input : a.inputs) text += read_file(input);
  TESSERA_CHECK(text.size() >= 2, "tessera prepare: the input has ", text.size(),
                " bytes; nothing to train on");
  // The last val_fraction of the text (cut at a line break when there is one near) is validation.
  size_t split =
      text.size() - static_cast<size_t>(static_cast<double>(text.size()) * a.val_fraction);
  if (a.val_fraction > 0) {
    const size_t newline = text.find('\n', split);
    if (newline != std::string::npos && newline + 1 < text.size()) split = newline + 1;
  }
  const std::string_view train_text = std::string_view(text).substr(0, split);
  const std::string_view val_text = std::string_view(text).substr(split);

  const auto t0 = std::chrono::steady_clock::now();
  const std::unique_ptr<data::Tokenizer> tok = make_tokenizer(a, train_text);
  const auto t1 = std::chrono::steady_clock::now();
  const std::vector<uint32_t> train_ids = tok->encode(train_text);  // every core on large text
  const std::vector<uint32_t> val_ids = tok->encode(val_text);
  const double encode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();

  const fs::path out(a.out);
  write_outputs_as_one_set(out, [&](const fs::path& folder) {
    tok->save_files(folder);  // tokenizer.json (+ vocab.json, merges.txt, tokenizer_config.json)
    data::write_token_file(folder / "train.bin", train_ids, tok->vocab_size());
    if (!val_ids.empty()) data::write_token_file(folder / "val.bin", val_ids, tok->vocab_size());
  });
  if (val_ids.empty())
    std::cerr << "tessera prepare: note: no val.bin written (--val-fraction " << a.val_fraction
              << "), so `tessera train` on this folder will not evaluate\n";
  std::cout << nlohmann::json{{"tokenizer", tok->type()},
                              {"vocab_size", tok->vocab_size()},
                              {"bytes", text.size()},
                              {"train_tokens", train_ids.size()},
                              {"val_tokens", val_ids.size()},
                              {"tokenizer_seconds", std::chrono::duration<double>(t1 - t0).count()},
                              {"encode_seconds", encode_seconds},
                              {"out", out.string()}}
                   .dump()
            << "\n";
}

const RegisterCommand reg(
    "prepare", "Tokenize text into train/val token files and a tokenizer", [](CLI::App& sub) {
      auto args = std::make_shared<PrepareArgs>();
      sub.add_option("--input", args->inputs, "text file(s) to tokenize (concatenated in order)")
          ->required();
      sub.add_option(
          "--tokenizer", args->tokenizer,
          "byte (256 ids), bpe (byte-level BPE trained here), gpt2 (GPT-2's 50,257 tokens, as "
          "tiktoken's gpt2 encode_ordinary), or a Hugging Face tokenizer.json / tokenizer folder");
      sub.add_option("--vocab", args->vocab, "BPE vocabulary size (default 512)");
      sub.add_option("--out", args->out, "output directory: tokenizer files, train.bin, val.bin")
          ->required();
      sub.add_option("--val-fraction", args->val_fraction,
                     "share of the text kept for validation (default 0.1)");
      sub.callback([args] { prepare(*args); });
    });

}  // namespace
}  // namespace tessera::cli
