// The library Trainer: early stopping, best-model tracking and reload, checkpoint rotation
// that keeps the best, and the arguments' checks. Tiny GPTs on a synthetic token stream.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tessera/core/file_io.h"
#include "tessera/core/safetensors.h"
#include "tessera/data/token_file.h"
#include "tessera/nn/gpt.h"
#include "tessera/train/checkpoint_files.h"
#include "tessera/train/run_folder.h"
#include "tessera/train/trainer.h"

namespace fs = std::filesystem;
using namespace tessera;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_test_train_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

data::TokenFile token_stream(const fs::path& dir) {
  std::vector<uint32_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<uint32_t>((i * 7 + i / 11) % 61);
  data::write_token_file(dir / "tokens.bin", tokens);
  return data::TokenFile(dir / "tokens.bin");
}

train::TrainingArguments tiny_args(const fs::path& dir) {
  train::TrainingArguments a;
  a.data = (dir / "tokens.bin").string();
  a.output_dir = (dir / "run").string();
  a.n_layer = 1, a.n_head = 2, a.n_embd = 16, a.seq = 16;
  a.per_device_train_batch_size = 4;
  a.eval_batches = 1;
  a.lr_scheduler_type = "constant";
  a.learning_rate = 3e-3;
  return a;
}

std::unique_ptr<nn::GPT> tiny_gpt() {
  nn::GPTConfig g;
  g.vocab_size = 61, g.block_size = 16, g.n_layer = 1, g.n_head = 2, g.n_embd = 16;
  Generator gen(5);
  return std::make_unique<nn::GPT>(g, &gen);
}

// compute_metrics returning a scripted loss (eval_loss) per evaluation (the model is still
// evaluated: the hook replaces only the metrics).
train::ComputeMetrics scripted(std::vector<double> values) {
  auto next = std::make_shared<size_t>(0);
  return [values, next](const train::EvalTotals& totals) {
    EXPECT_GT(totals.tokens, 0);
    return train::Metrics{{"loss", values.at(std::min(*next, values.size() - 1))},
                          {"evals", double((*next)++)}};
  };
}

std::vector<float> values_of(const Tensor& t) {
  return t.to(DType::f32).contiguous().to_vector<float>();
}

}  // namespace

TEST(Trainer, EarlyStoppingStopsAtTheRightStep) {
  const fs::path dir = scratch("early");
  const data::TokenFile tokens = token_stream(dir);
  // Evaluations at 5, 10, 15, 20, ...: 5.0 (best), 4.0 (better by 1), 4.5 (worse: 1),
  // 3.98 (better by only 0.02 < threshold 0.05: 2 = patience) -> stop at step 20.
  const std::vector<double> losses = {5.0, 4.0, 4.5, 3.98, 3.99, 3.99, 3.99};
  for (const auto& [threshold, stop_step] : {std::pair{0.05, 20}, {0.0, 30}}) {
    train::TrainingArguments args = tiny_args(dir);
    args.max_steps = 100, args.eval_steps = 5, args.save_strategy = "no";
    auto model = tiny_gpt();
    train::Trainer trainer(args, *model, tokens, tokens, scripted(losses));
    trainer.add_callback(std::make_shared<train::EarlyStoppingCallback>(2, threshold));
    trainer.train();
    EXPECT_EQ(trainer.state().global_step, stop_step) << "threshold " << threshold;
    const auto& last = trainer.state().log_history.back();
    EXPECT_EQ(last["step"], stop_step);
    EXPECT_TRUE(last.contains("eval_loss"));
    // Best tracking takes any improvement (no threshold).
    EXPECT_EQ(trainer.state().best_metric.value(), threshold > 0 ? 3.98 : 3.98);
    EXPECT_EQ(trainer.state().best_step, 20);
  }
}

