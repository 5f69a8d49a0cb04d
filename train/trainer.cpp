#include "tessera/train/trainer.h"

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/core/memory_stats.h"
#include "tessera/core/random.h"
#include "tessera/kernels/ops.h"
#include "tessera/train/accelerator_options.h"
#include "tessera/train/checkpoint_files.h"

namespace tessera::train {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

// The main process claims output_dir (run_folder.h); the others learn whether it could, so a
// refused job ends on every rank, before any work, instead of waiting in a collective.
std::shared_ptr<RunFolderLock> claim_output_dir(const TrainingArguments& args,
                                                dist::Accelerator& acc) {
  std::shared_ptr<RunFolderLock> lock;
  std::string refusal;
  if (acc.is_main_process()) {
    try {
      lock = claim_run_folder(args);
    } catch (const Error& e) {
      refusal = e.what();
    }
  }
  if (acc.num_processes() > 1) {
    const Tensor claimed =
        acc.reduce(full({1}, refusal.empty() ? 1.0 : 0.0, {.dtype = DType::f32}), "min");
    if (claimed.item() == 0 && refusal.empty())
      refusal =
          "the main process refused output_dir '" + args.output_dir + "' (its message says why)";
  }
  TESSERA_CHECK(refusal.empty(), refusal);
  return lock;
}

std::vector<int> preemption_signals_of(const TrainingArguments& args) {
  std::vector<int> signals;
  for (const std::string& name : args.preempt_signals)
    if (name != "none") signals.push_back(preemption_signal_number(name));
  return signals;
}

}  // namespace

void check_metric_for_best_model(const TrainingArguments& args,
                                 const std::vector<std::string>& metric_names) {
  const std::string wanted = evaluation_metric_name(args.metric_for_best_model);
  std::string names;
  for (const std::string& name : metric_names) {
    const std::string prefixed = with_prefix({{name, 0.0}}, "eval_").begin()->first;
    if (prefixed == wanted) return;
    names += (names.empty() ? "" : ", ") + prefixed;
  }
  TESSERA_FAIL(args.describe("metric_for_best_model"), " is \"", args.metric_for_best_model,
               "\", which the evaluation does not return; it returns ", names,
               " (a name without the eval_ prefix gets it: loss is eval_loss)");
}

void check_metric_for_best_model(const TrainingArguments& args,
                                 const ComputeMetrics& compute_metrics) {
  std::vector<std::string> names = {"loss"};
  for (const auto& [name, value] : compute_metrics(EvalTotals{}))  // only the names matter
    if (name != "loss") names.push_back(name);
  check_metric_for_best_model(args, names);
}

Trainer::Trainer(TrainingArguments args, nn::CausalLM& model, data::TokenFile train_data,
                 std::optional<data::TokenFile> eval_data, ComputeMetrics compute_metrics,
                 std::map<std::string, std::string> extra_files)
    : Trainer(std::move(args),
              make_causal_lm_task(model, std::move(train_data), std::move(eval_data),
                                  std::move(compute_metrics)),
              std::move(extra_files)) {}

Trainer::Trainer(TrainingArguments args, nn::SequenceClassifier& model,
                 data::ExampleDataset train_data, std::optional<data::ExampleDataset> eval_data,
                 data::Collator collator, ComputePredictionMetrics compute_metrics,
                 std::map<std::string, std::string> extra_files)
    : Trainer(std::move(args),
              make_sequence_classification_task(model, std::move(train_data), std::move(eval_data),
                                                std::move(collator), std::move(compute_metrics)),
              std::move(extra_files)) {}

