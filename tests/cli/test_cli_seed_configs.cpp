// The configuration files users bring (tests/data/configs: two DeepSpeed ZeRO files, the
// Trainer's DeepSpeed file and a TrainingArguments JSON) run unchanged through
// `tessera train --deepspeed FILE` / `--config FILE`: a short real run with each, the flags
// adding only the data, a tiny model, two steps and the run folder.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tests/cli/cli_harness.h"

using namespace tessera_cli_test;

namespace {

const std::string kConfigs = TESSERA_SOURCE_DIR "/tests/data/configs/";

RunResult short_run(const std::string& out, const std::string& config_flag) {
  return run("train --data " + (prepared("byte") / "train.bin").string() +
             " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --steps 2 --eval-batches 1 --out " +
             (scratch() / out).string() + " " + config_flag);
}

nlohmann::json saved_settings(const std::string& out) {
  return nlohmann::json::parse(slurp(scratch() / out / "config.train.json"));
}

// The run's saved settings hold `want`'s values.
void expect_saved(const std::string& out, const nlohmann::json& want) {
  const auto saved = saved_settings(out);
  for (const auto& [key, value] : want.items()) EXPECT_EQ(saved[key], value) << key;
}

}  // namespace

TEST(CliSeedConfigs, DeepSpeedZero2FileTrainsAsZero2WithFp16) {
  const auto r = short_run("seed_zero2", "--deepspeed " + kConfigs + "deepspeed_zero2.json");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_saved("seed_zero2", {{"zero_stage", 2}, {"fp16", true}, {"max_grad_norm", 1.0}});
  EXPECT_NE(r.output.find("done: 2 steps"), std::string::npos) << r.output;
}

TEST(CliSeedConfigs, DeepSpeedZero3FileTrainsAsZero3AndPrintsItsNote) {
  const auto r = short_run("seed_zero3", "--deepspeed " + kConfigs + "deepspeed_zero3.json");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(saved_settings("seed_zero3")["zero_stage"], 3);
  EXPECT_NE(r.output.find("note: zero_optimization.stage3_max_reuse_distance"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done: 2 steps"), std::string::npos) << r.output;
}

TEST(CliSeedConfigs, TrainerDeepSpeedFileTrainsWithOffloadBf16AndItsBatch) {
  const auto r = short_run("seed_trainer", "--deepspeed " + kConfigs + "ds_config_trainer.json");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_saved("seed_trainer", {{"offload", "optimizer"}, {"bf16", true}, {"per_device_train_batch_size", 4},
                                {"gradient_accumulation_steps", 8}});
  EXPECT_NE(r.output.find("4x16 x 8 micro-batches"), std::string::npos) << r.output;
}

TEST(CliSeedConfigs, TrainingArgumentsFileTrainsWithTransformersSchedule) {
  const auto r = short_run("seed_args", "--config " + kConfigs + "training_arguments.json");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_saved("seed_args", {{"lr_scheduler_type", "cosine"}, {"metric_for_best_model", "eval_accuracy"},
                             {"report_to", nlohmann::json::array({"tensorboard"})}});
  // warmup_ratio 0.1 of 2 steps = ceil(0.2) = 1 warmup step: transformers' first step trains at 0.
  EXPECT_TRUE(fs::is_directory(scratch() / "seed_args" / "tensorboard"));
  EXPECT_TRUE(fs::exists(scratch() / "seed_args" / "checkpoint-2" / "trainer_state.json"));
  const auto state = nlohmann::json::parse(slurp(scratch() / "seed_args" / "checkpoint-2" / "trainer_state.json"));
  ASSERT_TRUE(state.contains("log_history")) << state.dump();
  std::vector<double> lrs;
  for (const auto& entry : state["log_history"])
    if (entry.contains("learning_rate")) lrs.push_back(entry["learning_rate"].get<double>());
  ASSERT_EQ(lrs.size(), 1u);  // logging_steps 100: only the last step logs
  EXPECT_DOUBLE_EQ(lrs[0], 2e-5);  // step 2 trains at the peak (warmup 1 step), cosine at progress 0
}