TEST(Trainer, LoadBestModelAtEndRestoresTheBestCheckpointBitForBit) {
  const fs::path dir = scratch("best");
  const data::TokenFile tokens = token_stream(dir);
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 20, args.eval_steps = 5, args.save_steps = 10, args.save_total_limit = 1;
  args.load_best_model_at_end = true;
  auto model = tiny_gpt();
  train::Trainer trainer(args, *model, tokens, tokens, scripted({3.0, 2.0, 2.5, 2.7}));
  trainer.train();
  const fs::path run = args.output_dir;
  EXPECT_EQ(trainer.state().best_model_checkpoint, "checkpoint-10");
  // save_total_limit 1 never removes the best; the newest stays too.
  EXPECT_FALSE(fs::exists(run / "checkpoint-5"));
  ASSERT_TRUE(fs::exists(run / "checkpoint-10" / "model.safetensors"));
  ASSERT_TRUE(fs::exists(run / "checkpoint-20" / "model.safetensors"));
  const auto best =
      load_safetensors((run / "checkpoint-10" / "model.safetensors").string()).tensors;
  const auto last =
      load_safetensors((run / "checkpoint-20" / "model.safetensors").string()).tensors;
  size_t differing_from_last = 0;
  for (const auto& [name, t] : model->state_dict()) {
    ASSERT_TRUE(best.count(name)) << name;
    EXPECT_EQ(values_of(t), values_of(best.at(name))) << name;
    differing_from_last += values_of(t) != values_of(last.at(name));
  }
  EXPECT_GT(differing_from_last, 0u);  // step 20's weights were really replaced
  // trainer_state.json of the last checkpoint records the best.
  train::verify_checkpoint(run / "checkpoint-20");
}

namespace {

// Signals this process at the end of one step, as a scheduler's SIGTERM would.
class SignalAtStep : public train::TrainerCallback {
 public:
  SignalAtStep(int64_t step, int signal) : step_(step), signal_(signal) {}
  void on_step_end(const train::TrainingArguments&, train::TrainerState& state,
                   train::TrainerControl&) override {
    if (state.global_step == step_) ::raise(signal_);
  }

 private:
  int64_t step_;
  int signal_;
};

std::vector<std::vector<float>> weights_of(nn::Module& model) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : model.parameters()) out.push_back(values_of(p));
  return out;
}

}  // namespace

TEST(Trainer, APreemptionSignalSavesTheStepReachedAndTheResumeEndsBitIdentical) {
  const fs::path dir = scratch("preempt");
  const data::TokenFile tokens = token_stream(dir);
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 20, args.save_steps = 8, args.eval_steps = 5;
  args.lr_scheduler_type = "cosine";
  args.output_dir = (dir / "straight").string();
  auto straight = tiny_gpt();
  train::Trainer(args, *straight, tokens, tokens).train();

  args.output_dir = (dir / "run").string();
  {
    auto model = tiny_gpt();
    train::Trainer trainer(args, *model, tokens, tokens);
    trainer.add_callback(std::make_shared<SignalAtStep>(11, SIGUSR1));
    trainer.train();
    EXPECT_EQ(trainer.preempted_by(), SIGUSR1);
    EXPECT_EQ(trainer.state().global_step, 11);
  }
  train::verify_checkpoint(dir / "run" / "checkpoint-11");
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoint-20"));

  args.resume_from_checkpoint = (dir / "run" / "checkpoint-11").string();
  auto resumed = tiny_gpt();
  train::Trainer trainer(args, *resumed, tokens, tokens);
  trainer.train();
  EXPECT_EQ(trainer.preempted_by(), 0);
  EXPECT_EQ(trainer.state().global_step, 20);
  EXPECT_EQ(weights_of(*resumed), weights_of(*straight));
}

TEST(Trainer, AFreshRunIntoAFolderHoldingAnotherRunIsRefusedUnlessOverwriteOutputDir) {
  const fs::path dir = scratch("owned");
  const data::TokenFile tokens = token_stream(dir);
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 4;
  {
    auto model = tiny_gpt();
    train::Trainer(args, *model, tokens).train();
  }
  ASSERT_TRUE(fs::exists(dir / "run" / "checkpoint-4"));
  args.max_steps = 3;
  auto model = tiny_gpt();
  try {
    train::Trainer trainer(args, *model, tokens);
    ADD_FAILURE() << "a second run was let into the first one's folder";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already holds a run (checkpoint-4)"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoint-4"));
  args.overwrite_output_dir = true;
  train::Trainer trainer(args, *model, tokens);
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoint-4"));
  const std::string holder = [&] {
    std::ifstream in(dir / "run" / train::kRunFolderLockFile);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }();
  EXPECT_EQ(holder.rfind("pid " + std::to_string(::getpid()) + " on host ", 0), 0u) << holder;
}

