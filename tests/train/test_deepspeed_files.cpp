// DeepSpeed JSON as users write it (dist/deepspeed_config.h): the three seed files of
// tests/data/configs parse and map onto the expected settings unchanged, and every key
// DeepSpeed documents for zero_optimization, fp16/bf16, optimizer, scheduler, clipping and
// the batch sizes either shows its effect or is refused naming the key and the reason.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include <filesystem>
#include <fstream>

#include "tessera/dist/accelerator.h"
#include "tessera/dist/deepspeed_config.h"
#include "tessera/train/training_args.h"

namespace fs = std::filesystem;
using namespace tessera;
using Json = nlohmann::json;

namespace {

const std::string kConfigs = TESSERA_SOURCE_DIR "/tests/data/configs/";

dist::DeepSpeedConfig parse(const Json& j) { return dist::DeepSpeedConfig::from_json(j, "ds.json"); }

std::string refusal(const Json& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

dist::AcceleratorOptions applied(const Json& j, dist::AcceleratorOptions o = {}) {
  parse(j).apply_to(o);
  return o;
}

Json zero(const Json& keys) { return {{"zero_optimization", keys}}; }

// The settings a `tessera train --deepspeed FILE` run gets from the file.
train::TrainingArguments train_args_with(const std::string& deepspeed, const Json& values = Json::object()) {
  train::TrainingArguments a;
  a.data = "tokens.bin";
  train::apply_config_values(a, values, "command line");
  a.deepspeed = deepspeed;
  train::apply_sharding_config(a);
  return a;
}

}  // namespace

TEST(DeepSpeedFiles, SeedZero2MapsToZero2WithDeepSpeedsFp16LossScaler) {
  const auto ds = dist::DeepSpeedConfig::read(kConfigs + "deepspeed_zero2.json");
  EXPECT_EQ(ds.zero_stage, 2);
  EXPECT_EQ(ds.mixed_precision, "fp16");
  EXPECT_EQ(ds.gradient_clipping, 1.0);
  EXPECT_FALSE(ds.train_batch_size.has_value());             // "auto"
  EXPECT_FALSE(ds.gradient_accumulation_steps.has_value());  // "auto"
  EXPECT_EQ(ds.reduce_bucket_size, 500'000'000);
  ASSERT_TRUE(ds.loss_scaler.has_value());
  EXPECT_EQ(ds.loss_scaler->init_scale, 65536.0);  // 2^16, DeepSpeed's initial_scale_power
  EXPECT_EQ(ds.loss_scaler->growth_interval, 1000);
  EXPECT_EQ(ds.loss_scaler->hysteresis, 2);
  EXPECT_EQ(ds.loss_scaler->min_scale, 1.0);
  EXPECT_TRUE(ds.loss_scaler->dynamic);
  EXPECT_TRUE(ds.notes.empty());
  const auto a = train_args_with(kConfigs + "deepspeed_zero2.json");
  EXPECT_EQ(a.zero_stage, 2);
  EXPECT_TRUE(a.fp16);
  EXPECT_EQ(a.max_grad_norm, 1.0);
  EXPECT_EQ(a.gradient_accumulation_steps, 1);
  dist::AcceleratorOptions o;
  ds.apply_to(o);
  EXPECT_EQ(o.bucket_bytes, size_t(2'000'000'000));
}

TEST(DeepSpeedFiles, SeedZero3MapsToZero3AndNotesItsMemoryTuning) {
  const auto ds = dist::DeepSpeedConfig::read(kConfigs + "deepspeed_zero3.json");
  EXPECT_EQ(ds.zero_stage, 3);
  EXPECT_EQ(ds.mixed_precision, "fp16");
  EXPECT_FALSE(ds.reduce_bucket_size.has_value());           // "auto"
  EXPECT_FALSE(ds.stage3_prefetch_bucket_size.has_value());  // "auto"
  EXPECT_EQ(ds.stage3_max_live_parameters, 1'000'000'000);
  ASSERT_TRUE(ds.loss_scaler.has_value());
  EXPECT_EQ(ds.loss_scaler->init_scale, 65536.0);  // DeepSpeed's defaults for {"enabled": true}
  EXPECT_EQ(ds.loss_scaler->hysteresis, 2);
  // stage3_max_reuse_distance 1e9 has no counterpart; sub_group_size 1e9 is Tessera's behaviour.
  ASSERT_EQ(ds.notes.size(), 1u);
  EXPECT_NE(ds.notes[0].find("stage3_max_reuse_distance"), std::string::npos);
  dist::AcceleratorOptions o;
  ds.apply_to(o);
  EXPECT_EQ(o.zero_stage, 3);
  EXPECT_EQ(o.stage3_prefetch_bucket_size, 50'000'000);  // Tessera's default, under the 1e9 cap
  const auto a = train_args_with(kConfigs + "deepspeed_zero3.json");
  EXPECT_EQ(a.zero_stage, 3);
  EXPECT_TRUE(a.fp16);
}

TEST(DeepSpeedFiles, SeedTrainerConfigMapsToZero2OffloadBf16AndItsBatchSizes) {
  const auto ds = dist::DeepSpeedConfig::read(kConfigs + "ds_config_trainer.json");
  EXPECT_EQ(ds.zero_stage, 2);
  EXPECT_EQ(ds.offload_optimizer, true);
  EXPECT_EQ(ds.mixed_precision, "bf16");
  EXPECT_FALSE(ds.loss_scaler.has_value());
  const auto a = train_args_with(kConfigs + "ds_config_trainer.json");
  EXPECT_EQ(a.zero_stage, 2);
  EXPECT_EQ(a.offload, "optimizer");
  EXPECT_TRUE(a.bf16);
  EXPECT_EQ(a.per_device_train_batch_size, 4);
  EXPECT_EQ(a.gradient_accumulation_steps, 8);
  // A flag that disagrees with the file is an error naming both.
  try {
    train_args_with(kConfigs + "ds_config_trainer.json", {{"batch", 2}});
    ADD_FAILURE() << "a contradicting batch was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train_micro_batch_size_per_gpu"), std::string::npos) << e.what();
  }
}

// zero_optimization's switches: the value Tessera always has is accepted, the other refused
// with the reason (one case per key).
struct SwitchCase {
  std::string key;
  bool accepted, refused;
};
class DeepSpeedZeroSwitch : public ::testing::TestWithParam<SwitchCase> {};

TEST_P(DeepSpeedZeroSwitch, AcceptsTesserasValueAndRefusesTheOtherWithTheReason) {
  const SwitchCase& c = GetParam();
  EXPECT_EQ(refusal(zero({{c.key, c.accepted}})), "(no error)");
  const std::string e = refusal(zero({{c.key, c.refused}}));
  EXPECT_NE(e.find("zero_optimization." + c.key), std::string::npos) << e;
  EXPECT_NE(e.find("not supported ("), std::string::npos) << e;
}

INSTANTIATE_TEST_SUITE_P(
    EveryKey, DeepSpeedZeroSwitch,
    ::testing::Values(SwitchCase{"contiguous_gradients", true, false},
                      SwitchCase{"reduce_scatter", true, false}, SwitchCase{"allgather_partitions", true, false},
                      SwitchCase{"stage3_gather_16bit_weights_on_model_save", true, false},
                      SwitchCase{"stage3_gather_fp16_weights_on_model_save", true, false},
                      SwitchCase{"load_from_fp32_weights", true, false}, SwitchCase{"grad_hooks", true, false},
                      SwitchCase{"elastic_checkpoint", true, false},
                      SwitchCase{"memory_efficient_linear", true, false},
                      SwitchCase{"round_robin_gradients", false, true},
                      SwitchCase{"zero_quantized_weights", false, true},
                      SwitchCase{"zero_quantized_nontrainable_weights", false, true},
                      SwitchCase{"zero_quantized_gradients", false, true},
                      SwitchCase{"mics_hierarchical_params_gather", false, true}),
    [](const auto& info) { return info.param.key; });

TEST(DeepSpeedFiles, BucketSizesSetTheFlatBuckets) {
  EXPECT_EQ(applied(zero({{"reduce_bucket_size", 1000}})).bucket_bytes, 4000u);
  EXPECT_EQ(applied(zero({{"allgather_bucket_size", 2000}})).bucket_bytes, 8000u);
  EXPECT_EQ(applied(zero({{"reduce_bucket_size", 1000}, {"allgather_bucket_size", 1000.0}})).bucket_bytes, 4000u);
  EXPECT_NE(refusal(zero({{"reduce_bucket_size", 1000}, {"allgather_bucket_size", 2000}})).find("must be equal"),
            std::string::npos);
  EXPECT_EQ(applied(zero({{"reduce_bucket_size", "auto"}})).bucket_bytes, dist::AcceleratorOptions{}.bucket_bytes);
}

TEST(DeepSpeedFiles, Stage3PrefetchIsCappedByMaxLiveParameters) {
  EXPECT_EQ(applied(zero({{"stage3_prefetch_bucket_size", 3000}})).stage3_prefetch_bucket_size, 3000);
  EXPECT_EQ(applied(zero({{"stage3_prefetch_bucket_size", 3000}, {"stage3_max_live_parameters", 1200}}))
                .stage3_prefetch_bucket_size,
            1200);
  EXPECT_EQ(applied(zero({{"stage3_max_live_parameters", 1e3}})).stage3_prefetch_bucket_size, 1000);
}

TEST(DeepSpeedFiles, MemoryTuningWithoutACounterpartIsNotedNotIgnored) {
  EXPECT_TRUE(parse(zero({{"stage3_max_reuse_distance", 0}, {"stage3_param_persistence_threshold", "auto"},
                          {"sub_group_size", 1e9}}))
                  .notes.empty());
  const auto ds = parse(zero({{"stage3_max_reuse_distance", 10}, {"stage3_param_persistence_threshold", 1e4},
                              {"sub_group_size", 1e6}}));
  ASSERT_EQ(ds.notes.size(), 3u);
  EXPECT_NE(ds.notes[0].find("releases a block after its forward"), std::string::npos) << ds.notes[0];
  EXPECT_NE(ds.notes[1].find("partitions every parameter"), std::string::npos) << ds.notes[1];
  EXPECT_NE(ds.notes[2].find("whole shard"), std::string::npos) << ds.notes[2];
}

TEST(DeepSpeedFiles, OtherZeroKeysShowTheirEffectOrAreRefused) {
  EXPECT_TRUE(applied(zero({{"ignore_unused_parameters", true}})).find_unused_parameters);
  EXPECT_FALSE(applied(zero({{"ignore_unused_parameters", false}})).find_unused_parameters);
  EXPECT_TRUE(applied(zero({{"stage", 2}, {"cpu_offload", true}})).offload_optimizer);
  EXPECT_NE(refusal(zero({{"zero_hpz_partition_size", 2}})).find("hierarchical"), std::string::npos);
  EXPECT_EQ(refusal(zero({{"zero_hpz_partition_size", 1}})), "(no error)");
  // MiCS's shard groups are hybrid sharding's (dist/zero.h): -1 off, N > 0 groups of N ranks.
  EXPECT_EQ(applied(zero({{"stage", 3}, {"mics_shard_size", 4}})).hybrid_shard_size, 4);
  EXPECT_EQ(applied(zero({{"mics_shard_size", -1}})).hybrid_shard_size, -1);
  EXPECT_NE(refusal(zero({{"mics_shard_size", 1.5}})).find("mics_shard_size"), std::string::npos);
  EXPECT_NE(refusal(zero({{"mics_shard_size", -2}})).find("mics_shard_size"), std::string::npos);
  {
    dist::AcceleratorOptions two;
    two.hybrid_shard_size = 2;
    try {
      applied(zero({{"stage", 3}, {"mics_shard_size", 4}}), two);
      ADD_FAILURE() << "mics_shard_size 4 against hybrid_shard_size 2 was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("mics_shard_size"), std::string::npos) << e.what();
    }
  }
  EXPECT_NE(refusal(zero({{"stage", 3}, {"offload_param", {{"device", "cpu"}, {"nvme_path", "/x"}}}})).find("NVMe"),
            std::string::npos);
  EXPECT_NE(refusal(zero({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}}}})).find("ratio"),
            std::string::npos);
  EXPECT_EQ(refusal(zero({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"pin_memory", true}}}})),
            "(no error)");
  EXPECT_NE(refusal(zero({{"stage3_magic", 1}})).find("unknown key \"zero_optimization.stage3_magic\""),
            std::string::npos);
}

