// `tessera train --task classification`, `tessera eval --task classification` and `tessera
// predict` on a tiny BERT made here and a generated three-topic data set: eval's metrics
// against float64 recomputations from predict's logits, two ranks against one, and each bad
// input refused before any work, naming the file, the line or the key.
#include <cmath>
#include <fstream>
#include <random>
#include <set>

#include "tessera/core/random.h"
#include "tessera/data/wordpiece.h"
#include "tessera/nn/bert.h"
#include "tests/cli/cli_harness.h"

namespace tessera_cli_test {
namespace {

using Json = nlohmann::json;

const std::vector<std::vector<std::string>> kTopicWords = {
    {"apple", "pear", "plum", "grape", "melon"},
    {"red", "blue", "green", "amber", "violet"},
    {"run", "jump", "swim", "climb", "row"}};

std::vector<std::string> vocabulary() {
  std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "and"};
  for (const auto& words : kTopicWords) vocab.insert(vocab.end(), words.begin(), words.end());
  return vocab;
}

// `count` rows of 2..9 words, mostly of the row's topic (so a model can learn it), seeded.
void write_topics(const fs::path& path, int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::ofstream out(path);
  for (int i = 0; i < count; ++i) {
    const int label = static_cast<int>(rng() % kTopicWords.size());
    std::string text;
    for (int w = 0, n = 2 + static_cast<int>(rng() % 8); w < n; ++w) {
      const auto& words = rng() % 4 == 0 ? kTopicWords[rng() % kTopicWords.size()] : kTopicWords[label];
      text += (w ? " " : "") + words[rng() % words.size()];
    }
    out << Json{{"text", text}, {"label", label}}.dump() << "\n";
  }
}

// A seeded tiny BertForSequenceClassification with its tokenizer: 3 labels, 16 positions.
fs::path tiny_bert(const std::string& name, int64_t vocab_extra = 0, double dropout = 0) {
  const fs::path dir = scratch() / name;
  tessera::nn::BertConfig cfg;
  const auto vocab = vocabulary();
  cfg.vocab_size = static_cast<int64_t>(vocab.size()) + vocab_extra;
  cfg.hidden_size = 16;
  cfg.num_hidden_layers = 1;
  cfg.num_attention_heads = 2;
  cfg.intermediate_size = 24;
  cfg.max_position_embeddings = 16;
  cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout;
  cfg.labels.num_labels = 3;
  cfg.labels.id2label = {"fruit", "colour", "motion"};
  tessera::Generator gen(11);
  tessera::nn::BertForSequenceClassification(cfg, &gen).save_pretrained(dir.string());
  tessera::data::WordPieceTokenizer(tessera::data::WordPieceTokenizer::bert_config(vocab, true))
      .save_files(dir);
  return dir;
}

const fs::path& topics_file() {
  static const fs::path path = [] {
    const fs::path p = scratch() / "topics.jsonl";
    write_topics(p, 37, 5);  // odd: two ranks' last round is padded
    return p;
  }();
  return path;
}

Json last_json_line(const std::string& output) {
  const size_t start = output.rfind('{');
  EXPECT_NE(start, std::string::npos) << output;
  return Json::parse(output.substr(start == std::string::npos ? 0 : start));
}

std::vector<Json> read_jsonl(const fs::path& path) {
  std::vector<Json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) rows.push_back(Json::parse(line));
  return rows;
}

// The metrics in float64 from predicted rows and the file's labels: mean cross-entropy,
// accuracy and sklearn's macro precision/recall/F1.
Json reference_metrics(const std::vector<Json>& predictions, const std::vector<Json>& examples) {
  const size_t n = examples.size(), classes = 3;
  std::vector<double> tp(classes), predicted(classes), actual(classes);
  double loss = 0, correct = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto logits = predictions[i]["logits"].get<std::vector<double>>();
    const int label = examples[i]["label"].get<int>();
    const int guess = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    double sum = 0;
    for (double z : logits) sum += std::exp(z);
    loss += std::log(sum) - logits[label];
    correct += guess == label;
    ++predicted[guess];
    ++actual[label];
    tp[guess] += guess == label;
  }
  // Over every class (sklearn's labels=range(num_labels), zero_division=0).
  const double present = classes;
  double p = 0, r = 0, f = 0;
  for (size_t c = 0; c < classes; ++c) {
    const double pc = predicted[c] ? tp[c] / predicted[c] : 0, rc = actual[c] ? tp[c] / actual[c] : 0;
    p += pc;
    r += rc;
    f += pc + rc > 0 ? 2 * pc * rc / (pc + rc) : 0;
  }
  return {{"eval_loss", loss / n}, {"eval_accuracy", correct / n}, {"eval_precision", p / present},
          {"eval_recall", r / present}, {"eval_f1", f / present}};
}

