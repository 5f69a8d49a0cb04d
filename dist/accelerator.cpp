#include "tessera/dist/accelerator.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/data/file_io.h"
#include "tessera/kernels/ops.h"
#include "tessera/optim/clip.h"

namespace tessera::dist {

namespace fs = std::filesystem;

Accelerator::Accelerator(AcceleratorOptions options) : options_(std::move(options)) {
  TESSERA_CHECK(options_.gradient_accumulation_steps >= 1,
                "Accelerator: gradient_accumulation_steps must be >= 1, got ",
                options_.gradient_accumulation_steps);
  mixed_precision_ = options_.mixed_precision.empty()
                         ? env_string("TESSERA_MIXED_PRECISION", "no")
                         : options_.mixed_precision;
  TESSERA_CHECK(mixed_precision_ == "no" || mixed_precision_ == "fp16" || mixed_precision_ == "bf16",
                "Accelerator: mixed_precision must be no, fp16 or bf16; got '", mixed_precision_, "'");
  scaler_ = optim::LossScaler({.enabled = mixed_precision_ == "fp16"});
  env_ = read_dist_env();
  if (!is_initialized()) {
    InitOptions init;
    init.backend = options_.backend;
    // A CPU-only run must not pick NCCL just because a GPU is visible.
    if (options_.cpu && init.backend == "auto" && env_.world_size > 1)
      init.backend = (env_.launcher == Launcher::Mpirun && has_backend("mpi")) ? "mpi" : "tcp";
    init_process_group(init);
    owns_group_ = true;
  }
  if (!options_.cpu && cuda_is_available())
    device_ = Device::cuda(env_.local_rank % cuda_device_count());
}

Accelerator::~Accelerator() {
  *gate_open_ = true;  // the optimizers may outlive this Accelerator: leave them ungated
  models_.clear();
  if (owns_group_ && is_initialized()) {
    try {
      destroy_process_group();
    } catch (...) {  // a destructor must not throw (end_training reports errors)
    }
  }
}

int Accelerator::process_index() const { return world().rank(); }
int Accelerator::num_processes() const { return world().size(); }

void Accelerator::prepare_one(nn::Module& model) {
  if (models_.count(&model)) return;
  DDPOptions ddp;
  ddp.bucket_bytes = options_.bucket_bytes;
  ddp.find_unused_parameters = options_.find_unused_parameters;
  models_[&model] = std::make_unique<DistributedDataParallel>(model, world_ptr(), ddp);
  model_order_.push_back(&model);
}

// The prepared optimizer and schedule step only on gradient-syncing micro-steps, so the
// loop may call opt.step(); sched.step(); opt.zero_grad() on every micro-step.
void Accelerator::prepare_one(optim::Optimizer& optimizer) {
  optimizer.set_step_gate([open = gate_open_] { return *open; });
  optimizers_.push_back(&optimizer);
}
void Accelerator::prepare_one(optim::LRSchedule& schedule) {
  schedule.set_step_gate([open = gate_open_] { return *open; });
  schedules_.push_back(&schedule);
}

void Accelerator::prepare_one(data::DataLoader& loader) {
  data::DataLoaderOptions o = loader.options();
  if (o.rank != process_index() || o.world_size != num_processes()) {
    o.rank = process_index();
    o.world_size = num_processes();
    uint64_t position = loader.position();
    loader = data::DataLoader(loader.file(), o);
    loader.set_position(position);
  }
  loaders_.push_back(&loader);
}

DistributedDataParallel* Accelerator::ddp_of(const nn::Module& model) const {
  auto it = models_.find(&model);
  return it == models_.end() ? nullptr : it->second.get();
}

AccumulateScope Accelerator::accumulate(nn::Module& model) {
  ++micro_step_;
  step_skipped_ = false;
  sync_gradients_ = micro_step_ % options_.gradient_accumulation_steps == 0;
  *gate_open_ = sync_gradients_;
  std::vector<DistributedDataParallel::NoSyncGuard> guards;
  if (!sync_gradients_)
    if (DistributedDataParallel* ddp = ddp_of(model)) guards.push_back(ddp->no_sync());
  std::unique_ptr<autograd::AutocastGuard> autocast;
  if (mixed_precision_ != "no")
    autocast = std::make_unique<autograd::AutocastGuard>(mixed_precision_ == "bf16" ? DType::bf16
                                                                                     : DType::f16);
  return AccumulateScope(sync_gradients_, std::move(guards), std::move(autocast));
}

void Accelerator::backward(const Tensor& loss) {
  const int steps = options_.gradient_accumulation_steps;
  const Tensor scaled = steps > 1 ? loss / static_cast<double>(steps) : loss;
  if (scaler_.enabled()) {
    TESSERA_CHECK(optimizers_.size() == 1, "Accelerator::backward: fp16 loss scaling needs exactly "
                  "one prepared optimizer (its gradients are unscaled), got ", optimizers_.size());
    scaler_.backward(scaled);
  } else {
    scaled.backward();
  }
  if (!sync_gradients_) return;
  for (nn::Module* m : model_order_) models_.at(m)->finish_gradient_sync();
  if (scaler_.enabled()) unscale_gradients();
}

// The loss scaler's bookkeeping for this optimizer step happens here, right after the
// gradients are complete: unscale_ (and the finiteness check), then scaler.step with the
// optimizer's gate shut (it only records the outcome: the user's opt.step() does the
// update) and update() (the new scale is first used by the next backward).
void Accelerator::unscale_gradients() {
  optim::Optimizer& opt = *optimizers_.front();
  const bool finite = scaler_.unscale_(opt);
  *gate_open_ = false;
  scaler_.step(opt);
  scaler_.update();
  step_skipped_ = !finite;
  if (finite) {
    *gate_open_ = true;
  } else {
    // The gate stays shut for this micro-step (no step, no zero_grad by the user), so
    // the gradients are dropped here: the next accumulation starts clean.
    autograd::zero_grad(opt.parameters(), true);
  }
}

double Accelerator::clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) {
  if (!sync_gradients_ || step_skipped_) return 0.0;
  return optim::clip_grad_norm_(params, max_norm);
}

