// Hugging Face's TrainingArguments names mean what they mean there: the seed
// training_arguments.json (tests/data/configs) maps onto the expected settings, the keys
// users bring are honoured (each with its effect shown) or refused with the reason, and
// lr_scheduler_type is transformers' schedule (warmup from 0, cosine to 0) while Tessera's
// own --schedule keeps its floor of lr/10.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "tessera/data/token_file.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/optim.h"
#include "tessera/train/callbacks.h"
#include "tessera/train/checkpoint_files.h"
#include "tessera/train/trainer.h"
#include "tessera/train/training_args.h"

namespace fs = std::filesystem;
using namespace tessera;
using Json = nlohmann::json;

namespace {

const std::string kConfigs = TESSERA_SOURCE_DIR "/tests/data/configs/";

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_test_hf_args_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

train::TrainingArguments from(const Json& values) {
  train::TrainingArguments a;
  a.data = "tokens.bin";
  train::apply_config_values(a, values, "config 'test.json'");
  return a;
}

std::string error_of(const Json& values) {
  try {
    train::TrainingArguments a = from(values);
    train::validate(a);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<double> schedule_lrs(const train::TrainingArguments& a, int64_t total) {
  Tensor w = zeros({2});
  w.requires_grad_(true);
  optim::AdamW opt({w}, {.lr = a.learning_rate});
  auto schedule = train::make_lr_schedule(a, opt, total);
  std::vector<double> lrs;
  for (int64_t s = 0; s <= total; ++s) lrs.push_back(schedule->lr_at(s));
  return lrs;
}

}  // namespace

TEST(HfTrainingArguments, SeedTrainingArgumentsJsonMapsToTheExpectedSettings) {
  train::TrainingArguments a;
  train::apply_config_values(a, train::read_config_file(kConfigs + "training_arguments.json"),
                             "config 'training_arguments.json'");
  a.data = "tokens.bin";
  train::validate(a);
  EXPECT_EQ(a.output_dir, "./results");
  EXPECT_EQ(a.num_train_epochs, 3);
  EXPECT_EQ(a.per_device_train_batch_size, 16);
  EXPECT_EQ(a.per_device_eval_batch_size, 32);
  EXPECT_EQ(a.learning_rate, 2e-5);
  EXPECT_EQ(a.weight_decay, 0.01);
  EXPECT_EQ(a.warmup_ratio, 0.1);
  EXPECT_EQ(a.lr_scheduler_type, "cosine");
  EXPECT_EQ(a.gradient_accumulation_steps, 4);
  EXPECT_TRUE(a.bf16);
  EXPECT_EQ(a.eval_strategy, "steps");
  EXPECT_EQ(a.eval_steps, 500);
  EXPECT_EQ(a.logging_steps, 100);
  EXPECT_EQ(a.save_strategy, "steps");
  EXPECT_EQ(a.save_steps, 500);
  EXPECT_EQ(a.save_total_limit, 3);
  EXPECT_TRUE(a.load_best_model_at_end);
  // transformers' "accuracy" is the evaluation's accuracy: here the next-token accuracy,
  // and (greater_is_better left out) higher is better, as transformers decides.
  EXPECT_EQ(a.metric_for_best_model, "eval_accuracy");
  EXPECT_TRUE(a.greater_is_better);
  EXPECT_EQ(a.seed, 42);
  EXPECT_FALSE(a.push_to_hub);
  EXPECT_EQ(a.report_to, std::vector<std::string>{"tensorboard"});
  // cosine with warmup_ratio 0.1 over 100 steps: ceil(10) warmup steps from 0, then to 0.
  EXPECT_EQ(train::warmup_steps_for(a, 95), 10);
  const auto lrs = schedule_lrs(a, 100);
  EXPECT_EQ(lrs[0], 0.0);
  EXPECT_DOUBLE_EQ(lrs[10], 2e-5);
  EXPECT_EQ(lrs[100], 0.0);
}

TEST(HfTrainingArguments, CosineDecaysToZeroWhileTesserasScheduleKeepsItsFloor) {
  const auto hf = schedule_lrs(from({{"lr_scheduler_type", "cosine"}, {"learning_rate", 1e-3}}), 20);
  EXPECT_EQ(hf[0], 1e-3);
  EXPECT_EQ(hf[20], 0.0);
  const auto own = schedule_lrs(from({{"schedule", "cosine"}, {"learning_rate", 1e-3}}), 20);
  EXPECT_DOUBLE_EQ(own[20], 1e-4);  // --min-lr's default: lr / 10
  const auto floor = schedule_lrs(
      from({{"lr_scheduler_type", "cosine_with_min_lr"}, {"lr_scheduler_kwargs", {{"min_lr_rate", 0.2}}},
            {"learning_rate", 1e-3}, {"warmup_steps", 4}}),
      20);
  EXPECT_EQ(floor[0], 0.0);
  EXPECT_DOUBLE_EQ(floor[1], 2.5e-4);
  EXPECT_DOUBLE_EQ(floor[20], 2e-4);
  // The kwargs as transformers also takes them: a JSON string (from a flag or YAML).
  const auto text = schedule_lrs(from({{"lr_scheduler_type", "polynomial"},
                                       {"lr_scheduler_kwargs", R"({"power": 2.0, "lr_end": 0.0})"},
                                       {"learning_rate", 1e-3}}),
                                 10);
  EXPECT_DOUBLE_EQ(text[5], 1e-3 * 0.25);
}

TEST(HfTrainingArguments, ScheduleSettingsThatDoNotBelongTogetherAreRefused) {
  EXPECT_NE(error_of({{"lr_scheduler_type", "cosine"}, {"schedule", "linear"}}).find("give one"),
            std::string::npos);
  EXPECT_NE(error_of({{"lr_scheduler_type", "cosine"}, {"min_lr", 1e-5}}).find("cosine_with_min_lr"),
            std::string::npos);
  EXPECT_NE(error_of({{"lr_scheduler_kwargs", {{"num_cycles", 2}}}}).find("needs lr_scheduler_type"),
            std::string::npos);
  EXPECT_NE(error_of({{"lr_scheduler_type", "linear"}, {"lr_scheduler_kwargs", {{"num_cycles", 2}}}})
                .find("num_cycles"),
            std::string::npos);
  EXPECT_NE(error_of({{"lr_scheduler_type", "constant"}, {"warmup_steps", 3}}).find("constant_with_warmup"),
            std::string::npos);
  EXPECT_NE(error_of({{"lr_scheduler_type", "reduce_lr_on_plateau"}}).find("not supported"),
            std::string::npos);
  EXPECT_NE(error_of({{"lr_scheduler_type", "cosine_with_min_lr"}}).find("min_lr"), std::string::npos);
}

TEST(HfTrainingArguments, PushToHubTrueIsRefusedBecauseThereIsNoNetwork) {
  EXPECT_FALSE(from({{"push_to_hub", false}}).push_to_hub);
  const std::string e = error_of({{"push_to_hub", true}});
  EXPECT_NE(e.find("push_to_hub"), std::string::npos) << e;
  EXPECT_NE(e.find("network"), std::string::npos) << e;
}

TEST(HfTrainingArguments, ResumeFromCheckpointTrueMeansTheNewestAndAPathMeansThatOne) {
  EXPECT_EQ(from({{"resume_from_checkpoint", true}}).resume_from_checkpoint, "latest");
  EXPECT_EQ(from({{"resume_from_checkpoint", false}}).resume_from_checkpoint, "");
  EXPECT_EQ(from({{"resume_from_checkpoint", "runs/x/checkpoint-4"}}).resume_from_checkpoint,
            "runs/x/checkpoint-4");
  EXPECT_NE(error_of({{"resume_from_checkpoint", 3}}).find("a string or true/false"), std::string::npos);
}

TEST(HfTrainingArguments, ReportToRefusesServicesNamingWhatIsSupported) {
  const std::string e = error_of({{"report_to", "wandb"}});
  EXPECT_NE(e.find("\"wandb\""), std::string::npos) << e;
  EXPECT_NE(e.find("supported: jsonl, tensorboard, csv, mlflow"), std::string::npos) << e;
  EXPECT_EQ(from({{"report_to", "all"}}).report_to,
            (std::vector<std::string>{"jsonl", "tensorboard", "csv", "mlflow"}));
  EXPECT_EQ(from({{"report_to", "csv,mlflow"}}).report_to, (std::vector<std::string>{"csv", "mlflow"}));
  EXPECT_EQ(from({{"report_to", "none"}}).report_to, std::vector<std::string>{"none"});
  EXPECT_EQ(from({{"report_to", {"tensorboard"}}}).report_to, std::vector<std::string>{"tensorboard"});
}

TEST(HfTrainingArguments, MetricNamesAndGreaterIsBetterFollowTransformers) {
  EXPECT_EQ(from({{"metric_for_best_model", "eval_loss"}}).metric_for_best_model, "eval_loss");
  EXPECT_FALSE(from({{"metric_for_best_model", "eval_loss"}}).greater_is_better);
  EXPECT_TRUE(from({{"metric_for_best_model", "eval_accuracy"}}).greater_is_better);
  EXPECT_FALSE(from({{"metric_for_best_model", "accuracy"}, {"greater_is_better", false}}).greater_is_better);
  EXPECT_FALSE(from({{"greater_is_better", false}, {"metric_for_best_model", "accuracy"}}).greater_is_better);
  EXPECT_EQ(from({{"metric_for_best_model", "f1"}}).metric_for_best_model, "eval_f1");  // transformers adds eval_
}

// logging_strategy: steps logs every logging_steps, epoch at each epoch's end, no never.
TEST(HfTrainingArguments, LoggingStrategyDecidesWhichStepsLog) {
  auto logged_steps = [](const Json& values) {
    train::TrainingArguments a = from(values);
    train::TrainerState state;
    state.max_steps = 12, state.steps_per_epoch = 5;
    train::DefaultFlowCallback flow;
    std::vector<int64_t> logged;
    for (state.global_step = 1; state.global_step <= state.max_steps; ++state.global_step) {
      train::TrainerControl control;
      flow.on_step_end(a, state, control);
      if (control.should_log) logged.push_back(state.global_step);
    }
    return logged;
  };
  EXPECT_EQ(logged_steps({{"logging_steps", 4}}), (std::vector<int64_t>{4, 8, 12}));
  EXPECT_EQ(logged_steps({{"logging_strategy", "epoch"}, {"logging_steps", 4}}),
            (std::vector<int64_t>{5, 10, 12}));
  EXPECT_EQ(logged_steps({{"logging_strategy", "no"}}), std::vector<int64_t>{});
  EXPECT_NE(error_of({{"logging_strategy", "sometimes"}}).find("logging_strategy"), std::string::npos);
}

// logging_dir is where the TensorBoard event files go.
TEST(HfTrainingArguments, LoggingDirHoldsTheTensorBoardEventFiles) {
  const fs::path dir = scratch("logging_dir");
  train::TrainingArguments a = from({{"report_to", "tensorboard"}, {"logging_dir", (dir / "tb").string()},
                                     {"output_dir", (dir / "run").string()}});
  train::TrainerState state;
  train::TrainerControl control;
  {
    train::TrackerCallback trackers;
    trackers.on_train_begin(a, state, control);
    trackers.on_log(a, state, control, Json{{"step", 1}, {"loss", 2.5}});
  }
  ASSERT_TRUE(fs::is_directory(dir / "tb"));
  EXPECT_FALSE(fs::is_directory(fs::path(a.output_dir) / "tensorboard"));
  size_t events = 0;
  for (const auto& e : fs::directory_iterator(dir / "tb"))
    events += e.path().filename().string().starts_with("events.out.tfevents");
  EXPECT_EQ(events, 1u);
}

TEST(HfTrainingArguments, DataloaderNumWorkersIsAcceptedAndNegativeRefused) {
  EXPECT_EQ(from({{"dataloader_num_workers", 4}}).dataloader_num_workers, 4);
  EXPECT_EQ(error_of({{"dataloader_num_workers", 4}}), "(no error)");
  EXPECT_NE(error_of({{"dataloader_num_workers", -1}}).find("dataloader_num_workers"), std::string::npos);
}

// save_only_model: the checkpoints are model directories without the training state, and
// resuming from one is refused naming why. The lr the run logs is transformers' linear
// schedule's (warmup from 0).
TEST(HfTrainingArguments, SaveOnlyModelWritesModelOnlyCheckpointsThatCannotBeResumed) {
  const fs::path dir = scratch("save_only_model");
  std::vector<uint32_t> tokens(3000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>((i * 7 + i / 11) % 61);
  data::write_token_file(dir / "tokens.bin", tokens);
  const data::TokenFile file(dir / "tokens.bin");
  train::TrainingArguments a = from({{"save_only_model", true}, {"lr_scheduler_type", "linear"},
                                     {"warmup_steps", 2}, {"max_steps", 6}, {"save_steps", 3},
                                     {"eval_strategy", "no"}, {"learning_rate", 1e-3}});
  a.data = (dir / "tokens.bin").string(), a.output_dir = (dir / "run").string();
  a.n_layer = 1, a.n_head = 2, a.n_embd = 16, a.seq = 16, a.per_device_train_batch_size = 2;
  nn::GPTConfig g;
  g.vocab_size = 61, g.block_size = 16, g.n_layer = 1, g.n_head = 2, g.n_embd = 16;
  Generator gen(5);
  nn::GPT model(g, &gen);
  train::Trainer trainer(a, model, file, std::nullopt);
  trainer.train();
  const fs::path checkpoint = dir / "run" / "checkpoint-3";
  ASSERT_TRUE(fs::exists(checkpoint / "model.safetensors"));
  EXPECT_TRUE(fs::exists(checkpoint / "config.json"));
  EXPECT_FALSE(fs::exists(checkpoint / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(checkpoint / "accelerator_state.json"));
  try {
    train::verify_checkpoint(checkpoint);
    ADD_FAILURE() << "a model-only checkpoint was accepted for resuming";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("save_only_model"), std::string::npos) << e.what();
  }
  Tensor w = zeros({2});
  w.requires_grad_(true);
  optim::AdamW reference_opt({w}, {.lr = 1e-3});
  auto reference = optim::get_linear_schedule_with_warmup(reference_opt, 2, 6);
  int64_t checked = 0;
  trainer.state().log_history.for_each([&](const Json& entry) {
    if (!entry.contains("learning_rate")) return;
    const int64_t step = entry["step"].get<int64_t>();  // the lr step `step` trained with
    EXPECT_DOUBLE_EQ(entry["learning_rate"].get<double>(), reference->lr_at(step - 1)) << "step " << step;
    ++checked;
  });
  EXPECT_EQ(checked, 6);
}

namespace {

// gradient_checkpointing with Hugging Face's gradient_checkpointing_kwargs: torch's
// use_reentrant is accepted (and ignored: Tessera has one implementation), Tessera's "policy"
// selects what is recomputed, and a bad policy is refused by validate() naming the key and
// the value, before any work.
TEST(HfTrainingArguments, GradientCheckpointingKwargsSelectThePolicy) {
  EXPECT_EQ(train::gradient_checkpointing_policy(from(Json::object())), nn::CheckpointPolicy());
  EXPECT_EQ(train::gradient_checkpointing_policy(from({{"gradient_checkpointing", true}})),
            nn::CheckpointPolicy::full());
  const Json reentrant = {{"gradient_checkpointing", true},
                          {"gradient_checkpointing_kwargs", {{"use_reentrant", false}}}};
  EXPECT_EQ(error_of(reentrant), "(no error)");
  EXPECT_EQ(train::gradient_checkpointing_policy(from(reentrant)), nn::CheckpointPolicy::full());
  // HF configs often carry the kwargs with checkpointing off: nothing is recomputed then.
  const Json off = {{"gradient_checkpointing_kwargs", {{"use_reentrant", false}}}};
  EXPECT_EQ(error_of(off), "(no error)");
  EXPECT_EQ(train::gradient_checkpointing_policy(from(off)), nn::CheckpointPolicy());
  const Json every_2 = {{"gradient_checkpointing", true},
                        {"gradient_checkpointing_kwargs", {{"policy", "every_k:2"}, {"use_reentrant", true}}}};
  EXPECT_EQ(error_of(every_2), "(no error)");
  EXPECT_EQ(train::gradient_checkpointing_policy(from(every_2)), nn::CheckpointPolicy::every_k(2));
  // As text, as transformers' command line passes a dict.
  const Json text = {{"gradient_checkpointing", true}, {"gradient_checkpointing_kwargs", R"({"policy": "mlp"})"}};
  EXPECT_EQ(train::gradient_checkpointing_policy(from(text)), nn::CheckpointPolicy::mlp());
  EXPECT_EQ(from(every_2).to_json()["gradient_checkpointing_kwargs"]["policy"], "every_k:2");

  // n_layer is 4 by default.
  for (const std::string bad : {"every_k:0", "every_k:two", "every_k:1.5", "sometimes", "every_k:5"}) {
    const std::string e = error_of({{"gradient_checkpointing", true},
                                    {"gradient_checkpointing_kwargs", {{"policy", bad}}}});
    EXPECT_NE(e.find("key \"gradient_checkpointing_kwargs\""), std::string::npos) << bad << ": " << e;
    EXPECT_NE(e.find("'" + bad + "'"), std::string::npos) << bad << ": " << e;
  }
  // The same K fits a deeper model.
  EXPECT_EQ(error_of({{"gradient_checkpointing", true}, {"n_layer", 8},
                      {"gradient_checkpointing_kwargs", {{"policy", "every_k:5"}}}}),
            "(no error)");
  const std::string unknown = error_of({{"gradient_checkpointing", true},
                                        {"gradient_checkpointing_kwargs", {{"preserve_rng_state", true}}}});
  EXPECT_NE(unknown.find("\"preserve_rng_state\""), std::string::npos) << unknown;
  const std::string not_on = error_of({{"gradient_checkpointing_kwargs", {{"policy", "mlp"}}}});
  EXPECT_NE(not_on.find("gradient_checkpointing is false"), std::string::npos) << not_on;
  const std::string not_dict = error_of({{"gradient_checkpointing", true}, {"gradient_checkpointing_kwargs", 3}});
  EXPECT_NE(not_dict.find("gradient_checkpointing_kwargs"), std::string::npos) << not_dict;
}

}  // namespace

namespace {

// Accelerate's ParallelismConfig as a nested mapping: tp_size and dp_replicate_size are the
// mesh's tp_size and dp_size (saved under those names, not as the mapping), the keys that have
// no meaning here are refused by name, and the mapping and tp_size together are one setting
// given twice.
TEST(HfTrainingArguments, ParallelismConfigSetsTheMeshSizes) {
  train::TrainingArguments a =
      from({{"parallelism_config", {{"tp_size", 2}, {"dp_replicate_size", 3}, {"cp_size", 1}}}});
  EXPECT_EQ(a.tp_size, 2);
  EXPECT_EQ(a.dp_size, 3);
  EXPECT_EQ(a.pp_size, 1);
  const Json saved = a.to_json();
  EXPECT_EQ(saved["tp_size"], 2);
  EXPECT_EQ(saved["dp_size"], 3);
  EXPECT_FALSE(saved.contains("parallelism_config"));
  const train::TrainingArguments b = from({{"pp_size", 3}, {"micro_batches", 4}});
  EXPECT_EQ(b.pp_size, 3);
  EXPECT_EQ(b.pipeline_micro_batches, 4);  // --micro-batches' name
  auto refused = [](const Json& values) {
    try {
      from(values);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refused({{"parallelism_config", {{"cp_size", 2}}}}).find("cp_size 2 asks for context"),
            std::string::npos);
  EXPECT_NE(refused({{"parallelism_config", {{"dp_shard_size", 4}}}})
                .find("dp_shard_size 4 asks for FSDP sharding"),
            std::string::npos);
  EXPECT_NE(refused({{"parallelism_config", {{"sp_size", 2}}}}).find("unknown key \"sp_size\""),
            std::string::npos);
  EXPECT_NE(refused({{"parallelism_config", {{"tp_size", 0}}}}).find("whole number >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(refused({{"tp_size", 2}, {"parallelism_config", {{"tp_size", 2}}}})
                .find("set the same setting"),
            std::string::npos);
  train::TrainingArguments bad = from({{"pipeline_schedule", "gpipe"}});
  EXPECT_THROW(train::validate(bad), Error);
}

}  // namespace
