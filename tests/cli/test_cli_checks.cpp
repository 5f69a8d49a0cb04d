// Issue 38: every number and file `tessera train`, `eval`, `sample`, `plan`, `prepare` and
// `checkpoint` are given is checked before any work, and the messages name what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessera/core/file_io.h"
#include "tessera/core/safetensors.h"
#include "tests/cli/cli_harness.h"

namespace fs = std::filesystem;
using namespace tessera_cli_test;

namespace {

const std::string kTiny = " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 2 ";

std::string train_bin() { return (prepared("byte") / "train.bin").string(); }

std::string train_cmd(const std::string& out) {
  return "train --data " + train_bin() + kTiny + "--out " + (scratch() / out).string() + " ";
}

void expect_mentions(const RunResult& r, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
}

void expect_refused(const std::string& args, std::initializer_list<std::string> parts) {
  const RunResult r = run(args);
  EXPECT_EQ(r.rc, 1) << args << "\n" << r.output;
  expect_mentions(r, parts);
}

std::string write(const std::string& name, const std::string& text) {
  const fs::path p = scratch() / name;
  std::ofstream(p) << text;
  return p.string();
}

// A run of `steps` steps with a checkpoint at the end (run/checkpoint-<steps>, run/model).
fs::path trained_run(const std::string& name, const std::string& extra = "", int steps = 2) {
  const fs::path run_dir = scratch() / name;
  if (!fs::exists(run_dir / "model")) {
    const RunResult r = run(train_cmd(name) + "--steps " + std::to_string(steps) + " " + extra);
    EXPECT_EQ(r.rc, 0) << r.output;
  }
  return run_dir;
}

}  // namespace

// Item 4: a misspelt metric failed only at the first evaluation, after training up to it.
TEST(CliChecks, MetricForBestModelIsCheckedBeforeAnyWorkNamingTheMetrics) {
  const std::string config = write("bad_metric.yaml", "metric_for_best_model: eval_los\n");
  const RunResult r = run(train_cmd("bad_metric") + "--steps 50 --eval-every 40 --config " + config);
  EXPECT_EQ(r.rc, 1) << r.output;
  expect_mentions(r, {"eval_los", "eval_loss", "eval_perplexity", "eval_accuracy"});
  EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << r.output;
  const std::string hf = write("hf_metric.yaml", "metric_for_best_model: eval_loss\nload_best_model_at_end: true\n");
  const RunResult ok = run(train_cmd("hf_metric") + "--steps 4 --eval-every 2 --save-every 2 --config " + hf);
  EXPECT_EQ(ok.rc, 0) << ok.output;
  expect_mentions(ok, {"loaded the best model"});
}

// Item 10: --init kept its own shape whatever the flags said.
TEST(CliChecks, InitRefusesShapeFlagsThatDisagreeWithItsDirectory) {
  const fs::path model = trained_run("init_source") / "model";
  expect_refused(train_cmd("init_shape") + "--steps 1 --n-layer 3 --init " + model.string(),
                 {"n_layer", "3", "has 1", model.string()});
  // The same shape, given explicitly, is fine.
  const RunResult r = run(train_cmd("init_same") + "--steps 1 --init " + model.string());
  EXPECT_EQ(r.rc, 0) << r.output;
}

// Items 12 and 14: a file shorter than one micro-batch was tiled into rows; an empty one was
// reported as a vocabulary error of the validation file.
TEST(CliChecks, TrainingFilesShorterThanOneMicroBatchAreRefusedNamingTheSizes) {
  const fs::path tiny_dir = scratch() / "five_tokens";
  const std::string text = write("five.txt", "hello");
  ASSERT_EQ(run("prepare --input " + text + " --val-fraction 0 --out " + tiny_dir.string()).rc, 0);
  expect_refused("train --data " + (tiny_dir / "train.bin").string() + kTiny + "--steps 1 --out " +
                     (scratch() / "five_run").string(),
                 {"5 tokens", "33 tokens", "train.bin"});
  const fs::path empty_dir = scratch() / "empty_train";
  fs::create_directories(empty_dir);
  fs::copy_file(prepared("byte") / "val.bin", empty_dir / "val.bin", fs::copy_options::overwrite_existing);
  {
    std::ofstream out(empty_dir / "train.bin", std::ios::binary);
    const std::vector<int32_t> header = [] {
      std::vector<int32_t> h(256, 0);
      h[0] = 20240520, h[1] = 1, h[2] = 0;
      return h;
    }();
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
  }
  const RunResult r = run("train --data " + (empty_dir / "train.bin").string() + kTiny + "--steps 1 --out " +
                          (scratch() / "empty_run").string());
  EXPECT_EQ(r.rc, 1) << r.output;
  expect_mentions(r, {"training file", "is empty"});
  EXPECT_EQ(r.output.find("validation file"), std::string::npos) << r.output;
}

