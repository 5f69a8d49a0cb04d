// The `tessera` program end to end: prepare/train/eval/sample, bit-identical resume,
// damaged checkpoints, bad configs. Tiny models keep each run to seconds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <random>

#include "tessera/core/allocator.h"
#include "tessera/core/file_io.h"
#include "tessera/data/token_file.h"
#include "tessera/data/tokenizer.h"
#include "tessera/optim/optimizer.h"
#include "tests/cli/cli_harness.h"
#include "tests/nn/python_reference.h"

namespace fs = std::filesystem;
using namespace tessera_cli_test;

namespace {

const std::string kTinyModel = " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 4 ";

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
          (straight / "checkpoint-20").string());
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
      for (const char* key : {"step", "epoch", "loss", "learning_rate", "grad_norm", "ms", "tokens_per_s"}) EXPECT_TRUE(j.contains(key)) << key;
      train_loss.push_back(j["loss"]);
    } else {
      EXPECT_TRUE(j.contains("eval_loss"));
      val_loss.push_back(j["eval_loss"]);
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

// Flips one byte near the end of a file (and back again when called twice).
void flip_byte(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-5, std::ios::end);
  char c;
  f.get(c);
  f.seekp(-5, std::ios::end);
  f.put(static_cast<char>(c ^ 0x40));
}

