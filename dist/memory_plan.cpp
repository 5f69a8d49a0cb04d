#include "tessera/dist/memory_plan.h"

#include <algorithm>
#include <optional>
#include <set>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/deferred_init.h"
#include "tessera/core/size_only.h"
#include "tessera/dist/accelerator.h"
#include "tessera/dist/checkpoint.h"
#include "tessera/dist/ddp.h"
#include "tessera/dist/device_mesh.h"
#include "tessera/dist/parallelize.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/dist/zero.h"
#include "tessera/optim/adamw.h"

namespace tessera::dist {

namespace {

// Rank 0 of a world of `size` where every collective is complete at once and moves nothing
// (in size-only mode there are no values to move).
class SizeOnlyProcessGroup final : public ProcessGroup {
 public:
  explicit SizeOnlyProcessGroup(int size) : ProcessGroup(0, size, ProcessGroupOptions{}) {}
  std::string backend_name() const override { return "size-only"; }
  // The all-reduces issued over this group (their tensors' bytes), for the plan's traffic.
  StepTraffic all_reduces;

 protected:
  bool supports_device(Device) const override { return true; }
  WorkPtr do_all_reduce(const CollectiveSignature&, const Tensor& t, ReduceOp) override {
    ++all_reduces.collectives;
    all_reduces.bytes += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
    return completed_work();
  }
  WorkPtr do_reduce_scatter(const CollectiveSignature&, const Tensor&, const Tensor&,
                            ReduceOp) override {
    return completed_work();
  }
  WorkPtr do_all_gather(const CollectiveSignature&, const std::vector<Tensor>&,
                        const Tensor&) override {
    return completed_work();
  }
  WorkPtr do_broadcast(const CollectiveSignature&, const Tensor&, int) override {
    return completed_work();
  }
  WorkPtr do_barrier(const CollectiveSignature&) override { return completed_work(); }
  WorkPtr do_send(const Tensor&, int, int) override { return completed_work(); }
  WorkPtr do_recv(const Tensor&, int, int) override { return completed_work(); }
  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks, uint64_t,
                                             ProcessGroupOptions) override {
    return std::make_shared<SizeOnlyProcessGroup>(static_cast<int>(ranks.size()));
  }
};

std::unique_ptr<DataParallelStrategy> make_strategy(nn::Module& model,
                                                    std::shared_ptr<ProcessGroup> group,
                                                    const MemoryPlanOptions& o,
                                                    DType reduce_dtype) {
  if (o.zero_stage == 0) {
    DDPOptions ddp;
    ddp.bucket_bytes = o.bucket_bytes;
    ddp.reduce_dtype = reduce_dtype;
    return std::make_unique<DistributedDataParallel>(model, std::move(group), ddp);
  }
  ZeroOptions zero;
  zero.stage = o.zero_stage;
  zero.bucket_bytes = o.bucket_bytes;
  zero.reduce_dtype = reduce_dtype;
  zero.offload_optimizer = o.offload_optimizer;
  zero.offload_param = o.offload_param;
  zero.accumulation = o.accumulation;
  zero.max_buckets_in_flight = o.max_buckets_in_flight;
  zero.hybrid_shard_size = o.hybrid_shard_size;
  zero.prefetch_numel = o.stage3_prefetch_bucket_size >= 0
                            ? o.stage3_prefetch_bucket_size
                            : AcceleratorOptions{}.stage3_prefetch_bucket_size;
  return std::make_unique<ZeroStrategy>(model, std::move(group), zero);
}

// One optimizer step as the Trainer takes it (tessera train): accumulation micro-steps with
// the sync on the last, clipping, the update, zero_grad.
// A pipeline's stage (rank 0's: the first, which holds the most micro-batches' activations
// under 1F1B) runs its schedule as Accelerator::train_step does: the strategy's sync off over
// the micro-batches, then their accumulated gradients synced; the size-only groups' sends and
// receives complete at once.
void training_step(nn::Module& model, DataParallelStrategy& strategy, optim::Optimizer& opt,
                   const MemoryPlanOptions& o, const MixedPrecisionPolicy& policy) {
  if (auto* pipe = dynamic_cast<PipelineParallelCausalLM*>(&model)) {
    {
      MemoryCategoryScope activations(MemoryCategory::Activations);
      DataParallelStrategy::NoSyncGuard off = strategy.no_sync();
      std::unique_ptr<autograd::AutocastGuard> autocast;
      if (policy.compute_dtype != DType::f32)
        autocast = std::make_unique<autograd::AutocastGuard>(policy.compute_dtype);
      pipe->train_step(zeros({o.batch, o.seq}, {.dtype = DType::i64}),
                       zeros({o.batch, o.seq}, {.dtype = DType::i64}));
    }
    strategy.sync_accumulated_gradients();
    strategy.clip_grad_norm_(model.parameters(), 1.0);
    opt.step();
    opt.zero_grad();
    return;
  }
  auto& lm = dynamic_cast<nn::CausalLM&>(model);
  for (int micro = 0; micro < o.gradient_accumulation_steps; ++micro) {
    const bool sync = micro + 1 == o.gradient_accumulation_steps;
    MemoryCategoryScope activations(MemoryCategory::Activations);
    std::optional<DataParallelStrategy::NoSyncGuard> no_sync;
    if (!sync) no_sync.emplace(strategy.no_sync());
    std::unique_ptr<autograd::AutocastGuard> autocast;
    if (policy.compute_dtype != DType::f32)
      autocast = std::make_unique<autograd::AutocastGuard>(policy.compute_dtype);
    const Tensor x = zeros({o.batch, o.seq}, {.dtype = DType::i64});
    const Tensor y = zeros({o.batch, o.seq}, {.dtype = DType::i64});
    Tensor loss = lm.loss(x, y);
    if (o.gradient_accumulation_steps > 1)
      loss = loss / static_cast<double>(o.gradient_accumulation_steps);
    loss.backward();
    strategy.finish_gradient_sync();  // as Accelerator::backward: inside no_sync too
  }
  // Offloaded, clipping and the update work on host slices: host memory in a real run.
  const HostMemoryScope host(o.offload_optimizer || o.offload_param);
  strategy.clip_grad_norm_(model.parameters(), 1.0);
  opt.step();
  opt.zero_grad();
}

// The bucket and unit sizes the peak's terms are bounded by.
void record_layout(MemoryPlan& plan, const DataParallelStrategy& strategy, DType reduce_dtype) {
  const auto* zero = dynamic_cast<const ZeroStrategy*>(&strategy);
  if (zero == nullptr) return;
  for (const auto& b : zero->buckets().buckets()) {
    const int64_t gradients = b.padded_numel * static_cast<int64_t>(dtype_size(b.dtype));
    const bool reduced_elsewhere =
        (b.dtype == DType::bf16 || b.dtype == DType::f16) && reduce_dtype != b.dtype;
    const int64_t reduce =
        reduced_elsewhere ? b.padded_numel * static_cast<int64_t>(dtype_size(reduce_dtype)) : 0;
    plan.largest_bucket_bytes = std::max(plan.largest_bucket_bytes, gradients + reduce);
    if (zero->stage() == 3) plan.largest_unit_bytes = std::max(plan.largest_unit_bytes, gradients);
  }
  plan.max_buckets_in_flight = zero->stage() >= 2 ? zero->max_buckets_in_flight() : 0;
}

// The save phase: Accelerator::save_state between two steps, measured as the memory report
// measures the real one, in a peak window of its own. The dry run cannot run save_state
// itself: it is rank 0 alone, and the main process reads back what every rank wrote (the
// shards' descriptions, the optimizer shards, and every range of the model's shards, which it
// streams into model.safetensors); in size-only mode there are neither files nor other ranks.
// So it allocates what the save allocates beyond what is alive, laid out by the functions the
// save uses: what the save writes from the host is views (ops::to and contiguous of a
// contiguous CPU tensor are the tensor itself), and under ZeRO write_whole_model holds one
// range at a time, the largest largest_streamed_range_bytes; on a GPU those buffers (and
// the shards' copies to write) are host memory, so the device's save peak is what is alive
// between steps. Left out: the gathers of every rank's RNG state and loader positions (a few
// words a rank).
void record_save(MemoryPlan& plan, const DataParallelStrategy& strategy,
                 const MemoryPlanOptions& o) {
  const MemoryPeakWindow window(DeviceType::CPU);
  if (const auto* zero = dynamic_cast<const ZeroStrategy*>(&strategy)) {
    const HostMemoryScope host(o.gpu_routes);
    const MemoryCategoryScope other(MemoryCategory::Other);  // as save_state's caller files it
    const Tensor range = empty({largest_streamed_range_bytes(*zero)}, {.dtype = DType::u8});
  }
  const CategoryMemoryStats save = window.stats();
  plan.save_peak = save.peak;
  plan.save_at_peak = save.at_peak;
}

}  // namespace

