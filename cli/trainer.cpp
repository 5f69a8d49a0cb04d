#include "tessera/cli/trainer.h"

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/cli/checkpoint.h"
#include "tessera/cli/model_dir.h"
#include "tessera/cli/plot.h"
#include "tessera/cli/progress.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/data/dataloader.h"
#include "tessera/data/file_io.h"
#include "tessera/dist/accelerator.h"
#include "tessera/optim/optim.h"

namespace tessera::cli {

namespace fs = std::filesystem;

namespace {

optim::DecayShape decay_shape(const std::string& name) {
  if (name == "constant") return optim::DecayShape::Constant;
  if (name == "linear") return optim::DecayShape::Linear;
  return optim::DecayShape::Cosine;
}

// Where to resume from: a checkpoint directory, a run directory (its newest valid
// checkpoint), or "latest" (the newest valid checkpoint under cfg.out).
fs::path resolve_resume(const TrainConfig& cfg) {
  fs::path target = cfg.resume == "latest" ? fs::path(cfg.out) : fs::path(cfg.resume);
  if (fs::exists(target / "checksums.json") || fs::exists(target / "config.json")) return target;
  std::vector<std::string> warnings;
  auto latest = latest_valid_checkpoint(target / "checkpoints", warnings);
  for (const auto& w : warnings) std::cerr << "tessera train: warning: " << w << "\n";
  TESSERA_CHECK(latest.has_value(), "--resume: no valid checkpoint under '", (target / "checkpoints").string(), "'");
  return *latest;
}

// Keeps the metrics of steps up to `last_step` (a resumed run rewrites what follows).
void truncate_metrics(const fs::path& path, int64_t last_step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("step") && j["step"].get<int64_t>() <= last_step) kept += line + "\n";
  }
  data::write_file_atomically(path, kept);
}

LossCurves read_curves(const fs::path& metrics) {
  LossCurves curves;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step")) continue;
    if (j.contains("loss")) curves.train.emplace_back(j["step"].get<double>(), j["loss"].get<double>());
    if (j.contains("val_loss")) curves.val.emplace_back(j["step"].get<double>(), j["val_loss"].get<double>());
  }
  return curves;
}

std::string sample_text(nn::GPT& model, const data::Tokenizer* tokenizer, uint64_t seed, int64_t tokens) {
  std::vector<int64_t> prompt = {0};
  if (tokenizer) {
    const auto ids = tokenizer->encode("\n");
    prompt.assign(ids.begin(), ids.end());
  }
  Generator gen(seed);
  const bool was_training = model.is_training();
  model.eval();
  const Tensor out = model.generate(from_vector(prompt, {1, static_cast<int64_t>(prompt.size())}, {.dtype = DType::i64}),
                                    tokens, {.temperature = 1.0, .top_k = 0, .gen = &gen});
  model.train(was_training);
  const std::vector<int64_t> all = out.to_vector<int64_t>();
  std::vector<uint32_t> fresh(all.begin() + static_cast<int64_t>(prompt.size()), all.end());
  if (!tokenizer) {
    std::ostringstream ids;
    for (uint32_t id : fresh) ids << id << ' ';
    return ids.str();
  }
  return tokenizer->decode(fresh);
}

// Where the ranks other than the main one print (nothing).
std::ostream& null_stream() {
  static std::ostream sink(nullptr);
  return sink;
}
std::FILE* null_file() {
  static std::FILE* sink = std::fopen("/dev/null", "w");
  return sink;
}

}  // namespace