Trainer::Trainer(TrainingArguments args, std::unique_ptr<TrainingTask> task,
                 std::map<std::string, std::string> extra_files)
    : args_(std::move(args)), task_(std::move(task)), extra_files_(std::move(extra_files)) {
  TESSERA_CHECK(task_ != nullptr, "Trainer: no task");
  validate(args_, /*needs_token_file=*/task_->name() == "causal_lm");
  // Bad data and a misspelt metric fail here, before any work.
  task_->check_data(args_);
  if (args_.eval_strategy != "no" || args_.load_best_model_at_end)
    if (const std::vector<std::string> names = task_->metric_names(); !names.empty())
      check_metric_for_best_model(args_, names);
  const Device wanted = Device::parse(args_.device);
  acc_ =
      std::make_unique<dist::Accelerator>(accelerator_options(args_, task_->equal_batch_shapes()));
  // `tessera launch --gradient_accumulation_steps N` (or its DeepSpeed file) reaches the
  // Accelerator only; the Trainer's loop counts micro-batches by its own setting.
  TESSERA_CHECK(acc_->gradient_accumulation_steps() == args_.gradient_accumulation_steps,
                "the launch environment asks for ", acc_->gradient_accumulation_steps(),
                " gradient accumulation steps but the training arguments say ",
                args_.gradient_accumulation_steps,
                "; set gradient_accumulation_steps (--grad-accum) "
                "for `tessera train` instead");
  folder_lock_ = claim_output_dir(args_, *acc_);
  // One GPU per local rank when distributed; the named device otherwise.
  device_ = wanted.is_cuda() && acc_->num_processes() > 1 ? acc_->device() : wanted;
  // On a mesh with tp_size or pp_size > 1 the model is split now (the mesh exists), before it
  // moves to the device: model() is this rank's piece from here on.
  task_->split_over_mesh(*acc_, args_);
  nn::Module& model = task_->model();
  model.to(device_);
  task_->prepare(*acc_, args_, device_);
  state_.is_world_process_zero = acc_->is_main_process();
  // The dp replicas read different rows; the ranks of one tp group or pipeline the same.
  state_.steps_per_epoch = task_->steps_per_epoch(args_, acc_->mesh().dp_size());
  state_.max_steps = args_.total_steps(state_.steps_per_epoch);
  // A decaying schedule is shaped by the total step count, so a resumed run must keep it;
  // a constant one is not, so a run may be extended (its saved total is kept).
  int64_t schedule_total = state_.max_steps;
  if (!args_.resume_from_checkpoint.empty()) {
    verify_checkpoint(args_.resume_from_checkpoint);
    check_world_size_of(args_.resume_from_checkpoint);
    resumed_ = read_trainer_state(args_.resume_from_checkpoint);
    const int64_t saved_total = resumed_->schedule_total;
    if (!schedule_uses_total(args_)) {
      schedule_total = saved_total;
    } else {
      TESSERA_CHECK(saved_total == state_.max_steps, args_.describe("max_steps"), " is ",
                    state_.max_steps, " but the checkpoint's ", schedule_name(args_),
                    " schedule decays over ", saved_total, " steps; resume with --steps ",
                    saved_total, " (or train with --schedule constant to extend runs)");
    }
  }
  const int64_t warmup = warmup_steps_for(args_, schedule_total);
  TESSERA_CHECK(!schedule_uses_total(args_) || warmup < schedule_total,
                args_.describe("warmup_steps"), " must be shorter than the ", schedule_total,
                " steps of a decaying schedule (got ", warmup, ")");
  // Frozen parameters (requires_grad false) are left out, as transformers' Trainer does: they
  // get no optimizer state and no update, and DDP and ZeRO (trainable_parameters) leave them
  // whole on every rank.
  std::vector<Tensor> trainable;
  for (const Tensor& p : model.parameters())
    if (p.requires_grad()) trainable.push_back(p);
  TESSERA_CHECK(!trainable.empty(),
                "Trainer: every parameter of the model is frozen (requires_grad false)");
  optimizer_ = std::make_unique<optim::AdamW>(
      trainable, optim::AdamWOptions{.lr = args_.learning_rate,
                                     .beta1 = args_.adam_beta1,
                                     .beta2 = args_.adam_beta2,
                                     .eps = args_.adam_epsilon,
                                     .weight_decay = args_.weight_decay});
  schedule_ = make_lr_schedule(args_, *optimizer_, schedule_total);
  state_.schedule_total = schedule_total;
  acc_->prepare(model, *optimizer_, *schedule_);
  // A recorded step decides the clipping on the device, which ZeRO's sharded gradients and
  // fp16's loss scaling do not allow (device_clipping_blocker): such runs step eagerly.
  if (task_->graphable_model() && device_.is_cuda() && StepGraphRunner::enabled_by_environment() &&
      acc_->device_clipping_blocker().empty())
    graphs_ = std::make_unique<StepGraphRunner>(
        *acc_, *optimizer_, [this](const std::vector<data::Batch>& b) { return device_step(b); },
        StepGraphRunner::Options{});
  handler_.add(std::make_shared<DefaultFlowCallback>());
}

