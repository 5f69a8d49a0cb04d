// ZeRO stages 1, 2 and 3 (Rajbhandari et al.; FSDP's SHARD_GRAD_OP and FULL_SHARD) as
// data-parallel strategies on the shared flat buckets.
//
// Every bucket's flat buffer (padded to a multiple of W) is split into W contiguous
// slices; rank r owns slice r. The optimizer is re-pointed at this rank's pieces: one
// 1-D view per parameter that overlaps the slice, in the parameter's original group
// (so weight decay and lr follow), so AdamW's moments — and, for bf16/fp16
// parameters, its f32 masters — exist only for the slice.
//
//   stage 1  gradients all-reduced in full (the DDP hook); each rank updates its slice
//            of the flat parameter buffer; after the step the slices are all-gathered.
//   stage 2  the bucket hook reduce-scatters instead: each rank receives the average of
//            its slice only. A bucket's full gradient buffer exists from its first
//            gradient until its own reduce-scatter is done, then goes back to the
//            allocator (and the parameters' .grad views with it); at most
//            max_buckets_in_flight buffers are held at once (one filling, one being
//            reduced by default), so backward waits for the oldest reduce-scatter before
//            it takes another. Per rank: the shard's gradients plus those buckets, not the
//            full gradient; and the shard itself only from the step's first reduce-scatter
//            until its update (none between steps or through the forward).
//   stage 3  parameters are sharded too: a parameter holds its full value only while
//            its unit (a block of a ModuleList, or the rest of the model: the root) is
//            gathered — from the unit's forward pre-hook to its forward hook, and again
//            from its backward pre-hook until its gradients are final. The root unit
//            (embeddings, final norm, head; tied weights live there once) stays
//            gathered from the model's forward until its gradients are final. Gradients
//            as stage 2, one bucket per unit.
//
// Gradient accumulation (micro-steps inside no_sync), stages 2 and 3, two semantics:
//   reduce_every_micro_batch (the default; DeepSpeed's) every micro-batch's buckets are
//            reduce-scattered as backward produces them and the averaged slices summed
//            into the shard (in the f32 reduce buffer when there is one): no full
//            gradient outlives its bucket. Sums across ranks come before the sum over
//            micro-batches, so it rounds differently from DDP (same value up to rounding).
//   no_sync  (FSDP's no_sync) full local gradients accumulate until the syncing
//            micro-step, which reduces them once: DDP's arithmetic bit for bit, at the
//            cost of the full gradient's memory during accumulation.
// Stage 1 holds full gradients anyway and always accumulates as no_sync; so does
// ZeRO-Offload (the host takes the averaged slice once per optimizer step).
// Global-norm clipping sums the squares of every rank's slices.
//
// Hybrid sharding (hybrid_shard_size S > 0; FSDP's HYBRID_SHARD / _HYBRID_SHARD_ZERO2,
// ZeRO++'s hpZ, DeepSpeed's MiCS): the W ranks form G = W / S shard groups of S consecutive
// ranks, on a 2-D mesh of process groups: world rank r = g·S + l is rank l of shard group g
// {g·S, ..., g·S + S - 1} and rank g of replica group l {l, S + l, ..., (G - 1)·S + l}. The
// flat buffers are still cut into W world slices; rank r keeps the G slices l, S + l, ...,
// (G - 1)·S + l (the part of the model that index l of every shard group holds, so each shard
// group holds the whole model once and the G groups are replicas of each other). Per bucket
// a rank's shard is those G slices one after the other (G·padded/W = padded/S elements).
//   gradients   one reduce-scatter over the world (rank r receives the average of world
//               slice r: the same sums, in the same order, as without hybrid sharding, so
//               DDP's arithmetic bit for bit), then an all-gather within the replica group
//               assembles the rank's G slices.
//   parameters  all-gathered within the shard group only (stage 3's units, stage 2's update):
//               one all-gather per slice position, straight into the flat buffer.
//   optimizer   each rank updates its G slices: several pieces of one parameter may be this
//               rank's (non-contiguous slices), each a tensor of the optimizer of its own.
// Stages 2 and 3 only; not with offload. Checkpoints are written by shard group 0 (the other
// groups hold the same values).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/dist/flat_buckets.h"
#include "tessera/dist/offload.h"
#include "tessera/dist/strategy.h"

