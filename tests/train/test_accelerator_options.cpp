// Issue 37 item 3: a run's settings reach the Accelerator through one mapping
// (train::accelerator_options), and the DeepSpeed file is parsed once, by
// apply_sharding_config: the Accelerator works from that parse, not from the file again.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tessera/core/error.h"
#include "tessera/dist/accelerator.h"
#include "tessera/train/accelerator_options.h"
#include "tessera/train/training_args.h"

namespace fs = std::filesystem;
using namespace tessera;

namespace {

fs::path write_deepspeed_file(const std::string& name, const std::string& text) {
  const fs::path file =
      fs::temp_directory_path() / ("tessera_" + name + "_" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << text;
  return file;
}

train::TrainingArguments arguments_with(const fs::path& deepspeed,
                                        const nlohmann::json& flags = nlohmann::json::object()) {
  train::TrainingArguments a;
  a.data = "tokens.bin";
  a.device = "cpu";
  train::apply_config_values(a, flags, "command line");
  train::apply_config_values(a, {{"deepspeed", deepspeed.string()}}, "command line");
  train::apply_sharding_config(a);
  return a;
}

}  // namespace

TEST(AcceleratorOptions, TheDeepSpeedFileIsParsedOnceAndTheAcceleratorUsesThatParse) {
  const fs::path file = write_deepspeed_file(
      "ds_once",
      R"({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000, "overlap_comm": false,
                     "stage3_prefetch_bucket_size": 1234}, "gradient_clipping": 0.5})");
  const train::TrainingArguments args = arguments_with(file);
  EXPECT_EQ(args.zero_stage, 1);
  EXPECT_EQ(args.max_grad_norm, 0.5);
  // Gone before the Accelerator exists: a second read would fail ("cannot read it").
  fs::remove(file);
  const dist::AcceleratorOptions options =
      train::accelerator_options(args, /*equal_batch_shapes=*/true);
  ASSERT_TRUE(options.deepspeed.has_value());
  EXPECT_EQ(options.deepspeed->reduce_bucket_size, 1000);
  dist::Accelerator acc(options);
  EXPECT_EQ(acc.options().zero_stage, 1);
  EXPECT_EQ(acc.options().bucket_bytes, 4000u);  // f32 elements
  EXPECT_EQ(acc.options().max_buckets_in_flight, 1u);
  EXPECT_EQ(acc.options().stage3_prefetch_bucket_size, 1234);
  ASSERT_TRUE(acc.deepspeed_config().has_value());
  EXPECT_EQ(acc.deepspeed_config()->path, file.string());
}

TEST(AcceleratorOptions, ArgumentsMapOntoTheAcceleratorsOptions) {
  train::TrainingArguments a;
  a.data = "tokens.bin";
  train::apply_config_values(a,
                             {{"bf16", true},
                              {"grad_accum", 3},
                              {"zero_stage", 3},
                              {"offload", "param"},
                              {"reduce_dtype", "fp32"},
                              {"zero_accumulation", "no_sync"},
                              {"device", "cpu"}},
                             "command line");
  const dist::AcceleratorOptions o = train::accelerator_options(a, /*equal_batch_shapes=*/false);
  EXPECT_EQ(o.mixed_precision, "bf16");
  EXPECT_EQ(o.gradient_accumulation_steps, 3);
  EXPECT_EQ(o.zero_stage, 3);
  EXPECT_TRUE(o.offload_optimizer);
  EXPECT_TRUE(o.offload_param);
  EXPECT_EQ(o.reduce_dtype, "fp32");
  EXPECT_EQ(o.zero_accumulation, dist::GradientAccumulation::no_sync);
  EXPECT_TRUE(o.cpu);
  EXPECT_FALSE(o.sparse_embedding_gradients);
  EXPECT_TRUE(o.deepspeed_config.empty());
  EXPECT_FALSE(o.deepspeed.has_value());
}

// Applying the same arguments again (as a resumed run does with the checkpoint's settings)
// keeps the parse of a file that has not been renamed, and parses a new one.
TEST(AcceleratorOptions, ShardingConfigAppliedAgainKeepsTheParseOfTheSameFile) {
  const fs::path file = write_deepspeed_file("ds_again", R"({"zero_optimization": {"stage": 2}})");
  train::TrainingArguments args = arguments_with(file);
  fs::remove(file);
  train::apply_sharding_config(args);  // would fail reading the removed file
  EXPECT_EQ(args.zero_stage, 2);
  const fs::path other = write_deepspeed_file("ds_other", R"({"zero_optimization": {"stage": 1}})");
  train::TrainingArguments moved = args;
  moved.zero_stage = -1;
  moved.deepspeed = other.string();
  train::apply_sharding_config(moved);
  EXPECT_EQ(moved.zero_stage, 1);
  ASSERT_TRUE(moved.deepspeed_config.has_value());
  EXPECT_EQ(moved.deepspeed_config->path, other.string());
  fs::remove(other);
}

// Every contradiction between two sources reads the same way, naming both.
TEST(AcceleratorOptions, ContradictionsAreRefusedByOneHelperNamingBothSources) {
  const fs::path file =
      write_deepspeed_file("ds_contradiction", R"({"zero_optimization": {"stage": 2}})");
  std::string from_args, from_options;
  try {
    arguments_with(file, {{"zero_stage", 1}});
  } catch (const Error& e) {
    from_args = e.what();
  }
  dist::AcceleratorOptions o;
  o.zero_stage = 1;
  try {
    dist::DeepSpeedConfig::read(file.string()).apply_to(o);
  } catch (const Error& e) {
    from_options = e.what();
  }
  fs::remove(file);
  const std::string file_key =
      "DeepSpeed config '" + file.string() + "': \"zero_optimization.stage\" is 2 but ";
  EXPECT_NE(from_args.find(file_key +
                           "command line: key \"zero_stage\" is 1; they contradict each other"),
            std::string::npos)
      << from_args;
  EXPECT_NE(from_options.find(file_key + "zero_stage is 1; they contradict each other"),
            std::string::npos)
      << from_options;
  try {
    dist::refuse_contradiction(false, "one", "1", "other", "2");
    FAIL() << "refuse_contradiction accepted a contradiction";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one is 1 but other is 2; they contradict each other"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(dist::refuse_contradiction(true, "one", "1", "other", "1"));
}