Trainer::~Trainer() = default;

int64_t Trainer::tokens_per_step() const {
  // validate() bounds the product without the world size (2^40) and a world is far below 2^23.
  return task_->units_per_micro_batch() * args_.gradient_accumulation_steps *
         acc_->mesh().dp_size();
}

void Trainer::train() {
  if (resumed_) resume_from(args_.resume_from_checkpoint);
  task_->model().train();
  control_ = {};
  loss_since_log_ = Tensor();
  pending_log_.reset();
  last_log_time_ = std::chrono::steady_clock::now();
  last_log_step_ = state_.global_step;
  seconds_outside_steps_ = 0;
  preempted_by_ = 0;
  if (preemption_readback_.pending()) preemption_readback_.wait();  // of an earlier train()
  PreemptionSignals signals(preemption_signals_of(args_), args_.preempt_grace);
  handler_.call(&TrainerCallback::on_train_begin, args_, state_, control_);
  while (state_.global_step < state_.max_steps && !control_.should_stop) {
    const StepResult step = training_step();
    // The previous step's log entry: its values are on the device and this step is queued
    // behind them, so reading them now costs the GPU no idle time.
    flush_pending_log();
    ++state_.global_step;
    state_.epoch =
        static_cast<double>(state_.global_step) / static_cast<double>(state_.steps_per_epoch);
    add_step_loss(step.loss);
    ++state_.steps_since_log;
    handler_.call(&TrainerCallback::on_step_end, args_, state_, control_);
    if (control_.should_log) {
      // The copies queue right behind this step: reading them after the next step has been
      // queued waits for this step alone (item() would wait for the next one too).
      log_readback_.start({loss_since_log_, step.grad_norm});
      pending_log_ = PendingLog{state_.steps_since_log, step.grad_norm.defined(), step.lr,
                                acc_->group().issued_count(), std::chrono::steady_clock::now()};
      loss_since_log_ = Tensor();
      state_.loss_since_log = 0;
      state_.steps_since_log = 0;
    }
    const bool last = state_.global_step >= state_.max_steps || control_.should_stop;
    if (control_.should_evaluate || control_.should_save || last) flush_pending_log();
    const auto outside_steps = std::chrono::steady_clock::now();
    if (control_.should_evaluate) evaluate_and_track_best();
    if (control_.should_save) save_checkpoint();
    seconds_outside_steps_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - outside_steps).count();
    const bool saved = control_.should_save;
    control_.should_log = control_.should_evaluate = control_.should_save = false;
    // Checked after the evaluation and the save, so that a signal during either lets it
    // finish and the checkpoint is of the step reached.
    if (last) continue;
    if (const int signal = agreed_preemption_signal()) {
      stop_for_preemption(signal, saved, signals);
      break;
    }
  }
  flush_pending_log();
  read_loss_since_log();
  if (args_.load_best_model_at_end && !preempted_by_) load_best_model();
  handler_.call(&TrainerCallback::on_train_end, args_, state_, control_);
}

int Trainer::agreed_preemption_signal() {
  const int local = PreemptionSignals::received();
  if (acc_->num_processes() == 1) return local;
  // The largest signal number any rank received (0: none did), on every rank.
  const Tensor agreed = acc_->reduce(
      full({1}, static_cast<double>(local), {.dtype = DType::f32, .device = device_}), "max");
  if (!device_.is_cuda()) return static_cast<int>(agreed.item());
  int previous = 0;
  if (preemption_readback_.pending()) {
    acc_->group().check_outstanding(preemption_mark_);
    previous = static_cast<int>(preemption_readback_.wait()[0]);
  }
  preemption_readback_.start({agreed});
  preemption_mark_ = acc_->group().issued_count();
  return previous;
}

void Trainer::stop_for_preemption(int signal, bool saved, PreemptionSignals& signals) {
  flush_pending_log();
  const fs::path checkpoint =
      saved ? fs::path(args_.output_dir) / checkpoint_name(state_.global_step) : save_checkpoint();
  signals.saved();
  preempted_by_ = signal;
  if (PreemptionSignals::received() != 0) preempted_by_ = PreemptionSignals::received();
  if (acc_->is_main_process()) {
    std::printf("received %s: saved %s, resume with --resume %s\n",
                signal_name(preempted_by_).c_str(), checkpoint.filename().string().c_str(),
                args_.output_dir.c_str());
    std::fflush(stdout);
  }
}