TEST(CliClassification, EvalLineEqualsTheMetricsRecomputedFromPredictOutput) {
  const fs::path model = tiny_bert("eval_model");
  const fs::path preds = scratch() / "preds.jsonl";
  const auto predicted = run("predict --model " + model.string() + " --data " + topics_file().string() +
                             " --out " + preds.string());
  ASSERT_EQ(predicted.rc, 0) << predicted.output;
  const auto rows = read_jsonl(preds), examples = read_jsonl(topics_file());
  ASSERT_EQ(rows.size(), examples.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i]["index"], i);
    const std::set<std::string> names = {"fruit", "colour", "motion"};
    EXPECT_TRUE(names.count(rows[i]["label_name"].get<std::string>())) << rows[i];
    double sum = 0;
    for (double p : rows[i]["probabilities"]) sum += p;
    EXPECT_NEAR(sum, 1.0, 1e-9);
  }
  const auto evaluated = run("eval --task classification --model " + model.string() + " --data " +
                             topics_file().string() + " --batch 5");
  ASSERT_EQ(evaluated.rc, 0) << evaluated.output;
  const Json line = last_json_line(evaluated.output), expected = reference_metrics(rows, examples);
  for (const auto& [key, value] : expected.items())
    EXPECT_NEAR(line.at(key).get<double>(), value.get<double>(), 1e-6) << key;
  EXPECT_EQ(line.at("eval_samples"), 37);
}

TEST(CliClassification, TwoRanksPrintTheSameEvalLineAsOneProcess) {
  const fs::path model = tiny_bert("ranks_model");
  const std::string eval = " eval --task classification --model " + model.string() + " --data " +
                           topics_file().string() + " --batch 4";
  const auto one = run(eval);
  ASSERT_EQ(one.rc, 0) << one.output;
  const auto two = run("launch --nproc-per-node 2 " + tessera_binary() + eval);
  ASSERT_EQ(two.rc, 0) << two.output;
  const Json a = last_json_line(one.output), b = last_json_line(two.output);
  for (const char* key : {"eval_accuracy", "eval_f1", "eval_precision", "eval_recall", "eval_samples"})
    EXPECT_EQ(a.at(key), b.at(key)) << key;
  EXPECT_NEAR(a.at("eval_loss").get<double>(), b.at("eval_loss").get<double>(), 1e-6);
}