TEST(Trainer, EvaluateGivesLossPerplexityAndTokenAccuracy) {
  const fs::path dir = scratch("metrics");
  const data::TokenFile tokens = token_stream(dir);
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 1, args.eval_batches = 2;
  auto model = tiny_gpt();
  train::Trainer trainer(args, *model, tokens, tokens);
  const train::Metrics m = trainer.evaluate();
  // Reference: the model's own mean loss over the same two batches, and argmax hits.
  data::DataLoader loader(tokens, {.batch = 4, .seq = 16});
  double loss = 0;
  int64_t hits = 0;
  model->eval();
  for (int k = 0; k < 2; ++k) {
    const data::Batch b = loader.next();
    loss += model->loss(b.x, b.y).item() / 2;
    const Tensor logits = (*model)(b.x);
    const auto lv = values_of(logits);
    const auto y = b.y.to_vector<int64_t>();
    for (size_t row = 0; row < y.size(); ++row) {
      size_t best = 0;
      for (size_t v = 1; v < 61; ++v)
        if (lv[row * 61 + v] > lv[row * 61 + best]) best = v;
      hits += static_cast<int64_t>(best) == y[row];
    }
  }
  EXPECT_NEAR(m.at("eval_loss"), loss, 1e-6);
  EXPECT_NEAR(m.at("eval_perplexity"), std::exp(loss), 1e-5);
  EXPECT_DOUBLE_EQ(m.at("eval_accuracy"), static_cast<double>(hits) / (2 * 4 * 16));
}

TEST(TrainingArguments, HuggingFaceNamesAndFlagNamesSetTheSameSetting) {
  train::TrainingArguments a, b;
  train::apply_config_values(
      a, {{"learning_rate", 0.25}, {"per_device_train_batch_size", 3}, {"bf16", true}}, "x");
  train::apply_config_values(b, {{"lr", 0.25}, {"batch", 3}, {"dtype", "bf16"}}, "y");
  EXPECT_EQ(a.to_json(), b.to_json());
  EXPECT_EQ(b.describe("learning_rate"), "y: key \"lr\" (learning_rate)");
  EXPECT_THROW(train::apply_config_values(a, {{"n_embd", "32"}}, "z"),
               Error);  // text, not a number
  EXPECT_THROW(train::apply_config_values(a, {{"bf16", true}, {"dtype", "fp32"}}, "z"), Error);
  train::TrainingArguments c;
  train::apply_config_values(c, {{"bf16", false}, {"fp16", true}}, "z");  // two switches, no clash
  EXPECT_EQ(c.dtype(), "fp16");
  EXPECT_THROW(train::apply_config_values(a, {{"max_steps", 2.5}}, "z"), Error);
  EXPECT_THROW(train::apply_config_values(a, {{"report_to", 3}}, "z"), Error);
}

TEST(TrainingArguments, ReduceDtypeIsFp32OrTheTrainingDtype) {
  train::TrainingArguments a;
  train::apply_config_values(a, {{"data", "t.bin"}, {"dtype", "bf16"}, {"reduce_dtype", "bf16"}}, "x");
  EXPECT_NO_THROW(train::validate(a));
  train::TrainingArguments b;
  train::apply_config_values(b, {{"data", "t.bin"}, {"dtype", "bf16"}, {"reduce-dtype", "fp16"}},
                             "cfg.json");
  try {
    train::validate(b);
    ADD_FAILURE() << "reduce_dtype fp16 in a bf16 run was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.json: key \"reduce-dtype\""), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos) << e.what();
  }
  train::TrainingArguments c;  // an f32 run averages in f32 only
  train::apply_config_values(c, {{"data", "t.bin"}, {"reduce_dtype", "bf16"}}, "x");
  EXPECT_THROW(train::validate(c), Error);
}