void Trainer::add_step_loss(const Tensor& loss) {
  // Summed in f64 in the order the steps ran, from the value a resumed run saved: the same
  // sums as a host accumulator would give.
  if (!loss_since_log_.defined())
    loss_since_log_ = full({1}, state_.loss_since_log, {.dtype = DType::f64, .device = device_});
  loss_since_log_ = ops::add(loss_since_log_, loss);
}

void Trainer::read_loss_since_log() {
  if (!loss_since_log_.defined()) return;
  acc_->group().check_outstanding();
  state_.loss_since_log = loss_since_log_.item();
  TESSERA_CHECK(std::isfinite(state_.loss_since_log), "tessera train: the loss became ",
                state_.loss_since_log, " in the ", state_.steps_since_log, " steps up to step ",
                state_.global_step, " (try a lower --lr or --grad-clip)");
}

void Trainer::flush_pending_log() {
  if (!pending_log_) return;
  const PendingLog step = std::move(*pending_log_);
  pending_log_.reset();
  log_step(step);
}

// The gradients' norm measured on the device; the clipping itself is left to the optimizer's
// next step, which reads the gradients anyway (the bits of clipping first, one pass less).
Tensor Trainer::device_clip(const std::vector<Tensor>& params) {
  const Tensor norm = acc_->clip_grad_norm_on_device_(params, 0.0);
  if (args_.max_grad_norm > 0 && norm.defined())
    optimizer_->clip_grads_in_next_step(norm, args_.max_grad_norm);
  return norm;
}

Tensor Trainer::accumulate_micro_batches(int64_t count,
                                         const std::function<Tensor(int64_t)>& loss_of) {
  // The micro-steps' losses are summed on the device (in f64, as the host would); nothing
  // here waits for the device.
  Tensor loss_sum;
  for (int64_t micro = 0; micro < count; ++micro) {
    // Gradients are averaged over the processes on the last micro-step only.
    const dist::AccumulateScope scope = acc_->accumulate(task_->model());
    const Tensor loss = loss_of(micro);
    if (!task_->runs_own_backward()) acc_->backward(loss);  // of loss / gradient_accumulation_steps
    const Tensor loss64 = ops::to(loss.detach(), device_, DType::f64);
    loss_sum = micro == 0 ? loss64 : ops::add(loss_sum, loss64);
  }
  return ops::binary(BinaryOp::Div, loss_sum, static_cast<double>(count));
}

Trainer::StepResult Trainer::training_step() {
  if (graphs_) return graphed_training_step();
  const Tensor local = accumulate_micro_batches(args_.gradient_accumulation_steps,
                                                [this](int64_t) { return task_->next_loss(); });
  StepResult result;
  // The step's loss is the mean over all its target tokens, over every process's rows.
  result.loss = acc_->reduce(ops::reshape(local, {1}), "mean");
  const std::vector<Tensor> params = task_->model().parameters();
  if (acc_->device_clipping_blocker().empty()) {
    result.grad_norm = device_clip(params);
  } else {
    // A split model's norm sums its pieces over its group (an unbounded max_norm only measures).
    const double norm = args_.max_grad_norm > 0 ? acc_->clip_grad_norm_(params, args_.max_grad_norm)
                        : !acc_->mesh().data_parallel_only()
                            ? acc_->clip_grad_norm_(params, std::numeric_limits<double>::infinity())
                            : optim::grad_norm(params);
    result.grad_norm = full({1}, norm, {.dtype = DType::f64});
  }
  result.lr = optimizer_->lr();
  optimizer_->step();  // skipped by the Accelerator when an fp16 gradient overflowed
  schedule_->step();
  optimizer_->zero_grad();
  return result;
}