TEST(DeepSpeedFiles, Fp16LossScaleKeysConfigureTheScaler) {
  const auto ds = parse({{"fp16",
                          {{"enabled", true}, {"loss_scale", 0}, {"initial_scale_power", 12}, {"loss_scale_window", 50},
                           {"hysteresis", 3}, {"consecutive_hysteresis", true}, {"min_loss_scale", 8}}}});
  ASSERT_TRUE(ds.loss_scaler.has_value());
  EXPECT_EQ(ds.loss_scaler->init_scale, 4096.0);
  EXPECT_EQ(ds.loss_scaler->growth_interval, 50);
  EXPECT_EQ(ds.loss_scaler->hysteresis, 3);
  EXPECT_TRUE(ds.loss_scaler->consecutive_hysteresis);
  EXPECT_EQ(ds.loss_scaler->min_scale, 8.0);
  EXPECT_TRUE(ds.loss_scaler->dynamic);
  const auto fixed = parse({{"fp16", {{"enabled", true}, {"loss_scale", 128}}}});
  EXPECT_FALSE(fixed.loss_scaler->dynamic);
  EXPECT_EQ(fixed.loss_scaler->init_scale, 128.0);
  EXPECT_NE(refusal({{"fp16", {{"enabled", true}, {"min_loss_scale", 1e6}}}}).find("min_loss_scale"),
            std::string::npos);
  EXPECT_NE(refusal({{"fp16", {{"hysteresis", 0}}}}).find("fp16.hysteresis"), std::string::npos);
  EXPECT_NE(refusal({{"fp16", {{"fp16_master_weights_and_grads", true}}}}).find("f32 master"), std::string::npos);
  EXPECT_EQ(refusal({{"fp16", {{"enabled", true}, {"auto_cast", false}}}}), "(no error)");
}