// trainer_state.json keeps Hugging Face's layout while the log history lives on disk
// (log_history.h): every entry comes back exactly, in order, through the file and a
// resume, and a copy of a state is independent of the original.
TEST(TrainerState, LogHistoryOnDiskRoundTripsThroughTrainerStateJson) {
  Generator gen(11);
  const std::vector<float> noise = randn({3000}, {}, &gen).to_vector<float>();
  train::TrainerState state;
  state.global_step = 1500, state.max_steps = 2000, state.schedule_total = 2000;
  state.best_metric = 2.25, state.best_step = 1000, state.best_model_checkpoint = "checkpoint-1000";
  std::vector<nlohmann::json> want;
  for (int64_t step = 1; step <= 1500; ++step) {
    nlohmann::json entry = {{"step", step},
                            {"loss", 3.0 + noise[2 * step - 2]},
                            {"lr", 1e-3 * step / 1500.0},
                            {"grad_norm", std::abs(noise[2 * step - 1]) + 0.1}};
    if (step == 77) entry["loss"] = nullptr;  // a non-finite step is logged as null
    want.push_back(entry);
    state.log_history.push_back(entry);
    if (step % 500 == 0) {
      want.push_back({{"step", step}, {"val_loss", 2.0 + noise[step]}});
      state.log_history.push_back(want.back());
    }
  }
  ASSERT_EQ(state.log_history.size(), want.size());
  EXPECT_EQ(state.log_history.back(), want.back());

  const std::string text = state.to_text();
  const nlohmann::json j = nlohmann::json::parse(text);
  for (const char* key :
       {"global_step", "max_steps", "epoch", "log_history", "best_metric", "best_model_checkpoint"})
    EXPECT_TRUE(j.contains(key)) << key;
  ASSERT_EQ(j["log_history"].size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(j["log_history"][i], want[i]) << i;
  EXPECT_EQ(j["best_model_checkpoint"], "checkpoint-1000");
  EXPECT_EQ(state.to_json(), j);

  // Read back (as a resume does), then written again: the same text, byte for byte.
  const train::TrainerState resumed = train::TrainerState::from_json(j, "trainer_state.json");
  EXPECT_EQ(resumed.to_text(), text);
  size_t visited = 0;
  resumed.log_history.for_each([&](const nlohmann::json& entry) {
    ASSERT_LT(visited, want.size());
    EXPECT_EQ(entry, want[visited++]);
  });
  EXPECT_EQ(visited, want.size());

  // Copies are independent (each keeps a file of its own).
  train::TrainerState copy = state;
  copy.log_history.push_back({{"step", 1501}, {"loss", 1.0}});
  EXPECT_EQ(copy.log_history.size(), want.size() + 1);
  EXPECT_EQ(state.log_history.size(), want.size());
  EXPECT_EQ(state.to_text(), text);
  copy = resumed;
  EXPECT_EQ(copy.to_text(), text);

  train::TrainerState empty;
  EXPECT_TRUE(empty.log_history.empty());
  EXPECT_EQ(nlohmann::json::parse(empty.to_text())["log_history"], nlohmann::json::array());
  EXPECT_THROW(empty.log_history.back(), Error);
}

// ---- Issue 38: step times, sharding configs, sizes, rotation, the best-model metric ----

namespace {

// Makes every evaluation and every save take `pause`, and records the logged step times.
class SlowEvaluationAndSave : public train::TrainerCallback {
 public:
  explicit SlowEvaluationAndSave(std::chrono::milliseconds pause) : pause_(pause) {}
  void on_log(const train::TrainingArguments&, train::TrainerState&, train::TrainerControl&,
              const nlohmann::json& logs) override {
    if (logs.contains("ms")) ms.emplace_back(logs["step"].get<int64_t>(), logs["ms"].get<double>());
  }
  void on_evaluate(const train::TrainingArguments&, train::TrainerState&, train::TrainerControl&,
                   const train::Metrics&) override {
    pause();
  }
  void on_save(const train::TrainingArguments&, train::TrainerState&, train::TrainerControl&,
               const fs::path&) override {
    pause();
  }
  std::vector<std::pair<int64_t, double>> ms;
  double paused_ms = 0;

 private:
  void pause() {
    std::this_thread::sleep_for(pause_);
    paused_ms += static_cast<double>(pause_.count());
  }
  std::chrono::milliseconds pause_;
};

}  // namespace

// Issue 38 item 16: the step after an evaluation or save was charged with it, and the step
// logged just before one (and the last step) got the time of no work at all (0.03 ms).
// Checked without timing thresholds: the logged times add up to no more than the run's wall
// time less the pauses (however loaded the machine), and no step is reported as a fraction
// of the fastest ordinary step (every step does the same work).
TEST(TrainerChecks, LoggedStepTimesExcludeEvaluationsAndSaves) {
  const fs::path dir = scratch("timing");
  const data::TokenFile tokens = token_stream(dir);
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 12, args.eval_steps = 4, args.save_steps = 4;
  auto model = tiny_gpt();
  train::Trainer trainer(args, *model, tokens, tokens);
  auto recorder = std::make_shared<SlowEvaluationAndSave>(std::chrono::milliseconds(200));
  trainer.add_callback(recorder);
  const auto start = std::chrono::steady_clock::now();
  trainer.train();
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(recorder->ms.size(), 12u);
  ASSERT_EQ(recorder->paused_ms, 6 * 200.0);  // evaluations and saves at steps 4, 8, 12
  double logged_ms = 0, fastest_ordinary = 1e300;
  for (const auto& [step, ms] : recorder->ms) {
    logged_ms += ms;
    if (step % 4 != 0 && step % 4 != 1) fastest_ordinary = std::min(fastest_ordinary, ms);
  }
  EXPECT_LE(logged_ms, wall_ms - recorder->paused_ms) << "wall " << wall_ms << " ms";
  for (const auto& [step, ms] : recorder->ms)
    EXPECT_GT(ms, fastest_ordinary / 4) << "step " << step << ": " << ms << " ms";
}

// Issue 38 item 11: a DeepSpeed file and FSDP words are two sharding plans.
TEST(TrainerChecks, DeepSpeedTogetherWithFsdpIsRefusedAsTwoShardingConfigs) {
  const fs::path dir = scratch("two_shardings");
  std::ofstream(dir / "ds.json") << R"({"zero_optimization": {"stage": 1}})";
  train::TrainingArguments args = tiny_args(dir);
  train::apply_config_values(args, {{"deepspeed", (dir / "ds.json").string()}, {"fsdp", "FULL_SHARD"}},
                             "command line");
  try {
    train::apply_sharding_config(args);
    FAIL() << "accepted both, zero_stage " << args.zero_stage;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("two sharding configs"), std::string::npos) << what;
    EXPECT_NE(what.find("FULL_SHARD"), std::string::npos) << what;
    EXPECT_NE(what.find("ds.json"), std::string::npos) << what;
  }
}