// The device work of one step with no host read of device values, so that it can be
// recorded in a CUDA graph; its results equal training_step's bit for bit (the same
// micro-batch loop, the clipping decided on the device by the same rule).
StepOutputs Trainer::device_step(const std::vector<data::Batch>& micro_batches) {
  nn::CausalLM& model = *task_->graphable_model();
  StepOutputs out;
  out.loss = accumulate_micro_batches(static_cast<int64_t>(micro_batches.size()), [&](int64_t k) {
    return model.loss(micro_batches[k].x, micro_batches[k].y);
  });
  out.grad_norm = device_clip(model.parameters());
  optimizer_->step();
  optimizer_->zero_grad();
  return out;
}

Trainer::StepResult Trainer::graphed_training_step() {
  std::vector<data::Batch> micro_batches;
  for (int64_t micro = 0; micro < args_.gradient_accumulation_steps; ++micro)
    micro_batches.push_back(task_->token_loader()->next());
  StepResult result;
  result.lr = optimizer_->lr();
  const StepOutputs out = graphs_->run(micro_batches);
  // A replay overwrites the graph's outputs: keep copies until they are read (reduce makes
  // one too). The mean over the processes is taken outside the graph, as the eager step does.
  result.loss = acc_->num_processes() > 1 ? acc_->reduce(ops::reshape(out.loss, {1}), "mean")
                                          : ops::clone(ops::reshape(out.loss, {1}));
  if (out.grad_norm.defined()) result.grad_norm = ops::clone(out.grad_norm);
  schedule_->step();
  if (graphs_->status() != graphs_status_ && acc_->is_main_process()) {
    graphs_status_ = graphs_->status();
    if (graphs_status_.rfind("eager: warming", 0) != 0)
      std::printf("cuda graphs: %s (step %lld)\n", graphs_status_.c_str(),
                  static_cast<long long>(state_.global_step + 1));
  }
  return result;
}

void Trainer::log_step(const PendingLog& step) {
  // The step's collectives were only ordered on the device: a lost peer times out here
  // rather than hanging the read below. Only those up to the logged step: the next step is
  // queued behind them, and waiting for its collectives too would leave the GPU idle while
  // the host queues the step after it.
  acc_->group().check_outstanding(step.collectives);
  const std::vector<double> values = log_readback_.wait();
  const double loss = values[0] / static_cast<double>(std::max<int64_t>(1, step.steps));
  const double grad_norm = step.has_grad_norm ? values[1] : 0.0;
  auto number = [](double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); };
  Json entry = {{"step", state_.global_step},
                {"epoch", state_.epoch},
                {"loss", number(loss)},
                {"learning_rate", step.lr},
                {"grad_norm", number(grad_norm)}};
  state_.log_history.push_back(entry);  // no wall-clock figures: resumed histories match
  // Wall clock per step since the previous log, less evaluations and saves. A step ends when
  // its results are on the host: on a GPU when the read above returns (it waited for the
  // step), on the CPU when the host had done its work and queued the read (this log may come
  // a step later, or right after it, before an evaluation).
  const auto done = device_.is_cuda() ? std::chrono::steady_clock::now() : step.queued_at;
  const double elapsed = std::chrono::duration<double>(done - last_log_time_).count();
  const double seconds =
      std::max(elapsed - seconds_outside_steps_, 1e-9) /
      static_cast<double>(std::max<int64_t>(1, state_.global_step - last_log_step_));
  last_log_time_ = done;
  seconds_outside_steps_ = 0;
  last_log_step_ = state_.global_step;
  entry["ms"] = seconds * 1e3;
  entry[task_->unit_name() + "_per_s"] = static_cast<double>(tokens_per_step()) / seconds;
  // On a GPU, what the caching allocator holds (benchmarks/soak.sh checks it stays flat).
  if (const auto memory = device_memory_stats(device_))
    entry["reserved_bytes"] = memory->reserved_bytes;
  handler_.call(&TrainerCallback::on_log, args_, state_, control_, entry);
  TESSERA_CHECK(std::isfinite(loss), "tessera train: loss became ", loss, " at step ",
                state_.global_step, " (try a lower --lr or --grad-clip)");
}

// The wall-clock figures of an evaluation: reported, kept out of the resumable history.
static bool is_wall_clock_metric(const std::string& name) {
  for (const char* suffix : {"_runtime", "_samples_per_second", "_steps_per_second"})
    if (name.ends_with(suffix)) return true;
  return false;
}