void Accelerator::wait_for_everyone() { world().barrier()->wait(); }

Tensor Accelerator::gather(const Tensor& t) {
  ProcessGroup& pg = world();
  TESSERA_CHECK(t.dim() >= 1, "Accelerator::gather: needs a tensor with a leading dimension, got ",
                shape_str(t.shape()));
  // Every process's length along dim 0 first, then an uneven all_gather of the rows.
  Tensor my_rows = full({1}, static_cast<double>(t.size(0)), {.dtype = DType::i64});
  Tensor rows = empty({pg.size()}, {.dtype = DType::i64});
  pg.all_gather(rows, my_rows)->wait();
  std::vector<int64_t> counts = rows.to_vector<int64_t>();
  Shape out_shape = t.shape();
  out_shape[0] = 0;
  for (int64_t c : counts) out_shape[0] += c;
  Tensor out = empty(out_shape, {.dtype = t.dtype(), .device = t.device()});
  std::vector<Tensor> parts;
  int64_t start = 0;
  for (int64_t c : counts) {
    parts.push_back(raw::narrow(out, 0, start, c));
    start += c;
  }
  pg.all_gather(parts, t.detach())->wait();
  return out;
}

Tensor Accelerator::gather_for_metrics(const Tensor& t) {
  if (padded_split_total_ < 0) return gather(t);
  return gather_for_metrics(t, padded_split_total_);
}

