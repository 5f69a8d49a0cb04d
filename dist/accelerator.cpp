#include "tessera/dist/accelerator.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/file_io.h"
#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"
#include "tessera/core/settings.h"
#include "tessera/dist/memory_report.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/dist/zero.h"
#include "tessera/kernels/ops.h"
#include "tessera/optim/clip.h"

namespace tessera::dist {

namespace fs = std::filesystem;

namespace {
// What `tessera launch` passed on (its --deepspeed_config_file, --fsdp_sharding_strategy,
// --gradient_accumulation_steps, --cpu; Accelerate's ACCELERATE_* variables play this part) for
// the settings the program left at their defaults.
void take_launch_settings(AcceleratorOptions& o) {
  if (o.deepspeed_config.empty()) o.deepspeed_config = setting_text(Setting::DeepSpeedConfig);
  if (o.fsdp_sharding_strategy.empty())
    o.fsdp_sharding_strategy = setting_text(Setting::FsdpShardingStrategy);
  if (o.gradient_accumulation_steps == 1)
    o.gradient_accumulation_steps =
        static_cast<int>(setting_integer(Setting::GradientAccumulationSteps));
  o.cpu = o.cpu || setting_enabled(Setting::UseCpu);
  if (o.tp_size == 1) o.tp_size = static_cast<int>(setting_integer(Setting::TpSize));
  if (o.pp_size == 1) o.pp_size = static_cast<int>(setting_integer(Setting::PpSize));
}

// FSDP's strategy name and a DeepSpeed file fill zero_stage, offload, buckets, accumulation
// and precision; what is given twice must agree (checked before any work). A training run
// hands the file over parsed (train::accelerator_options); a library user may name it instead.
void resolve_sharding(AcceleratorOptions& o) {
  if (!o.fsdp_sharding_strategy.empty()) {
    const int stage = fsdp_sharding_stage(o.fsdp_sharding_strategy);
    refuse_contradiction(o.zero_stage < 0 || o.zero_stage == stage,
                         "Accelerator: fsdp_sharding_strategy " + o.fsdp_sharding_strategy,
                         "ZeRO stage " + std::to_string(stage), "zero_stage",
                         std::to_string(o.zero_stage));
    o.zero_stage = stage;
  }
  if (!o.deepspeed && !o.deepspeed_config.empty())
    o.deepspeed = DeepSpeedConfig::read(o.deepspeed_config);
  if (o.deepspeed) o.deepspeed->apply_to(o);
}

// The stage of options whose sharding settings are resolved: theirs, else TESSERA_ZERO_STAGE.
int zero_stage_of(const AcceleratorOptions& o) {
  const int stage =
      o.zero_stage >= 0 ? o.zero_stage : static_cast<int>(setting_integer(Setting::ZeroStage));
  TESSERA_CHECK(stage >= 0 && stage <= 3,  // TESSERA_ZERO_STAGE is checked as read
                "Accelerator: zero_stage must be 0 (DDP), 1, 2 or 3; got ", stage);
  return stage;
}

// Global-norm clipping of a model split over the mesh (dist/device_mesh.h) under DDP: every dp
// replica holds the same averaged gradients, so the norm is the sum over the model's group of
// the pieces each rank counts once (a parameter kept whole on every tp rank counts on the first,
// a tied embedding on the stage that holds it).
double clip_split_model(const nn::Module& model, const MeshParallelModel& split,
                        const std::vector<Tensor>& params, double max_norm) {
  TESSERA_CHECK(max_norm > 0, "Accelerator::clip_grad_norm_: max_norm must be > 0, got ", max_norm);
  std::map<const TensorImpl*, std::string> names;
  for (const auto& [name, p] : model.named_parameters()) names.emplace(p.impl_ptr().get(), name);
  std::set<const TensorImpl*> seen;
  std::vector<Tensor> counted, grads;
  for (const Tensor& p : params) {
    if (!seen.insert(p.impl_ptr().get()).second || !p.grad().defined()) continue;
    grads.push_back(p.grad());
    auto it = names.find(p.impl_ptr().get());
    if (it == names.end() || split.counts_in_model_sums(it->second)) counted.push_back(p);
  }
  const Device device = grads.empty() ? Device::cpu() : grads.front().device();
  Tensor total =
      full({1}, optim::grad_norm_squared(counted), {.dtype = DType::f64, .device = device});
  split.model_group().all_reduce(total)->wait();
  const double norm = std::sqrt(ops::to(total, Device::cpu(), DType::f64).to_vector<double>()[0]);
  optim::clip_grads_by_norm_(grads, full({1}, norm, {.dtype = DType::f64}), max_norm);
  return norm;
}
}  // namespace

int resolved_zero_stage(AcceleratorOptions options) {
  take_launch_settings(options);
  resolve_sharding(options);
  return zero_stage_of(options);
}

Accelerator::Accelerator(AcceleratorOptions options) : options_(std::move(options)) {
  check_tracker_options();  // before anything is created
  take_launch_settings(options_);
  resolve_sharding(options_);
  TESSERA_CHECK(options_.gradient_accumulation_steps >= 1,
                "Accelerator: gradient_accumulation_steps must be >= 1, got ",
                options_.gradient_accumulation_steps);
  mixed_precision_ = options_.mixed_precision.empty() ? setting_text(Setting::MixedPrecision)
                                                      : options_.mixed_precision;
  TESSERA_CHECK(
      mixed_precision_ == "no" || mixed_precision_ == "fp16" || mixed_precision_ == "bf16",
      "Accelerator: mixed_precision must be no, fp16 or bf16; got '", mixed_precision_, "'");
  policy_ = MixedPrecisionPolicy::from_name(
      mixed_precision_, options_.reduce_dtype.empty() ? setting_text(Setting::ReduceDtype)
                                                      : options_.reduce_dtype);
  zero_stage_ = zero_stage_of(options_);
  TESSERA_CHECK(
      zero_stage_ > 0 || !(options_.offload_optimizer || options_.offload_param),
      "Accelerator: offload_optimizer and offload_param need a ZeRO stage (zero_stage >= 1); "
      "zero_stage is 0 (DDP)");
  TESSERA_CHECK(!options_.offload_step_during_backward || mixed_precision_ != "fp16",
                "Accelerator: offload_step_during_backward steps before fp16's loss scaler has "
                "checked the gradients; use bf16 or no mixed precision");
  TESSERA_CHECK(options_.stage3_prefetch_bucket_size >= 0,
                "Accelerator: stage3_prefetch_bucket_size must not be negative, got ",
                options_.stage3_prefetch_bucket_size);
  optim::LossScalerOptions scaling = options_.loss_scaler.value_or(optim::LossScalerOptions{});
  scaling.enabled = mixed_precision_ == "fp16";
  scaler_ = optim::LossScaler(scaling);
  env_ = read_dist_env();
  resolve_mesh_shape_options();  // refused before the ranks meet
  resolve_hybrid_sharding();
  if (!is_initialized()) {
    InitOptions init;
    init.backend = options_.backend;
    // A CPU-only run must not pick NCCL just because a GPU is visible.
    init.device = options_.cpu || !cuda_is_available() ? DeviceType::CPU : DeviceType::CUDA;
    init_process_group(init);
    owns_group_ = true;
  }
  // Against the world the ranks met in (what the launch environment said was checked above).
  mesh_ = std::make_unique<DeviceMesh>(
      world_ptr(), MeshShape{.dp = options_.dp_size, .tp = mesh_shape_.tp, .pp = mesh_shape_.pp});
  if (!options_.cpu && cuda_is_available())
    device_ = Device::cuda(env_.local_rank % cuda_device_count());
  if (options_.deepspeed && is_main_process())
    for (const std::string& note : options_.deepspeed->notes)
      std::cerr << options_.deepspeed->source << ": note: " << note << "\n";
}

// The mesh's shape against the launch's world size, and what cannot run on a mesh with tensor
// or pipeline parallelism: ZeRO-3 (it would shard and gather the split model's parameters on
// the dp axis, which the split models' own collectives do not expect), offload and hybrid
// sharding.
void Accelerator::resolve_mesh_shape_options() {
  mesh_shape_ = resolve_mesh_shape(
      {.dp = options_.dp_size, .tp = options_.tp_size, .pp = options_.pp_size}, env_.world_size);
  if (mesh_shape_.tp == 1 && mesh_shape_.pp == 1) return;
  const std::string mesh = "the device mesh " + mesh_shape_.str();
  TESSERA_CHECK(zero_stage_ != 3, "Accelerator: ", mesh,
                " runs DDP, ZeRO-1 or ZeRO-2 on the dp axis; ZeRO-3 (zero_stage 3) needs "
                "tp_size = pp_size = 1");
  TESSERA_CHECK(!options_.offload_optimizer && !options_.offload_param, "Accelerator: ", mesh,
                " does not support offload (offload_optimizer, offload_param); it needs "
                "tp_size = pp_size = 1");
  TESSERA_CHECK(options_.hybrid_shard_size == -1 &&
                    (options_.fsdp_sharding_strategy.empty() ||
                     !fsdp_sharding_is_hybrid(options_.fsdp_sharding_strategy)),
                "Accelerator: ", mesh,
                " does not support hybrid sharding; it needs tp_size = "
                "pp_size = 1");
}

// Hybrid sharding: hybrid_shard_size, or for FSDP's HYBRID_SHARD / _HYBRID_SHARD_ZERO2 without
// it the ranks per node; checked against the world size, the stage and offload.
void Accelerator::resolve_hybrid_sharding() {
  const std::string& fsdp = options_.fsdp_sharding_strategy;
  const bool hybrid_strategy = !fsdp.empty() && fsdp_sharding_is_hybrid(fsdp);
  TESSERA_CHECK(options_.hybrid_shard_size == -1 || fsdp.empty() || hybrid_strategy,
                "Accelerator: hybrid_shard_size ", options_.hybrid_shard_size,
                " asks for hybrid sharding but ", "fsdp_sharding_strategy ", fsdp,
                " shards over every rank; use HYBRID_SHARD or _HYBRID_SHARD_ZERO2");
  int size = options_.hybrid_shard_size;
  if (size == -1 && hybrid_strategy) size = env_.local_world_size;
  if (size == -1) return;
  check_hybrid_sharding(size, env_.world_size, zero_stage_,
                        options_.offload_optimizer || options_.offload_param, "Accelerator");
  hybrid_shard_size_ = size;
}

Accelerator::~Accelerator() {
  *gate_open_ = true;  // the optimizers may outlive this Accelerator: leave them ungated
  models_.clear();
  if (owns_group_ && is_initialized()) {
    mesh_.reset();  // its groups go before the world they were made from
    try {
      destroy_process_group();
    } catch (...) {  // a destructor must not throw (end_training reports errors)
    }
  }
}

int Accelerator::process_index() const { return world().rank(); }
int Accelerator::num_processes() const { return world().size(); }

void Accelerator::check_sharded_init() const {
  TESSERA_CHECK(
      zero_stage_ == 3,
      "Accelerator::sharded_init: sharded construction needs ZeRO stage 3 "
      "(only stage 3 keeps a slice of each parameter instead of the whole), but zero_stage is ",
      zero_stage_, zero_stage_ == 0 ? " (DDP)" : "",
      "; set zero_stage = 3 or build the model without it");
}

void Accelerator::prepare_one(nn::Module& model) {
  if (models_.count(&model)) return;
  // A stage runs one backward per micro-batch under no_sync; DDP and ZeRO-1/2 then average
  // what they accumulated (DataParallelStrategy::sync_accumulated_gradients).
  const bool pipeline = dynamic_cast<const PipelineParallelCausalLM*>(&model) != nullptr;
  TESSERA_CHECK(zero_stage_ <= 2 || !pipeline,
                "Accelerator::prepare: a pipeline stage trains under DDP, ZeRO-1 or ZeRO-2 on "
                "the dp axis; zero_stage is ",
                zero_stage_);
  // On a mesh that splits models, each replica is one model split over its tp group, its
  // pipeline or both: a whole model would be trained tp x pp times over on the same rows.
  const auto* split = dynamic_cast<const MeshParallelModel*>(&model);
  TESSERA_CHECK(mesh_->data_parallel_only() ||
                    (split && split->model_group().size() == mesh_->tp_size() * mesh_->pp_size()),
                "Accelerator::prepare: the device mesh ", mesh_->shape().str(),
                " needs the model split over its ",
                mesh_->pp_size() == 1 ? "tp group"
                : mesh_->tp_size() == 1
                    ? "pipeline"
                    : "tp and pp groups at once (" + std::to_string(mesh_->tp_size()) + " x " +
                          std::to_string(mesh_->pp_size()) + " ranks)",
                " (dist::parallelize(model, acc.mesh())); got ",
                split ? "one split over a group of " + std::to_string(split->model_group().size())
                      : "a whole " + model.type_name());
  MemoryCategoryScope tag(MemoryCategory::Parameters);
  // Parameters live in the policy's dtype from here on; the optimizer's masters keep f32.
  if (policy_.low_precision_parameters()) model.to(policy_.param_dtype);
  if (zero_stage_ == 0) {
    DDPOptions ddp;
    ddp.bucket_bytes = options_.bucket_bytes;
    ddp.find_unused_parameters = options_.find_unused_parameters;
    ddp.reduce_dtype = policy_.reduce_dtype;
    // TESSERA_SPARSE_EMBEDDING_GRADIENTS=0 turns them off for a whole job.
    ddp.sparse_embedding_gradients =
        options_.sparse_embedding_gradients && setting_enabled(Setting::SparseEmbeddingGradients);
    models_[&model] = std::make_unique<DistributedDataParallel>(model, mesh_->dp_group(), ddp);
  } else {
    ZeroOptions zero;
    zero.stage = zero_stage_;
    zero.bucket_bytes = options_.bucket_bytes;
    zero.find_unused_parameters = options_.find_unused_parameters;
    zero.reduce_dtype = policy_.reduce_dtype;
    zero.offload_optimizer = options_.offload_optimizer;
    zero.offload_param = options_.offload_param;
    zero.offload_step_during_backward = options_.offload_step_during_backward;
    zero.prefetch_numel = options_.stage3_prefetch_bucket_size;
    // A pipeline's micro-batches accumulate in the full buckets until the step's end: its
    // tied embedding's two parts are summed after the last backward, before any reduction.
    zero.accumulation = pipeline ? GradientAccumulation::no_sync : options_.zero_accumulation;
    zero.max_buckets_in_flight = options_.max_buckets_in_flight;
    zero.hybrid_shard_size = hybrid_shard_size_;
    models_[&model] = std::make_unique<ZeroStrategy>(model, mesh_->dp_group(), zero);
  }
  model_order_.push_back(&model);
  // Built before their role was known; flat buffers a strategy made are tagged already.
  for (const Tensor& p : model.parameters())
    if (p.storage()) set_memory_category(*p.storage(), MemoryCategory::Parameters);
  attach_optimizers();
}

// Each prepared optimizer goes to the strategy of the model whose parameters it trains
// (prepare(model, opt) and prepare(opt, model) alike).
void Accelerator::attach_optimizers() {
  for (optim::Optimizer* opt : optimizers_) {
    if (optimizer_strategy_.count(opt)) continue;
    std::set<const TensorImpl*> trains;
    for (const Tensor& p : opt->parameters()) trains.insert(p.impl_ptr().get());
    for (nn::Module* m : model_order_) {
      bool owns = false;
      for (const Tensor& p : m->parameters()) owns = owns || trains.count(p.impl_ptr().get());
      if (!owns) continue;
      DataParallelStrategy& strategy = *models_.at(m);
      strategy.prepare_optimizer(*opt);
      optimizer_strategy_[opt] = &strategy;
      break;
    }
  }
}

// The prepared optimizer and schedule step only on gradient-syncing micro-steps, so the
// loop may call opt.step(); sched.step(); opt.zero_grad() on every micro-step.
void Accelerator::prepare_one(optim::Optimizer& optimizer) {
  MemoryCategoryScope tag(MemoryCategory::OptimizerState);  // f32 masters
  optimizer.set_step_gate([open = gate_open_] { return *open; });
  if (policy_.low_precision_parameters()) optimizer.set_master_weights(true);
  // The DeepSpeed file's optimizer.params.lr is the lr the loop's optimizer must have (tessera
  // train builds it from the file; a loop of one's own builds it itself).
  if (options_.deepspeed && options_.deepspeed->optimizer_lr)
    for (const auto& group : optimizer.param_groups())
      TESSERA_CHECK(group.initial_lr == *options_.deepspeed->optimizer_lr,
                    options_.deepspeed->source, ": \"optimizer.params.lr\" is ",
                    *options_.deepspeed->optimizer_lr, " but the prepared optimizer's lr is ",
                    group.initial_lr);
  optimizers_.push_back(&optimizer);
  attach_optimizers();
}
void Accelerator::prepare_one(optim::LRSchedule& schedule) {
  schedule.set_step_gate([open = gate_open_] { return *open; });
  schedules_.push_back(&schedule);
}

void Accelerator::prepare_one(data::DataLoader& loader) {
  data::DataLoaderOptions o = loader.options();
  if (options_.deepspeed && options_.deepspeed->train_micro_batch_size_per_gpu)
    TESSERA_CHECK(*options_.deepspeed->train_micro_batch_size_per_gpu == o.batch,
                  options_.deepspeed->source, ": \"train_micro_batch_size_per_gpu\" is ",
                  *options_.deepspeed->train_micro_batch_size_per_gpu,
                  " but the loader's batch is ", o.batch);
  const int replicas = mesh_->dp_size();  // the ranks that read different rows
  if (options_.deepspeed && options_.deepspeed->train_batch_size)
    TESSERA_CHECK(*options_.deepspeed->train_batch_size ==
                      o.batch * options_.gradient_accumulation_steps * replicas,
                  options_.deepspeed->source, ": \"train_batch_size\" is ",
                  *options_.deepspeed->train_batch_size, " but ", o.batch, " rows x ",
                  options_.gradient_accumulation_steps, " micro-steps x ", replicas,
                  " data-parallel ranks is ",
                  o.batch * options_.gradient_accumulation_steps * replicas);
  if (o.rank != mesh_->dp_rank() || o.world_size != replicas) {
    o.rank = mesh_->dp_rank();
    o.world_size = replicas;
    uint64_t position = loader.position();
    loader = data::DataLoader(loader.file(), o);
    loader.set_position(position);
  }
  loaders_.push_back(&loader);
}

DataParallelStrategy* Accelerator::strategy_of(const nn::Module& model) const {
  auto it = models_.find(&model);
  return it == models_.end() ? nullptr : it->second.get();
}

DataParallelStrategy& Accelerator::strategy_training(const optim::Optimizer& optimizer) const {
  auto it = optimizer_strategy_.find(&optimizer);
  TESSERA_CHECK(it != optimizer_strategy_.end(),
                "Accelerator: the optimizer trains no prepared model "
                "(prepare the model it was built from as well)");
  return *it->second;
}

DistributedDataParallel* Accelerator::ddp_of(const nn::Module& model) const {
  return dynamic_cast<DistributedDataParallel*>(strategy_of(model));
}

nn::Module& Accelerator::unwrap_model(nn::Module& model) {
  if (DataParallelStrategy* s = strategy_of(model)) s->gather_full_parameters();
  return model;
}

MemoryUsage Accelerator::memory_usage(const nn::Module& model) const {
  DataParallelStrategy* s = strategy_of(model);
  TESSERA_CHECK(s, "Accelerator::memory_usage: the model was not prepared");
  MemoryUsage m = s->memory();
  for (auto& [opt, strategy] : optimizer_strategy_)
    if (strategy == s) m.optimizer += optimizer_state_bytes(*opt);
  return m;
}

void Accelerator::reset_memory_peak() { reset_category_peak(device_.type); }

std::vector<RankMemory> Accelerator::gather_rank_memory(const CategoryMemoryStats& stats) {
  std::vector<int64_t> mine(stats.in_use.begin(), stats.in_use.end());
  mine.insert(mine.end(), stats.at_peak.begin(), stats.at_peak.end());
  mine.push_back(stats.peak);
  const int64_t width = static_cast<int64_t>(mine.size());
  const std::vector<int64_t> all =
      gather(ops::to(from_vector(mine, {1, width}, {.dtype = DType::i64}), device_, DType::i64))
          .to_vector<int64_t>();
  std::vector<RankMemory> ranks(num_processes());
  for (int r = 0; r < num_processes(); ++r) {
    const int64_t* row = all.data() + r * width;
    std::copy(row, row + kNumMemoryCategories, ranks[r].now.begin());
    std::copy(row + kNumMemoryCategories, row + 2 * kNumMemoryCategories, ranks[r].at_peak.begin());
    ranks[r].peak = row[2 * kNumMemoryCategories];
  }
  return ranks;
}

void Accelerator::keep_memory_apart(const std::string& phase, const CategoryMemoryStats& stats) {
  for (auto& [name, kept] : memory_apart_)
    if (name == phase) {
      if (stats.peak > kept.peak) kept = stats;
      return;
    }
  memory_apart_.emplace_back(phase, stats);
}

std::optional<CategoryMemoryStats> Accelerator::memory_apart(const std::string& phase) const {
  for (const auto& [name, kept] : memory_apart_)
    if (name == phase) return kept;
  return std::nullopt;
}

void Accelerator::end_memory_phase(const std::string& phase) {
  memory_phases_.push_back({phase, gather_rank_memory(category_memory_stats(device_.type))});
  reset_memory_peak();
}

std::string Accelerator::memory_report(const nn::Module& model) {
  DataParallelStrategy* s = strategy_of(model);
  TESSERA_CHECK(s, "Accelerator::memory_report: the model was not prepared");
  const std::vector<RankMemory> ranks = gather_rank_memory(category_memory_stats(device_.type));
  std::vector<MemoryPhase> phases = memory_phases_;
  // Every rank saved or none did (save_state is collective): the gather is everyone's.
  for (const auto& [phase, stats] : memory_apart_)
    phases.push_back({phase, gather_rank_memory(stats)});
  if (!is_main_process()) return "";
  std::set<const TensorImpl*> seen;
  int64_t psi = 0;
  DType dtype = DType::f32;
  for (const Tensor& p : model.parameters())
    if (p.requires_grad() && seen.insert(p.impl_ptr().get()).second) {
      psi += p.numel();
      dtype = p.dtype();
    }
  const bool masters = policy_.low_precision_parameters();
  const MemoryReportHeader header{s->name(), num_processes(), psi,
                                  masters
                                      ? std::string(dtype_name(dtype)) + " parameters + f32 masters"
                                      : std::string(dtype_name(dtype))};
  std::string table = format_memory_report(
      header, ranks,
      // Hybrid sharding keeps ZeRO's state of a shard group: Psi over its ranks.
      zero_memory_formula(psi, dtype_size(dtype), masters, zero_stage_,
                          hybrid_shard_size_ > 0 ? hybrid_shard_size_ : mesh_->dp_size()),
      phases);
  if (!memory_categories_enabled())
    table += "(counting was off: call enable_memory_categories(true) first)\n";
  return table;
}

AccumulateScope Accelerator::accumulate(nn::Module& model) {
  ++micro_step_;
  step_skipped_ = false;
  sync_gradients_ = micro_step_ % options_.gradient_accumulation_steps == 0;
  *gate_open_ = sync_gradients_;
  std::vector<DataParallelStrategy::NoSyncGuard> guards;
  if (!sync_gradients_)
    if (DataParallelStrategy* s = strategy_of(model)) guards.push_back(s->no_sync());
  std::unique_ptr<autograd::AutocastGuard> autocast;
  if (policy_.compute_dtype != DType::f32)
    autocast = std::make_unique<autograd::AutocastGuard>(policy_.compute_dtype);
  return AccumulateScope(sync_gradients_, std::move(guards), std::move(autocast));
}

Tensor Accelerator::train_step(nn::Module& model, const std::function<Tensor()>& step) {
  DataParallelStrategy* s = strategy_of(model);
  TESSERA_CHECK(s, "Accelerator::train_step: the model was not prepared");
  TESSERA_CHECK(zero_stage_ <= 2, "Accelerator::train_step: ZeRO stage ", zero_stage_,
                " cannot average the gradients of a model that runs its own backwards; use "
                "DDP, ZeRO-1 or ZeRO-2");
  TESSERA_CHECK(!scaler_.enabled(),
                "Accelerator::train_step: fp16 loss scaling needs the loss "
                "before its backward (Accelerator::backward); use bf16 or no mixed precision");
  TESSERA_CHECK(options_.gradient_accumulation_steps == 1,
                "Accelerator::train_step: "
                "gradient_accumulation_steps is ",
                options_.gradient_accumulation_steps,
                "; a pipeline accumulates over its micro-batches (set those instead)");
  Tensor loss;
  {
    DataParallelStrategy::NoSyncGuard off = s->no_sync();
    loss = step();
  }
  if (sync_gradients_) s->sync_accumulated_gradients();
  return loss;
}

void Accelerator::backward(const Tensor& loss) {
  const int steps = options_.gradient_accumulation_steps;
  const Tensor scaled = steps > 1 ? loss / static_cast<double>(steps) : loss;
  if (scaler_.enabled()) {
    TESSERA_CHECK(optimizers_.size() == 1,
                  "Accelerator::backward: fp16 loss scaling needs exactly "
                  "one prepared optimizer (its gradients are unscaled), got ",
                  optimizers_.size());
    scaler_.backward(scaled);
  } else {
    scaled.backward();
  }
  // Inside no_sync too: ZeRO-2/3 reduce every micro-batch by default (DDP's does nothing).
  for (nn::Module* m : model_order_) models_.at(m)->finish_gradient_sync();
  if (!sync_gradients_) return;
  if (scaler_.enabled()) unscale_gradients();
}

// The loss scaler's bookkeeping for this optimizer step happens here, right after the
// gradients are complete: unscale_ (and the finiteness check), then scaler.step with the
// optimizer's gate shut (it only records the outcome: the user's opt.step() does the
// update) and update() (the new scale is first used by the next backward).
void Accelerator::unscale_gradients() {
  optim::Optimizer& opt = *optimizers_.front();
  bool finite = scaler_.unscale_(opt);
  if (zero_stage_ > 0 || !mesh_->data_parallel_only()) {
    // A ZeRO rank checks only its slices, a tensor-parallel rank its part of the model: the
    // step is skipped everywhere if any overflowed.
    Tensor overflow = full({1}, finite ? 0.0 : 1.0, {.device = device_});
    world().all_reduce(overflow, ReduceOp::Max)->wait();
    if (finite && ops::to(overflow, Device::cpu(), DType::f32).item() != 0) {
      scaler_.record_found_inf();
      finite = false;
    }
  }
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
  if (!mesh_->data_parallel_only()) {
    const auto* split = model_order_.size() == 1
                            ? dynamic_cast<const MeshParallelModel*>(model_order_.front())
                            : nullptr;
    TESSERA_CHECK(split, "Accelerator::clip_grad_norm_: on the device mesh ", mesh_->shape().str(),
                  " it clips one prepared model split over the mesh (tensor or pipeline "
                  "parallel, or both); ",
                  model_order_.size(), " models were prepared");
    // ZeRO: this rank's slices of what it counts, summed over dp and over the model's group.
    if (auto* zero = dynamic_cast<ZeroStrategy*>(models_.at(model_order_.front()).get()))
      return zero->clip_split_grad_norm_(
          max_norm, [split](const std::string& name) { return split->counts_in_model_sums(name); },
          split->model_group());
    return clip_split_model(*model_order_.front(), *split, params, max_norm);
  }
  // A sharding strategy clips what its rank holds, with the norm summed over ranks.
  if (model_order_.size() == 1)
    return models_.at(model_order_.front())->clip_grad_norm_(params, max_norm);
  return optim::clip_grad_norm_(params, max_norm);
}

Tensor Accelerator::clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm) {
  if (!sync_gradients_ || step_skipped_) return Tensor();
  const std::string blocker = device_clipping_blocker();
  TESSERA_CHECK(blocker.empty(), "Accelerator::clip_grad_norm_on_device_: ", blocker);
  // After the sync every process's gradients are the full averaged ones (DDP), so the
  // local norm is the global one.
  return optim::clip_grad_norm_on_device_(params, max_norm);
}