// Item 12: `eval --batches 500` repeated a small file into far more "tokens" than it holds.
TEST(CliChecks, EvalScoresEachTokenOnceAndSaysWhenBatchesAreCapped) {
  const fs::path model = trained_run("eval_source") / "model";
  const fs::path val = prepared("byte") / "val.bin";
  const RunResult r = run("eval --model " + model.string() + " --data " + val.string() +
                          " --batch 2 --seq 16 --batches 500");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto result = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  const int64_t tokens_in_file = static_cast<int64_t>((fs::file_size(val) - 1024) / 2);
  EXPECT_LE(result["tokens"].get<int64_t>(), tokens_in_file);
  EXPECT_EQ(result["tokens"].get<int64_t>(), (tokens_in_file - 1) / 32 * 32);
  expect_mentions(r, {"--batches 500", "each token once"});
}

// Item 13 and the small findings on numbers: no saturation, no wrapped product, no bare
// bad_alloc, no long allocation before an answer a size check gives at once.
TEST(CliChecks, NumberFlagsAreRangeCheckedBeforeAnyWork) {
  expect_refused(train_cmd("steps_huge") + "--steps 99999999999999999999", {"--steps", "out of range"});
  expect_refused(train_cmd("batch_huge") + "--steps 1 --batch 99999999999999999999", {"--batch", "out of range"});
  expect_refused(train_cmd("batch_big") + "--steps 1 --batch 4294967298", {"batch 4294967298", "68719476769 tokens"});
  expect_refused(train_cmd("layers_big") + "--steps 1 --n-layer 1000000", {"n_layer 1000000", "GiB", "parameters"});
  expect_refused(train_cmd("steps_minus") + "--steps -1", {"steps", "num_train_epochs"});
  expect_refused(train_cmd("inter_zero") + "--steps 1 --arch llama --intermediate-size 0", {"intermediate_size", "positive"});
  const std::string config = write("unsigned.json", R"({"max_steps": 18446744073709551615})");
  expect_refused(train_cmd("unsigned_steps") + "--config " + config, {"max_steps", "out of range"});
  expect_refused("plan --n-layer 1000000 --device cpu", {"--n-layer 1000000", "10000"});
  expect_refused("plan --prefetch -5 --device cpu", {"--prefetch", "-5"});
  const fs::path model = trained_run("sample_source") / "model";
  expect_refused("sample --model " + model.string() + " --max-new-tokens 2 --temperature nan",
                 {"--temperature", "finite"});
  expect_refused(train_cmd("two_shardings") + "--steps 1 --fsdp FULL_SHARD --deepspeed " +
                     write("ds1.json", R"({"zero_optimization": {"stage": 1}})"),
                 {"two sharding configs"});
}

