// `tessera train --task classification`: fine-tunes the sequence classifier of an --init model
// directory (BERT, DistilBERT, GPT-2, Llama; a language model's or a bare body's directory
// gets a new head) on a JSONL/CSV/TSV file of labelled texts with train::Trainer, and writes
// the run folder as `tessera train` does: checkpoints, metrics.jsonl, model/ (save_pretrained,
// so transformers loads it) with the tokenizer of --init beside it.
//
// Labels: a config.json with num_labels / id2label (a classification config) decides them, and
// a label outside is refused naming the row. A config without them (a language model's, a bare
// BertModel's) takes them from the training labels: the sorted names of string labels, or
// LABEL_0 .. LABEL_{max id} for integer ids.
#include "tessera/cli/train_classification.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <type_traits>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/collator.h"
#include "tessera/dist/env.h"
#include "tessera/train/callbacks.h"
#include "tessera/train/run_folder.h"
#include "tessera/train/trainer.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;

// The labels a new head gets from the training data.
void take_labels_from(const data::ExampleDataset& train_set, ModelFacts& facts) {
  facts.num_labels = train_set.num_labels();
  facts.id2label = train_set.label_names();
  if (facts.id2label.empty())
    for (int64_t i = 0; i < *facts.num_labels; ++i) facts.id2label.push_back("LABEL_" + std::to_string(i));
}