std::string Accelerator::device_clipping_blocker() const {
  if (!device_.is_cuda()) return "the run is not on a CUDA device";
  if (zero_stage_ > 0) return "ZeRO shards the gradients (their norm is summed over ranks)";
  if (!mesh_->data_parallel_only()) return "the device mesh splits the model over ranks";
  if (scaler_.enabled()) return "fp16 loss scaling checks gradients on the host";
  return "";
}

std::string Accelerator::graph_capture_blocker() const {
  if (zero_stage_ > 0) return "ZeRO shards the optimizer step";
  if (num_processes() > 1 && !world().records_in_graphs())
    return "the " + world().backend_name() + " backend's collectives cannot be recorded";
  return device_clipping_blocker();
}

void Accelerator::wait_for_everyone() { world().barrier()->wait(); }

// NCCL moves the memory of its own GPU only: host tensors (evaluation totals, metrics,
// flags) travel through the run's device there and come back.
Device Accelerator::comm_device(const Tensor& t) const {
  const Device here = t.defined() ? t.device() : Device::cpu();
  return !world().handles(here) && world().handles(device_) ? device_ : here;
}

Tensor Accelerator::gather(const Tensor& t) { return gather_over(world(), t); }

Tensor Accelerator::gather_over(ProcessGroup& pg, const Tensor& t) {
  TESSERA_CHECK(t.dim() >= 1, "Accelerator::gather: needs a tensor with a leading dimension, got ",
                shape_str(t.shape()));
  if (comm_device(t) != t.device())
    return ops::to(gather_over(pg, ops::to(t.detach(), comm_device(t), t.dtype())), t.device(),
                   t.dtype());
  // Every process's length along dim 0 first, then an uneven all_gather of the rows. The
  // lengths travel on t's device.
  Tensor my_rows =
      full({1}, static_cast<double>(t.size(0)), {.dtype = DType::i64, .device = t.device()});
  Tensor rows = empty({pg.size()}, {.dtype = DType::i64, .device = t.device()});
  pg.all_gather(rows, my_rows)->wait();
  std::vector<int64_t> counts = rows.to_vector<int64_t>();
  Shape out_shape = t.shape();
  out_shape[0] = 0;
  for (int64_t c : counts) out_shape[0] += c;
  Tensor out = empty(out_shape, {.dtype = t.dtype(), .device = t.device()});
  std::vector<Tensor> parts;
  int64_t start = 0;
  for (int64_t c : counts) {
    parts.push_back(ops::narrow(out, 0, start, c));
    start += c;
  }
  pg.all_gather(parts, t.detach())->wait();
  return out;
}

