// Accelerator: the user-facing API, shaped like Hugging Face Accelerate.
//
//   Accelerator acc({.gradient_accumulation_steps = 4});
//   acc.prepare(model, opt, loader, sched);       // DDP-wraps, shards the loader
//   for (auto& [x, y] : loader) {
//     auto step = acc.accumulate(model);          // no_sync except on the last micro-step
//     acc.backward(model.loss(x, y));             // loss / steps, backward, gradient sync
//     acc.clip_grad_norm_(model.parameters(), 1.0);
//     opt.step(); sched.step(); opt.zero_grad();  // gated: act on syncing steps only
//   }
//
// The process group comes from the launch environment (tessera launch, mpirun, SLURM,
// or a single process). The model object stays the user's: prepare() attaches a
// data-parallel strategy (dist/strategy.h: DDP, or a ZeRO stage) to it instead of
// replacing it, so unwrap_model returns the same object.
//
// Mixed precision is one policy (MixedPrecisionPolicy): with "bf16"/"fp16" prepare()
// casts the model's parameters to that dtype, the prepared optimizer keeps f32 masters
// and updates them (AdamW's master-weights path), gradients are averaged in the policy's
// reduce dtype (bf16 for bf16, f32 for fp16; `reduce_dtype` overrides), and fp16's dynamic
// loss scale lives here.
#pragma once
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/autograd/autocast.h"
#include "tessera/core/deferred_init.h"
#include "tessera/core/memory_category.h"
#include "tessera/data/dataloader.h"
#include "tessera/dist/ddp.h"
#include "tessera/dist/deepspeed_config.h"
#include "tessera/dist/device_mesh.h"
#include "tessera/dist/memory_report.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/strategy.h"
#include "tessera/dist/trackers.h"
#include "tessera/dist/zero.h"
#include "tessera/nn/module.h"
#include "tessera/optim/loss_scaler.h"
#include "tessera/optim/optimizer.h"
#include "tessera/optim/schedule.h"

