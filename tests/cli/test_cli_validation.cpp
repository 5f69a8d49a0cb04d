// Bad input at the CLI's boundaries (issue 14): prepare writes its outputs as one set,
// exported models are verified on load, non-finite results fail, config sizes are checked
// against the weight file before anything is allocated, invalid numbers are errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "tessera/core/safetensors.h"
#include "tests/cli/cli_harness.h"

namespace fs = std::filesystem;
using namespace tessera_cli_test;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
constexpr bool kAddressSanitizer = __has_feature(address_sanitizer);
#else
constexpr bool kAddressSanitizer = false;
#endif

// A tiny trained model directory (run/model), trained once per test program.
fs::path trained_model() {
  const fs::path run_dir = scratch() / "validation_run";
  if (!fs::exists(run_dir / "model" / "model.safetensors")) {
    const auto r = run("train --data " + (prepared("byte") / "train.bin").string() +
                       " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 4 --steps 3 --out " +
                       run_dir.string());
    EXPECT_EQ(r.rc, 0) << r.output;
  }
  return run_dir / "model";
}

// A copy of the trained model directory that a test may damage.
fs::path model_copy(const std::string& name) {
  const fs::path dir = scratch() / name;
  fs::remove_all(dir);
  fs::copy(trained_model(), dir, fs::copy_options::recursive);
  return dir;
}

// name -> size and hash of every file in `dir` (short enough to print when they differ).
std::map<std::string, std::string> folder_contents(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string bytes = slurp(e.path());
    out[e.path().filename().string()] = std::to_string(bytes.size()) + " bytes, hash " +
                                        std::to_string(std::hash<std::string>{}(bytes));
  }
  return out;
}

std::string eval_args(const fs::path& model) {
  return "eval --model " + model.string() + " --data " + (prepared("byte") / "val.bin").string() +
         " --batch 2 --seq 16 --batches 2";
}

}  // namespace

// Issue 14, defect 2.
TEST(CliValidation, PrepareReplacesItsOutputsAsOneSet) {
  const fs::path corpus = scratch() / "set_corpus.txt";
  std::ofstream(corpus) << generated_corpus(2000);
  const fs::path out = scratch() / "prepared_set";
  const std::string prepare = "prepare --input " + corpus.string() + " --out " + out.string() + " ";
  auto r = run(prepare + "--tokenizer byte --val-fraction 0.1");
  ASSERT_EQ(r.rc, 0) << r.output;
  ASSERT_TRUE(fs::exists(out / "val.bin"));

  // A changed option leaves no output of the previous run behind.
  r = run(prepare + "--tokenizer byte --val-fraction 0");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_FALSE(fs::exists(out / "val.bin")) << "an old val.bin survived --val-fraction 0";
  EXPECT_EQ(fs::file_size(out / "train.bin"), 1024 + 2 * fs::file_size(corpus));

  // A prepare that fails while writing (a file-size limit stands in for a full disk: the
  // BPE train.bin needs more than 16 blocks, its tokenizer.json fewer) changes nothing.
  r = run(prepare + "--tokenizer byte --val-fraction 0.1");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto before = folder_contents(out);
  r = run(prepare + "--tokenizer bpe --vocab 300 --val-fraction 0.1",
          "ulimit -f 16; trap '' XFSZ;");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("File too large"), std::string::npos) << r.output;
  EXPECT_EQ(folder_contents(out), before) << "a failed prepare changed the outputs: " << r.output;
  // Nothing left beside the output folder either.
  for (const auto& e : fs::directory_iterator(out.parent_path()))
    EXPECT_EQ(e.path().filename().string().find("prepared_set."), std::string::npos) << e.path();

  // Unhindered, the same command replaces the whole set.
  r = run(prepare + "--tokenizer bpe --vocab 300 --val-fraction 0.1");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto after = folder_contents(out);
  EXPECT_NE(after.at("tokenizer.json"), before.at("tokenizer.json"));
  EXPECT_NE(after.at("train.bin"), before.at("train.bin"));
}

// Issue 14, defect 3 (checksums of the exported model).
TEST(CliValidation, ExportedModelIsVerifiedOnLoad) {
  ASSERT_TRUE(fs::exists(trained_model() / "checksums.json"));
  const fs::path damaged = model_copy("flipped_model");
  {  // flip one bit of the last weight
    std::fstream f(damaged / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-3, std::ios::end);
    f.put(static_cast<char>(c ^ 0x10));
  }
  for (const std::string& cmd :
       {eval_args(damaged), "sample --max-new-tokens 4 --model " + damaged.string()}) {
    const auto r = run(cmd);
    EXPECT_NE(r.rc, 0) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("damaged"), std::string::npos) << r.output;
  }
  const auto r = run(eval_args(trained_model()));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_TRUE(std::isfinite(nlohmann::json::parse(r.output)["loss"].get<double>())) << r.output;
}