// Small findings: folders given as files, a token file given as text, a GPT-2 folder that
// is not there, no validation said out loud.
TEST(CliChecks, PathsThatAreNotWhatTheFlagWantsAreNamed) {
  expect_refused("prepare --input " + scratch().string() + " --out " + (scratch() / "p_dir").string(),
                 {scratch().string(), "is a directory"});
  expect_refused(train_cmd("config_dir") + "--config " + scratch().string(), {"--config", "is a directory"});
  const fs::path data = scratch() / "retokenise";
  fs::create_directories(data);
  fs::copy_file(train_bin(), data / "train.bin", fs::copy_options::overwrite_existing);
  const std::string before = slurp(data / "train.bin");
  expect_refused("prepare --input " + (data / "train.bin").string() + " --out " + data.string(),
                 {"train.bin", "overwritten"});
  expect_refused("prepare --input " + (data / "train.bin").string() + " --out " + (scratch() / "elsewhere").string(),
                 {"token file"});
  EXPECT_EQ(slurp(data / "train.bin"), before);
  const std::string text = write("gpt2_text.txt", "hello there\n");
  const RunResult gpt2 = run("prepare --input " + text + " --tokenizer gpt2 --out " +
                                 (scratch() / "gpt2_nowhere").string(),
                             "TESSERA_GPT2_DIR=/nonexistent/gpt2");
  EXPECT_EQ(gpt2.rc, 1) << gpt2.output;
  expect_mentions(gpt2, {"TESSERA_GPT2_DIR", "/nonexistent/gpt2"});
  const fs::path no_val = scratch() / "no_val";
  RunResult r = run("prepare --input " + write("noval.txt", generated_corpus(40)) + " --val-fraction 0 --out " +
                    no_val.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_mentions(r, {"no val.bin"});
  r = run("train --data " + (no_val / "train.bin").string() + kTiny + "--steps 1 --out " +
          (scratch() / "no_val_run").string());
  EXPECT_EQ(r.rc, 0) << r.output;
  expect_mentions(r, {"no validation file", "not evaluated"});
}

// Small findings: NaN weights from --init were blamed on the learning rate; a resumed
// finished run exported NaN weights with valid checksums.
TEST(CliChecks, NonFiniteWeightsAreNamedAtInitAndNeverExported) {
  const fs::path source = trained_run("nan_source");
  const fs::path model = scratch() / "nan_model";
  fs::remove_all(model);
  fs::copy(source / "model", model, fs::copy_options::recursive);
  auto contents = tessera::load_safetensors((model / "model.safetensors").string()).tensors;
  std::vector<std::pair<std::string, tessera::Tensor>> poisoned;
  for (auto& [name, t] : contents) {
    tessera::Tensor copy = t.to(tessera::DType::f32).contiguous().clone();
    if (name.find("wte") != std::string::npos) copy.data<float>()[3] = NAN;
    poisoned.emplace_back(name, copy);
  }
  tessera::save_safetensors((model / "model.safetensors").string(), poisoned, {{"format", "pt"}});
  fs::remove(model / "checksums.json");
  RunResult r = run(train_cmd("nan_init") + "--steps 1 --init " + model.string());
  EXPECT_EQ(r.rc, 1) << r.output;
  expect_mentions(r, {"initial weights", "wte", "nan"});
  EXPECT_EQ(r.output.find("lower --lr"), std::string::npos) << r.output;
  // The finished run's last checkpoint with the same damage, under valid checksums: resuming
  // it only exports, and the export is refused.
  const fs::path checkpoint = scratch() / "nan_checkpoint";
  fs::remove_all(checkpoint);
  fs::copy(source / "checkpoint-2", checkpoint, fs::copy_options::recursive);
  fs::copy_file(model / "model.safetensors", checkpoint / "model.safetensors", fs::copy_options::overwrite_existing);
  tessera::write_folder_checksums(checkpoint);
  const fs::path out = scratch() / "nan_export";
  r = run("train --steps 2 --out " + out.string() + " --resume " + checkpoint.string());
  EXPECT_EQ(r.rc, 1) << r.output;
  expect_mentions(r, {"final weights", "wte", "nan"});
  EXPECT_FALSE(fs::exists(out / "model" / "model.safetensors"));
}

// Small findings: an unreadable checkpoint was treated as damaged (and later overwritten).
TEST(CliChecks, AnUnreadableCheckpointIsAPermissionErrorNotDamage) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files whatever their permissions";
  const fs::path run_dir = trained_run("eacces", "--save-every 1");
  const fs::path state = run_dir / "checkpoint-2" / "trainer_state.json";
  fs::permissions(state, fs::perms::none);
  const RunResult r = run(train_cmd("eacces") + "--steps 3 --resume");
  fs::permissions(state, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(r.rc, 1) << r.output;
  expect_mentions(r, {"trainer_state.json", "ermission"});
  EXPECT_TRUE(fs::exists(run_dir / "checkpoint-2"));
}

// Issue 39: a job script re-run after an interruption with --resume appended, its --init
// included, was refused; as Hugging Face's resume_from_checkpoint it resumes, and the
// checkpoint's weights win over the --init model's.
TEST(CliChecks, TheSameCommandWithResumeAppendedResumesFromTheCheckpointNotTheInit) {
  const fs::path init = trained_run("resume_init_source") / "model";
  const std::string common = " --schedule constant --save-every 3 --init " + init.string() + " ";
  const fs::path whole = scratch() / "resume_init_whole", split = scratch() / "resume_init_split";
  ASSERT_EQ(run(train_cmd("resume_init_whole") + common + "--steps 6").rc, 0);
  ASSERT_EQ(run(train_cmd("resume_init_split") + common + "--steps 3").rc, 0);
  const RunResult r = run(train_cmd("resume_init_split") + common + "--steps 6 --resume");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_mentions(r, {"resuming from"});
  // The training losses (the split run also evaluated at the end of its first part).
  auto train_losses = [](const fs::path& run_dir) {
    std::vector<std::pair<int64_t, double>> train;
    for (const auto& step_loss : losses_after(run_dir, 0))
      if (step_loss.second > 0) train.push_back(step_loss);
    return train;
  };
  EXPECT_EQ(train_losses(whole).size(), 6u);
  EXPECT_EQ(train_losses(whole), train_losses(split));
  EXPECT_EQ(slurp(whole / "model" / "model.safetensors"), slurp(split / "model" / "model.safetensors"));
}

// Issue 39: `tessera launch --mixed-precision bf16 tessera train ...` trained in fp32 (the
// launcher's TESSERA_MIXED_PRECISION reached the Accelerator, never the Trainer's settings).
// As under `accelerate launch` with a Hugging Face Trainer it is the run's precision unless the
// run's own flags name one.
TEST(CliChecks, TheLaunchersMixedPrecisionIsTheRunsUnlessItsFlagsSayOtherwise) {
  const std::string bf16_launch = "TESSERA_MIXED_PRECISION=bf16 ";
  auto dtype_of = [](const std::string& run_name) {
    const auto saved = nlohmann::json::parse(slurp(scratch() / run_name / "config.train.json"));
    return saved.at("bf16").get<bool>() ? "bf16" : saved.at("fp16").get<bool>() ? "fp16" : "fp32";
  };
  RunResult r = run(train_cmd("launch_bf16") + "--steps 1", bf16_launch);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(dtype_of("launch_bf16"), "bf16");
  r = run(train_cmd("launch_bf16_flag_wins") + "--steps 1 --dtype fp32", bf16_launch);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(dtype_of("launch_bf16_flag_wins"), "fp32");
  r = run(train_cmd("launch_bad_precision") + "--steps 1", "TESSERA_MIXED_PRECISION=fp8 ");
  EXPECT_EQ(r.rc, 1) << r.output;
  expect_mentions(r, {"TESSERA_MIXED_PRECISION", "fp8"});
  EXPECT_FALSE(fs::exists(scratch() / "launch_bad_precision")) << "refused before any work";
}

// Small findings: a changed lr/schedule/dtype/sampling on resume gave internal messages or none.
TEST(CliChecks, ResumeRefusesSettingsItCannotChangeNamingThem) {
  const fs::path run_dir = trained_run("resume_changes", "--schedule constant");
  const std::string resume = train_cmd("resume_changes") + "--steps 4 --schedule constant --resume ";
  expect_refused(resume + "--lr 0.5", {"\"lr\"", "0.5", "cannot change on resume"});
  expect_refused(train_cmd("resume_changes") + "--steps 4 --schedule linear --resume",
                 {"schedule", "linear", "constant", "cannot change on resume"});
  expect_refused(resume + "--sampling random", {"sampling", "random", "windows"});
  expect_refused(resume + "--dtype bf16", {"dtype", "bf16", "fp32"});
  const RunResult r = run(resume);
  EXPECT_EQ(r.rc, 0) << r.output;
}

// Small findings: `checkpoint merge` said "A subcommand is required"; consolidate given a run
// folder blamed a missing checksums.json, and removed or left `<out>.partial` silently.
TEST(CliChecks, CheckpointSubcommandsNameWhatTheyWereGiven) {
  expect_refused("checkpoint merge x", {"unknown subcommand 'merge'", "consolidate"});
  const fs::path run_dir = trained_run("consolidate_src");
  const fs::path out = scratch() / "checks_consolidated";
  expect_refused("checkpoint consolidate " + run_dir.string() + " --out " + out.string(),
                 {"run folder", "checkpoint-2"});
  fs::create_directories(out.string() + ".partial");
  expect_refused("checkpoint consolidate " + (run_dir / "checkpoint-2").string() + " --out " + out.string(),
                 {".partial", "exists"});
  fs::remove_all(out.string() + ".partial");
  const RunResult r = run("checkpoint consolidate " + (run_dir / "checkpoint-2").string() + " --out " + out.string());
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_FALSE(fs::exists(out.string() + ".partial"));
}

// Item 15 and a small finding: a 2-rank checkpoint resumed on 1 rank blamed
// gradient_accumulation_steps; with the global batch kept it resumes, without a warning that
// the run will not match.
TEST(CliChecks, ResumingOnAnotherWorldSizeNamesItOrKeepsTheGlobalBatchQuietly) {
  const fs::path run_dir = scratch() / "two_ranks";
  const std::string launch = "launch --nproc-per-node 2 " + tessera_binary() + " ";
  RunResult r = run(launch + train_cmd("two_ranks") + "--steps 2 --schedule constant");
  ASSERT_EQ(r.rc, 0) << r.output;
  const std::string checkpoint = (run_dir / "checkpoint-2").string();
  expect_refused("train --steps 4 --schedule constant --out " + (scratch() / "one_rank_b2").string() +
                     " --resume " + checkpoint,
                 {"2 processes", "world size changed", "--batch 4"});
  r = run("train --steps 4 --schedule constant --batch 4 --out " + (scratch() / "one_rank_b4").string() +
          " --resume " + checkpoint);
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.find("will not match"), std::string::npos) << r.output;
}