MemoryPlan::Terms MemoryPlan::terms() const {
  using C = MemoryCategory;
  auto peak_of = [&](C c) { return step_at_peak[static_cast<int>(c)]; };
  Terms t;
  t.shard_parameters = peak_of(C::Parameters);
  t.optimizer = peak_of(C::OptimizerState);
  // Under stages 2/3 the averaged shard (alive from a step's first reduce-scatter to its
  // update: ZeRO's pΨ/W, or what stays between steps when that is more, the buckets' padding);
  // the rest at the peak is buckets of full gradients being filled or reduced. DDP and stage 1
  // hold the full gradient.
  const int64_t shard = std::max(formula.gradients, steady[static_cast<int>(C::Gradients)]);
  t.shard_gradients =
      max_buckets_in_flight == 0 ? peak_of(C::Gradients) : std::min(peak_of(C::Gradients), shard);
  t.buckets_in_flight = peak_of(C::Gradients) - t.shard_gradients;
  t.activations = peak_of(C::Activations);
  t.gathered_units = peak_of(C::Communication);
  t.other = peak_of(C::Other);
  return t;
}

int64_t MemoryPlan::expected_stage3_bound() const {
  const size_t in_flight = max_buckets_in_flight > 0 ? max_buckets_in_flight : 1;
  return formula.total() + terms().activations + 2 * largest_unit_bytes +
         static_cast<int64_t>(in_flight) * largest_bucket_bytes;
}