namespace tessera::dist {

enum class GradientAccumulation { reduce_every_micro_batch, no_sync };
// "reduce_every_micro_batch" | "no_sync"; anything else is an error naming the value.
GradientAccumulation gradient_accumulation_from_name(const std::string& name);
const char* gradient_accumulation_name(GradientAccumulation accumulation);

struct ZeroOptions {
  int stage = 1;  // 1, 2 or 3
  size_t bucket_bytes = kDefaultBucketBytes;
  bool find_unused_parameters = false;
  DType reduce_dtype = DType::f32;  // for f16/bf16 gradients
  // ZeRO-Offload (dist/offload.h): this rank's f32 masters, gradients and AdamW moments in
  // host memory, the update on the CPU.
  bool offload_optimizer = false;
  // Stage 3 only: the rank's parameter shard stays on the host as well (implies
  // offload_optimizer); a unit's gather copies it to the device first.
  bool offload_param = false;
  // Offloaded: each bucket's AdamW step runs on the host as soon as its averaged slice has
  // landed there, during backward, instead of in opt.step() after it. The caller promises
  // that nothing changes the gradients or the learning rate between backward and opt.step():
  // no clipping (a clip_grad_norm_ that would scale is then an error; measuring is fine), no
  // fp16 loss scaling. The result is the same bits as the step after backward.
  bool offload_step_during_backward = false;
  // Stage 3: parameters (elements) of the units after the one running that are all-gathered
  // ahead of use — forward: the next blocks, backward: the previous ones — so the gather
  // overlaps compute (DeepSpeed's stage3_prefetch_bucket_size). At least one unit when > 0;
  // 0 gathers each unit only when it is needed.
  int64_t prefetch_numel = 0;
  // Stages 2/3 (see the header): how micro-steps inside no_sync accumulate.
  GradientAccumulation accumulation = GradientAccumulation::reduce_every_micro_batch;
  // Stages 2/3: full gradient buckets held at once in a backward (filling or being
  // reduce-scattered); 2 overlaps one bucket's reduction with the next one's gradients
  // (DeepSpeed's overlap_comm), 1 reduces each before the next begins; 0: no bound (every
  // bucket kept until the end of backward).
  size_t max_buckets_in_flight = kDefaultBucketsInFlight;
  // Hybrid sharding (see the header): shard within groups of this many ranks and replicate
  // across the groups; 0 shards over the whole group. Must divide the group's size; stages
  // 2 and 3 only, not with offload.
  int hybrid_shard_size = 0;
};

// Refuses hybrid sharding that cannot be built, naming the numbers: a size below 1, one that
// does not divide the world size, a stage other than 2 or 3 (`stage` 0 is DDP), offload.
// `who` starts the message ("Accelerator", "tessera plan", ...).
void check_hybrid_sharding(int hybrid_shard_size, int world_size, int stage, bool offload,
                           const std::string& who);

class ZeroStrategy : public DataParallelStrategy {
 public:
  ZeroStrategy(nn::Module& module, std::shared_ptr<ProcessGroup> group, ZeroOptions options);
  ~ZeroStrategy() override;
  ZeroStrategy(const ZeroStrategy&) = delete;
  ZeroStrategy& operator=(const ZeroStrategy&) = delete;

  std::string name() const override;
  nn::Module& module() const override { return module_; }
  int stage() const { return options_.stage; }
  size_t max_buckets_in_flight() const { return options_.max_buckets_in_flight; }
  // Hybrid sharding: ranks per shard group (0 when not hybrid) and the groups of the mesh.
  int hybrid_shard_size() const { return options_.hybrid_shard_size; }
  const std::shared_ptr<ProcessGroup>& shard_group() const { return shard_group_; }
  const std::shared_ptr<ProcessGroup>& replica_group() const { return replica_group_; }
  // The group whose members write a sharded checkpoint (together they hold every value
  // once): the whole group, or under hybrid sharding shard group 0; null on the other ranks.
  std::shared_ptr<ProcessGroup> checkpoint_group() const;