// Issue 14, defect 3 (non-finite results). A model directory without checksums (as
// `transformers` writes it) whose final LayerNorm holds a NaN: every logit is NaN.
TEST(CliValidation, NonFiniteResultsExitNonZeroNamingThem) {
  const fs::path dir = model_copy("nan_model");
  fs::remove(dir / "checksums.json");
  const std::string weights = (dir / "model.safetensors").string();
  std::vector<std::pair<std::string, tessera::Tensor>> tensors;
  for (const auto& [name, t] : tessera::load_safetensors(weights, {.memory_map = false}).tensors) {
    if (name != "transformer.ln_f.weight") {
      tensors.emplace_back(name, t);
      continue;
    }
    std::vector<float> values = t.to_vector<float>();
    values[0] = std::numeric_limits<float>::quiet_NaN();
    tensors.emplace_back(name, tessera::from_vector(values, t.shape()));
  }
  tessera::save_safetensors(weights, tensors, {{"format", "pt"}});

  auto r = run(eval_args(dir));
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not finite"), std::string::npos) << r.output;
  r = run("sample --max-new-tokens 4 --model " + dir.string());
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("logits"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not finite"), std::string::npos) << r.output;
}

// Issue 14, defect 4. Under a 2 GiB address-space limit a loader that allocated before
// checking would fail on the limit (or grow until it), not name the key. (AddressSanitizer
// reserves terabytes of address space for its shadow memory, so its builds run unlimited.)
TEST(CliValidation, ConfigSizesAreCheckedAgainstTheWeightsBeforeAllocating) {
  const std::string limit = kAddressSanitizer ? "" : "ulimit -v 2097152;";
  auto r = run(eval_args(trained_model()), limit);
  ASSERT_EQ(r.rc, 0) << "the trained model must load under the limit:\n" << r.output;
  const std::vector<std::pair<std::string, nlohmann::json>> cases = {
      {"n_layer", 1000000},
      {"n_layer", 2},
      {"n_embd", int64_t{1} << 31},
      {"n_embd", 32},
      {"vocab_size", int64_t{1} << 40},
      {"vocab_size", 300},
      {"n_positions", int64_t{1} << 40},
      {"n_positions", 2048},
      {"n_head", int64_t{1} << 40},
  };
  const fs::path dir = model_copy("resized_model");
  fs::remove(dir / "checksums.json");  // a foreign model directory: nothing but the sizes to check
  const std::string original = slurp(dir / "config.json");
  for (const auto& [key, value] : cases) {
    nlohmann::json config = nlohmann::json::parse(original);
    config[key] = value;
    std::ofstream(dir / "config.json", std::ios::trunc) << config.dump(2);
    r = run(eval_args(dir), limit);
    EXPECT_NE(r.rc, 0) << key << " " << value << "\n" << r.output;
    EXPECT_NE(r.output.find("\"" + key + "\""), std::string::npos) << key << " " << value << "\n"
                                                                   << r.output;
    EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(value.dump()), std::string::npos) << r.output;
  }
}

// Issue 14, defect 8: paths and numbers the CLI used to misread.
TEST(CliValidation, InvalidPathsAndNumbersAreErrorsNamingThem) {
  const fs::path data = prepared("byte");
  auto r = run("train --data " + data.string() +
               " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --steps 1 --out " +
               (scratch() / "dir_as_data").string());
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("is a directory"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("No such device"), std::string::npos) << r.output;

  const std::string eval =
      "eval --model " + trained_model().string() + " --data " + (data / "val.bin").string() + " ";
  const std::string sample = "sample --max-new-tokens 2 --model " + trained_model().string() + " ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {eval + "--batches -2", "--batches"},
      {eval + "--batches 0", "--batches"},
      {eval + "--seq 0", "--seq"},
      {eval + "--seq -16", "--seq"},
      {eval + "--batch 0", "--batch"},
      {sample + "--num-samples -1", "--num-samples"},
      {sample + "--num-samples 0", "--num-samples"},
  };
  for (const auto& [cmd, flag] : cases) {
    r = run(cmd);
    EXPECT_NE(r.rc, 0) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << cmd << "\n" << r.output;
  }
  r = run(sample + "--num-samples 2");
  EXPECT_EQ(r.rc, 0) << r.output;
}

// Issue 14, defect 8: a BPE vocabulary that stops short of --vocab says so.
TEST(CliValidation, PrepareWarnsWhenBpeStopsShortOfTheVocabulary) {
  const fs::path corpus = scratch() / "short_bpe.txt";
  std::ofstream(corpus) << "abab abab cdcd cdcd abab\n";
  auto r = run("prepare --input " + corpus.string() +
               " --tokenizer bpe --vocab 1000 --val-fraction 0 --out " +
               (scratch() / "short_bpe").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto summary = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  const int64_t vocab = summary["vocab_size"];
  ASSERT_LT(vocab, 1000);
  EXPECT_NE(r.output.find("warning"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(std::to_string(vocab - 256) + " merges"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1000"), std::string::npos) << r.output;

  r = run("prepare --input " + corpus.string() +
          " --tokenizer bpe --vocab 258 --val-fraction 0 --out " +
          (scratch() / "short_bpe").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.find("warning"), std::string::npos) << r.output;
}