// Trains the tiny BERT on the topics (the same file as validation): the run's last evaluation
// equals `tessera eval` of model/, which loses less than the initial weights did, and model/
// carries the labels and the tokenizer.
TEST(CliClassification, TrainWritesAModelThatEvalAndPredictRead) {
  const fs::path init = tiny_bert("train_init"), out = scratch() / "train_run";
  const fs::path config = scratch() / "finetune.json";
  std::ofstream(config) << R"({"task": "classification", "num_train_epochs": 4, "per_device_train_batch_size": 8,
    "learning_rate": 0.01, "weight_decay": 0.01, "lr_scheduler_type": "linear", "eval_strategy": "epoch",
    "save_strategy": "no", "metric_for_best_model": "accuracy", "logging_steps": 5, "max_length": 16})";
  const std::string data = topics_file().string();
  const auto before = run("eval --task classification --model " + init.string() + " --data " + data);
  ASSERT_EQ(before.rc, 0) << before.output;
  const auto trained = run("train --config " + config.string() + " --init " + init.string() + " --data " + data +
                           " --val-data " + data + " --out " + out.string());
  ASSERT_EQ(trained.rc, 0) << trained.output;
  for (const char* file : {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json"})
    EXPECT_TRUE(fs::exists(out / "model" / file)) << file;
  std::ifstream config_in(out / "model" / "config.json");
  EXPECT_EQ(Json::parse(config_in)["id2label"]["1"], "colour");
  Json last_eval;
  for (const Json& row : read_jsonl(out / "metrics.jsonl"))
    if (row.contains("eval_accuracy")) last_eval = row;
  ASSERT_FALSE(last_eval.is_null());
  const auto after = run("eval --task classification --model " + (out / "model").string() + " --data " + data);
  ASSERT_EQ(after.rc, 0) << after.output;
  const Json a = last_json_line(after.output), b = last_json_line(before.output);
  for (const char* key : {"eval_accuracy", "eval_f1", "eval_precision", "eval_recall"})
    EXPECT_NEAR(a.at(key).get<double>(), last_eval.at(key).get<double>(), 1e-9) << key;
  EXPECT_NEAR(a.at("eval_loss").get<double>(), last_eval.at("eval_loss").get<double>(), 1e-4);
  EXPECT_LT(a.at("eval_loss").get<double>(), b.at("eval_loss").get<double>() - 0.05);
  const auto predicted = run("predict --model " + (out / "model").string() + " --data " + data);
  ASSERT_EQ(predicted.rc, 0) << predicted.output;
}

// Under ZeRO-3 no process holds the whole weights after training: the export streams them from
// every rank's slice (it read the freed parameters before), and what it wrote evaluates.
TEST(CliClassification, TwoRanksUnderZero3ExportAModelThatEvalReads) {
  const fs::path init = tiny_bert("zero3_init"), out = scratch() / "zero3_run";
  const fs::path config = scratch() / "zero3.json";
  std::ofstream(config) << R"({"task": "classification", "num_train_epochs": 1, "per_device_train_batch_size": 4,
    "zero_stage": 3, "eval_strategy": "no", "save_strategy": "no", "max_length": 16})";
  const std::string data = topics_file().string();
  const auto trained = run("launch --nproc-per-node 2 " + tessera_binary() + " train --config " + config.string() +
                           " --init " + init.string() + " --data " + data + " --out " + out.string());
  ASSERT_EQ(trained.rc, 0) << trained.output;
  const auto evaluated = run("eval --task classification --model " + (out / "model").string() + " --data " + data);
  ASSERT_EQ(evaluated.rc, 0) << evaluated.output;
  EXPECT_EQ(last_json_line(evaluated.output).at("eval_samples"), 37);
  EXPECT_NE(slurp(out / "model" / "model.safetensors"), slurp(init / "model.safetensors")) << "trained";
}

// The training rows of metrics.jsonl: (step, loss).
std::vector<std::pair<int64_t, double>> training_losses(const fs::path& run_dir) {
  std::vector<std::pair<int64_t, double>> losses;
  for (const Json& row : read_jsonl(run_dir / "metrics.jsonl"))
    if (row.contains("loss")) losses.emplace_back(row.at("step").get<int64_t>(), row.at("loss").get<double>());
  return losses;
}

// Six steps in one go against three, then `--resume` with nothing else: the task, columns and
// labels come from the checkpoint's task_settings.json; with dropout and a shuffled epoch
// boundary at step 5 (37 rows, batches of 8) every loss and the final weights are the same bits.
// A task setting given again with another value is refused, naming it, and the run is kept.
TEST(CliClassification, ResumeContinuesBitIdenticallyAndRefusesAChangedTaskSetting) {
  const fs::path init = tiny_bert("resume_init", 0, 0.1), config = scratch() / "resume.json";
  std::ofstream(config) << R"({"task": "classification", "per_device_train_batch_size": 8, "learning_rate": 0.01,
    "lr_scheduler_type": "constant", "save_strategy": "steps", "save_steps": 3, "eval_strategy": "no",
    "shuffle": true, "seed": 3, "max_length": 16, "logging_steps": 1, "text_column": "text"})";
  const fs::path whole = scratch() / "resume_whole", split = scratch() / "resume_split";
  const std::string common = "train --config " + config.string() + " --init " + init.string() + " --data " +
                             topics_file().string() + " --out ";
  auto r = run(common + whole.string() + " --steps 6");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("samples/s"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("tok/s"), std::string::npos) << r.output;
  ASSERT_EQ(run(common + split.string() + " --steps 3").rc, 0);
  EXPECT_TRUE(fs::exists(split / "checkpoint-3" / "task_settings.json"));
  r = run("train --resume " + split.string() + " --steps 6");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(training_losses(whole).size(), 6u);
  EXPECT_EQ(training_losses(whole), training_losses(split));
  EXPECT_EQ(slurp(whole / "model" / "model.safetensors"), slurp(split / "model" / "model.safetensors"));

  const std::string weights = slurp(split / "model" / "model.safetensors");
  r = run(common + split.string() + " --steps 9 --resume --text-column body");
  EXPECT_EQ(r.rc, 1) << r.output;
  for (const char* named : {"text_column", "\"body\"", "\"text\"", "checkpoint-6"})
    EXPECT_NE(r.output.find(named), std::string::npos) << named << "\n" << r.output;
  EXPECT_FALSE(fs::exists(split / "checkpoint-9"));
  EXPECT_EQ(slurp(split / "model" / "model.safetensors"), weights) << "the run is kept";
  r = run("train --task causal_lm --resume " + split.string() + " --steps 9");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("task is \"causal_lm\""), std::string::npos) << r.output;
}