Tensor Accelerator::gather_for_metrics(const Tensor& t) {
  // Over the dp axis: the ranks of one tp group and the stages of one pipeline hold the same
  // rows (gathering over the world would repeat them tp x pp times).
  if (padded_split_total_ < 0) return gather_over(*mesh_->dp_group(), t);
  return gather_for_metrics(t, padded_split_total_);
}

Tensor Accelerator::gather_for_metrics(const Tensor& t, int64_t total) {
  const int replicas = mesh_->dp_size();
  Tensor all = gather_over(*mesh_->dp_group(), t);
  TESSERA_CHECK(total >= 0 && total <= all.size(0), "Accelerator::gather_for_metrics: total ",
                total, " is more than the ", all.size(0), " rows gathered");
  // Shares are contiguous and in rank order, so the padding sits at the ends of the
  // shares; with equal padded shares the real rows of rank r are the first `real_r`.
  auto padded = share_of(total, true).padded;
  if (padded * replicas != all.size(0)) return ops::narrow(all, 0, 0, total);
  std::vector<Tensor> rows;
  for (int r = 0; r < replicas; ++r) {
    int64_t base = total / replicas, extra = total % replicas;
    int64_t real = base + (r < extra ? 1 : 0);
    if (real > 0) rows.push_back(ops::narrow(all, 0, r * padded, real));
  }
  return rows.empty() ? ops::narrow(all, 0, 0, 0) : ops::cat(rows, 0);
}