Metrics Trainer::evaluate() {
  TESSERA_CHECK(task_->has_eval_data(), "Trainer::evaluate: no evaluation data");
  const auto start = std::chrono::steady_clock::now();
  // Measured apart ("rank R eval" in the memory report): the steps' peak stays theirs (a
  // pipeline's evaluation gathers the whole model).
  const TaskEvaluation result =
      acc_->measure_apart("eval", [&] { return task_->evaluate(*acc_, args_); });
  const double seconds = std::max(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1e-9);
  Metrics metrics = with_prefix(result.metrics, "eval_");
  metrics["eval_runtime"] = seconds;
  metrics["eval_samples_per_second"] = static_cast<double>(result.samples) / seconds;
  metrics["eval_steps_per_second"] = static_cast<double>(result.batches) / seconds;
  return metrics;
}

PredictionOutput Trainer::predict(const data::ExampleDataset& dataset) {
  const auto start = std::chrono::steady_clock::now();
  PredictionOutput out = task_->predict(*acc_, args_, dataset);
  const double seconds = std::max(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1e-9);
  out.metrics = with_prefix(out.metrics, "test_");
  out.metrics["test_runtime"] = seconds;
  out.metrics["test_samples_per_second"] = static_cast<double>(dataset.size()) / seconds;
  return out;
}

void Trainer::evaluate_and_track_best() {
  if (!task_->has_eval_data()) return;
  const Metrics metrics = evaluate();
  Json entry = {{"step", state_.global_step}, {"epoch", state_.epoch}};
  for (const auto& [k, v] : metrics)
    if (!is_wall_clock_metric(k)) entry[k] = std::isfinite(v) ? Json(v) : Json(nullptr);
  state_.log_history.push_back(entry);
  handler_.call(&TrainerCallback::on_evaluate, args_, state_, control_, metrics);
  auto it = metrics.find(evaluation_metric_name(args_.metric_for_best_model));
  TESSERA_CHECK(it != metrics.end(), args_.describe("metric_for_best_model"), ": \"",
                args_.metric_for_best_model, "\" is not among the evaluation's metrics");
  if (metric_improves(args_, it->second, state_.best_metric)) {
    state_.best_metric = it->second;
    state_.best_step = state_.global_step;
    // The best weights must be on disk to be restored at the end.
    if (args_.load_best_model_at_end) control_.should_save = true;
  }
}

fs::path Trainer::save_checkpoint() {
  read_loss_since_log();  // trainer_state.json carries it (and a non-finite one stops here)
  const fs::path out(args_.output_dir);
  const std::string name = checkpoint_name(state_.global_step);
  const fs::path final_dir = out / name, partial = out / (name + ".partial");
  if (acc_->is_main_process()) fs::remove_all(partial);
  acc_->wait_for_everyone();
  acc_->save_state(partial.string());  // model, optimizer, schedule, RNG and loader of every rank
  // On every process: load_best_model_at_end loads it on all of them (ZeRO-3: collectively).
  if (state_.best_step == state_.global_step) state_.best_model_checkpoint = name;
  if (acc_->is_main_process()) {
    if (args_.save_only_model) drop_training_state(partial);
    handler_.save_states(state_);
    task_->save_config(partial);
    for (const auto& [file, contents] : extra_files_)
      write_file_atomically(partial / file, contents);
    write_file_atomically(partial / kTrainingArgsFile, args_.to_json().dump(2));
    write_trainer_state(partial / kTrainerStateFile, state_);
    write_folder_checksums(partial);  // last: marks every other file complete
    fs::remove_all(final_dir);
    fs::rename(partial, final_dir);
    rotate_checkpoints(out, args_.save_total_limit, state_.best_model_checkpoint);
  }
  acc_->wait_for_everyone();
  handler_.call(&TrainerCallback::on_save, args_, state_, control_, final_dir);
  return final_dir;
}