// The Accelerator's scaler is the file's: an fp16 run starts at 2^initial_scale_power.
TEST(DeepSpeedFiles, TheAcceleratorsLossScalerStartsAtTheFilesInitialScale) {
  const fs::path file = fs::temp_directory_path() / ("tessera_ds_fp16_" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << R"({"fp16": {"enabled": true, "initial_scale_power": 10, "hysteresis": 4}})";
  dist::AcceleratorOptions options;
  options.cpu = true;
  options.deepspeed_config = file.string();
  dist::Accelerator acc(options);
  EXPECT_EQ(acc.loss_scale(), 1024.0);
  fs::remove(file);
}

TEST(DeepSpeedFiles, Bf16AndItsOldNameEnableBf16) {
  EXPECT_EQ(parse({{"bf16", {{"enabled", true}}}}).mixed_precision, "bf16");
  EXPECT_EQ(parse({{"bfloat16", {{"enabled", true}}}}).mixed_precision, "bf16");
  EXPECT_NE(refusal({{"bf16", {{"enabled", true}}}, {"bfloat16", {{"enabled", true}}}}).find("same block"),
            std::string::npos);
  EXPECT_NE(refusal({{"amp", {{"enabled", true}}}}).find("Apex"), std::string::npos);
}

TEST(DeepSpeedFiles, OptimizerParamsSetAdamWAndOtherOptimizersAreRefused) {
  const Json adamw = {{"optimizer",
                       {{"type", "AdamW"},
                        {"params", {{"lr", 3e-4}, {"betas", {0.8, 0.95}}, {"eps", 1e-6}, {"weight_decay", 0.05},
                                    {"torch_adam", true}}}}}};
  const fs::path file = fs::temp_directory_path() / ("tessera_ds_opt_" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << adamw.dump();
  const auto a = train_args_with(file.string());
  EXPECT_EQ(a.learning_rate, 3e-4);
  EXPECT_EQ(a.adam_beta1, 0.8);
  EXPECT_EQ(a.adam_beta2, 0.95);
  EXPECT_EQ(a.adam_epsilon, 1e-6);
  EXPECT_EQ(a.weight_decay, 0.05);
  EXPECT_THROW(train_args_with(file.string(), {{"lr", 1e-3}}), Error);  // contradicts the file
  fs::remove(file);
  EXPECT_EQ(refusal({{"optimizer", {{"type", "Adam"}, {"params", {{"lr", "auto"}, {"betas", "auto"}}}}}}),
            "(no error)");
  EXPECT_NE(refusal({{"optimizer", {{"type", "Lamb"}}}}).find("AdamW"), std::string::npos);
  EXPECT_NE(refusal({{"optimizer", {{"type", "Adam"}, {"params", {{"adam_w_mode", false}}}}}}).find("L2"),
            std::string::npos);
  EXPECT_NE(refusal({{"optimizer", {{"type", "AdamW"}, {"params", {{"amsgrad", true}}}}}}).find("AMSGrad"),
            std::string::npos);
}

TEST(DeepSpeedFiles, SchedulerClippingAndBatchSizes) {
  EXPECT_NE(refusal({{"scheduler", {{"type", "WarmupLR"}}}}).find("lr_scheduler_type"), std::string::npos);
  EXPECT_EQ(parse({{"gradient_clipping", 0.3}}).gradient_clipping, 0.3);
  EXPECT_NE(refusal({{"gradient_clipping", -1}}).find("gradient_clipping"), std::string::npos);
  EXPECT_EQ(refusal({{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4},
                     {"gradient_accumulation_steps", 2}}),
            "(no error)");
  EXPECT_NE(refusal({{"train_batch_size", 30}, {"train_micro_batch_size_per_gpu", 4},
                     {"gradient_accumulation_steps", 2}}).find("multiple"),
            std::string::npos);
  const auto reduce = train_args_with("", {});
  EXPECT_EQ(reduce.reduce_dtype, "");
  EXPECT_EQ(applied({{"communication_data_type", "fp32"}}).reduce_dtype, "fp32");
  EXPECT_NE(refusal({{"communication_data_type", "int8"}}).find("communication_data_type"), std::string::npos);
}

// train_batch_size is checked against the run: micro x accumulation x world.
TEST(DeepSpeedFiles, TrainBatchSizeMustEqualMicroTimesAccumulationTimesWorld) {
  const fs::path file = fs::temp_directory_path() / ("tessera_ds_tbs_" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << R"({"train_batch_size": 12, "gradient_accumulation_steps": 3})";
  std::vector<uint32_t> tokens(500, 1);
  const fs::path data = fs::temp_directory_path() / ("tessera_ds_tbs_" + std::to_string(::getpid()) + ".bin");
  data::write_token_file(data, tokens);
  const data::TokenFile tf(data);
  for (const auto& [batch, ok] : {std::pair{4, true}, {2, false}}) {
    dist::AcceleratorOptions options;
    options.cpu = true;
    options.deepspeed_config = file.string();
    dist::Accelerator acc(options);
    data::DataLoader loader(tf, {.batch = batch, .seq = 8});
    if (ok)
      EXPECT_NO_THROW(acc.prepare(loader));
    else
      EXPECT_THROW(acc.prepare(loader), Error);
  }
  fs::remove(file);
  fs::remove(data);
}

// Hybrid sharding in the training arguments: Hugging Face's `fsdp: hybrid_shard` (ZeRO-3) and
// `_hybrid_shard_zero2` (ZeRO-2) shard within a node (LOCAL_WORLD_SIZE) unless hybrid_shard_size
// says otherwise, and a DeepSpeed file's mics_shard_size sets it.
TEST(DeepSpeedFiles, HybridShardingFromFsdpWordsAndMicsShardSize) {
  // A rank of a job on 2 nodes of 4 ranks.
  setenv("WORLD_SIZE", "8", 1);
  setenv("RANK", "0", 1);
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  auto with = [](const Json& values) {
    train::TrainingArguments a;
    a.data = "tokens.bin";
    train::apply_config_values(a, values, "config.json");
    train::apply_sharding_config(a);
    return a;
  };
  train::TrainingArguments a = with({{"fsdp", "hybrid_shard"}});
  EXPECT_EQ(a.zero_stage, 3);
  EXPECT_EQ(a.hybrid_shard_size, 4);
  a = with({{"fsdp", "_hybrid_shard_zero2 auto_wrap"}, {"hybrid_shard_size", 2}});
  EXPECT_EQ(a.zero_stage, 2);
  EXPECT_EQ(a.hybrid_shard_size, 2);
  for (const char* v : {"WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"}) unsetenv(v);
  try {
    with({{"fsdp", "full_shard"}, {"hybrid_shard_size", 2}});
    ADD_FAILURE() << "full_shard with hybrid_shard_size was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shards over every rank"), std::string::npos) << e.what();
  }
  const fs::path ds =
      fs::temp_directory_path() / ("tessera_mics_" + std::to_string(getpid()) + ".json");
  std::ofstream(ds) << R"({"zero_optimization": {"stage": 2, "mics_shard_size": 2}})";
  const train::TrainingArguments m = train_args_with(ds.string());
  EXPECT_EQ(m.zero_stage, 2);
  EXPECT_EQ(m.hybrid_shard_size, 2);
  fs::remove(ds);
}