Accelerator::Share Accelerator::share_of(int64_t n, bool apply_padding) const {
  // By dp rank: the ranks of one replica (its tp and pp peers) take the same share.
  const int64_t w = mesh_->dp_size(), r = mesh_->dp_rank();
  const int64_t base = n / w, extra = n % w;
  const int64_t begin = r * base + std::min(r, extra);
  const int64_t size = base + (r < extra ? 1 : 0);
  return {begin, begin + size, apply_padding ? base + (extra > 0 ? 1 : 0) : size};
}

Tensor Accelerator::reduce(const Tensor& t, const std::string& op) {
  static const std::map<std::string, ReduceOp> ops = {{"sum", ReduceOp::Sum},
                                                      {"mean", ReduceOp::Avg},
                                                      {"max", ReduceOp::Max},
                                                      {"min", ReduceOp::Min}};
  auto it = ops.find(op);
  TESSERA_CHECK(it != ops.end(), "Accelerator::reduce: op must be sum, mean, max or min; got '", op,
                "'");
  Tensor out = ops::to(t.detach(), comm_device(t), t.dtype());
  if (out.raw_data() == t.raw_data()) out = ops::clone(out);
  // Ordered on the device (the host goes on; a host read of `out` waits for it there).
  world().all_reduce(out, it->second)->wait_on_device();
  return ops::to(out, t.device(), t.dtype());
}