void Trainer::check_world_size_of(const fs::path& checkpoint) const {
  const auto [saved_world, saved_rows] = saved_world_and_global_batch(checkpoint);
  // The rows of a micro-step are the dp replicas' (a tp group or a pipeline reads one replica's).
  const int64_t world = acc_->num_processes(), batch = args_.per_device_train_batch_size;
  const int64_t replicas = acc_->mesh().dp_size();
  if (saved_world <= 0 || saved_rows <= 0 || saved_rows == replicas * batch) return;
  if (saved_world == world && acc_->mesh().data_parallel_only()) return;
  // "process(es)" on a mesh of data parallelism alone, where the replicas are the processes.
  const std::string replica_word =
      acc_->mesh().data_parallel_only() ? " process(es)" : " dp replica(s)";
  const std::string keep = saved_rows % replicas == 0
                               ? "keep the global batch of " + std::to_string(saved_rows) +
                                     " rows (--batch " + std::to_string(saved_rows / replicas) +
                                     " on " + std::to_string(replicas) + replica_word + ")"
                               : "run on " + std::to_string(saved_world) + " processes";
  TESSERA_FAIL(
      "checkpoint '", checkpoint.string(), "' was written by ", saved_world, " processes (",
      saved_rows, " rows per micro-step) but this job has ", world, " process(es)",
      acc_->mesh().data_parallel_only() ? "" : " in " + std::to_string(replicas) + " dp replicas",
      " of ", batch, " rows (", replicas * batch, " per micro-step): the ",
      saved_world != world ? "world size" : "global batch", " changed; to resume, ", keep);
}

void Trainer::resume_from(const fs::path& checkpoint) {
  const TrainerState saved = *resumed_;
  const std::string where = "checkpoint '" + checkpoint.string() + "'";
  acc_->load_state(checkpoint.string());  // verifies and checks every tensor before loading
  // The parts must describe the same moment of the same run (an fp16 step skipped for an
  // overflowing gradient does not advance the schedule, so it may lag behind).
  TESSERA_CHECK(schedule_->current_step() <= saved.global_step, where,
                ": the LR schedule is at step ", schedule_->current_step(),
                " but trainer_state.json says global_step ", saved.global_step);
  // First: it bounds the product below.
  TESSERA_CHECK(saved.global_step <= state_.max_steps, "tessera train: the checkpoint is at step ",
                saved.global_step, ", past max_steps ", state_.max_steps);
  const uint64_t want_position =
      static_cast<uint64_t>(saved.global_step * args_.gradient_accumulation_steps);
  // A token loader's position is restored with the Accelerator's state; other tasks' streams
  // are positioned by the step alone.
  if (!task_->token_loader()) task_->seek(want_position);
  TESSERA_CHECK(task_->position() == want_position, where, ": the data position is ",
                task_->position(), " micro-batches but ", saved.global_step, " steps of ",
                args_.gradient_accumulation_steps, " micro-batches took ", want_position,
                " (was gradient_accumulation_steps changed?)");
  const int64_t max_steps = state_.max_steps, per_epoch = state_.steps_per_epoch;
  const int64_t schedule_total = state_.schedule_total;
  state_ = saved;
  state_.max_steps = max_steps;
  state_.steps_per_epoch = per_epoch;
  state_.schedule_total = schedule_total;
  state_.is_world_process_zero = acc_->is_main_process();
  handler_.load_states(state_);
  if (acc_->is_main_process())
    std::printf("resuming from %s at step %lld\n", checkpoint.string().c_str(),
                static_cast<long long>(saved.global_step));
  std::fflush(stdout);
}

void Trainer::load_best_model() {
  if (state_.best_model_checkpoint.empty()) return;
  const fs::path dir = fs::path(args_.output_dir) / state_.best_model_checkpoint;
  if (!fs::exists(dir)) {  // removed by hand: the run's own weights are still a model
    if (acc_->is_main_process())
      std::fprintf(stderr,
                   "tessera train: warning: the best checkpoint %s is gone (removed by hand?); "
                   "keeping the final weights instead of the best ones\n",
                   dir.string().c_str());
    return;
  }
  verify_checkpoint(dir);
  // ZeRO-3: whole while they load (every process is here), then each rank keeps its slice of
  // the best weights (which the model/ export reads; save_state no longer leaves them gathered).
  nn::Module& model = task_->model();
  acc_->unwrap_model(model);
  task_->load_weights(dir / "model.safetensors");
  if (dist::DataParallelStrategy* strategy = acc_->strategy_of(model))
    strategy->after_parameters_loaded();
  if (acc_->is_main_process())
    std::printf("loaded the best model (%s = %.6g) from %s\n", args_.metric_for_best_model.c_str(),
                state_.best_metric.value_or(NAN), dir.string().c_str());
}

}  // namespace tessera::train