TEST(Cli, DamagedCheckpointsAreRefusedAndResumeFallsBackToThePreviousValidOne) {
  const fs::path data = prepared("byte");
  const fs::path out = scratch() / "damaged";
  const std::string common = "train --data " + (data / "train.bin").string() + kTinyModel + " --schedule constant --save-every 10 --keep-last 2 ";
  auto r = run(common + "--steps 30 --out " + out.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  // keep-last 2: checkpoint-10 rotated away.
  EXPECT_FALSE(fs::exists(out / "checkpoint-10"));
  const fs::path prev = out / "checkpoint-20", last = out / "checkpoint-30";
  ASSERT_TRUE(fs::exists(prev) && fs::exists(last));
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors", "accelerator_state.json",
                        "trainer_state.json", "training_args.json", "tokenizer.json", "checksums.json"})
    EXPECT_TRUE(fs::exists(last / f)) << f;

  // Truncate the newest checkpoint's weights: a model loader names the damage.
  const auto weights = last / "model.safetensors";
  fs::resize_file(weights, fs::file_size(weights) / 2);
  r = run("sample --model " + last.string() + " --max-new-tokens 5");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("damaged"), std::string::npos) << r.output;

  // A flipped byte in the previous one's optimizer state is caught by its checksum: with
  // both damaged there is nothing to fall back to, and nothing is trained.
  flip_byte(prev / "optimizer.safetensors");
  r = run(common + "--steps 40 --out " + out.string() + " --resume " + last.string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("optimizer.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CRC"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 31"), std::string::npos) << r.output;
  flip_byte(prev / "optimizer.safetensors");  // undone: usable again

  // An interrupted write (no checksums.json) is not a checkpoint.
  fs::create_directories(out / "checkpoint-99");
  fs::copy_file(prev / "config.json", out / "checkpoint-99" / "config.json");
  // --resume without a path skips the damaged/incomplete newer ones and uses step 20.
  r = run(common + "--steps 40 --out " + out.string() + " --resume");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("skipping damaged checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at step 20"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 40/40"), std::string::npos) << r.output;
  // Rotation (keep-last 2) counted only complete checkpoints: 30 and 40 remain.
  EXPECT_TRUE(fs::exists(out / "checkpoint-30" / "checksums.json"));
  EXPECT_TRUE(fs::exists(out / "checkpoint-40" / "checksums.json"));
  EXPECT_FALSE(fs::exists(out / "checkpoint-20"));

  // Naming a damaged checkpoint falls back to the previous valid one and says so.
  fs::resize_file(out / "checkpoint-40" / "trainer_state.json", 10);
  r = run(common + "--steps 45 --out " + out.string() + " --resume " + (out / "checkpoint-40").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("trainer_state.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("falling back to the previous valid checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at step 30"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 45/45"), std::string::npos) << r.output;
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
      {"--config " + write("unknown.yaml", "steps: 3\nlerning_rate: 0.1\n"), "lerning_rate"},
      {"--config " + write("broken.json", "{\"steps\": "), "not valid JSON"},
      {"--steps=-5", "\"steps\""},
      {"--steps abc", "--steps"},
      {"--config " + write("string_int.json", R"({"n_embd": "32"})"), "\"n_embd\""},
      {"--config " + write("dup.json", R"({"steps": 3, "steps": 4})"), "given twice"},
      {"--config " + write("alias_dup.json", R"({"lr": 0.1, "learning_rate": 0.2})"), "\"learning_rate\""},
      {"--config " + write("huge.yaml", "lr: 1e999\n"), "\"lr\""},
      {"--config " + write("huge.json", R"({"lr": 1e999})"), "\"lr\""},
      {"--config " + write("huge.json", R"({"lr": 1e999})"), "huge.json"},
      {"--config " + write("hf_typo.json", R"({"learning_rat": 0.1})"), "learning_rat"},
      {"--config " + write("bad_strategy.json", R"({"eval_strategy": "sometimes"})"), "\"eval_strategy\""},
      {"--config " + write("bad_report.json", R"({"report_to": ["wandb"]})"), "\"report_to\""},
      {"--data " + data.string(), "is a directory"},
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
  EXPECT_EQ(saved["max_steps"], 3);
  EXPECT_EQ(saved["learning_rate"], 0.002);
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
      // bf16 at lr 3e-3 amplifies the order of atomic sums: measured up to 1.04e-4 (H100).
      else EXPECT_NEAR(got[i].second, want[i].second, 3e-4 * std::fabs(want[i].second)) << tag;
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

// ---- the Trainer stack behind `tessera train` (issues 10 and 14) ----

TEST(Cli, NumericFlagsAreTypedInHelp) {
  const auto r = run("train --help");
  ASSERT_EQ(r.rc, 0) << r.output;
  for (const char* flag : {"--steps INT", "--batch INT", "--lr FLOAT", "--grad-clip FLOAT", "--seed INT"})
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag << "\n" << r.output;
  EXPECT_EQ(r.output.find("--steps TEXT"), std::string::npos) << r.output;
}

TEST(Cli, TrainsOnABareFileNameInTheCurrentFolder) {
  const fs::path data = prepared("byte");
  const fs::path out = scratch() / "bare_name";
  const auto r = run("train --data train.bin" + kTinyModel + "--steps 2 --out " + out.string(), "cd '" + data.string() + "' && ");
  EXPECT_NE(r.output.find("done: 2 steps"), std::string::npos) << r.output;
  // The saved settings hold absolute paths, so a resume from elsewhere finds the data.
  const auto saved = nlohmann::json::parse(slurp(out / "config.train.json"));
  EXPECT_EQ(saved["data"], (data / "train.bin").string());
  EXPECT_EQ(saved["val_data"], "");
}

// `--resume RUN` alone (no data, no settings, from another folder) continues the run
// bit for bit: metrics, final weights and trainer_state.json of the last checkpoint.
TEST(Cli, ResumeFromTheRunFolderAloneIsBitIdenticalIncludingTrainerState) {
  const fs::path data = prepared("byte");
  const fs::path straight = scratch() / "run_straight", resumed = scratch() / "run_resumed";
  const std::string flags = "train --data " + (data / "train.bin").string() + kTinyModel +
                            " --grad-accum 2 --warmup 3 --eval-every 10 --eval-batches 2 --save-every 10 --shuffle"
                            " --steps 30 --schedule cosine --out ";
  auto r = run(flags + straight.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  // The interrupted run: its checkpoint-20 and metrics so far, in another folder.
  fs::create_directories(resumed);
  fs::copy(straight / "checkpoint-20", resumed / "checkpoint-20", fs::copy_options::recursive);
  fs::copy_file(straight / "metrics.jsonl", resumed / "metrics.jsonl");
  r = run("train --resume " + resumed.string(), "cd '" + fs::temp_directory_path().string() + "' && ");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("at step 20"), std::string::npos) << r.output;
  EXPECT_EQ(losses_after(straight, 0), losses_after(resumed, 0));
  EXPECT_EQ(slurp(straight / "model" / "model.safetensors"), slurp(resumed / "model" / "model.safetensors"));
  const std::string state = slurp(straight / "checkpoint-30" / "trainer_state.json");
  EXPECT_EQ(state, slurp(resumed / "checkpoint-30" / "trainer_state.json"));
  const auto j = nlohmann::json::parse(state);
  EXPECT_EQ(j["global_step"], 30);
  EXPECT_EQ(j["log_history"].size(), 33u);  // 30 steps + evaluations at 10, 20, 30
  EXPECT_EQ(j["best_model_checkpoint"], "checkpoint-" + std::to_string(j["best_step"].get<int>()));
}

// A config file written with Hugging Face TrainingArguments names trains the same run as
// the flags. The schedule is named by its Tessera key: lr_scheduler_type is transformers'
// schedule (warmup from 0, no --min-lr floor), a different run.
TEST(Cli, HuggingFaceNamedConfigTrainsTheSameRunAsTheFlags) {
  const fs::path data = prepared("byte");
  const fs::path by_flags = scratch() / "hf_flags", by_config = scratch() / "hf_config";
  auto r = run("train --data " + (data / "train.bin").string() + kTinyModel +
               " --grad-accum 2 --steps 12 --lr 2e-3 --min-lr 1e-4 --warmup 2 --schedule linear --weight-decay 0.05"
               " --beta1 0.8 --beta2 0.95 --eps 1e-7 --grad-clip 0.5 --seed 7 --eval-every 6 --eval-batches 2"
               " --save-every 6 --keep-last 1 --shuffle --out " + by_flags.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  const fs::path config = scratch() / "hf.json";
  std::ofstream(config) << nlohmann::json{
      {"data", (data / "train.bin").string()}, {"n_layer", 1}, {"n_head", 2}, {"n_embd", 16}, {"seq", 16},
      {"per_device_train_batch_size", 4}, {"gradient_accumulation_steps", 2}, {"max_steps", 12},
      {"learning_rate", 2e-3}, {"min_lr", 1e-4}, {"warmup_steps", 2}, {"schedule", "linear"},
      {"weight_decay", 0.05}, {"adam_beta1", 0.8}, {"adam_beta2", 0.95}, {"adam_epsilon", 1e-7},
      {"max_grad_norm", 0.5}, {"seed", 7}, {"eval_strategy", "steps"}, {"eval_steps", 6}, {"eval_batches", 2},
      {"save_strategy", "steps"}, {"save_steps", 6}, {"save_total_limit", 1}, {"shuffle", true},
      {"report_to", {"jsonl"}}, {"output_dir", by_config.string()}}.dump(2);
  r = run("train --config " + config.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(losses_after(by_flags, 0), losses_after(by_config, 0));
  EXPECT_EQ(losses_after(by_flags, 0).size(), 12u + 2u);
  EXPECT_EQ(slurp(by_flags / "model" / "model.safetensors"), slurp(by_config / "model" / "model.safetensors"));
  EXPECT_EQ(slurp(by_flags / "checkpoint-12" / "trainer_state.json"),
            slurp(by_config / "checkpoint-12" / "trainer_state.json"));
}

// issue 14, defect 1: a validation file with a token outside the vocabulary is refused at
// the start, naming the file, before any step (so no run is thrown away at its first eval).
TEST(Cli, BadValidationFileIsRefusedBeforeTraining) {
  const fs::path dir = scratch() / "bad_val";
  fs::create_directories(dir);
  std::vector<uint32_t> train(4000), val(500);
  for (size_t i = 0; i < train.size(); ++i) train[i] = static_cast<uint32_t>((i * 7) % 250);
  for (size_t i = 0; i < val.size(); ++i) val[i] = static_cast<uint32_t>((i * 3) % 250);
  val[333] = 300;
  tessera::data::write_token_file(dir / "train.bin", train);
  tessera::data::write_token_file(dir / "val.bin", val);
  const auto r = run("train --data " + (dir / "train.bin").string() + kTinyModel +
                     "--steps 20 --eval-every 10 --save-every 10 --out " + (dir / "run").string());
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("validation file '" + (dir / "val.bin").string() + "' holds token 300"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoint-10"));
}

// issue 14, defect 7: resume trusts nothing it did not check.
TEST(Cli, ResumeRefusesAModelShapeThatDisagreesWithTheRun) {
  const fs::path data = prepared("byte");
  const fs::path out = scratch() / "shape_run";
  const std::string base = "train --data " + (data / "train.bin").string() + kTinyModel + "--steps 4 --out " + out.string();
  ASSERT_EQ(run(base).rc, 0);
  const std::string before = slurp(out / "config.train.json");
  const auto r = run("train --resume " + out.string() + " --steps 8 --n-layer 2");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("\"n_layer\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("has 1"), std::string::npos) << r.output;
  EXPECT_EQ(slurp(out / "config.train.json"), before);  // nothing rewritten
  // The same shape given again is fine, and so is leaving it out.
  const auto again = run("train --resume " + out.string() + " --n-layer 1");
  EXPECT_EQ(again.rc, 0) << again.output;
}

namespace {
// Rewrites a checkpoint's checksums after tampering, so only the contents checks can tell.
void resign(const fs::path& checkpoint) { tessera::write_folder_checksums(checkpoint); }

std::string resume_output(const fs::path& checkpoint, const fs::path& out) {
  return run("train --resume " + checkpoint.string() + " --out " + out.string()).output;
}
}  // namespace

TEST(Cli, ResumeChecksTheTrainingStateContents) {
  const fs::path data = prepared("byte");
  const fs::path run_dir = scratch() / "tamper_run";
  ASSERT_EQ(run("train --data " + (data / "train.bin").string() + kTinyModel + "--steps 4 --save-every 2 --keep-last 5 --out " +
                run_dir.string()).rc, 0);
  const fs::path good = run_dir / "checkpoint-2";
  int variant = 0;
  // Each case: a copy of checkpoint-2, tampered, re-signed; resume must fail naming it.
  auto tampered = [&](const std::function<void(const fs::path&)>& edit) {
    const fs::path dir = scratch() / ("tamper_" + std::to_string(variant++)) / "checkpoint-2";
    fs::create_directories(dir.parent_path());
    fs::copy(good, dir, fs::copy_options::recursive);
    edit(dir);
    resign(dir);
    return dir;
  };
  auto edit_optimizer = [](const std::function<void(tessera::optim::OptimizerStateDict&)>& f) {
    return [f](const fs::path& dir) {
      auto state = tessera::optim::load_optimizer_state((dir / "optimizer.safetensors").string());
      f(state);
      tessera::optim::save_optimizer_state(state, (dir / "optimizer.safetensors").string());
    };
  };
  auto edit_json = [](const std::string& file, const std::function<void(nlohmann::json&)>& f) {
    return [file, f](const fs::path& dir) {
      auto j = nlohmann::json::parse(slurp(dir / file));
      f(j);
      std::ofstream(dir / file) << j.dump(2);
    };
  };
  const std::vector<std::pair<std::function<void(const fs::path&)>, std::vector<std::string>>> cases = {
      {edit_optimizer([](auto& s) { s.tensors["state.0.exp_avg"] = s.tensors["state.0.exp_avg"].to(tessera::DType::i32); }),
       {"state.0.exp_avg", "int32"}},
      {edit_optimizer([](auto& s) { s.tensors.erase("state.1.exp_avg_sq"); }), {"state.1.exp_avg_sq", "missing"}},
      {edit_optimizer([](auto& s) { s.scalars["state.0.step"] = -5; }), {"state.0.step", "-5"}},
      {edit_json("trainer_state.json", [](auto& j) { j["global_step"] = -5; }), {"global_step", "-5"}},
      {edit_json("trainer_state.json", [](auto& j) { j.erase("log_history"); }), {"log_history"}},
      {edit_json("accelerator_state.json", [](auto& j) { j["state"]["loader_positions"][0][0] = -1; }),
       {"loader_positions", "-1"}},
      {edit_json("accelerator_state.json", [](auto& j) { j["state"]["loader_positions"][0][0] = 7; }),
       {"data position", "7"}},
      {edit_json("accelerator_state.json", [](auto& j) { j["state"].erase("rng"); }), {"\"rng\" is missing"}},
      // Counts past what their int64 holders take (seen reading the paths fuzz_training_state covers).
      {edit_json("accelerator_state.json", [](auto& j) { j["state"]["schedules"][0]["step"] = 1e300; }),
       {"schedule \"step\"", "1e+300"}},
      {edit_json("accelerator_state.json", [](auto& j) { j["state"]["loss_scaler"]["growth_interval"] = 1e300; }),
       {"growth_interval", "1e+300"}},
      {edit_json("accelerator_state.json", [](auto& j) { j["state"]["loader_positions"][0][0] = uint64_t{1} << 62; }),
       {"loader_positions", "4611686018427387904", "past the largest"}},
      {edit_optimizer([](auto& s) { s.scalars["state.0.step"] = 1e300; }), {"state.0.step", "1e+300"}},
      {edit_json("trainer_state.json", [](auto& j) { j["global_step"] = int64_t{1} << 62; }), {"past max_steps"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const fs::path dir = tampered(cases[i].first);
    const std::string out = resume_output(dir, dir.parent_path() / "out");
    EXPECT_EQ(out.find("step 3/"), std::string::npos) << "case " << i << "\n" << out;
    EXPECT_EQ(out.find("operation on an undefined"), std::string::npos) << "case " << i << "\n" << out;
    for (const std::string& want : cases[i].second) EXPECT_NE(out.find(want), std::string::npos) << "case " << i << ": " << want << "\n" << out;
  }
}

// A step whose loss was not finite is logged as "loss": null; that line must never break
// a later resume (or the loss plot).
TEST(Cli, NullLossLineInMetricsDoesNotBreakResume) {
  const fs::path data = prepared("byte");
  const fs::path out = scratch() / "null_loss";
  const std::string base = "train --data " + (data / "train.bin").string() + kTinyModel + "--schedule constant --save-every 5 ";
  ASSERT_EQ(run(base + "--steps 5 --out " + out.string()).rc, 0);
  std::string metrics = slurp(out / "metrics.jsonl");
  const size_t at = metrics.find("{\"epoch\"");  // a training line (the Trainer's keys are sorted)
  ASSERT_NE(at, std::string::npos) << metrics;
  metrics.insert(at, "{\"grad_norm\":null,\"loss\":null,\"lr\":0.001,\"ms\":1.0,\"step\":3,\"tokens_per_s\":1.0}\n");
  std::ofstream(out / "metrics.jsonl") << metrics;
  {  // and in the checkpoint's log history (re-signed: only the contents matter here)
    const fs::path state_path = out / "checkpoint-5" / "trainer_state.json";
    auto state = nlohmann::json::parse(slurp(state_path));
    state["log_history"][2]["loss"] = nullptr;
    std::ofstream(state_path) << state.dump(2);
    resign(out / "checkpoint-5");
  }
  const auto r = run(base + "--steps 8 --resume --out " + out.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("step 8/8"), std::string::npos) << r.output;
  EXPECT_EQ(slurp(out / "loss.png").substr(0, 8), "\x89PNG\r\n\x1a\n");
}

// Evaluation under `tessera launch` (each rank scores its share, gathered) equals one process.
TEST(Cli, DistributedEvaluationOn2And3RanksEqualsOneProcess) {
  const fs::path data = prepared("byte");
  const fs::path out = scratch() / "dist_eval_model";
  ASSERT_EQ(run("train --data " + (data / "train.bin").string() + kTinyModel + "--steps 3 --out " + out.string()).rc, 0);
  const std::string eval = " eval --model " + (out / "model").string() + " --data " + (data / "val.bin").string() +
                           " --batch 3 --seq 16 --batches 5";
  auto parse_last_json = [](const std::string& text) {
    const size_t at = text.rfind("{\"loss\"");
    return at == std::string::npos ? nlohmann::json() : nlohmann::json::parse(text.substr(at, text.find('\n', at) - at));
  };
  const auto one = run(eval);
  ASSERT_EQ(one.rc, 0) << one.output;
  const auto want = parse_last_json(one.output);
  ASSERT_TRUE(want.is_object()) << one.output;
  for (int ranks : {2, 3}) {
    const auto r = run("launch --nproc-per-node " + std::to_string(ranks) + " " + tessera_binary() + eval);
    ASSERT_EQ(r.rc, 0) << r.output;
    const auto got = parse_last_json(r.output);
    ASSERT_TRUE(got.is_object()) << r.output;
    EXPECT_EQ(got["tokens"], want["tokens"]);
    EXPECT_NEAR(got["loss"].get<double>(), want["loss"].get<double>(), 1e-6) << ranks << " ranks";
    EXPECT_NEAR(got["token_accuracy"].get<double>(), want["token_accuracy"].get<double>(), 1e-12);
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '{'), 1) << "only the main process prints\n" << r.output;
  }
}

// `eval --dtype` scores the weights in that dtype: bf16 and fp16 round the arithmetic (the
// loss moves, within their resolution), fp32 is the stored model, anything else is refused.
TEST(Cli, EvalDtypeScoresTheWeightsInThatDtype) {
  const fs::path data = prepared("byte");
  const fs::path out = scratch() / "eval_dtype";
  auto r = run("train --data " + (data / "train.bin").string() + kTinyModel +
               "--steps 8 --eval-batches 3 --out " + out.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  double trained_val_loss = NAN;
  for (const auto& j : read_metrics(out))
    if (j.contains("eval_loss")) trained_val_loss = j["eval_loss"].get<double>();
  ASSERT_FALSE(std::isnan(trained_val_loss));

  std::map<std::string, double> loss;
  for (const std::string dtype : {"fp32", "bf16", "fp16"}) {
    r = run("eval --model " + (out / "model").string() + " --data " + (data / "val.bin").string() +
            " --batch 4 --seq 16 --batches 3 --dtype " + dtype);
    ASSERT_EQ(r.rc, 0) << r.output;
    loss[dtype] = nlohmann::json::parse(r.output)["loss"].get<double>();
  }
  EXPECT_NEAR(loss["fp32"], trained_val_loss, 1e-6) << "fp32 is the trainer's own evaluation";
  for (const std::string dtype : {"bf16", "fp16"}) EXPECT_NE(loss[dtype], loss["fp32"]) << dtype << " must round";
  // bf16 keeps 8 significant bits, fp16 11: the loss moves by well under their relative steps.
  EXPECT_NEAR(loss["bf16"], loss["fp32"], 2e-2 * loss["fp32"]);
  EXPECT_NEAR(loss["fp16"], loss["fp32"], 4e-3 * loss["fp32"]);

  r = run("eval --model " + (out / "model").string() + " --data " + (data / "val.bin").string() + " --dtype f64");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("--dtype"), std::string::npos) << r.output;
}

// GPT-2's tokenizer through the program: prepare with --tokenizer gpt2 and with the
// tokenizer.json it wrote (same token file), train, and a model folder that is a complete
// Hugging Face model: AutoTokenizer loads it and encodes as Tessera does; sample decodes.
TEST(Cli, Gpt2TokenizerPreparesTrainsAndSamples) {
  const char* env = std::getenv("TESSERA_GPT2_DIR");
  const fs::path gpt2 =
      env && *env ? fs::path(env) : fs::path(TESSERA_SOURCE_DIR) / ".deps" / "gpt2";
  if (!fs::exists(gpt2 / "encoder.json"))
    GTEST_SKIP() << "GPT-2's files not in " << gpt2 << " (scripts/setup.sh)";
  const fs::path corpus = scratch() / "gpt2_corpus.txt";
  std::ofstream(corpus) << generated_corpus(2000) << "Ünïcödé 日本語 don't 😀 12345\n";
  const fs::path d1 = scratch() / "gpt2_data", d2 = scratch() / "gpt2_data_from_json";
  auto r = run("prepare --tokenizer gpt2 --input " + corpus.string() + " --out " + d1.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["vocab_size"], 50257);
  for (const char* f : {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                        "train.bin", "val.bin"})
    EXPECT_TRUE(fs::exists(d1 / f)) << f;
  r = run("prepare --tokenizer " + (d1 / "tokenizer.json").string() + " --input " +
          corpus.string() + " --out " + d2.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_TRUE(slurp(d1 / "train.bin") == slurp(d2 / "train.bin"));
  const auto tok =
      tessera::data::BpeTokenizer::from_gpt2_files(gpt2 / "encoder.json", gpt2 / "vocab.bpe");
  const std::string train_bin = slurp(d1 / "train.bin");
  ASSERT_GT(train_bin.size(), 1024u);
  EXPECT_EQ(train_bin[4], 1) << "50,257 ids fit llm.c's uint16 version 1";
  const std::vector<uint32_t> ids = tok.encode(generated_corpus(2000).substr(0, 400));
  for (size_t i = 0; i < 50; ++i)
    EXPECT_EQ(static_cast<unsigned char>(train_bin[1024 + 2 * i]) |
                  static_cast<unsigned char>(train_bin[1025 + 2 * i]) << 8,
              ids[i]);

  const fs::path out = scratch() / "gpt2_run";
  r = run("train --data " + (d1 / "train.bin").string() + kTinyModel + "--steps 2 --out " +
          out.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "vocab.json",
                        "merges.txt", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(out / "model" / f)) << f;
  for (const auto& row : read_metrics(out)) {
    ASSERT_TRUE(row.contains("time")) << row.dump();
    EXPECT_GT(row["time"].get<double>(), 1.7e9) << "a Unix time";
  }
  r = run("sample --model " + (out / "model").string() +
          " --prompt 'The cat' --max-new-tokens 4 --temperature 0");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.rfind("The cat", 0), 0u) << r.output;

  if (!tessera::test::python_can_import("transformers"))
    GTEST_SKIP() << "no transformers for the model-folder check";
  const std::string text = "The cat sees the moon. Ünïcödé 😀 42  spaces";  // no quote: it goes in a shell argument
  const std::string cmd =
      tessera::test::python_interpreter() +
      " -c \"import json,sys; from transformers import AutoTokenizer; t = "
      "AutoTokenizer.from_pretrained('" +
      (out / "model").string() +
      "'); print(json.dumps(t(sys.argv[1], add_special_tokens=False)['input_ids']))\" '" + text +
      "' 2>/dev/null";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string printed;
  char buf[4096];
  while (pipe && fgets(buf, sizeof(buf), pipe)) printed += buf;
  ASSERT_TRUE(pipe && pclose(pipe) == 0) << cmd;
  EXPECT_EQ(nlohmann::json::parse(printed).get<std::vector<uint32_t>>(), tok.encode(text));
}

// --dropout, --sampling random and --gradient-checkpointing through `tessera train`:
// checkpointing changes nothing but memory, dropout and random windows change the run, and
// a run with both resumes bit for bit (the generator and the loader position are saved).
TEST(Cli, DropoutRandomSamplingAndGradientCheckpointing) {
  const fs::path data = prepared("byte");
  const std::string common = "train --data " + (data / "train.bin").string() + kTinyModel +
                             " --schedule constant --eval-batches 2 --save-every 6 ";
  auto train = [&](const std::string& name, const std::string& flags) {
    const fs::path out = scratch() / name;
    const auto r = run(common + flags + " --out " + out.string());
    EXPECT_EQ(r.rc, 0) << r.output;
    return out;
  };
  const std::string regularised = "--dropout 0.1 --sampling random ";
  const fs::path checkpointed = train("flags_ckpt", regularised + "--gradient-checkpointing --steps 12");
  const fs::path plain = train("flags_plain", regularised + "--steps 12");
  const fs::path no_dropout = train("flags_nodrop", "--sampling random --steps 12");
  const fs::path windows = train("flags_windows", "--steps 12");
  const auto losses = losses_after(plain, 0);
  ASSERT_EQ(losses.size(), 12u + 1u);  // 12 steps + the final evaluation
  EXPECT_EQ(losses_after(checkpointed, 0), losses);
  EXPECT_EQ(slurp(checkpointed / "model" / "model.safetensors"), slurp(plain / "model" / "model.safetensors"));
  EXPECT_NE(losses_after(no_dropout, 0).front(), losses.front()) << "dropout must change the forward";
  EXPECT_NE(losses_after(windows, 0).front(), losses_after(no_dropout, 0).front())
      << "random windows must be other rows than the sequential ones";

  // Stopped after 6 steps and resumed (newest checkpoint under --out): the same 12 steps.
  const fs::path split = train("flags_split", regularised + "--steps 6");
  const auto r = run(common + regularised + "--steps 12 --out " + split.string() + " --resume");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(losses_after(split, 6), losses_after(plain, 6));
  EXPECT_EQ(slurp(split / "model" / "model.safetensors"), slurp(plain / "model" / "model.safetensors"));

  for (const auto& [bad, key] : std::vector<std::pair<std::string, std::string>>{
           {"--sampling shuffled", "sampling"}, {"--dropout 1.5", "dropout"}}) {
    const auto failed = run(common + bad + " --steps 2 --out " + (scratch() / "flags_bad").string());
    EXPECT_NE(failed.rc, 0) << bad;
    EXPECT_NE(failed.output.find(key), std::string::npos) << failed.output;
  }
}