Tensor Accelerator::pad_across_processes(const Tensor& t, int64_t dim, double pad_value,
                                         bool pad_first) {
  dim = wrap_dim(dim, t.dim(), "Accelerator::pad_across_processes");
  Tensor size =
      full({1}, static_cast<double>(t.size(dim)), {.dtype = DType::i64, .device = comm_device(t)});
  world().all_reduce(size, ReduceOp::Max)->wait();
  const int64_t longest = size.to_vector<int64_t>()[0];
  if (longest == t.size(dim)) return t;
  Shape shape = t.shape();
  shape[dim] = longest;
  Tensor out = full(shape, pad_value, {.dtype = t.dtype(), .device = t.device()});
  ops::copy_(ops::narrow(out, dim, pad_first ? longest - t.size(dim) : 0, t.size(dim)), t.detach());
  return out;
}

bool Accelerator::check_trigger() {
  Tensor flag =
      full({1}, trigger_ ? 1.0 : 0.0, {.dtype = DType::u8, .device = comm_device(Tensor())});
  world().all_reduce(flag, ReduceOp::Max)->wait();
  trigger_ = false;
  return flag.to_vector<uint8_t>()[0] != 0;
}

void Accelerator::free_memory() {
  *gate_open_ = true;
  // Parameters stay whole once their strategy is gone (ZeRO-3 gathers them: collective).
  for (auto& [m, s] : models_) s->gather_full_parameters();
  optimizer_strategy_.clear();
  models_.clear();
  model_order_.clear();
  optimizers_.clear();
  schedules_.clear();
  loaders_.clear();
}

void Accelerator::end_training() {
  finish_trackers();
  wait_for_everyone();
  free_memory();
  if (owns_group_) {
    mesh_.reset();
    destroy_process_group();
    owns_group_ = false;
  }
}

}  // namespace tessera::dist