Tensor Accelerator::gather_for_metrics(const Tensor& t, int64_t total) {
  Tensor all = gather(t);
  TESSERA_CHECK(total >= 0 && total <= all.size(0), "Accelerator::gather_for_metrics: total ",
                total, " is more than the ", all.size(0), " rows gathered");
  // Shares are contiguous and in rank order, so the padding sits at the ends of the
  // shares; with equal padded shares the real rows of rank r are the first `real_r`.
  auto padded = share_of(total, true).padded;
  if (padded * num_processes() != all.size(0)) return raw::narrow(all, 0, 0, total);
  std::vector<Tensor> rows;
  for (int r = 0; r < num_processes(); ++r) {
    int64_t base = total / num_processes(), extra = total % num_processes();
    int64_t real = base + (r < extra ? 1 : 0);
    if (real > 0) rows.push_back(raw::narrow(all, 0, r * padded, real));
  }
  return rows.empty() ? raw::narrow(all, 0, 0, 0) : ops::cat(rows, 0);
}

Accelerator::Share Accelerator::share_of(int64_t n, bool apply_padding) const {
  const int64_t w = num_processes(), r = process_index();
  const int64_t base = n / w, extra = n % w;
  const int64_t begin = r * base + std::min(r, extra);
  const int64_t size = base + (r < extra ? 1 : 0);
  return {begin, begin + size, apply_padding ? base + (extra > 0 ? 1 : 0) : size};
}

Tensor Accelerator::reduce(const Tensor& t, const std::string& op) {
  static const std::map<std::string, ReduceOp> ops = {
      {"sum", ReduceOp::Sum}, {"mean", ReduceOp::Avg}, {"max", ReduceOp::Max}, {"min", ReduceOp::Min}};
  auto it = ops.find(op);
  TESSERA_CHECK(it != ops.end(), "Accelerator::reduce: op must be sum, mean, max or min; got '",
                op, "'");
  Tensor out = raw::clone(t.detach());
  world().all_reduce(out, it->second)->wait();
  return out;
}

Tensor Accelerator::pad_across_processes(const Tensor& t, int64_t dim, double pad_value,
                                         bool pad_first) {
  dim = wrap_dim(dim, t.dim(), "Accelerator::pad_across_processes");
  Tensor size = full({1}, static_cast<double>(t.size(dim)), {.dtype = DType::i64});
  world().all_reduce(size, ReduceOp::Max)->wait();
  const int64_t longest = size.to_vector<int64_t>()[0];
  if (longest == t.size(dim)) return t;
  Shape shape = t.shape();
  shape[dim] = longest;
  Tensor out = full(shape, pad_value, {.dtype = t.dtype(), .device = t.device()});
  raw::copy_(raw::narrow(out, dim, pad_first ? longest - t.size(dim) : 0, t.size(dim)), t.detach());
  return out;
}

bool Accelerator::check_trigger() {
  Tensor flag = full({1}, trigger_ ? 1.0 : 0.0, {.dtype = DType::u8});
  world().all_reduce(flag, ReduceOp::Max)->wait();
  trigger_ = false;
  return flag.to_vector<uint8_t>()[0] != 0;
}

namespace {
std::string numbered(const std::string& stem, size_t i, const std::string& ext) {
  return i == 0 ? stem + ext : stem + "_" + std::to_string(i) + ext;
}
constexpr const char* kStateFile = "accelerator_state.json";
}  // namespace