// Small finding: with the best checkpoint removed by hand, load_best_model_at_end failed the
// finished run ("not a directory"); the final weights are kept, with a warning.
TEST(CliChecks, ABestCheckpointRemovedByHandIsSkippedWithAWarning) {
  const std::string config = write("best_first.yaml", "load_best_model_at_end: true\ngreater_is_better: true\n");
  const std::string common = "--eval-every 2 --save-every 2 --schedule constant --config " + config + " ";
  RunResult r = run(train_cmd("best_removed") + "--steps 4 --keep-last 3 " + common);
  ASSERT_EQ(r.rc, 0) << r.output;
  const fs::path run_dir = scratch() / "best_removed";
  const auto state = nlohmann::json::parse(slurp(run_dir / "checkpoint-4" / "trainer_state.json"));
  const std::string best = state["best_model_checkpoint"];
  ASSERT_NE(best, "checkpoint-4");  // greater_is_better on a falling loss: an early one
  fs::remove_all(run_dir / best);
  r = run(train_cmd("best_removed") + "--steps 8 --keep-last 1 --resume " + common);
  EXPECT_EQ(r.rc, 0) << r.output;
  expect_mentions(r, {best, "is gone", "final weights"});
  EXPECT_TRUE(fs::exists(run_dir / "model" / "model.safetensors"));
}

// Small finding: resuming on a replaced training file (same path, other tokens) said nothing.
TEST(CliChecks, ATrainingFileReplacedSinceTheCheckpointIsNamedOnResume) {
  const fs::path data = scratch() / "replaced_data";
  fs::create_directories(data);
  fs::copy_file(train_bin(), data / "train.bin", fs::copy_options::overwrite_existing);
  const std::string cmd = "train --data " + (data / "train.bin").string() + kTiny + "--schedule constant --out " +
                          (scratch() / "replaced_run").string() + " ";
  RunResult r = run(cmd + "--steps 2");
  ASSERT_EQ(r.rc, 0) << r.output;
  r = run(cmd + "--steps 3 --resume");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.find("is not the one"), std::string::npos) << r.output;
  std::string bytes = slurp(data / "train.bin");
  bytes[2000] ^= 1;  // one token changed
  std::ofstream(data / "train.bin", std::ios::binary | std::ios::trunc) << bytes;
  r = run(cmd + "--steps 4 --resume");
  EXPECT_EQ(r.rc, 0) << r.output;
  expect_mentions(r, {"warning", (data / "train.bin").string(), "is not the one the checkpoint was trained on"});
}
