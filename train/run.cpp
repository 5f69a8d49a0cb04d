#include "tessera/train/run.h"

#include "tessera/core/memory_category.h"

#include <cstdio>
#include <iostream>
#include <sstream>
#include <tuple>

#include "tessera/core/deferred_init.h"
#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/core/random.h"
#include "tessera/dist/env.h"
#include "tessera/dist/parallelize.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"
#include "tessera/train/accelerator_options.h"
#include "tessera/train/checkpoint_files.h"
#include "tessera/train/model_dir.h"
#include "tessera/train/run_checks.h"
#include "tessera/train/run_folder.h"
#include "tessera/train/trainer.h"

namespace tessera::train {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

std::string absolute_path(const std::string& p) {
  return p.empty() ? p : fs::absolute(fs::path(p)).lexically_normal().string();
}

void make_paths_absolute(TrainingArguments& a) {
  for (std::string* p : {&a.data, &a.val_data, &a.init, &a.output_dir, &a.deepspeed}) *p = absolute_path(*p);
}

TrainingArguments apply_layers(TrainingArguments args, const std::vector<ArgumentLayer>& layers) {
  for (const ArgumentLayer& layer : layers) apply_config_values(args, layer.values, layer.source);
  make_paths_absolute(args);
  apply_sharding_config(args);
  return args;
}

// The run's settings as saved with a checkpoint (training_args.json, verified).
TrainingArguments saved_arguments(const fs::path& checkpoint) {
  const fs::path path = checkpoint / kTrainingArgsFile;
  Json saved;
  try {
    saved = Json::parse(read_file(path));
  } catch (const Json::exception& e) {
    TESSERA_FAIL("checkpoint '", checkpoint.string(), "': ", kTrainingArgsFile,
                 " is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(saved.is_object(), path.string(), ": expected a JSON object of settings");
  saved.erase("resume_from_checkpoint");
  saved.erase("overwrite_output_dir");  // a permission for one command, never carried on
  // Runs from before transformers' schedules: their lr_scheduler_type was Tessera's own.
  if (!saved.contains("schedule") && saved.contains("lr_scheduler_type")) {
    saved["schedule"] = saved["lr_scheduler_type"];
    saved.erase("lr_scheduler_type");
  }
  TrainingArguments args;
  apply_config_values(args, saved, path.string());
  args.given.clear();
  return args;
}

// --memory-report: after the second optimizer step (whose backward ran with the optimizer
// state the first one allocated: the steady-state peak), every rank's bytes by category next
// to ZeRO's formula, printed by the main process; when that step writes a checkpoint, after
// the save, whose peak gets rows of its own ("rank 0 save").
class MemoryReportCallback : public TrainerCallback {
 public:
  MemoryReportCallback(dist::Accelerator& acc, nn::Module& model) : acc_(acc), model_(model) {}
  void on_step_end(const TrainingArguments&, TrainerState& state,
                   TrainerControl& control) override {
    if (state.global_step != std::min<int64_t>(2, state.max_steps)) return;
    // The schedule (DefaultFlowCallback, called first) has decided whether this step saves.
    if (control.should_save)
      after_save_ = true;
    else
      print();
  }
  void on_save(const TrainingArguments&, TrainerState&, TrainerControl&,
               const std::filesystem::path&) override {
    if (after_save_) print();
    after_save_ = false;
  }

 private:
  void print() {
    const std::string table = acc_.memory_report(model_);
    if (!table.empty()) std::cout << table << std::flush;
  }
  dist::Accelerator& acc_;
  nn::Module& model_;
  bool after_save_ = false;
};

// Prints a sample continuing a newline every sample_every steps (main process).
class SampleCallback : public TrainerCallback {
 public:
  SampleCallback(nn::CausalLM& model, const data::Tokenizer* tokenizer,
                 std::shared_ptr<ProgressCallback> console)
      : model_(model), tokenizer_(tokenizer), console_(std::move(console)) {}
  void on_step_end(const TrainingArguments& args, TrainerState& state, TrainerControl&) override {
    if (args.sample_every <= 0 || state.global_step % args.sample_every != 0) return;
    console_->message("sample at step " + std::to_string(state.global_step) + ":\n" +
                      sample(static_cast<uint64_t>(args.seed + state.global_step)));
  }

 private:
  std::string sample(uint64_t seed) {
    std::vector<int64_t> prompt = {0};
    if (tokenizer_) {
      const auto ids = tokenizer_->encode("\n");
      prompt.assign(ids.begin(), ids.end());
    }
    Generator gen(seed);
    const bool was_training = model_.is_training();
    model_.eval();
    const Tensor out = model_.generate(
        from_vector(prompt, {1, static_cast<int64_t>(prompt.size())}, {.dtype = DType::i64}), 128,
        {.temperature = 1.0, .top_k = 0, .gen = &gen});
    model_.train(was_training);
    const std::vector<int64_t> all = out.to_vector<int64_t>();
    std::vector<uint32_t> fresh(all.begin() + static_cast<int64_t>(prompt.size()), all.end());
    if (tokenizer_) return tokenizer_->decode(fresh);
    std::ostringstream ids;
    for (uint32_t id : fresh) ids << id << ' ';
    return ids.str();
  }
  nn::CausalLM& model_;
  const data::Tokenizer* tokenizer_;
  std::shared_ptr<ProgressCallback> console_;
};

data::TokenFile open_token_file(const std::string& path, const std::string& role) {
  TESSERA_CHECK(fs::exists(path), "tessera train: ", role, " '", path, "' does not exist");
  TESSERA_CHECK(!fs::is_directory(path), "tessera train: ", role, " '", path,
                "' is a directory; name the token file in it (e.g. train.bin)");
  return data::TokenFile(path);
}

// Every token of a file must index the model's vocabulary; checked before any training so
// a bad file (also the validation file, first read at the first evaluation) costs nothing.
void check_tokens_fit(const data::TokenFile& file, const std::string& role, int64_t vocab_size) {
  TESSERA_CHECK(file.max_token() < vocab_size, "tessera train: ", role, " '", file.path().string(),
                "' holds token ", file.max_token(), " but the model's vocab_size is ", vocab_size);
}

// A model from --init keeps its own config (a GPT's dropout included); Llama has no dropout
// to set, so asking for one is an error rather than silently ignored.
void check_dropout_applies(const nn::CausalLM& model, const TrainingArguments& args) {
  TESSERA_CHECK(args.dropout == 0 || dynamic_cast<const nn::GPT*>(&model) != nullptr,
                args.describe("dropout"), " must be 0 for a Llama model (got ", args.dropout, ")");
}

nn::LlamaConfig llama_config(const TrainingArguments& args, int64_t vocab_size) {
  nn::LlamaConfig c;
  c.vocab_size = vocab_size;
  c.hidden_size = args.n_embd;
  c.intermediate_size = args.llama_intermediate_size();
  c.num_hidden_layers = args.n_layer;
  c.num_attention_heads = args.n_head;
  c.num_key_value_heads = args.n_kv_head > 0 ? args.n_kv_head : args.n_head;
  c.max_position_embeddings = args.block_size > 0 ? args.block_size : args.seq;
  c.rope_theta = args.rope_theta;
  c.tie_word_embeddings = args.tie_word_embeddings;
  return c;
}

int64_t fresh_vocab_size(const TrainingArguments& args, const data::TokenFile& train_file,
                         const data::Tokenizer* tokenizer) {
  return args.vocab_size > 0 ? args.vocab_size
         : tokenizer         ? tokenizer->vocab_size()
                             : static_cast<int64_t>(train_file.max_token()) + 1;
}

// Under ZeRO-3 (as the Accelerator will resolve the stage) the model is built under sharded
// construction (Accelerator::sharded_init's deferred initialisation): its parameters are
// placeholders until prepare() fills each rank's slice with the eager construction's bits,
// so no rank holds the whole model.
bool builds_sharded(const TrainingArguments& args) {
  return dist::resolved_zero_stage(accelerator_options(args, /*equal_batch_shapes=*/true)) == 3;
}

std::unique_ptr<nn::CausalLM> build_model(const TrainingArguments& args,
                                          const data::TokenFile& train_file,
                                          const data::Tokenizer* tokenizer) {
  std::optional<DeferredInitGuard> sharded;
  if (builds_sharded(args)) sharded.emplace();
  if (!args.resume_from_checkpoint.empty()) {  // weights come with the checkpoint's state
    const std::string config = (fs::path(args.resume_from_checkpoint) / "config.json").string();
    if (nn::model_type_of(config) == "llama")
      return std::make_unique<nn::Llama>(nn::llama_config_from_json_file(config));
    nn::GPTConfig g = nn::gpt_config_from_json_file(config);
    g.dropout = args.dropout;
    return std::make_unique<nn::GPT>(g);
  }
  if (!args.init.empty()) {
    std::unique_ptr<nn::CausalLM> model = load_model(args.init, Device::cpu());
    check_dropout_applies(*model, args);
    const std::string what = "the initial weights from --init '" + args.init + "'";
    // Placeholders hold no values yet: the file they will be read from is checked instead.
    if (sharded)
      check_weights_finite(fs::path(args.init) / "model.safetensors", what);
    else
      check_weights_finite(*model, what);
    return model;
  }
  const int64_t vocab_size = fresh_vocab_size(args, train_file, tokenizer);
  Generator init_gen(static_cast<uint64_t>(args.seed));
  if (args.arch == "llama")
    return std::make_unique<nn::Llama>(llama_config(args, vocab_size), &init_gen);
  nn::GPTConfig g;
  g.n_layer = args.n_layer, g.n_head = args.n_head, g.n_embd = args.n_embd;
  g.dropout = args.dropout;
  g.block_size = args.block_size > 0 ? args.block_size : args.seq;
  g.vocab_size = vocab_size;
  g.tie_word_embeddings = args.tie_word_embeddings;
  g.validate();
  return std::make_unique<nn::GPT>(g, &init_gen);
}

// Settings the optimizer, the LR schedule or the data order were built from: the checkpoint's
// state holds their effect, so a resumed run cannot take another value (Tessera does not
// re-base a schedule on a new learning rate as a fresh one would be).
void check_unchanged_on_resume(const TrainingArguments& requested, const TrainingArguments& saved,
                               const fs::path& checkpoint) {
  auto refuse = [&](const std::string& key, const std::string& now, const std::string& then,
                    const std::string& why) {
    TESSERA_FAIL(requested.describe(key), " is ", now, " but the run being resumed (",
                 checkpoint.string(), ") was trained with ", then, "; ", why,
                 " cannot change on resume: leave it out, or start a new run (--init)");
  };
  const Json want = requested.to_json(), had = saved.to_json();
  for (const char* key : {"learning_rate", "schedule", "lr_scheduler_type", "lr_scheduler_kwargs",
                          "min_lr", "warmup_steps", "warmup_ratio"})
    if (requested.given.count(key) && want[key] != had[key])
      refuse(key, want[key].dump(), had[key].dump(), "the learning-rate schedule");
  if (requested.given.count("sampling") && requested.sampling != saved.sampling)
    refuse("sampling", requested.sampling, saved.sampling, "the data order (sampling)");
  for (const char* key : {"dtype", "bf16", "fp16"})
    if (requested.given.count(key) && requested.dtype() != saved.dtype())
      refuse(key, requested.dtype(), saved.dtype(), "the precision (dtype)");
}

// `tessera launch --mixed-precision X` (as `accelerate launch --mixed_precision X` under a
// Hugging Face Trainer): the run's precision unless its own flags or config name one, which
// come later and win. A layer in front of them, so that a resume checks it like a flag. The
// same for the device mesh's `--tp-size N` / `--pp-size N` (TESSERA_TP_SIZE, TESSERA_PP_SIZE):
// a run launched on a mesh trains on it without repeating the flag (a flag that says otherwise
// is refused by check_mesh_settings, since the Accelerator takes the launch's size too).
std::vector<ArgumentLayer> with_launch_settings(const std::vector<ArgumentLayer>& layers) {
  std::vector<ArgumentLayer> all;
  const std::string launched = dist::env_string("TESSERA_MIXED_PRECISION");
  if (!launched.empty()) {
    TESSERA_CHECK(launched == "no" || launched == "bf16" || launched == "fp16",
                  "TESSERA_MIXED_PRECISION (set by tessera launch --mixed-precision) must be no, "
                  "bf16 or fp16 (got \"",
                  launched, "\")");
    all.push_back({Json{{"dtype", launched == "no" ? "fp32" : launched}},
                   "tessera launch --mixed-precision"});
  }
  for (const auto& [variable, key, flag] : {std::tuple{"TESSERA_TP_SIZE", "tp_size", "--tp-size"},
                                            std::tuple{"TESSERA_PP_SIZE", "pp_size", "--pp-size"}})
    if (!dist::env_string(variable).empty())
      all.push_back({Json{{key, static_cast<int64_t>(dist::env_integer(variable, 1, 1, 65536))}},
                     std::string("tessera launch ") + flag});
  all.insert(all.end(), layers.begin(), layers.end());
  return all;
}

}  // namespace

TrainingArguments arguments_for_run(const std::vector<ArgumentLayer>& given_layers) {
  const std::vector<ArgumentLayer> layers = with_launch_settings(given_layers);
  const TrainingArguments requested = apply_layers(TrainingArguments{}, layers);
  if (requested.resume_from_checkpoint.empty()) {
    validate(requested);
    return requested;
  }
  const bool latest = requested.resume_from_checkpoint == "latest";
  const fs::path target =
      latest ? fs::path(requested.output_dir) : fs::path(requested.resume_from_checkpoint);
  // "latest" before any checkpoint was written is a fresh run: the first attempt of a job
  // that `tessera launch --max-restarts` restarts runs the same command as the later ones.
  if (latest && list_checkpoints(target).empty()) {
    std::cerr << "tessera train: --resume: no checkpoint under '" << target.string()
              << "' yet; starting a fresh run\n";
    TrainingArguments fresh = requested;
    fresh.resume_from_checkpoint.clear();
    validate(fresh);
    return fresh;
  }
  std::vector<std::string> warnings;
  const fs::path checkpoint = fs::absolute(resolve_checkpoint(target, warnings)).lexically_normal();
  for (const std::string& w : warnings) std::cerr << "tessera train: warning: " << w << "\n";
  TrainingArguments saved = saved_arguments(checkpoint);
  if (!requested.given.count("output_dir")) saved.output_dir = checkpoint.parent_path().string();
  saved.deepspeed_config =
      requested.deepspeed_config;  // parsed once: kept when the file is the same
  TrainingArguments args = apply_layers(saved, layers);
  args.resume_from_checkpoint = checkpoint.string();
  // As Hugging Face's resume_from_checkpoint next to model_name_or_path: a job script re-run
  // with --resume appended resumes, and the checkpoint's weights win over --init's.
  if (!requested.init.empty() && requested.init != saved.init && dist::read_dist_env().rank == 0)
    std::cerr << "tessera train: note: " << requested.describe("init") << " '" << requested.init
              << "' is not read: the weights come from the checkpoint (its run started from "
              << (saved.init.empty() ? "a fresh model" : "'" + saved.init + "'") << ")\n";
  // The model's shape is the checkpoint's; a flag that says otherwise is a mistake.
  const Json saved_json = saved.to_json(), args_json = args.to_json();
  for (const std::string& key : model_shape_keys())
    TESSERA_CHECK(!requested.given.count(key) || args_json[key] == saved_json[key],
                  args.describe(key), " is ", args_json[key].dump(), " but the run being resumed (",
                  checkpoint.string(), ") has ", saved_json[key].dump(),
                  "; leave it out to resume, or start a new run");
  check_unchanged_on_resume(requested, saved, checkpoint);
  // Another world size keeps the data order when the global batch is kept (the positions
  // are re-counted): only a changed global batch makes the run differ.
  const auto [saved_world, saved_rows] = saved_world_and_global_batch(checkpoint);
  // The rows of a micro-step are the dp replicas' (a tp group or a pipeline reads one's rows).
  const int64_t replicas = mesh_shape(args, dist::read_dist_env().world_size).dp;
  const bool same_global_batch =
      saved_world > 0 && saved_rows == replicas * args.per_device_train_batch_size;
  for (const char* key : {"per_device_train_batch_size", "seq", "gradient_accumulation_steps",
                          "shuffle", "seed", "data"})
    if (args_json[key] != saved_json[key] &&
        !(same_global_batch && std::string(key) == "per_device_train_batch_size"))
      std::cerr << "tessera train: warning: resuming with " << key << " = " << args_json[key].dump()
                << " but the checkpoint was trained with " << saved_json[key].dump()
                << "; the run will not match an uninterrupted one\n";
  validate(args);
  return args;
}

int run_training(const TrainingArguments& args) {
  validate(args);
  for (const std::string& name : args.report_to)
    TESSERA_CHECK(name == "none" || tracker_available(name), args.describe("report_to"),
                  ": tracker \"", name, "\" is not available in this build");
  check_metric_for_best_model(args, language_model_metrics);
  if (args.resume_from_checkpoint.empty()) check_init_shape(args);  // resumed: the checkpoint's shape
  // The device mesh, before the model is built (the model's heads and blocks against it once it
  // is, before any rank meets another: Trainer, TrainingTask::split_over_mesh).
  check_mesh_settings(args, dist::read_dist_env().world_size);
  const data::TokenFile train_file = open_token_file(args.data, "training file");
  check_training_file_size(train_file, args);
  fs::path val_path = args.val_data;
  const fs::path data_dir = fs::path(args.data).parent_path();
  if (val_path.empty() && fs::exists(data_dir / "val.bin") &&
      fs::path(args.data).filename() != "val.bin")
    val_path = data_dir / "val.bin";
  std::optional<data::TokenFile> val_file;
  if (!val_path.empty()) val_file.emplace(open_token_file(val_path.string(), "validation file"));
  const auto tokenizer = find_tokenizer(data_dir);
  if (args.resume_from_checkpoint.empty() && args.init.empty()) {
    const int64_t vocab_size = fresh_vocab_size(args, train_file, tokenizer.get());
    check_fits_in_memory(args, estimated_parameters(args, vocab_size), vocab_size);
  }
  if (!val_file && args.eval_strategy != "no" && dist::read_dist_env().rank == 0)
    std::cerr << "tessera train: note: no validation file (no --val-data and no val.bin beside '"
              << args.data << "'), so the run is not evaluated\n";
  // Before any work: a folder in use or holding another run is refused here. The main
  // process holds the lock until it returns (its Trainer shares it).
  std::shared_ptr<RunFolderLock> folder_lock;
  if (dist::read_dist_env().rank == 0) folder_lock = claim_run_folder(args);

  // Counted from the model's first parameter on (the report's categories need every storage).
  if (args.memory_report) enable_memory_categories(true);
  std::unique_ptr<nn::CausalLM> model = build_model(args, train_file, tokenizer.get());
  TESSERA_CHECK(args.seq <= model->context_length(), args.describe("seq"),
                " is longer than the model context = ", model->context_length(), " (got ", args.seq,
                ")");
  if (args.vocab_size > 0)
    TESSERA_CHECK(args.vocab_size == model->vocab_size(), args.describe("vocab_size"), " is ",
                  args.vocab_size, " but the model has ", model->vocab_size());
  check_tokens_fit(train_file, "training file", model->vocab_size());
  if (val_file) check_tokens_fit(*val_file, "validation file", model->vocab_size());
  const dist::MeshShape mesh = mesh_shape(args, dist::read_dist_env().world_size);
  dist::check_mesh_split(*model, mesh, pipeline_options(args), args.per_device_train_batch_size);

  std::map<std::string, std::string> extra_files;
  if (tokenizer) extra_files = tokenizer->files();  // tokenizer.json (+ Hugging Face's other files)
  // Checkpoints also record the training file, so a resume notices a replaced one.
  std::map<std::string, std::string> checkpoint_files = extra_files;
  if (dist::read_dist_env().rank == 0) {
    const std::string fingerprint = data_fingerprint(train_file);
    if (!args.resume_from_checkpoint.empty()) warn_if_data_replaced(args.resume_from_checkpoint, fingerprint);
    checkpoint_files[kDataFingerprintFile] = fingerprint;
  }
  Trainer trainer(args, *model, train_file, val_file, language_model_metrics, checkpoint_files);
  const bool main_process = trainer.accelerator().is_main_process();
  // What trains, is prepared and is saved: the model, or on a mesh that splits it this rank's
  // piece (`model` is then a shell that only describes the full model and writes its config).
  nn::Module& trained = trainer.model();
  // The model built and prepared: its own rows in the report, the steps' peak after them.
  if (args.memory_report) trainer.accelerator().end_memory_phase("construction");
  if (args.memory_report)  // every rank: the report gathers each one's counters
    trainer.add_callback(std::make_shared<MemoryReportCallback>(trainer.accelerator(), trained));
  if (args.early_stopping_patience > 0)
    trainer.add_callback(std::make_shared<EarlyStoppingCallback>(args.early_stopping_patience,
                                                                 args.early_stopping_threshold));
  if (main_process) {
    auto console = std::make_shared<ProgressCallback>();
    trainer.add_callback(std::make_shared<TrackerCallback>());
    trainer.add_callback(console);
    trainer.add_callback(std::make_shared<LossPlotCallback>());
    trainer.add_callback(std::make_shared<SampleCallback>(*model, tokenizer.get(), console));
    fs::create_directories(args.output_dir);
    write_file_atomically(fs::path(args.output_dir) / "config.train.json", args.to_json().dump(2));
    const int world = trainer.accelerator().num_processes();
    // The rows of a step are the dp replicas' (the ranks of a tp group or a pipeline share them).
    const int replicas = trainer.accelerator().mesh().dp_size();
    const std::string replicas_text =
        replicas == world ? (world > 1 ? " x " + std::to_string(world) + " processes" : "")
                          : " x " + std::to_string(replicas) + " dp replica(s)";
    std::printf(
        "model: %s (%lld parameters) on %s\n"
        "data: %lld tokens; %lldx%lld x %lld micro-batches%s = %lld tokens per step, %s\n",
        model->describe().c_str(), (long long)model->num_parameters(),
        trainer.device().str().c_str(), (long long)train_file.size(),
        (long long)args.per_device_train_batch_size, (long long)args.seq,
        (long long)args.gradient_accumulation_steps, replicas_text.c_str(),
        (long long)trainer.tokens_per_step(), args.shuffle ? "shuffled" : "sequential");
    const dist::DeviceMesh& device_mesh = trainer.accelerator().mesh();
    const dist::DataParallelStrategy* s = trainer.accelerator().strategy_of(trained);
    if (!device_mesh.data_parallel_only())
      std::printf("device mesh: %s, the model %s, %s on the dp axis\n",
                  device_mesh.shape().str().c_str(),
                  dist::mesh_split_name(dist::mesh_split_of(device_mesh.shape())),
                  s ? s->name().c_str() : "?");
    else if (s && world > 1)
      std::printf("data parallel: %s over %d processes\n", s->name().c_str(), world);
    std::fflush(stdout);
  }
  trainer.train();
  trainer.accelerator().wait_for_everyone();
  if (trainer.preempted_by()) return kPreemptedExitStatus;
  // The final model as a plain model directory (what eval/sample/transformers load). Every
  // process takes part: under ZeRO the weights are streamed from each rank's shard, never
  // gathered (Accelerator::save_model).
  const fs::path out(args.output_dir), model_dir = out / "model";
  // A split model is gathered whole (collective) and written as one process's.
  trainer.accelerator().save_model(trained, model_dir.string());
  if (!main_process) return 0;
  // A resumed finished run exports the checkpoint's weights: non-finite ones are refused
  // rather than given valid checksums.
  try {
    check_weights_finite(model_dir / "model.safetensors",
                         "the final weights (to be exported to '" + model_dir.string() + "')");
  } catch (const Error&) {
    fs::remove(model_dir / "model.safetensors");
    throw;
  }
  model->save_config((model_dir / "config.json").string());
  for (const auto& [name, contents] : extra_files)
    write_file_atomically(model_dir / name, contents);
  write_folder_checksums(model_dir);  // verified by every load, as a checkpoint's are
  std::printf("done: %lld steps; model in %s, metrics in %s, loss curve in %s\n",
              (long long)trainer.state().global_step, model_dir.string().c_str(),
              (out / "metrics.jsonl").string().c_str(), (out / "loss.png").string().c_str());
  return 0;
}

}  // namespace tessera::train