void run_training(const TrainConfig& cfg) {
  // ---- processes ----
  // Under `tessera launch` (or mpirun/SLURM) with WORLD_SIZE > 1 the run is data-parallel
  // through the Accelerator: DDP averages the gradients over the ranks, each rank reads
  // its share of every step's batches (W ranks x B rows = one process x W·B rows on
  // sequential data), and only the main process prints, logs metrics and saves.
  std::optional<dist::Accelerator> acc;
  Device device = Device::parse(cfg.device);
  if (dist::read_dist_env().world_size > 1) {
    // The trainer keeps its own mixed precision (f32 masters, loss scaler), so the
    // Accelerator adds none.
    acc.emplace(dist::AcceleratorOptions{.mixed_precision = "no",
                                         .gradient_accumulation_steps = static_cast<int>(cfg.grad_accum),
                                         .cpu = device.is_cpu()});
    if (device.is_cuda()) device = acc->device();  // one GPU per local rank
  }
  const bool main_process = !acc || acc->is_main_process();
  const int world_size = acc ? acc->num_processes() : 1;
  std::ostream& console = main_process ? std::cout : null_stream();
  const fs::path out(cfg.out);
  fs::create_directories(out);

  // ---- data ----
  const data::TokenFile train_file(cfg.data);
  fs::path val_path = cfg.val_data;
  if (val_path.empty() && fs::exists(fs::path(cfg.data).parent_path() / "val.bin") &&
      fs::path(cfg.data).filename() != "val.bin")
    val_path = fs::path(cfg.data).parent_path() / "val.bin";
  std::optional<data::TokenFile> val_file;
  if (!val_path.empty()) val_file.emplace(val_path);
  const auto tokenizer = find_tokenizer(fs::path(cfg.data).parent_path());

  // ---- model ----
  std::optional<fs::path> resume_dir;
  if (!cfg.resume.empty()) resume_dir = resolve_resume(cfg);
  manual_seed(static_cast<uint64_t>(cfg.seed));
  std::unique_ptr<nn::GPT> model;
  if (resume_dir) {
    verify_checkpoint(*resume_dir);
    model = nn::GPT::from_pretrained(resume_dir->string(), {.device = device});
  } else if (!cfg.init.empty()) {
    model = load_model(cfg.init, device);
  } else {
    nn::GPTConfig g;
    g.n_layer = cfg.n_layer, g.n_head = cfg.n_head, g.n_embd = cfg.n_embd;
    g.block_size = cfg.block_size > 0 ? cfg.block_size : cfg.seq;
    g.vocab_size = cfg.vocab_size > 0 ? cfg.vocab_size
                   : tokenizer       ? tokenizer->vocab_size()
                                     : static_cast<int64_t>(train_file.max_token()) + 1;
    g.validate();
    Generator init_gen(static_cast<uint64_t>(cfg.seed));
    model = std::make_unique<nn::GPT>(g, &init_gen, TensorOptions{.device = device});
  }
  const nn::GPTConfig& mcfg = model->config();
  TESSERA_CHECK(cfg.seq <= mcfg.block_size, "config: key \"seq\" is longer than the model context block_size = ",
                mcfg.block_size, " (got ", cfg.seq, ")");
  TESSERA_CHECK(train_file.max_token() < mcfg.vocab_size, "tessera train: '", cfg.data, "' holds token ",
                train_file.max_token(), " but the model's vocab_size is ", mcfg.vocab_size);
  if (cfg.vocab_size > 0)
    TESSERA_CHECK(cfg.vocab_size == mcfg.vocab_size, "config: key \"vocab_size\" is ", cfg.vocab_size,
                  " but the model loaded has ", mcfg.vocab_size);

  // ---- optimisation ----
  // Mixed precision: the model computes in bf16/fp16 while the optimizer updates fp32
  // master copies of its parameters (and keeps fp32 moments); after each step the masters
  // are rounded back into the model. The masters here carry f32 gradients too (unlike
  // AdamW's master_weights, which reads the low-precision gradients): fp16 loss scaling then
  // unscales, checks and clips in f32, with no underflow from dividing fp16 values.
  const std::vector<Tensor> params = model->parameters();
  const DType compute_dtype = dtype_from_name(cfg.dtype);
  const bool mixed = compute_dtype != DType::f32;
  std::vector<Tensor> master = params;
  if (mixed) {
    master.clear();
    for (const Tensor& p : params) master.push_back(p.detach().clone().requires_grad_(true));
    model->to(compute_dtype);
  }
  // After the dtype change: DDP builds its buffers for the parameters as they will train.
  if (acc) acc->prepare(*model);
  auto copy_master_into_model = [&] {
    autograd::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) Tensor(params[i]).copy_(master[i]);
  };
  optim::AdamW opt(master, {.lr = cfg.lr, .beta1 = cfg.beta1, .beta2 = cfg.beta2, .eps = cfg.eps,
                            .weight_decay = cfg.weight_decay});
  std::optional<TrainingState> resume_state;
  if (resume_dir) resume_state = load_training_state(*resume_dir);
  // A decaying schedule is shaped by the total step count, so a resumed run must keep it;
  // a constant one is not, so a run may be extended (its saved total is kept).
  int64_t schedule_total = cfg.steps;
  if (resume_state && resume_state->schedule.count("total")) {
    const auto saved_total = static_cast<int64_t>(resume_state->schedule.at("total"));
    if (cfg.schedule == "constant") {
      schedule_total = saved_total;
    } else {
      TESSERA_CHECK(saved_total == cfg.steps, "config: key \"steps\" is ", cfg.steps, " but the checkpoint's ",
                    cfg.schedule, " schedule decays over ", saved_total,
                    " steps; resume with --steps ", saved_total, " (or train with --schedule constant to extend runs)");
    }
  }
  optim::LRSchedule schedule(opt, decay_shape(cfg.schedule),
                             {.warmup = cfg.warmup, .total = schedule_total,
                              .min_lr = cfg.min_lr >= 0 ? cfg.min_lr : cfg.lr / 10});
  // fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
  optim::LossScaler scaler({.enabled = compute_dtype == DType::f16});
  data::DataLoader loader(train_file, {.batch = cfg.batch, .seq = cfg.seq,
                                       .rank = acc ? acc->process_index() : 0,
                                       .world_size = world_size, .shuffle = cfg.shuffle,
                                       .seed = static_cast<uint64_t>(cfg.seed), .device = device});

  int64_t step = 0;
  const fs::path metrics_path = out / "metrics.jsonl";
  if (resume_state) {
    const TrainingState& state = *resume_state;
    opt.load_state_dict(state.optimizer);
    schedule.load_state_dict(state.schedule);
    if (!state.loss_scaler.empty()) scaler.load_state_dict(state.loss_scaler);
    loader.set_position(state.data_position);
    default_generator().set_state(state.rng_seed, state.rng_offset);
    step = state.step;
    for (const char* key : {"batch", "seq", "grad_accum", "shuffle", "seed", "data"}) {
      if (state.config.contains(key) && state.config[key] != cfg.to_json()[key])
        std::cerr << "tessera train: warning: --resume with " << key << " = " << cfg.to_json()[key].dump()
                  << " but the checkpoint was trained with " << state.config[key].dump()
                  << "; the run will not match an uninterrupted one\n";
    }
    if (main_process) truncate_metrics(metrics_path, step);
    console << "resuming from " << resume_dir->string() << " at step " << step << "\n";
  } else if (main_process) {
    data::write_file_atomically(metrics_path, std::string());
  }
  TESSERA_CHECK(step <= cfg.steps, "tessera train: the checkpoint is at step ", step, ", past --steps ", cfg.steps);

  std::map<std::string, std::string> extra_files;
  if (tokenizer) extra_files["tokenizer.json"] = tokenizer->to_json();
  if (main_process) data::write_file_atomically(out / "config.train.json", cfg.to_json().dump(2));
  std::ofstream metrics;
  if (main_process) metrics.open(metrics_path, std::ios::app);
  auto log_metrics = [&](const nlohmann::json& j) {
    if (!main_process) return;
    metrics << j.dump() << "\n";
    metrics.flush();
  };

  console << "model: " << mcfg.n_layer << " layers, " << mcfg.n_head << " heads, " << mcfg.n_embd
            << " channels, context " << mcfg.block_size << ", vocab " << mcfg.vocab_size << " ("
            << model->num_parameters() << " parameters) on " << device.str() << "\n"
            << "data: " << train_file.size() << " tokens; " << cfg.batch << "x" << cfg.seq << " x "
            << cfg.grad_accum << " micro-batches" << (world_size > 1 ? " x " + std::to_string(world_size) + " processes" : "")
            << " = " << cfg.batch * cfg.seq * cfg.grad_accum * world_size
            << " tokens per step, " << (cfg.shuffle ? "shuffled" : "sequential") << "\n";
  std::cout.flush();

  auto run_eval = [&](Progress& progress) {
    if (!val_file || !main_process) return;
    const EvalResult r = evaluate_loss(*model, *val_file, cfg.batch, cfg.seq, cfg.eval_batches, device);
    log_metrics({{"step", step}, {"val_loss", r.loss}});
    char text[96];
    std::snprintf(text, sizeof(text), "step %lld: val_loss %.4f", static_cast<long long>(step), r.loss);
    progress.message(text);
  };
  auto save = [&](Progress& progress) {
    if (!main_process) return;
    TrainingState state;
    state.step = step;
    state.data_position = loader.position();
    state.rng_seed = default_generator().seed();
    state.rng_offset = default_generator().offset();
    state.optimizer = opt.state_dict();
    state.schedule = schedule.state_dict();
    state.loss_scaler = scaler.state_dict();
    state.config = cfg.to_json();
    fs::path dir;
    if (mixed) {
      // Checkpoints hold the fp32 masters as the model weights, so resuming is exact.
      model->to(DType::f32);
      copy_master_into_model();
      dir = save_checkpoint(out / "checkpoints", *model, state, extra_files, cfg.keep_last);
      model->to(compute_dtype);
    } else {
      dir = save_checkpoint(out / "checkpoints", *model, state, extra_files, cfg.keep_last);
    }
    progress.message("saved checkpoint " + dir.string());
  };

  Progress progress(cfg.steps, step, main_process ? stdout : null_file());
  model->train();
  const double micro_scale = 1.0 / static_cast<double>(cfg.grad_accum);
  while (step < cfg.steps) {
    const auto t0 = std::chrono::steady_clock::now();
    double step_loss = 0;
    for (int64_t micro = 0; micro < cfg.grad_accum; ++micro) {
      // Distributed: gradients are averaged over the ranks on the last micro-step only.
      std::optional<dist::AccumulateScope> scope;
      if (acc) scope.emplace(acc->accumulate(*model));
      const data::Batch batch = loader.next();
      Tensor loss = model->loss(batch.x, batch.y);
      // The step's loss is the mean over all its target tokens: each micro-batch weighs 1/A.
      const Tensor weighted = cfg.grad_accum > 1 ? loss * micro_scale : loss;
      if (scaler.enabled()) {
        scaler.backward(weighted);
      } else {
        weighted.backward();
      }
      step_loss += loss.item() * micro_scale;
      if (scope && scope->sync_gradients()) acc->ddp_of(*model)->finish_gradient_sync();
    }
    // The step's loss over all ranks' rows (what one process with all the rows reports).
    if (acc) step_loss = acc->reduce(full({1}, step_loss, {.dtype = DType::f64, .device = device}), "mean").item();
    if (mixed) {
      for (size_t i = 0; i < params.size(); ++i) {
        const Tensor g = params[i].grad();
        master[i].set_grad(g.defined() ? g.to(DType::f32) : Tensor());
      }
      model->zero_grad();
    }
    if (scaler.enabled()) scaler.unscale_(opt);
    const double norm = cfg.grad_clip > 0 ? optim::clip_grad_norm_(master, cfg.grad_clip) : optim::grad_norm(master);
    const double lr = opt.lr();
    if (scaler.enabled()) {
      scaler.step(opt);  // skipped when a gradient overflowed
      scaler.update();
    } else {
      opt.step();
    }
    opt.zero_grad();
    if (mixed) copy_master_into_model();
    schedule.step();
    ++step;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tokens_per_s = static_cast<double>(cfg.batch * cfg.seq * cfg.grad_accum * world_size) / seconds;
    log_metrics({{"step", step}, {"loss", step_loss}, {"lr", lr}, {"grad_norm", norm},
                 {"ms", seconds * 1e3}, {"tokens_per_s", tokens_per_s}});
    progress.update(step, step_loss, tokens_per_s, lr);
    TESSERA_CHECK(std::isfinite(step_loss), "tessera train: loss became ", step_loss, " at step ", step,
                  " (try a lower --lr or --grad-clip)");

    if ((cfg.eval_every > 0 && step % cfg.eval_every == 0) || step == cfg.steps) run_eval(progress);
    if (main_process && cfg.sample_every > 0 && step % cfg.sample_every == 0)
      progress.message("sample at step " + std::to_string(step) + ":\n" +
                       sample_text(*model, tokenizer.get(), static_cast<uint64_t>(cfg.seed) + step, 128));
    if ((cfg.save_every > 0 && step % cfg.save_every == 0) || step == cfg.steps) save(progress);
  }
  progress.finish();
  metrics.close();
  if (acc) {
    // Every rank holds the same weights; the main process writes them.
    acc->end_training();
    if (!main_process) return;
  }

  // The final model as a plain model directory (what eval/sample/transformers load).
  const fs::path model_dir = out / "model";
  if (mixed) {
    model->to(DType::f32);
    copy_master_into_model();
  }
  model->save_pretrained(model_dir.string());
  for (const auto& [name, contents] : extra_files) data::write_file_atomically(model_dir / name, contents);
  write_loss_curve_png((out / "loss.png").string(), read_curves(metrics_path));
  std::cout << "done: " << step << " steps; model in " << model_dir.string() << ", metrics in "
            << metrics_path.string() << ", loss curve in " << (out / "loss.png").string() << "\n";
}

}  // namespace tessera::cli
