// The `tessera` program end to end: prepare/train/eval/sample, bit-identical resume,
// damaged checkpoints, bad configs. Tiny models keep each run to seconds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <random>

#include "tessera/core/allocator.h"

namespace fs = std::filesystem;

namespace {

struct RunResult {
  int rc;
  std::string output;
};

std::string tessera_binary() {
  if (const char* env = std::getenv("TESSERA_BINARY")) return env;
  return (fs::path(TESSERA_BINARY_DIR) / "tessera").string();
}

RunResult run(const std::string& args) {
  const std::string cmd = "OMP_NUM_THREADS=2 " + tessera_binary() + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (pipe && fgets(buf, sizeof(buf), pipe)) out += buf;
  const int status = pipe ? pclose(pipe) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

fs::path scratch() {
  static const fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("tessera_test_cli_" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

// A small deterministic corpus with learnable structure (repeated phrases).
std::string generated_corpus(size_t sentences) {
  const std::vector<std::string> subjects = {"The cat", "A dog", "My friend", "The old man", "She"};
  const std::vector<std::string> verbs = {"sees", "likes", "finds", "wants", "reads"};
  const std::vector<std::string> objects = {"the moon.", "a book.", "green tea.", "the sea.", "a red ball."};
  std::mt19937 rng(7);
  std::string text;
  for (size_t i = 0; i < sentences; ++i) {
    text += subjects[rng() % subjects.size()] + " " + verbs[rng() % verbs.size()] + " " +
            objects[rng() % objects.size()] + (i % 4 == 3 ? "\n" : " ");
  }
  return text;
}

// prepare once per tokenizer kind; returns the data directory.
fs::path prepared(const std::string& tokenizer) {
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

// Removes this process's scratch folder when the tests are done.
class ScratchCleanup : public ::testing::Environment {
 public:
  void TearDown() override { fs::remove_all(scratch()); }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

const std::string kTinyModel = " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 4 ";

std::vector<nlohmann::json> read_metrics(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// (loss or val_loss) of every metrics line with step > after, as exact doubles.
std::vector<std::pair<int64_t, double>> losses_after(const fs::path& run_dir, int64_t after) {
  std::vector<std::pair<int64_t, double>> out;
  for (const auto& j : read_metrics(run_dir)) {
    const int64_t step = j["step"];
    if (step <= after) continue;
    out.emplace_back(step, j.contains("loss") ? j["loss"].get<double>() : -j["val_loss"].get<double>());
  }
  return out;
}

void expect_resume_bit_identical(const std::string& mode) {
  const fs::path data = prepared("byte");
  const std::string common = "train --data " + (data / "train.bin").string() + kTinyModel +
                             " --grad-accum 2 --warmup 5 --eval-every 10 --eval-batches 2 --save-every 20 " + mode;
  // Cosine schedule: 40 steps straight, checkpoint at 20 resumed in a fresh process and run dir.
  const fs::path straight = scratch() / ("straight" + mode);
  auto r = run(common + " --steps 40 --schedule cosine --out " + straight.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  const fs::path resumed = scratch() / ("resumed" + mode);
  fs::create_directories(resumed);
  r = run(common + " --steps 40 --schedule cosine --out " + resumed.string() + " --resume " +
          (straight / "checkpoints" / "step_00000020").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  const auto a = losses_after(straight, 20), b = losses_after(resumed, 20);
  ASSERT_EQ(a.size(), 20u + 2u);  // 20 train steps + evaluations at 30 and 40
  EXPECT_EQ(a, b);
  EXPECT_EQ(slurp(straight / "model" / "model.safetensors"), slurp(resumed / "model" / "model.safetensors"));

  // Constant schedule: stop after 20 steps, then --resume (newest checkpoint under --out) to 40.
  const fs::path whole = scratch() / ("whole" + mode), split = scratch() / ("split" + mode);
  ASSERT_EQ(run(common + " --steps 40 --schedule constant --out " + whole.string()).rc, 0);
  ASSERT_EQ(run(common + " --steps 20 --schedule constant --out " + split.string()).rc, 0);
  r = run(common + " --steps 40 --schedule constant --out " + split.string() + " --resume");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(losses_after(whole, 0), losses_after(split, 0));
  EXPECT_EQ(slurp(whole / "model" / "model.safetensors"), slurp(split / "model" / "model.safetensors"));
}

}  // namespace

TEST(Cli, EverySubcommandHasHelp) {
  for (const char* cmd : {"prepare", "train", "eval", "sample"}) {
    const auto r = run(std::string(cmd) + " --help");
    EXPECT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("--"), std::string::npos) << r.output;
  }
  const auto r = run("train --help");
  for (const char* flag : {"--config", "--data", "--val-data", "--init", "--n-layer", "--n-head", "--n-embd",
                           "--block-size", "--vocab-size", "--batch", "--seq", "--grad-accum", "--steps", "--lr",
                           "--min-lr", "--warmup", "--schedule", "--weight-decay", "--beta1", "--beta2", "--eps",
                           "--grad-clip", "--seed", "--sequential", "--shuffle", "--device", "--dtype",
                           "--eval-every", "--eval-batches", "--sample-every", "--save-every", "--keep-last",
                           "--out", "--resume"})
    EXPECT_NE(r.output.find(std::string(flag) + " "), std::string::npos) << flag;
}

TEST(Cli, PrepareTrainEvalSampleEndToEnd) {
  // The default corpus setup installs (Debian fortunes) when present, else a generated one.
  fs::path corpus = "/usr/share/games/fortunes/fortunes";
  if (!fs::exists(corpus)) {
    corpus = scratch() / "e2e_corpus.txt";
    std::ofstream(corpus) << generated_corpus(4000);
  }
  const fs::path data = scratch() / "e2e_data";
  auto r = run("prepare --input " + corpus.string() + " --tokenizer bpe --vocab 320 --val-fraction 0.1 --out " +
               data.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto summary = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(summary["tokenizer"], "bpe");
  EXPECT_LE(summary["vocab_size"].get<int>(), 320);
  EXPECT_LT(summary["train_tokens"].get<int64_t>(), summary["bytes"].get<int64_t>());
  for (const char* f : {"tokenizer.json", "train.bin", "val.bin"}) EXPECT_TRUE(fs::exists(data / f)) << f;

  const fs::path out = scratch() / "e2e_run";
  r = run("train --data " + (data / "train.bin").string() +
          " --n-layer 1 --n-head 2 --n-embd 32 --seq 32 --batch 8 --steps 200 --lr 3e-3 --warmup 10"
          " --eval-every 100 --eval-batches 4 --sample-every 100 --out " + out.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("step 200/200"), std::string::npos) << r.output;  // plain lines off a terminal
  EXPECT_NE(r.output.find("sample at step 100"), std::string::npos) << r.output;
  const auto metrics = read_metrics(out);
  std::vector<double> train_loss, val_loss;
  for (const auto& j : metrics) {
    if (j.contains("loss")) {
      for (const char* key : {"step", "loss", "lr", "grad_norm", "ms", "tokens_per_s"}) EXPECT_TRUE(j.contains(key)) << key;
      train_loss.push_back(j["loss"]);
    } else {
      EXPECT_TRUE(j.contains("val_loss"));
      val_loss.push_back(j["val_loss"]);
    }
  }
  ASSERT_EQ(train_loss.size(), 200u);
  ASSERT_EQ(val_loss.size(), 2u);
  const double uniform = std::log(summary["vocab_size"].get<double>());
  EXPECT_NEAR(train_loss.front(), uniform, 0.5);       // a fresh GPT-2 init predicts ~uniformly
  EXPECT_LT(train_loss.back(), train_loss.front() - 1.0);  // and it learns
  EXPECT_LT(val_loss.back(), uniform - 1.0);
  EXPECT_EQ(slurp(out / "loss.png").substr(0, 8), "\x89PNG\r\n\x1a\n");
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"}) EXPECT_TRUE(fs::exists(out / "model" / f)) << f;

  r = run("eval --model " + (out / "model").string() + " --data " + (data / "val.bin").string() +
          " --batch 8 --seq 32 --batches 4");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto eval = nlohmann::json::parse(r.output);
  EXPECT_EQ(eval["tokens"].get<int64_t>(), 8 * 32 * 4);
  // Same batches as the trainer's last evaluation: the same loss (f32 sums, printed as doubles).
  EXPECT_NEAR(eval["loss"].get<double>(), val_loss.back(), 1e-6);

  // PyTorch reads the same directory as a Hugging Face GPT-2 state dict and gets the same loss.
  {
    const std::string cmd = "/usr/bin/python3 " + (fs::path(TESSERA_SOURCE_DIR) / "tests/cli/torch_gpt2_loss.py").string() +
                            " " + (out / "model").string() + " " + (data / "val.bin").string() + " 8 32 4 2>&1";
    FILE* pipe = popen(cmd.c_str(), "r");
    std::string torch_out;
    char buf[4096];
    while (pipe && fgets(buf, sizeof(buf), pipe)) torch_out += buf;
    ASSERT_EQ(pipe ? pclose(pipe) : -1, 0) << torch_out;
    const auto torch_eval = nlohmann::json::parse(torch_out);
    EXPECT_EQ(torch_eval["tokens"], eval["tokens"]);
    EXPECT_NEAR(torch_eval["loss"].get<double>(), eval["loss"].get<double>(), 1e-4) << torch_out;
  }

  const std::string sample = "sample --model " + (out / "model").string() + " --prompt 'The ' --max-new-tokens 40 ";
  const auto s1 = run(sample + "--seed 1"), s2 = run(sample + "--seed 1"), s3 = run(sample + "--seed 2");
  ASSERT_EQ(s1.rc, 0) << s1.output;
  EXPECT_EQ(s1.output.rfind("The ", 0), 0u) << s1.output;
  EXPECT_GT(s1.output.size(), 10u);
  EXPECT_EQ(s1.output, s2.output);
  EXPECT_NE(s1.output, s3.output);
}

TEST(Cli, ResumeIsBitIdenticalSequential) { expect_resume_bit_identical("--sequential"); }
TEST(Cli, ResumeIsBitIdenticalShuffled) { expect_resume_bit_identical("--shuffle"); }

TEST(Cli, DamagedCheckpointsAreRefusedAndThePreviousOneStaysUsable) {
  const fs::path data = prepared("byte");
  const fs::path out = scratch() / "damaged";
  const std::string common = "train --data " + (data / "train.bin").string() + kTinyModel + " --schedule constant --save-every 10 --keep-last 2 ";
  auto r = run(common + "--steps 30 --out " + out.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  // keep-last 2: step 10 rotated away.
  EXPECT_FALSE(fs::exists(out / "checkpoints" / "step_00000010"));
  const fs::path prev = out / "checkpoints" / "step_00000020", last = out / "checkpoints" / "step_00000030";
  ASSERT_TRUE(fs::exists(prev) && fs::exists(last));

  // Truncate the newest checkpoint's weights: named in a clear error, nothing trained.
  const auto weights = last / "model.safetensors";
  const auto size = fs::file_size(weights);
  fs::resize_file(weights, size / 2);
  r = run(common + "--steps 40 --out " + out.string() + " --resume " + last.string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("damaged"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 31"), std::string::npos) << r.output;
  r = run("sample --model " + last.string() + " --max-new-tokens 5");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("damaged"), std::string::npos) << r.output;

  // A flipped byte in the training state is caught by its checksum.
  {
    std::fstream f(prev / "training_state.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-5, std::ios::end);
    f.put(static_cast<char>(c ^ 0x40));
  }
  r = run(common + "--steps 40 --out " + out.string() + " --resume " + prev.string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("training_state.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CRC"), std::string::npos) << r.output;
  {  // undo the flip: the checkpoint is usable again
    std::fstream f(prev / "training_state.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-5, std::ios::end);
    f.put(static_cast<char>(c ^ 0x40));
  }
  // An interrupted write (no checksums.json) is not a checkpoint.
  fs::create_directories(out / "checkpoints" / "step_00000099");
  fs::copy_file(prev / "config.json", out / "checkpoints" / "step_00000099" / "config.json");
  // --resume without a path skips the damaged/incomplete newer ones and uses step 20.
  r = run(common + "--steps 40 --out " + out.string() + " --resume");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("skipping damaged checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at step 20"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 40/40"), std::string::npos) << r.output;
  // Rotation (keep-last 2) counted only complete checkpoints: 30 and 40 remain, plus the
  // incomplete folder, which is never taken for a checkpoint.
  EXPECT_TRUE(fs::exists(out / "checkpoints" / "step_00000030" / "checksums.json"));
  EXPECT_TRUE(fs::exists(out / "checkpoints" / "step_00000040" / "checksums.json"));
  EXPECT_FALSE(fs::exists(out / "checkpoints" / "step_00000020"));
}

TEST(Cli, BadConfigsFailBeforeTrainingNamingTheKey) {
  const fs::path data = prepared("byte");
  const std::string train = "train --data " + (data / "train.bin").string() + kTinyModel + " --steps 3 --out " +
                            (scratch() / "badcfg").string() + " ";
  auto write = [](const std::string& name, const std::string& text) {
    const fs::path p = scratch() / name;
    std::ofstream(p) << text;
    return p.string();
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--config " + write("unknown.json", R"({"steps": 3, "bogus_key": 1})"), "bogus_key"},
      {"--config " + write("wrongtype.json", R"({"steps": "many"})"), "\"steps\""},
      {"--config " + write("float_steps.json", R"({"steps": 2.5})"), "\"steps\""},
      {"--config " + write("unknown.yaml", "steps: 3\nlearning_rate: 0.1\n"), "learning_rate"},
      {"--config " + write("broken.json", "{\"steps\": "), "not valid JSON"},
      {"--steps=-5", "\"steps\""},
      {"--steps abc", "\"steps\""},
      {"--n-embd 30 --n-head 4", "\"n_head\""},
      {"--seq 64 --block-size 32", "\"seq\""},
      {"--schedule stepwise", "\"schedule\""},
      {"--dtype fp8", "\"dtype\""},
      {"--device tpu", "\"device\""},
      {"--lr 0", "\"lr\""},
      {"--batch 0", "\"batch\""},
  };
  for (const auto& [args, key] : cases) {
    const auto r = run(train + args);
    EXPECT_NE(r.rc, 0) << args;
    EXPECT_NE(r.output.find(key), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << args << "\n" << r.output;
  }
  // A valid YAML config works, and flags override it.
  const auto yaml = write("good.yaml", "# tiny run\nsteps: 1000\nlr: 0.002\nschedule: constant\nshuffle: true\n");
  auto r = run(train + "--config " + yaml);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("step 3/3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("shuffled"), std::string::npos) << r.output;
  const auto saved = nlohmann::json::parse(slurp(scratch() / "badcfg" / "config.train.json"));
  EXPECT_EQ(saved["steps"], 3);
  EXPECT_EQ(saved["lr"], 0.002);
}

// fp32, bf16 and fp16 runs on `device` ("cpu" or "cuda"); the final train losses by dtype.
// Resuming a mixed-precision run from its checkpoint continues the same run: bit for bit on
// the CPU; on a GPU within float rounding (atomic gradient sums may add in another order).
static std::map<std::string, double> mixed_precision_runs(const std::string& device) {
  const fs::path data = prepared("byte");
  const std::string common = "train --data " + (data / "train.bin").string() + kTinyModel +
                             " --schedule constant --lr 3e-3 --eval-batches 2 --save-every 10 --device " +
                             device + " ";
  const bool exact = device == "cpu";
  std::map<std::string, double> final_loss;
  for (const std::string dtype : {"fp32", "bf16", "fp16"}) {
    const std::string tag = device + "_" + dtype;
    const fs::path whole = scratch() / ("mp_whole_" + tag), split = scratch() / ("mp_split_" + tag);
    auto r = run(common + "--steps 20 --dtype " + dtype + " --out " + whole.string());
    EXPECT_EQ(r.rc, 0) << r.output;
    if (r.rc != 0) return {};
    final_loss[dtype] = losses_after(whole, 19).front().second;
    if (dtype == "fp32") continue;
    // Checkpoints hold the fp32 master weights: resuming continues the same run.
    EXPECT_EQ(run(common + "--steps 10 --dtype " + dtype + " --out " + split.string()).rc, 0);
    r = run(common + "--steps 20 --dtype " + dtype + " --out " + split.string() + " --resume");
    EXPECT_EQ(r.rc, 0) << r.output;
    // Train losses (the split run also evaluates at its first end, step 10).
    auto train_only = [](std::vector<std::pair<int64_t, double>> v) {
      std::erase_if(v, [](const auto& e) { return e.second < 0; });
      return v;
    };
    const auto want = train_only(losses_after(whole, 0)), got = train_only(losses_after(split, 0));
    EXPECT_EQ(got.size(), want.size()) << tag;
    for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
      EXPECT_EQ(got[i].first, want[i].first) << tag;
      if (exact) EXPECT_EQ(got[i].second, want[i].second) << tag << " step " << want[i].first;
      else EXPECT_NEAR(got[i].second, want[i].second, 1e-4 * std::fabs(want[i].second)) << tag;
    }
    if (exact) {
      EXPECT_EQ(losses_after(whole, 19).back(), losses_after(split, 19).back()) << dtype;  // final val_loss
      EXPECT_EQ(slurp(whole / "model" / "model.safetensors"), slurp(split / "model" / "model.safetensors"));
    }
  }
  return final_loss;
}

TEST(Cli, MixedPrecisionTracksFp32AndResumesExactly) {
  std::map<std::string, double> final_loss = mixed_precision_runs("cpu");
  ASSERT_EQ(final_loss.size(), 3u);
  // Low-precision compute follows the fp32 run closely (and learns: ln 256 = 5.55 at the start).
  EXPECT_LT(final_loss["fp32"], 5.0);
  EXPECT_NEAR(final_loss["bf16"], final_loss["fp32"], 0.1);
  EXPECT_NEAR(final_loss["fp16"], final_loss["fp32"], 0.1);
}

TEST(Cli, CudaTrainingInEveryDtypeTracksTheCpu) {
  if (!tessera::cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const std::map<std::string, double> cpu = mixed_precision_runs("cpu"), gpu = mixed_precision_runs("cuda");
  ASSERT_EQ(gpu.size(), 3u);
  // fp32 on the GPU is the CPU's run up to summation order; bf16/fp16 follow fp32.
  EXPECT_NEAR(gpu.at("fp32"), cpu.at("fp32"), 1e-3 * cpu.at("fp32"));
  EXPECT_LT(gpu.at("fp32"), 5.0);
  EXPECT_NEAR(gpu.at("bf16"), gpu.at("fp32"), 0.1);
  EXPECT_NEAR(gpu.at("fp16"), gpu.at("fp32"), 0.1);
}