namespace tessera::dist {

// Stage 3's default prefetch (DeepSpeed's stage3_prefetch_bucket_size default), in elements.
inline constexpr int64_t kDefaultStage3PrefetchElements = 50'000'000;

struct AcceleratorOptions {
  // "no", "fp16" or "bf16"; empty = TESSERA_MIXED_PRECISION (set by tessera launch) or "no".
  std::string mixed_precision;
  // The dtype gradients are averaged in across ranks: "fp32", or the parameters' own
  // ("bf16" with mixed_precision bf16); empty = TESSERA_REDUCE_DTYPE or the policy's default
  // (bf16 for bf16, fp32 otherwise).
  std::string reduce_dtype;
  int gradient_accumulation_steps = 1;
  std::string backend = "auto";  // see init_process_group
  size_t bucket_bytes = kDefaultBucketBytes;
  bool find_unused_parameters = false;
  // DDP: embedding gradients all-gathered as rows where that moves fewer bytes than the
  // all-reduce (dist/sparse_embedding.h); false (or TESSERA_SPARSE_EMBEDDING_GRADIENTS=0):
  // averaged densely like every other gradient.
  bool sparse_embedding_gradients = true;
  bool cpu = false;  // stay on the CPU even when a GPU is visible
  // 0 = DDP; 1 = optimizer state sharded, 2 = and gradients, 3 = and parameters (ZeRO);
  // -1 = TESSERA_ZERO_STAGE (set by the launch environment) or 0.
  int zero_stage = -1;
  // ZeRO-Offload (dist/offload.h): this rank's optimizer state and f32 masters in (pinned)
  // host memory and AdamW on the CPU; needs zero_stage >= 1.
  bool offload_optimizer = false;
  // And the rank's parameter shard on the host (zero_stage 3; implies offload_optimizer).
  bool offload_param = false;
  // Offloaded: each bucket's host AdamW step runs as soon as its gradient slice has landed,
  // during backward (ZeroOptions::offload_step_during_backward: no clipping, no fp16).
  bool offload_step_during_backward = false;
  // Stage 3: elements of the next units' parameters all-gathered ahead of use (DeepSpeed's
  // stage3_prefetch_bucket_size); 0 gathers each unit only when it runs.
  int64_t stage3_prefetch_bucket_size = kDefaultStage3PrefetchElements;
  // ZeRO-2/3 (dist/zero.h): how accumulation micro-steps reach the shard
  // (reduce_every_micro_batch, DeepSpeed's; no_sync, FSDP's), and the full gradient buckets a
  // backward holds at once (2: DeepSpeed's overlap_comm; 1: overlap_comm false; 0: no bound).
  GradientAccumulation zero_accumulation = GradientAccumulation::reduce_every_micro_batch;
  size_t max_buckets_in_flight = kDefaultBucketsInFlight;
  // FSDP's name for the stage instead: FULL_SHARD (3), SHARD_GRAD_OP (2), NO_SHARD (DDP),
  // HYBRID_SHARD (3) and _HYBRID_SHARD_ZERO2 (2) with hybrid sharding.
  std::string fsdp_sharding_strategy;
  // Hybrid sharding (dist/zero.h; FSDP's HYBRID_SHARD, DeepSpeed's mics_shard_size): ZeRO-2/3
  // within shard groups of this many ranks, replicated across the groups. -1: off, unless
  // fsdp_sharding_strategy is a hybrid one, which takes the ranks per node (LOCAL_WORLD_SIZE).
  // Must be >= 1 and divide the world size; stages 2 and 3 without offload.
  int hybrid_shard_size = -1;
  // The device mesh (dist/device_mesh.h; Accelerate's ParallelismConfig dp_size, tp_size,
  // pp_size): ranks per tensor-parallel group and pipeline stages, 1 = TESSERA_TP_SIZE and
  // TESSERA_PP_SIZE (tessera launch --tp-size, --pp-size) or 1; dp_size -1: the world over
  // tp_size x pp_size. The strategy (DDP, ZeRO-1/2) runs on the dp axis; ZeRO-3, offload and
  // hybrid sharding need tp_size = pp_size = 1.
  int dp_size = -1;
  int tp_size = 1;
  int pp_size = 1;
  // fp16's dynamic loss scaler (Accelerate's GradScalerKwargs); unset = torch's GradScaler
  // defaults, or the DeepSpeed file's fp16 block.
  std::optional<optim::LossScalerOptions> loss_scaler;
  // A DeepSpeed JSON file (dist/deepspeed_config.h) whose settings fill the ones above;
  // a setting given both here and there must agree.
  std::string deepspeed_config;
  // The same file already parsed (DeepSpeedConfig::read), as a training run passes it on so
  // that the file is read once; it wins over deepspeed_config.
  std::optional<DeepSpeedConfig> deepspeed;
  // Experiment trackers (dist/trackers.h), Accelerate's log_with: built-in names
  // ("tensorboard", "csv", "mlflow", "all") and trackers of one's own, used on the main
  // process only. Names are checked when the Accelerator is made.
  std::vector<std::string> log_with;
  std::vector<std::shared_ptr<GeneralTracker>> log_with_trackers;
  // Accelerate's ProjectConfiguration: where trackers write (logging_dir; "" = project_dir).
  std::string project_dir;
  std::string logging_dir;
};

class Accelerator;

// The ZeRO stage (0 = DDP) an Accelerator made with `options` runs, resolved as its
// constructor resolves it: the options, what the launch environment passed on, FSDP's
// strategy name, the DeepSpeed file, TESSERA_ZERO_STAGE. For a program that must know it
// before the Accelerator exists: `tessera train` builds its model under sharded construction
// (Accelerator::sharded_init's deferred initialisation) when this is 3.
int resolved_zero_stage(AcceleratorOptions options);

// The scope of one micro-step (see accumulate()). While it lives, gradient sync is off
// (except on the syncing micro-step) and, with mixed precision, autocast is on.
class AccumulateScope {
 public:
  bool sync_gradients() const { return sync_; }

