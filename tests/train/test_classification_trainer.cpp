// The Trainer on the sequence-classification task: a tiny random BERT over a generated
// (text, label) JSON Lines file. Training lowers the loss; evaluate() and predict() give
// Hugging Face's keys and shapes; compute_metrics sees every example once, in dataset order;
// a resumed run equals the uninterrupted one bit for bit; bad data and a misspelt
// metric_for_best_model are refused before any step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "tessera/autograd/autograd.h"
#include "tessera/core/file_io.h"
#include "tessera/nn/bert.h"
#include "tessera/nn/classification.h"
#include "tessera/nn/distilbert.h"
#include "tessera/train/trainer.h"
#include "tests/dist/run_job.h"
#include "tests/train/classify_fixture.h"

namespace fs = std::filesystem;
using namespace tessera;

namespace {

using namespace tessera::test;

fs::path scratch(const std::string& name) {
  return test_jobs::fresh_scratch_folder("tessera_test_classify_" + name);
}

train::TrainingArguments tiny_args(const fs::path& dir) {
  train::TrainingArguments a;
  a.output_dir = (dir / "run").string();
  a.per_device_train_batch_size = 4;
  a.per_device_eval_batch_size = 4;
  a.learning_rate = 5e-3;
  a.weight_decay = 0;
  a.lr_scheduler_type = "constant";
  a.max_steps = 10;
  a.eval_strategy = "no", a.save_strategy = "no";
  a.report_to = {"none"};
  return a;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The logits of example i alone (no padding), in f64, as an independent reference.
std::vector<double> logits_alone(nn::BertForSequenceClassification& model, const data::ExampleDataset& d,
                                 int64_t i) {
  autograd::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const data::Example e = d[i];
  std::vector<int64_t> ids(e.input_ids.begin(), e.input_ids.end());
  const Tensor logits = model.logits(from_vector(ids, {1, static_cast<int64_t>(ids.size())}, {.dtype = DType::i64}));
  model.train(was_training);
  return logits.to(DType::f64).to_vector<double>();
}

}  // namespace

TEST(ClassificationTrainer, TrainingLowersTheLossAndLogsUseTransformersNames) {
  const fs::path dir = scratch("loss");
  const data::ExampleDataset train_set = load(write_rows(dir / "train.jsonl", 32, 1));
  auto model = tiny_bert();
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 40, args.learning_rate = 2e-2;
  train::Trainer trainer(args, *model, train_set, std::nullopt, padding_collator());
  trainer.train();
  std::vector<double> losses;
  std::vector<double> epochs;
  trainer.state().log_history.for_each([&](const nlohmann::json& j) {
    for (const char* key : {"step", "epoch", "loss", "learning_rate", "grad_norm"})
      EXPECT_TRUE(j.contains(key)) << key << " in " << j.dump();
    EXPECT_FALSE(j.contains("lr")) << j.dump();
    losses.push_back(j["loss"].get<double>());
    epochs.push_back(j["epoch"].get<double>());
  });
  ASSERT_EQ(losses.size(), 40u);
  const double first = (losses[0] + losses[1] + losses[2]) / 3, last = (losses[37] + losses[38] + losses[39]) / 3;
  EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
  // 32 rows in batches of 4: 8 steps an epoch, the epoch fractional as transformers logs it.
  EXPECT_EQ(trainer.state().steps_per_epoch, 8);
  EXPECT_DOUBLE_EQ(epochs[2], 3.0 / 8.0);
  EXPECT_DOUBLE_EQ(epochs.back(), 5.0);
}

// The WordPiece batches carry token_type_ids (BERT's segments). As transformers' Trainer drops
// the columns a model's forward does not take, DistilBERT, GPT-2 and Llama heads train on them,
// and predict() gives the logits of the model called without them; called directly with
// token_type_ids, those models still refuse them.
TEST(ClassificationTrainer, ModelsWithoutSegmentsTrainOnBatchesThatCarryTokenTypes) {
  const fs::path dir = scratch("segments");
  const data::ExampleDataset train_set = load(write_rows(dir / "train.jsonl", 24, 4));
  ASSERT_FALSE(train_set[0].token_type_ids.empty()) << "the batches must carry token types";
  const int64_t vocab = static_cast<int64_t>(kVocab.size());
  nn::SequenceClassificationConfig labels;
  labels.num_labels = kClasses;
  Generator gen(9);
  nn::DistilBertConfig d;
  d.vocab_size = vocab, d.max_position_embeddings = 16, d.n_layers = 1, d.n_heads = 2, d.dim = 16;
  d.hidden_dim = 24, d.dropout = d.attention_dropout = d.seq_classif_dropout = 0, d.labels = labels;
  nn::GPTConfig g{.vocab_size = vocab, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16};
  nn::LlamaConfig l;
  l.vocab_size = vocab, l.hidden_size = 16, l.intermediate_size = 24, l.num_hidden_layers = 1;
  l.num_attention_heads = 2, l.num_key_value_heads = 1, l.max_position_embeddings = 16;
  std::vector<std::unique_ptr<nn::SequenceClassifier>> models;
  models.push_back(std::make_unique<nn::DistilBertForSequenceClassification>(d, &gen));
  models.push_back(std::make_unique<nn::GPT2ForSequenceClassification>(g, labels, 0, &gen));
  models.push_back(std::make_unique<nn::LlamaForSequenceClassification>(l, labels, 0, &gen));
  for (auto& model : models) {
    SCOPED_TRACE(model->type_name());
    train::TrainingArguments args = tiny_args(dir / model->type_name());
    args.max_steps = 36, args.learning_rate = 1e-2;
    train::Trainer trainer(args, *model, train_set, std::nullopt, padding_collator());
    trainer.train();
    std::vector<double> losses;
    trainer.state().log_history.for_each([&](const nlohmann::json& j) { losses.push_back(j["loss"].get<double>()); });
    ASSERT_EQ(losses.size(), 36u);
    const double first = std::accumulate(losses.begin(), losses.begin() + 6, 0.0);
    EXPECT_LT(std::accumulate(losses.end() - 6, losses.end(), 0.0), 0.85 * first);
    const std::vector<float> predicted = trainer.predict(train_set).predictions.to(DType::f32).to_vector<float>();
    const data::Example e = train_set[5];
    std::vector<int64_t> ids(e.input_ids.begin(), e.input_ids.end());
    const Tensor one = from_vector(ids, {1, static_cast<int64_t>(ids.size())}, {.dtype = DType::i64});
    autograd::NoGradGuard no_grad;
    model->eval();
    const std::vector<float> alone = model->logits(one).to(DType::f32).to_vector<float>();
    for (int64_t c = 0; c < kClasses; ++c)
      EXPECT_NEAR(predicted[5 * kClasses + c], alone[c], 1e-5) << c;
    const Tensor types = from_vector(std::vector<int64_t>(ids.size(), 0), one.shape(), {.dtype = DType::i64});
    EXPECT_THROW(model->logits(one, Tensor(), types), Error);
  }
}

TEST(ClassificationTrainer, EvaluateAndPredictGiveTransformersKeysAndShapes) {
  const fs::path dir = scratch("keys");
  const data::ExampleDataset train_set = load(write_rows(dir / "train.jsonl", 16, 2));
  const data::ExampleDataset eval_set = load(write_rows(dir / "eval.jsonl", 13, 3));
  auto model = tiny_bert();
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 4, args.eval_strategy = "steps", args.eval_steps = 2;
  train::Trainer trainer(args, *model, train_set, eval_set, padding_collator());
  trainer.train();
  const train::Metrics m = trainer.evaluate();
  for (const char* key : {"eval_loss", "eval_accuracy", "eval_f1", "eval_precision", "eval_recall",
                          "eval_f1_micro", "eval_f1_weighted", "eval_runtime", "eval_samples_per_second",
                          "eval_steps_per_second"})
    EXPECT_TRUE(m.count(key)) << key;
  EXPECT_EQ(m.size(), 10u);
  // The history's evaluations hold the metrics but not the wall-clock figures.
  int evaluations = 0;
  trainer.state().log_history.for_each([&](const nlohmann::json& j) {
    if (!j.contains("eval_loss")) return;
    ++evaluations;
    EXPECT_TRUE(j.contains("eval_f1")) << j.dump();
    EXPECT_TRUE(j.contains("epoch")) << j.dump();
    EXPECT_FALSE(j.contains("eval_runtime")) << j.dump();
  });
  EXPECT_EQ(evaluations, 2);  // steps 2 and 4

  const train::PredictionOutput p = trainer.predict(eval_set);
  EXPECT_EQ(p.predictions.shape(), (Shape{13, kClasses}));
  EXPECT_EQ(p.label_ids.shape(), (Shape{13}));
  EXPECT_NEAR(p.metrics.at("test_loss"), m.at("eval_loss"), 1e-12);
  EXPECT_NEAR(p.metrics.at("test_accuracy"), m.at("eval_accuracy"), 1e-12);
  EXPECT_TRUE(p.metrics.count("test_runtime"));
  // eval_loss is the mean cross-entropy of the predictions, in f64 here.
  const std::vector<float> logits = p.predictions.to_vector<float>();
  const std::vector<int64_t> labels = p.label_ids.to_vector<int64_t>();
  double loss = 0;
  for (int64_t i = 0; i < 13; ++i) {
    double norm = 0;
    for (int64_t c = 0; c < kClasses; ++c) norm += std::exp(double(logits[i * kClasses + c]));
    loss += std::log(norm) - double(logits[i * kClasses + labels[i]]);
  }
  EXPECT_NEAR(m.at("eval_loss"), loss / 13, 1e-6);
}

TEST(ClassificationTrainer, ComputeMetricsGetsEveryExampleOnceInDatasetOrder) {
  const fs::path dir = scratch("order");
  const data::ExampleDataset train_set = load(write_rows(dir / "train.jsonl", 8, 4));
  const data::ExampleDataset eval_set = load(write_rows(dir / "eval.jsonl", 11, 5));  // 11 = 2 × 4 + 3
  auto model = tiny_bert();
  std::vector<train::EvalPrediction> seen;
  auto capture = [&](const train::EvalPrediction& p) {
    seen.push_back(p);
    return train::Metrics{{"rows", double(p.size())}};
  };
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = 2, args.eval_strategy = "steps", args.metric_for_best_model = "rows";
  train::Trainer trainer(args, *model, train_set, eval_set, padding_collator(), capture);
  ASSERT_EQ(seen.size(), 1u) << "called once on a synthetic prediction to learn its names";
  EXPECT_EQ(seen[0].num_labels(), kClasses);
  trainer.train();  // evaluates at the end
  ASSERT_EQ(seen.size(), 2u);
  const train::EvalPrediction& p = seen.back();
  ASSERT_EQ(p.predictions.shape(), (Shape{11, kClasses}));
  const std::vector<double> got = p.predictions_f64();
  const std::vector<int64_t> labels = p.label_ids_vector();
  for (int64_t i = 0; i < 11; ++i) {
    EXPECT_EQ(labels[i], std::get<int64_t>(eval_set[i].label)) << "row " << i;
    const std::vector<double> want = logits_alone(*model, eval_set, i);
    for (int64_t c = 0; c < kClasses; ++c) EXPECT_NEAR(got[i * kClasses + c], want[c], 1e-5) << i << "," << c;
  }
}

// Checkpoint at step 6 (mid-epoch: 20 rows, batch 4, 2 micro-batches a step = 3 steps an
// epoch, micro-batch 12 is batch 2 of epoch 2), with dropout: the resumed run's weights and
// history equal the uninterrupted run's bit for bit.
TEST(ClassificationTrainer, ResumeFromAMidRunCheckpointEqualsTheUninterruptedRunBitForBit) {
  const fs::path dir = scratch("resume");
  const data::ExampleDataset train_set = load(write_rows(dir / "train.jsonl", 20, 6));
  const data::ExampleDataset eval_set = load(write_rows(dir / "eval.jsonl", 7, 7));
  auto run = [&](const std::string& name, int64_t steps, const std::string& resume) {
    train::TrainingArguments args = tiny_args(dir);
    args.output_dir = (dir / name).string();
    args.gradient_accumulation_steps = 2, args.max_steps = steps;
    args.save_strategy = "steps", args.save_steps = 6, args.eval_strategy = "steps", args.eval_steps = 6;
    args.resume_from_checkpoint = resume;
    auto model = tiny_bert(0.1);
    train::Trainer trainer(args, *model, train_set, eval_set, padding_collator());
    EXPECT_EQ(trainer.state().steps_per_epoch, 3);
    trainer.train();
    std::vector<std::string> history;
    trainer.state().log_history.for_each([&](const nlohmann::json& j) { history.push_back(j.dump()); });
    return history;
  };
  const auto whole = run("whole", 12, "");
  run("split", 6, "");
  const auto resumed = run("split", 12, (dir / "split" / "checkpoint-6").string());
  EXPECT_EQ(resumed, whole);
  const std::string a = slurp(dir / "whole" / "checkpoint-12" / "model.safetensors");
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(slurp(dir / "split" / "checkpoint-12" / "model.safetensors") == a) << "the weights differ";
  EXPECT_TRUE(fs::exists(dir / "whole" / "checkpoint-12" / "config.json"));
}

TEST(ClassificationTrainer, NumTrainEpochsSetsTheStepsAsTransformersCeil) {
  const fs::path dir = scratch("epochs");
  const data::ExampleDataset train_set = load(write_rows(dir / "train.jsonl", 18, 8));  // 5 batches of 4
  auto model = tiny_bert();
  train::TrainingArguments args = tiny_args(dir);
  args.max_steps = -1, args.num_train_epochs = 2, args.gradient_accumulation_steps = 2;
  train::Trainer trainer(args, *model, train_set, std::nullopt, padding_collator());
  EXPECT_EQ(trainer.state().steps_per_epoch, 3);  // ceil(5 / 2)
  trainer.train();
  EXPECT_EQ(trainer.state().global_step, 6);
}

TEST(ClassificationTrainer, MetricForBestModelIsRefusedBeforeAnyStepNamingTheMetrics) {
  const fs::path dir = scratch("metric");
  const data::ExampleDataset train_set = load(write_rows(dir / "train.jsonl", 8, 9));
  auto model = tiny_bert();
  train::TrainingArguments args = tiny_args(dir);
  args.eval_strategy = "steps";
  train::apply_config_values(args, {{"metric_for_best_model", "bleu"}}, "config 'c.yaml'");
  try {
    train::Trainer trainer(args, *model, train_set, train_set, padding_collator());
    FAIL() << "bleu accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("eval_bleu"), std::string::npos) << what;
    EXPECT_NE(what.find("eval_loss, eval_accuracy, eval_f1, eval_precision, eval_recall, eval_f1_micro, "
                        "eval_f1_weighted"),
              std::string::npos)
        << what;
  }
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoint-1"));
  // A user compute_metrics that throws is named.
  train::TrainingArguments plain = tiny_args(dir);
  plain.eval_strategy = "steps";
  auto broken = [](const train::EvalPrediction&) -> train::Metrics { throw std::runtime_error("boom"); };
  try {
    train::Trainer trainer(plain, *model, train_set, train_set, padding_collator(), broken);
    FAIL() << "a throwing compute_metrics accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("compute_metrics"), std::string::npos) << what;
    EXPECT_NE(what.find("boom"), std::string::npos) << what;
  }
}

TEST(ClassificationTrainer, BadDataIsRefusedBeforeAnyWorkNamingFileLineAndKey) {
  const fs::path dir = scratch("bad");
  auto model = tiny_bert();
  const train::TrainingArguments args = tiny_args(dir);
  auto refusal = [&](const data::ExampleDataset& d) {
    try {
      train::Trainer trainer(args, *model, d, std::nullopt, padding_collator());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  // Class 5 with the model's 3 classes (the dataset itself was told num_labels 6).
  {
    const fs::path file = write_rows(dir / "labels.jsonl", 9, 10, /*override_row=*/4, /*label=*/5);
    data::ExampleDatasetOptions o;
    o.num_labels = 6, o.use_cache = false;
    const std::string what = refusal(data::ExampleDataset::load(file, tokenizer(), o));
    for (const char* part : {"labels.jsonl", "line 5", "\"label\"", "num_labels 3"})
      EXPECT_NE(what.find(part), std::string::npos) << part << " in: " << what;
  }
  // 30 words without truncation, past the model's 16 positions.
  {
    const fs::path file = write_rows(dir / "long.jsonl", 6, 11, /*override_row=*/2, 0, /*extra_words=*/30);
    const std::string what = refusal(load(file, /*truncation=*/false));
    for (const char* part : {"long.jsonl", "line 3", "\"text\"", "16 positions", "truncation"})
      EXPECT_NE(what.find(part), std::string::npos) << part << " in: " << what;
  }
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoint-10"));
}