TEST(CliClassification, TrainRefusesALabelOutsideNumLabelsBeforeAnyWork) {
  const fs::path init = tiny_bert("train_bad_init"), data = scratch() / "train_bad.jsonl";
  const fs::path out = scratch() / "train_bad_run";
  std::ofstream(data) << "{\"text\": \"red\", \"label\": 0}\n{\"text\": \"plum\", \"label\": 7}\n";
  const auto r = run("train --task classification --init " + init.string() + " --data " + data.string() +
                     " --out " + out.string());
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("train_bad.jsonl:2: label 7"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
}

TEST(CliClassification, ClassificationSettingsForACausalLmRunAreRefusedNamingTheKey) {
  const auto r = run("train --data x.bin --text-column body");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("text_column applies to --task classification only"), std::string::npos) << r.output;
}

// A bad input fails with status 1, the message naming what is wrong, and --out not written.
void expect_refused(const std::string& args, const std::vector<std::string>& named) {
  const fs::path out = scratch() / "refused.jsonl";
  fs::remove(out);
  const auto r = run("predict " + args + " --out " + out.string());
  EXPECT_EQ(r.rc, 1) << r.output;
  for (const std::string& text : named) EXPECT_NE(r.output.find(text), std::string::npos) << text << "\n" << r.output;
  EXPECT_FALSE(fs::exists(out));
}

TEST(CliClassification, ALabelOutsideNumLabelsIsRefusedNamingFileAndLine) {
  const fs::path model = tiny_bert("label_model"), data = scratch() / "bad_label.jsonl";
  std::ofstream(data) << "{\"text\": \"red blue\", \"label\": 1}\n{\"text\": \"apple\", \"label\": 3}\n";
  const auto r = run("eval --task classification --model " + model.string() + " --data " + data.string());
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("bad_label.jsonl:2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("label 3 in column 'label' is outside [0, 3)"), std::string::npos) << r.output;
}

TEST(CliClassification, AMissingColumnIsRefusedNamingTheColumn) {
  const fs::path model = tiny_bert("column_model");
  expect_refused("--model " + model.string() + " --data " + topics_file().string() + " --text-column body",
                 {"topics.jsonl", "body"});
}

TEST(CliClassification, ATextLongerThanThePositionsWithoutTruncationIsRefusedNamingTheLine) {
  const fs::path model = tiny_bert("long_model"), data = scratch() / "long.jsonl";
  std::string words;
  for (int i = 0; i < 20; ++i) words += " apple";  // 20 tokens + [CLS] [SEP] > 16 positions
  std::ofstream(data) << "{\"text\": \"red\"}\n{\"text\": \"" << words << "\"}\n";
  expect_refused("--model " + model.string() + " --data " + data.string() + " --truncation false",
                 {"long.jsonl' line 2", "22 tokens", "16 positions"});
  // With truncation (the default) the same file is scored.
  const auto r = run("predict --model " + model.string() + " --data " + data.string());
  EXPECT_EQ(r.rc, 0) << r.output;
}

TEST(CliClassification, ATokenizerLargerThanTheModelVocabularyIsRefused) {
  const fs::path model = tiny_bert("small_vocab_model", /*vocab_extra=*/-3);
  expect_refused("--model " + model.string() + " --data " + topics_file().string(),
                 {"small_vocab_model", "vocab_size"});
}

TEST(CliClassification, APadTokenIdOutsideTheVocabularyIsRefused) {
  const fs::path model = tiny_bert("pad_model");
  // A tokenizer without a pad token (GPT-2's byte-level kind): the config's pad_token_id pads.
  fs::remove(model / "tokenizer.json");
  fs::remove(model / "vocab.txt");
  tessera::data::ByteTokenizer().save_files(model);
  std::ifstream in(model / "config.json");
  Json config = Json::parse(in);
  in.close();
  config["vocab_size"] = 300;
  config["pad_token_id"] = 300;
  std::ofstream(model / "config.json") << config.dump();
  expect_refused("--model " + model.string() + " --data " + topics_file().string(),
                 {"pad_token_id 300", "vocab_size 300"});
}

}  // namespace
}  // namespace tessera_cli_test