namespace {
void check_plannable_mesh(const MemoryPlanOptions& o) {
  TESSERA_CHECK(o.tp_size == 1 || o.pp_size == 1, "plan: the mesh of tp_size ", o.tp_size,
                " x pp_size ", o.pp_size,
                " splits the model over tp and pp at once, which the plan does not lay out yet "
                "(tessera train runs it); plan the tensor-parallel and the pipeline split "
                "apart (--tp-size ",
                o.tp_size, ", then --pp-size ", o.pp_size, ")");
}
}  // namespace

MemoryPlan plan_memory(const MemoryPlanOptions& o) {
  TESSERA_CHECK(
      o.world >= 1 && o.zero_stage >= 0 && o.zero_stage <= 3 && o.batch > 0 && o.seq > 0 &&
          o.gradient_accumulation_steps >= 1,
      "plan_memory: needs world >= 1, zero_stage 0-3, positive batch, seq and accumulation");
  TESSERA_CHECK(!(o.offload_optimizer || o.offload_param) || o.zero_stage >= 1,
                "plan_memory: offload needs a ZeRO stage (1-3), got stage ", o.zero_stage);
  TESSERA_CHECK(!o.offload_param || o.zero_stage == 3,
                "plan_memory: offload_param needs stage 3, got stage ", o.zero_stage);
  TESSERA_CHECK(o.seq <= o.model.block_size, "plan_memory: seq ", o.seq,
                " is longer than the context block_size ", o.model.block_size);
  o.gradient_checkpointing.check_model(o.model.n_layer);
  TESSERA_CHECK((o.tp_size == 1 && o.pp_size == 1) ||
                    (o.zero_stage < 3 && !o.offload_optimizer && !o.offload_param &&
                     o.hybrid_shard_size == 0),
                "plan_memory: tp_size ", o.tp_size, " x pp_size ", o.pp_size,
                " runs DDP or ZeRO-1/2 on the dp axis, "
                "without offload or hybrid sharding (zero_stage ",
                o.zero_stage, ")");
  check_plannable_mesh(o);
  TESSERA_CHECK(o.pp_size == 1 ||
                    (o.gradient_accumulation_steps == 1 && !o.gradient_checkpointing.enabled()),
                "plan_memory: a pipeline accumulates over its micro-batches and checkpoints "
                "nothing (pp_size ", o.pp_size, ")");
  const MixedPrecisionPolicy policy = MixedPrecisionPolicy::from_name(o.mixed_precision, o.reduce_dtype);
  SizeOnlyMode size_only(o.gpu_routes);
  const int64_t before = category_memory_stats(DeviceType::CPU).total_in_use() +
                         host_memory_stats_of_dry_run().total_in_use();
  TESSERA_CHECK(before == 0, "plan_memory: ", before,
                " bytes were already counted; run it in a fresh process");
  reset_category_peak(DeviceType::CPU);
  MemoryPlan plan;
  {
    // Stage 3 builds as `tessera train` does (train/run.cpp): placeholders, each rank's slice
    // filled by the strategy.
    plan.sharded_construction = o.zero_stage == 3;
    std::optional<DeferredInitGuard> deferred;
    if (plan.sharded_construction) deferred.emplace();
    nn::GPT whole(o.model);
    deferred.reset();
    // On a mesh the real split of the model over a size-only mesh (rank 0's piece), the whole
    // model released after it, as `tessera train` does (TrainingTask::split_over_mesh).
    const MeshShape shape = resolve_mesh_shape({.tp = o.tp_size, .pp = o.pp_size}, o.world);
    const DeviceMesh mesh(std::make_shared<SizeOnlyProcessGroup>(o.world), shape);
    const PipelineOptions pipeline{.micro_batches = o.pipeline_micro_batches};
    check_mesh_split(whole, shape, pipeline, o.batch);
    std::unique_ptr<nn::Module> split = split_over_mesh(whole, mesh, {.pipeline = pipeline});
    if (split) release_parameter_memory(whole, *split);
    nn::Module& model = split ? *split : static_cast<nn::Module&>(whole);
    if (auto* lm = dynamic_cast<nn::CausalLM*>(&model))
      lm->gradient_checkpointing_enable(o.gradient_checkpointing);
    const std::shared_ptr<ProcessGroup> group = mesh.dp_group();
    std::unique_ptr<DataParallelStrategy> strategy;
    {
      MemoryCategoryScope tag(MemoryCategory::Parameters);
      if (policy.low_precision_parameters()) model.to(policy.param_dtype);
      strategy = make_strategy(model, group, o, policy.reduce_dtype);
      for (const Tensor& p : model.parameters())
        if (p.storage()) set_memory_category(*p.storage(), MemoryCategory::Parameters);
    }
    optim::AdamW opt(model.parameters(), {.weight_decay = 0.1});
    {
      MemoryCategoryScope tag(MemoryCategory::OptimizerState);
      if (policy.low_precision_parameters()) opt.set_master_weights(true);
      strategy->prepare_optimizer(opt);
    }
    // The model is built in f32 before the policy casts it and the strategy shards it (as
    // `tessera train` does on its device): a peak of its own, which can be the run's.
    const CategoryMemoryStats setup = category_memory_stats(DeviceType::CPU);
    plan.setup_peak = setup.peak;
    plan.setup_at_peak = setup.at_peak;
    reset_category_peak(DeviceType::CPU);
    // Two steps: the optimizer state appears in the first, the second's backward runs with it.
    auto* tp_group = dynamic_cast<SizeOnlyProcessGroup*>(mesh.tp_group().get());
    auto* dp_group = dynamic_cast<SizeOnlyProcessGroup*>(mesh.dp_group().get());
    for (int step = 0; step < 2; ++step) {
      // The second step's traffic (the first also allocates the optimizer state).
      if (tp_group) tp_group->all_reduces = {};
      if (dp_group) dp_group->all_reduces = {};
      training_step(model, *strategy, opt, o, policy);
    }
    if (tp_group && shape.tp > 1) plan.tp_traffic = tp_group->all_reduces;
    if (dp_group && shape.dp > 1) plan.dp_traffic = dp_group->all_reduces;
    const CategoryMemoryStats stats = category_memory_stats(DeviceType::CPU);
    plan.step_peak = stats.peak;
    plan.step_at_peak = stats.at_peak;
    plan.steady = stats.in_use;
    plan.host_peak = host_memory_stats_of_dry_run().peak;  // the steps' (the save's is apart)
    record_save(plan, *strategy, o);
    plan.peak = std::max(setup.peak, stats.peak);
    plan.at_peak = setup.peak > stats.peak ? setup.at_peak : stats.at_peak;
    if (o.saves_checkpoints && plan.save_peak > plan.peak) {
      plan.peak = plan.save_peak;
      plan.at_peak = plan.save_at_peak;
    }
    plan.strategy = strategy->name();
    record_layout(plan, *strategy, policy.reduce_dtype);
    std::set<const TensorImpl*> seen;
    for (const Tensor& p : model.parameters())
      if (seen.insert(p.impl_ptr().get()).second) plan.psi += p.numel();
    plan.formula =
        zero_memory_formula(plan.psi, static_cast<int64_t>(dtype_size(policy.param_dtype)),
                            policy.low_precision_parameters(), o.zero_stage,
                            o.hybrid_shard_size > 0 ? o.hybrid_shard_size : shape.dp);
  }
  return plan;
}