  void prepare_optimizer(optim::Optimizer& optimizer) override;
  // Under reduce_every_micro_batch the buckets keep reducing inside no_sync: only the shard
  // accumulates.
  void set_gradient_sync(bool on) override;
  bool gradient_sync() const override { return sync_requested_; }
  // Whether micro-steps inside no_sync are reduce-scattered (see the header).
  bool reduces_every_micro_batch() const;
  void finish_gradient_sync() override;
  // A pipeline stage's step (its backwards under no_sync, accumulated in the full gradient
  // buckets): every parameter reported ready, then the buckets' reductions as after one synced
  // backward. Stages 1 and 2 accumulating locally (GradientAccumulation::no_sync, no offload:
  // the Accelerator prepares a pipeline so); anything else is refused, naming it.
  void sync_accumulated_gradients() override;
  double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) override;
  // Global-norm clipping of a model split over the device mesh (its pieces of the model on
  // `model_group`): the squares of this rank's slices of the parameters `counts` names (each
  // counted on one rank of the model group), summed over the dp group and the model group.
  double clip_split_grad_norm_(double max_norm,
                               const std::function<bool(const std::string&)>& counts,
                               ProcessGroup& model_group);
  void after_optimizer_step() override;
  // Collective. After the strategy is destroyed, parameters keep what they last pointed
  // at: the Accelerator gathers them before it lets a stage-3 strategy go.
  void gather_full_parameters() override;
  void release_full_parameters() override;
  void after_parameters_loaded() override;
  MemoryUsage memory() const override;
  std::vector<OptimizerSlice> optimizer_slices(const optim::Optimizer& optimizer) const override;
  std::vector<ParameterShard> parameter_shards() override;
  // What parameter_shards() returns on member `index` of the checkpoint group (its names,
  // begins and lengths; no values): each writer's share of a sharded save, for `tessera
  // plan`, whose dry run is rank 0 alone but whose save streams every writer's pieces.
  std::vector<ParameterShard> parameter_shard_layout(int index) const;
  void after_parameter_shards_loaded() override;

  const FlatBuckets& buckets() const { return *buckets_; }
  // This rank's slices, one per overlapped parameter (what the optimizer updates; host
  // views of the offloaded masters under offload).
  const std::vector<Tensor>& pieces() const { return pieces_; }
  // Host bytes of the offloaded masters, gradients and staging (0 without offload).
  int64_t offloaded_bytes() const { return offload_ ? offload_->host_bytes() : 0; }

 private:
  // Per bucket: the flat parameters and this rank's gradient slice.
  struct Shard {
    Tensor parameters;        // [padded] stage 1/2 always; stage 3 while gathered
    Tensor owned_parameters;  // [S] stage 3: this rank's slice, kept between steps
    // [S] stage 2/3: the averaged slice, parameter dtype, and the same in reduce_dtype when
    // that differs (else undefined); from a step's first reduce-scatter until its update
    // (kept between steps when offloaded).
    Tensor gradients;
    Tensor reduced;
    // Stage 2/3, reduce_every_micro_batch: the shard holds earlier micro-batches of this
    // optimizer step, so the next reduce-scatter lands in `incoming` and is added to it.
    bool holds_earlier_micro_batches = false;
    Tensor incoming;
    bool gathered = false;
    WorkPtr gathering;  // stage 3: an all-gather issued ahead of use (prefetch)
    double gather_issued_us = 0;
    double unit_began_us = 0;  // when the unit's forward or backward began (trace)
    std::shared_ptr<void> unit_began_event;  // the same on the device's stream (trace, GPU)
    double reduction_issued_us = 0;
  };
  // A parameter's overlap with one of this rank's slices of its bucket.
  struct Piece {
    size_t param, bucket;
    int64_t begin, numel;  // in the bucket's flat buffer
    int64_t at;            // in this rank's shard of the bucket (its slices one after another)
  };
  std::vector<std::vector<size_t>> stage3_units(const std::vector<Tensor>& params);
  void flatten_parameters();
  void allocate_shard_gradient(size_t bucket);
  void release_shard_gradients();
  void fill_owned_slice(size_t bucket);
  void install_comm_hooks();
  void install_unit_hooks();
  void wait_for_upload(size_t bucket);
  void wait_for_uploads();
  void issue_gather(size_t bucket);
  void gather(size_t bucket);
  void prefetch_after(size_t bucket, bool forward);
  void release(size_t bucket);
  // This rank's slice of bucket b's parameters as kept between steps (stage 1/2: a view of
  // the flat buffer; stage 3: the owned shard), and its averaged gradient after the bucket's
  // collective.
  Tensor owned_slice(size_t bucket) const;
  Tensor averaged_gradient(size_t bucket);
  // Where bucket b's reduce-scatter writes: the averaged slice, or `incoming` when the
  // shard accumulates micro-batches; add_incoming folds that in once it has landed.
  Tensor reduce_scatter_target(size_t bucket);
  void add_incoming(size_t bucket);
  void on_unit_grad_ready(size_t bucket);
  void trace_unit_begin(size_t bucket);
  void trace_unit_end(size_t bucket, bool forward);
  void point_pieces_at_gradients(size_t bucket);
  // Stages 1/2: every bucket's flat parameters from all ranks' owned slices.
  void all_gather_owned_slices();
  // Where this rank's k-th slice of bucket b starts in the flat buffer (k < slices_per_rank_),
  // and its length (padded / W); of_index: those of the rank with that index in its shard
  // group (the group's rank without hybrid sharding).
  int64_t slice_begin(size_t bucket, int k = 0) const;
  int64_t slice_begin_of(size_t bucket, int k, int index) const;
  int64_t slice_numel(size_t bucket) const;
  // The pieces the rank with that index keeps, bucket by bucket (this rank's: piece_layout_).
  std::vector<Piece> pieces_of(int index) const;
  // Elements of this rank's shard of bucket b: its slices one after another.
  int64_t owned_numel(size_t bucket) const;
  // Piece i where it is kept between steps (flat parameters, or the stage-3 shard).
  Tensor piece_values(const Piece& piece) const;
  void make_mesh();