 private:
  friend class Accelerator;
  AccumulateScope(bool sync, std::vector<DataParallelStrategy::NoSyncGuard> guards,
                  std::unique_ptr<autograd::AutocastGuard> autocast)
      : sync_(sync),
        guards_(std::move(guards)),
        autocast_(std::move(autocast)),
        activations_(std::make_unique<MemoryCategoryScope>(MemoryCategory::Activations)) {}
  bool sync_;
  std::vector<DataParallelStrategy::NoSyncGuard> guards_;
  std::unique_ptr<autograd::AutocastGuard> autocast_;  // null without mixed precision
  // What the micro-step allocates is counted as activations unless tagged otherwise.
  std::unique_ptr<MemoryCategoryScope> activations_;
};

class Accelerator {
 public:
  explicit Accelerator(AcceleratorOptions options = {});
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  // ---- preparation ----
  template <class... Objects>
  void prepare(Objects&... objects) {
    (prepare_one(objects), ...);
  }
  // Casts to the policy's parameter dtype and attaches the strategy (zero_stage).
  void prepare_one(nn::Module& model);
  // Remembered for save/load_state; the strategy of the model it trains may re-point it
  // at this rank's shards, and mixed precision turns on its f32 master weights.
  void prepare_one(optim::Optimizer& optimizer);
  void prepare_one(optim::LRSchedule& schedule);   // remembered for save/load_state
  // Re-creates the loader with this process's rank and world size on the mesh's dp axis
  // (sequential order: W ranks × B rows see what one process × W·B rows sees; the ranks of
  // one tp group and the stages of one pipeline read the same rows).
  void prepare_one(data::DataLoader& loader);
  // Sharded construction (DeepSpeed's zero.Init; docs/distributed.md): runs build() with
  // deferred initialisation on (core/deferred_init.h), so the parameters it creates are
  // shape-only placeholders that remember their init (or, from from_pretrained, the file
  // bytes they would be loaded from); prepare(model) then fills only this rank's slice of
  // each flat parameter, with the bits the eager construction gives, and no rank ever holds
  // the whole model. Needs zero_stage 3 (refused before build() runs otherwise).
  //   auto model = acc.sharded_init([&] { return std::make_unique<nn::GPT>(cfg); });
  //   acc.prepare(*model, opt);
  template <class Build>
  auto sharded_init(Build&& build) -> decltype(build()) {
    check_sharded_init();
    DeferredInitGuard deferred;
    return build();
  }
  // The model itself; under ZeRO-3 its parameters are gathered first (so every process
  // must call it), and stay whole until its next forward.
  nn::Module& unwrap_model(nn::Module& model);
  DataParallelStrategy* strategy_of(const nn::Module& model) const;
  // The DDP strategy of a model (null when it runs under a ZeRO stage or is not prepared).
  DistributedDataParallel* ddp_of(const nn::Module& model) const;
  int zero_stage() const { return zero_stage_; }
  // Ranks per shard group under hybrid sharding; 0 when not hybrid.
  int hybrid_shard_size() const { return hybrid_shard_size_; }
  const AcceleratorOptions& options() const { return options_; }
  // The DeepSpeed config the options named (its gradient_clipping is the trainer's to use).
  const std::optional<DeepSpeedConfig>& deepspeed_config() const { return options_.deepspeed; }
  const MixedPrecisionPolicy& mixed_precision_policy() const { return policy_; }
  // The device mesh: split a model over it (dist::parallelize: the tp group, the pp group or
  // both), then prepare it as any model.
  const DeviceMesh& mesh() const { return *mesh_; }
  // This process's bytes by category for a prepared model (optimizer state from the
  // prepared optimizers).
  MemoryUsage memory_usage(const nn::Module& model) const;
  // Collective. Every rank's bytes by category as the allocator counts them (on this
  // Accelerator's device; core/memory_category.h: enable_memory_categories(true) before
  // the model is built), now and at the peak since the last reset_memory_peak(), next to
  // ZeRO's formula for the prepared model; the table on the main process, "" elsewhere.
  std::string memory_report(const nn::Module& model);
  void reset_memory_peak();
  // Collective. Ends a phase of the memory report: every rank's peak since the last reset
  // (and the split at it) is kept as `phase`, printed by memory_report() above the rows of
  // what follows ("rank 0 construction"), and the peak is reset. `tessera train
  // --memory-report` ends "construction" (the model built and prepared) before training.
  void end_memory_phase(const std::string& phase);
  // With counting on, save_state measures itself in a peak window of its own
  // (core/memory_category.h: MemoryPeakWindow), so the training steps' peak stays theirs:
  // this process's allocator peak (and split) during its largest save_state so far, which
  // memory_report() prints as the "save" phase ("rank 0 save"); empty before a save.
  std::optional<CategoryMemoryStats> save_memory() const { return memory_apart("save"); }
  // The same for any phase a program measures apart (the Trainer's evaluation: "eval"):
  // fn() (returning a value) runs in a peak window of its own and the largest window of each
  // name is printed by memory_report() as that phase. Collective when fn is; with counting
  // off, just fn().
  template <class Fn>
  auto measure_apart(const std::string& phase, Fn&& fn) -> decltype(fn()) {
    std::optional<MemoryPeakWindow> window;
    if (memory_categories_enabled()) window.emplace(device_.type);
    auto result = fn();  // a phase that throws is not kept, as a failed save is not
    if (window) keep_memory_apart(phase, window->stats());
    return result;
  }
  std::optional<CategoryMemoryStats> memory_apart(const std::string& phase) const;