std::vector<PipelineStagePlan> plan_pipeline_stages(const MemoryPlanOptions& o) {
  const MeshShape shape = resolve_mesh_shape({.tp = o.tp_size, .pp = o.pp_size}, o.world);
  TESSERA_CHECK(shape.pp > 1, "plan_pipeline_stages: needs pp_size > 1 (the mesh ", shape.str(),
                ")");
  check_plannable_mesh(o);
  TESSERA_CHECK(o.zero_stage <= 2,
                "plan_pipeline_stages: a pipeline trains under DDP or ZeRO-1/2 on the dp "
                "axis, not ZeRO-",
                o.zero_stage);
  check_pipeline_parallel(o.model.n_layer, shape.pp, "GPT-2");
  check_micro_batches(o.pipeline_micro_batches, o.batch);
  const MixedPrecisionPolicy policy =
      MixedPrecisionPolicy::from_name(o.mixed_precision, o.reduce_dtype);
  // Shapes only: placeholders hold no memory.
  DeferredInitGuard deferred;
  const nn::GPT model(o.model);
  const int64_t p_bytes = static_cast<int64_t>(dtype_size(policy.param_dtype));
  const int64_t act_bytes = static_cast<int64_t>(dtype_size(policy.compute_dtype));
  const int64_t rows = o.batch / o.pipeline_micro_batches;
  const int64_t activation_bytes = rows * o.seq * o.model.n_embd * act_bytes;
  const bool tied = o.model.tie_word_embeddings;
  std::vector<PipelineStagePlan> stages;
  for (int s = 0; s < shape.pp; ++s) {
    PipelineStagePlan st;
    st.stage = s;
    const StageBlocks blocks = pipeline_stage_blocks(o.model.n_layer, s, shape.pp);
    st.blocks_begin = blocks.begin, st.blocks_end = blocks.end;
    const bool first = s == 0, last = s == shape.pp - 1;
    for (const auto& [name, t] : model.named_parameters())
      if (pipeline_stage_holds(name, s, shape.pp, o.model.n_layer, tied))
        st.parameters += t.numel();
    // ZeRO-1 and ZeRO-2 shard the optimizer state over the dp axis; a pipeline's micro-batches
    // accumulate in full gradient buckets either way (reduced once a step by
    // ZeroStrategy::sync_accumulated_gradients), so at the steps' peak its gradients are whole,
    // as ZeRO-1's formula counts them.
    const ZeroMemoryFormula kept =
        zero_memory_formula(st.parameters, p_bytes, policy.low_precision_parameters(),
                            std::min(o.zero_stage, 1), shape.dp);
    st.parameter_bytes = kept.parameters;
    st.gradient_bytes = kept.gradients;
    st.optimizer_bytes = kept.optimizer;
    const int64_t sends =
        (last ? 0 : o.pipeline_micro_batches) + (first ? 0 : o.pipeline_micro_batches);
    st.sends = {sends, sends * activation_bytes};
    if (tied && (first || last))
      st.tied_all_reduce_bytes = o.model.vocab_size * o.model.n_embd * p_bytes;
    stages.push_back(st);
  }
  return stages;
}

}  // namespace tessera::dist