// A copy of the --init directory's config.json with the labels (and the pad token the
// batches are padded with) written in, beside links to its other files: the directory
// load_sequence_classifier builds the model from. Removed with this object.
class LabelledInit {
 public:
  LabelledInit(const ModelFacts& facts, uint32_t pad_id)
      : dir_(fs::temp_directory_path() / ("tessera-init-" + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const auto& entry : fs::directory_iterator(facts.dir))
      if (entry.path().filename() != "config.json" && entry.is_regular_file())
        fs::create_symlink(fs::absolute(entry.path()), dir_ / entry.path().filename());
    std::ifstream in(fs::path(facts.dir) / "config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    config["num_labels"] = *facts.num_labels;
    nlohmann::json id2label = nlohmann::json::object(), label2id = nlohmann::json::object();
    for (size_t i = 0; i < facts.id2label.size(); ++i) {
      id2label[std::to_string(i)] = facts.id2label[i];
      label2id[facts.id2label[i]] = i;
    }
    config["id2label"] = id2label;
    config["label2id"] = label2id;
    if (!config.contains("pad_token_id") || config["pad_token_id"].is_null()) config["pad_token_id"] = pad_id;
    std::ofstream(dir_ / "config.json") << config.dump(2);
  }
  ~LabelledInit() {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  LabelledInit(const LabelledInit&) = delete;
  LabelledInit& operator=(const LabelledInit&) = delete;
  std::string dir() const { return dir_.string(); }

 private:
  fs::path dir_;
};

struct ClassificationRun {
  ModelFacts facts;
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::optional<data::ExampleDataset> train_set, val_set;
  std::unique_ptr<nn::SequenceClassifier> model;
  uint32_t pad_id = 0;
};

// Everything checked and loaded before the Trainer exists (so before any training work).
// A decoder reads each row at the token before its first pad (HF's rule), so a pad id that
// occurs in a text would cut it short: refused, naming the line.
void check_pad_not_in_texts(const data::ExampleDataset& set, const ModelFacts& facts, uint32_t pad_id) {
  if (facts.model_type != "gpt2" && facts.model_type != "llama") return;
  for (int64_t i = 0; i < set.size(); ++i)
    for (uint32_t id : set[i].input_ids)
      TESSERA_CHECK(id != pad_id, "data file '", set.source().string(), "' line ", set.source_line(i),
                    ": the text holds the pad token id ", pad_id, ", which ends a ", facts.model_type,
                    " row early; choose a pad_token_id that no text uses");
}

ClassificationRun load_run(const train::TrainingArguments& args, const TaskSettings& settings) {
  const ClassificationColumns& columns = settings.columns;
  TESSERA_CHECK(!args.init.empty(), "tessera train --task classification: --init must name the model "
                                    "directory to fine-tune (config.json, model.safetensors and its tokenizer)");
  ClassificationRun run;
  run.facts = read_model_facts(args.init);
  const bool pad_from_settings = !run.facts.pad_token_id && settings.pad_token_id;
  if (pad_from_settings) run.facts.pad_token_id = settings.pad_token_id;
  run.tokenizer = load_model_tokenizer(run.facts);
  run.pad_id = padding_id(*run.tokenizer, run.facts);
  const bool labels_from_data = !run.facts.num_labels.has_value();
  run.train_set.emplace(load_classification_data(args.data, *run.tokenizer, run.facts, columns, true,
                                                 run.facts.num_labels.value_or(0), run.facts.id2label));
  TESSERA_CHECK(run.train_set->size() > 0, "tessera train: training file '", args.data, "' holds no examples");
  if (labels_from_data) take_labels_from(*run.train_set, run.facts);
  // A resumed run's head has the checkpoint's classes: the training file must still name them.
  if (settings.id2label && *settings.id2label != run.facts.id2label)
    TESSERA_FAIL("tessera train --resume: the labels are now ", nlohmann::json(run.facts.id2label).dump(),
                 " (from ", labels_from_data ? "'" + args.data + "'" : "'" + args.init + "/config.json'",
                 ") but the run being resumed (", args.resume_from_checkpoint, ") trained ",
                 nlohmann::json(*settings.id2label).dump(), "; resume with the same data and --init");
  if (!args.val_data.empty())
    run.val_set.emplace(load_classification_data(args.val_data, *run.tokenizer, run.facts, columns, true,
                                                 *run.facts.num_labels, run.facts.id2label));
  check_pad_not_in_texts(*run.train_set, run.facts, run.pad_id);
  if (run.val_set) check_pad_not_in_texts(*run.val_set, run.facts, run.pad_id);
  const Device device = Device::parse(args.device);
  if (labels_from_data || pad_from_settings) {
    const LabelledInit init(run.facts, run.pad_id);
    run.model = nn::load_sequence_classifier(init.dir(), {.device = device});
  } else {
    run.model = nn::load_sequence_classifier(args.init, {.device = device});
  }
  return run;
}

void print_setup(const ClassificationRun& run, const train::Trainer& trainer, const train::TrainingArguments& args) {
  const auto& fresh = run.model->newly_initialized_keys();
  if (!fresh.empty()) {
    std::string names;
    for (const std::string& key : fresh) names += (names.empty() ? "" : ", ") + key;
    std::printf("note: newly initialized (not in '%s'): %s; a new classification head to train\n",
                args.init.c_str(), names.c_str());
  }
  std::printf("model: %s (%lld parameters, %lld labels) on %s\ndata: %lld training examples%s, %lld per step\n",
              run.model->type_name().c_str(), (long long)run.model->num_parameters(),
              (long long)*run.facts.num_labels, trainer.device().str().c_str(), (long long)run.train_set->size(),
              run.val_set ? (", " + std::to_string(run.val_set->size()) + " validation").c_str() : "",
              (long long)trainer.tokens_per_step());
  std::fflush(stdout);
}

template <class T>
T typed_value(const nlohmann::json& value, const std::string& key, const std::string& source) {
  try {
    return value.get<T>();
  } catch (const nlohmann::json::exception&) {
    TESSERA_FAIL(source, ": ", key, " must be ", std::is_same_v<T, bool> ? "true or false" :
                 std::is_integral_v<T> ? "an integer" : "text", ", got ", value.dump());
  }
}

// task_settings.json: the settings as take_task_settings reads them, and the labels.
nlohmann::json task_settings_json(const TaskSettings& settings, const ModelFacts& facts) {
  const ClassificationColumns& c = settings.columns;
  return {{"task", "classification"},
          {"text_column", c.text_column},
          {"text_pair_column", c.text_pair_column},
          {"label_column", c.label_column},
          {"max_length", c.max_length},
          {"truncation", c.truncation},
          {"pad_token_id", settings.pad_token_id ? nlohmann::json(*settings.pad_token_id) : nlohmann::json()},
          {"id2label", facts.id2label}};
}

}  // namespace

TaskSettings settings_for_run(const TaskSettings& requested, const train::TrainingArguments& args) {
  if (args.resume_from_checkpoint.empty()) return requested;
  const fs::path path = fs::path(args.resume_from_checkpoint) / kTaskSettingsFile;
  if (!fs::exists(path)) {
    TESSERA_CHECK(requested.task == Task::CausalLM, "tessera train --resume: checkpoint '",
                  args.resume_from_checkpoint, "' was written by a causal_lm run (it has no ", kTaskSettingsFile,
                  "), not by --task classification; start a new run, or resume it without the classification "
                  "settings");
    return requested;
  }
  nlohmann::json saved;
  try {
    saved = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(path.string(), ": not valid JSON: ", e.what());
  }
  TESSERA_CHECK(saved.is_object() && saved.value("task", "") == "classification", path.string(),
                ": expected {\"task\": \"classification\", ...}, got ", saved.dump());
  // The saved values as one more layer under the requested ones, read with the same rules.
  std::vector<train::ArgumentLayer> layers{{saved, path.string()}};
  layers[0].values.erase("id2label");
  if (layers[0].values["pad_token_id"].is_null()) layers[0].values.erase("pad_token_id");
  TaskSettings resumed = take_task_settings(layers);
  const nlohmann::json was = task_settings_json(resumed, {}), now = task_settings_json(requested, {});
  for (const std::string& key : requested.given)
    TESSERA_CHECK(key == "task" ? requested.task == Task::Classification : now[key] == was[key],
                  "tessera train --resume: ", key, " is ", key == "task" ? "\"causal_lm\"" : now[key].dump(),
                  " but the run being resumed (", args.resume_from_checkpoint, ") has ", was[key].dump(),
                  "; leave it out to resume, or start a new run");
  try {
    resumed.id2label = saved.at("id2label").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception&) {
    TESSERA_FAIL(path.string(), ": id2label must be a list of label names, got ", saved.value("id2label", nlohmann::json()).dump());
  }
  resumed.given.clear();
  return resumed;
}

TaskSettings take_task_settings(std::vector<train::ArgumentLayer>& layers) {
  TaskSettings settings;
  std::string column_source;  // the first layer that set a classification key, for errors
  for (train::ArgumentLayer& layer : layers) {
    if (!layer.values.is_object()) continue;
    nlohmann::json& v = layer.values;
    const auto take = [&](const char* key, auto& field) {
      if (!v.contains(key)) return;
      field = typed_value<std::decay_t<decltype(field)>>(v[key], key, layer.source);
      v.erase(key);
      settings.given.insert(std::string(key) == "max_seq_length" ? "max_length" : key);
      if (std::string(key) != "task" && column_source.empty()) column_source = layer.source + " key " + key;
    };
    std::string task;
    take("task", task);
    if (!task.empty()) settings.task = parse_task(task, "tessera train (" + layer.source + ")");
    take("text_column", settings.columns.text_column);
    take("text_pair_column", settings.columns.text_pair_column);
    take("label_column", settings.columns.label_column);
    take("max_seq_length", settings.columns.max_length);
    take("max_length", settings.columns.max_length);
    take("truncation", settings.columns.truncation);
    int64_t pad = -1;
    take("pad_token_id", pad);
    if (pad != -1) settings.pad_token_id = pad;
  }
  TESSERA_CHECK(settings.task == Task::Classification || column_source.empty(), "tessera train: ", column_source,
                " applies to --task classification only (this run trains a causal_lm)");
  return settings;
}

int run_classification_training(const train::TrainingArguments& args, const TaskSettings& settings) {
  ClassificationRun run = load_run(args, settings);
  std::shared_ptr<train::RunFolderLock> folder_lock;
  if (dist::read_dist_env().rank == 0) folder_lock = train::claim_run_folder(args);
  const std::map<std::string, std::string> tokenizer_files = run.tokenizer->files();
  std::map<std::string, std::string> checkpoint_files = tokenizer_files;
  checkpoint_files[kTaskSettingsFile] = task_settings_json(settings, run.facts).dump(2);
  data::PaddingOptions padding;
  padding.pad_token_id = run.pad_id;
  train::Trainer trainer(args, *run.model, std::move(*run.train_set), std::move(run.val_set),
                         data::DataCollatorWithPadding(padding), {}, checkpoint_files);
  const bool main_process = trainer.accelerator().is_main_process();
  if (args.early_stopping_patience > 0)
    trainer.add_callback(
        std::make_shared<train::EarlyStoppingCallback>(args.early_stopping_patience, args.early_stopping_threshold));
  if (main_process) {
    trainer.add_callback(std::make_shared<train::TrackerCallback>());
    trainer.add_callback(std::make_shared<train::ProgressCallback>());
    trainer.add_callback(std::make_shared<train::LossPlotCallback>());
    fs::create_directories(args.output_dir);
    write_file_atomically(fs::path(args.output_dir) / "config.train.json", args.to_json().dump(2));
    print_setup(run, trainer, args);
  }
  trainer.train();
  trainer.accelerator().wait_for_everyone();
  if (trainer.preempted_by()) return train::kPreemptedExitStatus;
  // Every process writes its part (under ZeRO-3 no process holds the whole weights).
  const fs::path model_dir = fs::path(args.output_dir) / "model";
  trainer.accelerator().save_model(*run.model, model_dir.string());
  if (!main_process) return 0;
  run.model->save_config((model_dir / "config.json").string());
  for (const auto& [name, contents] : tokenizer_files)
    write_file_atomically(model_dir / name, contents);
  std::printf("done: %lld steps; model in %s, metrics in %s\n", (long long)trainer.state().global_step,
              model_dir.string().c_str(), (fs::path(args.output_dir) / "metrics.jsonl").string().c_str());
  return 0;
}

}  // namespace tessera::cli