// Issue 38 item 13: numbers whose products overflow, or beyond int64, are refused naming them.
TEST(TrainerChecks, SizesWhoseProductsOverflowAreRefusedNamingTheKey) {
  const fs::path dir = scratch("overflow");
  auto refused = [&](const nlohmann::json& values, const std::string& key) {
    train::TrainingArguments args = tiny_args(dir);
    try {
      train::apply_config_values(args, values, "config 'c.json'");
      train::validate(args);
      ADD_FAILURE() << values.dump() << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  refused({{"batch", int64_t(1) << 40}, {"seq", 1 << 20}}, "batch");
  refused({{"batch", 4}, {"seq", 16}, {"grad_accum", INT64_MAX / 2}}, "batch");
  refused({{"max_steps", nlohmann::json::parse("18446744073709551615")}}, "out of range");
  refused({{"max_steps", int64_t(1) << 60}}, "max_steps");
  refused({{"max_steps", -1}}, "num_train_epochs");
  train::TrainingArguments fine = tiny_args(dir);
  train::apply_config_values(fine, {{"max_steps", -1}, {"num_train_epochs", 1.0}}, "config 'c.json'");
  train::validate(fine);
  EXPECT_EQ(fine.total_steps(7), 7);
  fine.num_train_epochs = 1e300;
  EXPECT_THROW(fine.total_steps(7), Error);
  EXPECT_EQ(tiny_args(dir).total_steps(7), train::kDefaultMaxSteps);
}

// Small finding: a checkpoint-N/ a killed rotation left without its checksums stayed forever.
TEST(TrainerChecks, RotationRemovesACheckpointHalfDeletedByAKilledRotation) {
  const fs::path run = scratch("half_deleted");
  for (int step : {1, 2, 3}) {
    const fs::path d = run / train::checkpoint_name(step);
    fs::create_directories(d);
    tessera::write_file_atomically(d / "model.safetensors", "x");
    tessera::write_folder_checksums(d);
  }
  fs::remove(run / "checkpoint-1" / tessera::kFolderChecksumFile);  // the rotation was killed here
  train::rotate_checkpoints(run, 3, "");
  EXPECT_FALSE(fs::exists(run / "checkpoint-1"));
  EXPECT_TRUE(fs::exists(run / "checkpoint-2"));
  EXPECT_TRUE(fs::exists(run / "checkpoint-3"));
}

// Issue 38 item 4: a metric the evaluation does not return is refused up front, naming
// those it does; Hugging Face's names (eval_loss) are the same metrics.
TEST(TrainerChecks, MetricForBestModelIsCheckedAgainstTheEvaluationsMetrics) {
  const fs::path dir = scratch("metric");
  for (const char* name : {"eval_loss", "loss", "val_loss", "eval_accuracy", "perplexity"}) {
    train::TrainingArguments args = tiny_args(dir);
    train::apply_config_values(args, {{"metric_for_best_model", name}}, "config 'c.yaml'");
    EXPECT_NO_THROW(train::check_metric_for_best_model(args, train::language_model_metrics)) << name;
  }
  train::TrainingArguments args = tiny_args(dir);
  train::apply_config_values(args, {{"metric_for_best_model", "eval_bleu"}}, "config 'c.yaml'");
  try {
    train::check_metric_for_best_model(args, train::language_model_metrics);
    FAIL() << "eval_bleu accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("eval_bleu"), std::string::npos) << what;
    EXPECT_NE(what.find("eval_loss, eval_accuracy, eval_perplexity"), std::string::npos) << what;
  }
}

// Issue 40 item 6: logs use transformers' names now (learning_rate, eval_loss); a checkpoint
// of an older run, whose history says lr and val_loss and whose metric is val_loss, resumes,
// keeps its history as written and tracks the best by eval_loss.
TEST(Trainer, ACheckpointWithTheOldLogKeysResumes) {
  const fs::path dir = scratch("old_keys");
  const data::TokenFile tokens = token_stream(dir);
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 6, args.eval_steps = 2, args.save_steps = 2;
  train::apply_config_values(args, {{"metric_for_best_model", "val_loss"}}, "config 'old.yaml'");
  EXPECT_EQ(args.metric_for_best_model, "eval_loss");
  {
    auto model = tiny_gpt();
    train::TrainingArguments first = args;
    first.max_steps = 2;
    train::Trainer(first, *model, tokens, tokens).train();
  }
  const fs::path checkpoint = fs::path(args.output_dir) / "checkpoint-2";
  nlohmann::json state =
      nlohmann::json::parse(tessera::read_file(checkpoint / train::kTrainerStateFile));
  for (auto& entry : state["log_history"]) {
    if (entry.contains("learning_rate")) entry["lr"] = entry["learning_rate"], entry.erase("learning_rate");
    for (const char* key : {"loss", "perplexity", "accuracy"})
      if (entry.contains(std::string("eval_") + key)) {
        entry[std::string("val_") + (std::string(key) == "accuracy" ? "token_accuracy" : key)] =
            entry[std::string("eval_") + key];
        entry.erase(std::string("eval_") + key);
      }
    entry.erase("epoch");
  }
  tessera::write_file_atomically(checkpoint / train::kTrainerStateFile, state.dump(2));
  tessera::write_folder_checksums(checkpoint);

  args.resume_from_checkpoint = checkpoint.string();
  auto model = tiny_gpt();
  train::Trainer trainer(args, *model, tokens, tokens);
  trainer.train();
  EXPECT_EQ(trainer.state().global_step, 6);
  std::vector<std::string> keys;
  trainer.state().log_history.for_each([&](const nlohmann::json& j) {
    keys.push_back(j.contains("lr") ? "lr" : j.contains("val_loss") ? "val_loss"
                                         : j.contains("eval_loss") ? "eval_loss" : "learning_rate");
  });
  // Steps 1-2 and the evaluation at 2 as the old run wrote them, then the new names.
  EXPECT_EQ(keys, (std::vector<std::string>{"lr", "lr", "val_loss", "learning_rate", "learning_rate", "eval_loss",
                                            "learning_rate", "learning_rate", "eval_loss"}));
  EXPECT_GE(trainer.state().best_step, 2);
}