void Accelerator::save_state(const std::string& dir) {
  // Per-process values (RNG, loader positions) are gathered so the main process can
  // write them all.
  Generator& gen = default_generator();
  Tensor mine = from_vector(std::vector<int64_t>{static_cast<int64_t>(gen.seed()),
                                                 static_cast<int64_t>(gen.offset())},
                            {2}, {.dtype = DType::i64});
  std::vector<int64_t> rng = gather(mine.view({1, 2})).to_vector<int64_t>();
  std::vector<std::vector<int64_t>> positions;
  for (data::DataLoader* l : loaders_) {
    Tensor p = full({1}, static_cast<double>(l->position()), {.dtype = DType::i64});
    positions.push_back(gather(p).to_vector<int64_t>());
  }
  if (is_main_process()) {
    fs::create_directories(dir);
    for (size_t i = 0; i < model_order_.size(); ++i) {
      optim::OptimizerStateDict weights;
      for (auto& [name, t] : model_order_[i]->state_dict()) weights.tensors[name] = t;
      optim::save_optimizer_state(weights, (fs::path(dir) / numbered("model", i, ".safetensors")).string());
    }
    for (size_t i = 0; i < optimizers_.size(); ++i)
      optim::save_optimizer_state(optimizers_[i]->state_dict(),
                                  (fs::path(dir) / numbered("optimizer", i, ".safetensors")).string());
    nlohmann::json state;
    state["micro_step"] = micro_step_;
    state["num_processes"] = num_processes();
    state["rng"] = rng;  // seed, offset for each process in turn
    state["loader_positions"] = positions;
    state["schedules"] = nlohmann::json::array();
    for (optim::LRSchedule* s : schedules_) state["schedules"].push_back(s->state_dict());
    state["loss_scaler"] = scaler_.state_dict();
    nlohmann::json file;
    file["state"] = state;
    file["crc32"] = data::crc32(state.dump());
    data::write_file_atomically(fs::path(dir) / kStateFile, file.dump(2));
  }
  wait_for_everyone();
}

void Accelerator::load_state(const std::string& dir) {
  const fs::path state_path = fs::path(dir) / kStateFile;
  nlohmann::json file;
  try {
    file = nlohmann::json::parse(data::read_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("Accelerator::load_state: ", state_path.string(), " is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(file.contains("state") && file.contains("crc32") &&
                    file["crc32"].get<uint32_t>() == data::crc32(file["state"].dump()),
                "Accelerator::load_state: ", state_path.string(),
                " is damaged (checksum mismatch); refusing to load it");
  const nlohmann::json& state = file["state"];
  TESSERA_CHECK(state["num_processes"].get<int>() == num_processes(),
                "Accelerator::load_state: ", dir, " was saved by ",
                state["num_processes"].get<int>(), " processes, this job has ", num_processes());
  TESSERA_CHECK(state["schedules"].size() == schedules_.size() &&
                    state["loader_positions"].size() == loaders_.size(),
                "Accelerator::load_state: ", dir, " holds ", state["schedules"].size(),
                " schedules and ", state["loader_positions"].size(),
                " loaders, but this Accelerator prepared ", schedules_.size(), " and ",
                loaders_.size());
  for (size_t i = 0; i < model_order_.size(); ++i)
    model_order_[i]->load_state_dict(
        optim::load_optimizer_state((fs::path(dir) / numbered("model", i, ".safetensors")).string()).tensors);
  for (size_t i = 0; i < optimizers_.size(); ++i)
    optimizers_[i]->load_state_dict(
        optim::load_optimizer_state((fs::path(dir) / numbered("optimizer", i, ".safetensors")).string()));
  for (size_t i = 0; i < schedules_.size(); ++i)
    schedules_[i]->load_state_dict(state["schedules"][i].get<std::map<std::string, double>>());
  for (size_t i = 0; i < loaders_.size(); ++i)
    loaders_[i]->set_position(state["loader_positions"][i][process_index()].get<uint64_t>());
  auto rng = state["rng"].get<std::vector<int64_t>>();
  default_generator().set_state(static_cast<uint64_t>(rng.at(2 * process_index())),
                                static_cast<uint64_t>(rng.at(2 * process_index() + 1)));
  micro_step_ = state["micro_step"].get<int64_t>();
  if (state.contains("loss_scaler"))  // states written before fp16 scaling lack it
    scaler_.load_state_dict(state["loss_scaler"].get<std::map<std::string, double>>());
  sync_gradients_ = *gate_open_ = true;
  wait_for_everyone();
}

void Accelerator::free_memory() {
  *gate_open_ = true;
  models_.clear();
  model_order_.clear();
  optimizers_.clear();
  schedules_.clear();
  loaders_.clear();
}

void Accelerator::end_training() {
  wait_for_everyone();
  free_memory();
  if (owns_group_) {
    destroy_process_group();
    owns_group_ = false;
  }
}

}  // namespace tessera::dist