  // ---- training ----
  // Enters a micro-step: gradients are synchronised only on every
  // gradient_accumulation_steps-th call (the returned scope says which). With
  // mixed_precision bf16/fp16 the scope also runs matmul, linear and attention in the
  // policy's compute dtype (autograd::AutocastGuard), which casts inputs that are not
  // in it yet (f32 features fed to bf16 parameters).
  AccumulateScope accumulate(nn::Module& model);
  bool sync_gradients() const { return sync_gradients_; }
  // Backward of loss / gradient_accumulation_steps; on a syncing micro-step the prepared
  // models' gradients are averaged over the processes before it returns. With fp16 the
  // loss is multiplied by the dynamic loss scale first, and on the syncing micro-step the
  // gradients of the prepared optimizer are divided by it again (so clip_grad_norm_ and
  // the step see the true gradients); when one is inf/NaN the gradients are dropped, the
  // optimizer and schedule steps of this micro-step are skipped and the scale backs off.
  void backward(const Tensor& loss);
  // A model that runs its own backwards (PipelineParallelCausalLM::train_step, one per
  // micro-batch), inside accumulate(): runs step() with the gradient sync off, then, on a
  // syncing micro-step, averages what it accumulated over the dp axis (what backward() does
  // after loss.backward()); returns step()'s loss. Refused: ZeRO stage 3, fp16 loss scaling,
  // gradient_accumulation_steps > 1 (the pipeline's micro-batches are its accumulation).
  //   auto scope = acc.accumulate(*pp);
  //   Tensor loss = acc.train_step(*pp, [&] { return pp->train_step(x, y); });
  Tensor train_step(nn::Module& model, const std::function<Tensor()>& step);
  // The fp16 loss scale (1 otherwise), and whether this micro-step's optimizer step is
  // skipped (fp16 only: a gradient was inf/NaN).
  double loss_scale() const { return scaler_.scale(); }
  bool optimizer_step_was_skipped() const { return step_skipped_; }
  // Global-norm clipping on syncing steps (returns the norm before clipping); 0 otherwise.
  // On a mesh with tp_size or pp_size > 1: the norm of the one prepared split model (its pieces
  // summed over its group, each counted once; under ZeRO-1/2 this rank's slices of them summed
  // over the dp axis too).
  double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm);
  // clip_grad_norm_ decided on the device (optim::clip_grad_norm_on_device_): the norm stays
  // a 0-d f32 tensor there, so the host need not wait for it (and a CUDA graph can record
  // the step); max_norm <= 0 only measures. Undefined on steps that do not sync. DDP on a
  // GPU without fp16 loss scaling only (see device_clipping_blocker).
  Tensor clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm);
  // Why clip_grad_norm_on_device_ cannot serve this Accelerator (no GPU, ZeRO's sharded
  // gradients, fp16 loss scaling), or "" when it can.
  std::string device_clipping_blocker() const;
  int gradient_accumulation_steps() const { return options_.gradient_accumulation_steps; }

  // ---- whole steps as CUDA graphs (train/step_graph.h) ----
  // Why an optimizer step of this Accelerator cannot be recorded in a CUDA graph (ZeRO,
  // fp16 loss scaling, no GPU, several processes on a backend other than NCCL), or "" when
  // it can (DDP's all-reduces over NCCL are recorded with the step).
  std::string graph_capture_blocker() const;
  // The micro-step counter: kept before a capture, restored when it fails, and advanced by
  // gradient_accumulation_steps for each replay (the host side of the recorded accumulate()s).
  int64_t micro_step() const { return micro_step_; }
  void set_micro_step(int64_t micro_step) { micro_step_ = micro_step; }
  const std::string& mixed_precision() const { return mixed_precision_; }

  // ---- processes ----
  bool is_main_process() const { return process_index() == 0; }
  bool is_local_main_process() const { return local_process_index() == 0; }
  int process_index() const;
  int local_process_index() const { return env_.local_rank; }
  int num_processes() const;
  Device device() const { return device_; }
  ProcessGroup& group() const { return world(); }
  void wait_for_everyone();
  // Prints on the main process only.
  template <class... Args>
  void print(const Args&... args) const {
    if (!is_main_process()) return;
    std::ostringstream os;
    (os << ... << args);
    std::cout << os.str() << std::endl;
  }

  // ---- collectives on results ----
  // Concatenation along dim 0 of every process's tensor (sizes along dim 0 may differ).
  Tensor gather(const Tensor& t);
  // gather() without the padding duplicates, as in Accelerate: the rows that the last
  // split_between_processes(items, apply_padding = true) added are dropped again, so the
  // result has one row per item (all rows when nothing was padded). Over the mesh's dp axis
  // only: the ranks of one tp group and the stages of one pipeline hold the same rows, so each
  // replica's rows come once.
  Tensor gather_for_metrics(const Tensor& t);
  // The same with the evaluation set's size given: keeps `total` real rows.
  Tensor gather_for_metrics(const Tensor& t, int64_t total);
  // "sum", "mean", "max" or "min" over processes (a new tensor).
  Tensor reduce(const Tensor& t, const std::string& op = "sum");
  // Pads dim to the largest size over processes with pad_value (at the end, or the start).
  Tensor pad_across_processes(const Tensor& t, int64_t dim = 0, double pad_value = 0,
                              bool pad_first = false);
  // This process's contiguous share of items (by its dp rank: the ranks of one replica get
  // the same share); with apply_padding every share has the same length, the last item
  // repeated (gather_for_metrics drops those again, remembering items.size() from here).
  template <class T>
  std::vector<T> split_between_processes(const std::vector<T>& items, bool apply_padding = false) {
    auto [begin, end, padded] = share_of(static_cast<int64_t>(items.size()), apply_padding);
    padded_split_total_ = apply_padding ? static_cast<int64_t>(items.size()) : -1;
    std::vector<T> mine(items.begin() + begin, items.begin() + end);
    while (static_cast<int64_t>(mine.size()) < padded && !items.empty()) mine.push_back(items.back());
    return mine;
  }

  // ---- early stopping across processes ----
  void set_trigger() { trigger_ = true; }
  // True on every process when any process set the trigger since the last check.
  bool check_trigger();

  // ---- state ----
  // Writes model weights (model.safetensors: the state_dict, Hugging Face names for GPT),
  // optimizer and schedule state, every process's loader position and RNG state, the loss
  // scale and step counter to dir, then checksums.json (main process writes, every
  // process waits). load_state verifies the checksums and checks every value (dtypes,
  // shapes, ranges, missing tensors) before it changes anything; errors name the file.
  void save_state(const std::string& dir);
  // Collective (Accelerate's save_model): the prepared model's state_dict as
  // dir/model.safetensors, written by the main process. Under ZeRO every process first writes
  // the slices it keeps (dist/checkpoint.h) and the main process streams the file from them
  // one saved range at a time, so no process holds the gathered model; the shards are removed.
  // A model split over the device mesh is gathered whole (collective) and saved as one process's.
  void save_model(nn::Module& model, const std::string& dir);
  void load_state(const std::string& dir);
  // Forgets prepared objects (DDP buffers are released).
  void free_memory();
  // Finishes the trackers, waits for everyone and tears down the process group this
  // Accelerator created.
  void end_training();

  // ---- experiment trackers (Accelerate's names; main process only, no-ops elsewhere) ----
  // Creates the log_with trackers for `project_name` (TensorBoard and CSV under
  // logging_dir/project_name, MLflow's store in logging_dir/mlruns) and hands `config` (a
  // JSON object; null = none) to every tracker's store_init_configuration. init_kwargs:
  // {tracker name: {its settings}}; a name not in log_with is refused.
  void init_trackers(const std::string& project_name,
                     const nlohmann::json& config = nullptr,
                     const nlohmann::json& init_kwargs = nlohmann::json::object());
  // values: {name: number, ...} to every tracker at `step` (0 when not given, as Accelerate's
  // trackers store step None).
  void log(const nlohmann::json& values, std::optional<int64_t> step = std::nullopt);
  // The tracker of that name (an error naming the ones there are); on other processes a
  // tracker that does nothing, as Accelerate's.
  GeneralTracker& get_tracker(const std::string& name);
  const std::vector<std::shared_ptr<GeneralTracker>>& trackers() const { return trackers_; }
  // The log_with names with "all" expanded.
  const std::vector<std::string>& log_with() const { return log_with_names_; }
  // Where trackers write: logging_dir, else project_dir.
  std::string logging_dir() const;

  // Calls fn(batch_size), halving batch_size after an out-of-memory error until it runs
  // (or reaches 0, which is an error). Returns what fn returned.
  template <class Fn>
  auto find_executable_batch_size(Fn&& fn, int64_t starting_batch_size) {
    for (int64_t bs = starting_batch_size; bs > 0; bs /= 2) {
      try {
        return fn(bs);
      } catch (const OutOfMemoryError& e) {
        print("find_executable_batch_size: batch size ", bs, " ran out of memory; trying ",
              bs / 2);
        free_memory();
      }
    }
    TESSERA_FAIL("find_executable_batch_size: out of memory even with batch size 1 (started at ",
                 starting_batch_size, ")");
  }

 private:
  struct Share {
    int64_t begin, end, padded;
  };
  Share share_of(int64_t n, bool apply_padding) const;
  // gather() over `pg` (the world, or the dp axis).
  Tensor gather_over(ProcessGroup& pg, const Tensor& t);
  void check_sharded_init() const;
  // Collective: every rank's `stats` (now and at its peak: memory_report's rows).
  std::vector<RankMemory> gather_rank_memory(const CategoryMemoryStats& stats);
  std::vector<MemoryPhase> memory_phases_;
  // measure_apart's largest window of each phase, in the order the phases first appeared.
  std::vector<std::pair<std::string, CategoryMemoryStats>> memory_apart_;
  void keep_memory_apart(const std::string& phase, const CategoryMemoryStats& stats);
  void unscale_gradients();
  // Where a collective on `t` runs: its own device, or the run's device for a host tensor
  // the backend cannot move (NCCL).
  Device comm_device(const Tensor& t) const;

  AcceleratorOptions options_;
  std::string mixed_precision_;
  MixedPrecisionPolicy policy_;
  int zero_stage_ = 0;
  int hybrid_shard_size_ = 0;
  DistEnv env_;
  MeshShape mesh_shape_;              // resolved before the ranks meet
  std::unique_ptr<DeviceMesh> mesh_;  // built once they have
  void resolve_mesh_shape_options();
  Device device_ = Device::cpu();
  bool owns_group_ = false;
  int64_t micro_step_ = 0;
  bool sync_gradients_ = true;
  // What the gates of the prepared optimizers and schedules read: sync_gradients_, shared
  // so that a gate never points into a destroyed Accelerator (it is left open then).
  std::shared_ptr<bool> gate_open_ = std::make_shared<bool>(true);
  optim::LossScaler scaler_;  // enabled for fp16 only
  bool step_skipped_ = false;
  bool trigger_ = false;
  void attach_optimizers();
  void resolve_hybrid_sharding();
  std::function<void()> stage_model_weights(const std::string& dir, size_t model_index);
  void check_tracker_options();
  void finish_trackers();
  std::vector<std::string> log_with_names_;
  std::vector<std::shared_ptr<GeneralTracker>> trackers_;
  DataParallelStrategy& strategy_training(const optim::Optimizer& optimizer) const;
  std::map<const nn::Module*, std::unique_ptr<DataParallelStrategy>> models_;
  std::map<const optim::Optimizer*, DataParallelStrategy*> optimizer_strategy_;
  std::vector<nn::Module*> model_order_;
  std::vector<optim::Optimizer*> optimizers_;
  std::vector<optim::LRSchedule*> schedules_;
  std::vector<data::DataLoader*> loaders_;
  int64_t padded_split_total_ = -1;  // items of the last padded split, -1 when none
};

}  // namespace tessera::dist