  nn::Module& module_;
  std::shared_ptr<ProcessGroup> group_;
  ZeroOptions options_;
  // Hybrid sharding's mesh (else the shard group is group_ and there is no replica group):
  // S ranks per shard group, this rank's index l in it, G groups and this rank's group g.
  std::shared_ptr<ProcessGroup> shard_group_, replica_group_;
  int slices_per_rank_ = 1;  // G
  int shard_index_ = 0;      // l (the rank without hybrid sharding)
  std::unique_ptr<FlatBuckets> buckets_;
  std::vector<Shard> shards_;
  std::vector<Piece> piece_layout_;
  std::vector<Tensor> pieces_;
  // Stage 3: the modules whose hooks gather each bucket (the root's for the last one),
  // and how many of a bucket's parameters still wait for their gradient.
  std::vector<nn::Module*> unit_module_;
  std::vector<size_t> unit_waiting_;
  // Stage 3: the block units (not the root) in the order forward runs them.
  std::vector<size_t> forward_order_;
  std::unique_ptr<OptimizerOffload> offload_;
  std::vector<WorkPtr> uploads_;  // per bucket: the offloaded master's copy back, in flight
  // Offloaded with an optimizer that steps a subset (AdamW): per bucket, the flat indices of
  // its pieces in the prepared optimizer. offload_step_during_backward: the steps queued in
  // this backward (finish_gradient_sync waits for them) and which buckets they were.
  std::vector<std::vector<size_t>> bucket_pieces_;
  std::vector<WorkPtr> early_steps_;
  std::vector<char> stepped_in_backward_;
  bool uploads_queued_ = false;  // this step's copies back were queued in the pre-step hook
  // The copies back: each bucket's target (its owned slice) and the order they go in.
  std::vector<Tensor> upload_targets() const;
  std::vector<size_t> upload_order() const;
  // opt.step()'s pre-step hook, offloaded: steps each bucket not stepped in backward on the
  // stepper, in upload order, with each bucket's copy back queued behind its own update.
  void step_offloaded_buckets();
  double synced_at_us_ = 0;  // when the last gradient sync finished (trace)
  bool sync_requested_ = true;  // false inside no_sync
  // Read by the hooks left on the module and optimizer: false once this is destroyed.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::vector<autograd::HookHandle> grad_hooks_;
  optim::Optimizer* optimizer_ = nullptr;
};

}  // namespace tessera::dist
