// Pipeline parallelism (GPipe's and PipeDream-Flush's, as Megatron-LM and DeepSpeed run them):
// the model is cut into pp_size STAGES of whole blocks, one per rank of a pipeline group; the
// batch of a step into micro-batches that follow each other down the pipe. Stage s receives
// each micro-batch's activations from stage s - 1 and sends its output to s + 1
// (ProcessGroup::send/recv); backward, the gradient of that output comes back from s + 1 and
// the gradient of its input goes to s - 1. docs/parallelism.md walks through it; the ladder's
// steps 9 and 10 (ladders/dist/09_pipeline_afab.cpp, 10_pipeline_1f1b.cpp) teach the same on a
// small MLP.
//
// The pieces, bottom up:
//   - the schedules: pipeline_ops gives the order in which one stage runs the forward and
//     backward of every micro-batch, AFAB (all forward, then all backward) or 1F1B (a warm-up
//     of p - 1 - s forwards, then one forward and one backward in turn, then the remaining
//     backwards); simulate_pipeline places those orders on a logical clock;
//   - the timeline: what a stage ran (op, micro-batch, start, end on a steady clock) and the
//     bubble measured from it;
//   - pipeline_stage_blocks and the refusals (pp_size against the blocks and the world size,
//     micro-batches against the batch);
//   - PipelineParallelCausalLM, an nn::GPT or nn::Llama cut into stages
//     (dist/pipeline_parallel_models.cpp): train_step runs one step's forward and backward of
//     every micro-batch on this stage, in the schedule's order.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/dist/device_mesh.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/tensor_parallel.h"
#include "tessera/nn/causal_lm.h"

namespace tessera::dist {

using GroupPtr = std::shared_ptr<ProcessGroup>;

// ---- the schedules ----
enum class PipelineSchedule : uint8_t { afab, one_f_one_b };
// "afab" | "1f1b"; anything else is refused, naming it.
PipelineSchedule parse_pipeline_schedule(const std::string& name);
const char* pipeline_schedule_name(PipelineSchedule schedule);

struct PipelineOp {
  enum Kind : uint8_t { forward, backward };
  Kind kind = forward;
  int micro_batch = 0;
  bool operator==(const PipelineOp& o) const {
    return kind == o.kind && micro_batch == o.micro_batch;
  }
};

// The order in which stage `stage` of `stages` runs the forward and the backward of each of
// `micro_batches` micro-batches. Every micro-batch's forward comes before its backward; each
// kind runs in micro-batch order (the order the sends between stages pair up in).
std::vector<PipelineOp> pipeline_ops(PipelineSchedule schedule, int stage, int stages,
                                     int micro_batches);

// ---- the timeline ----
struct PipelineEvent {
  PipelineOp op;
  double start_s = 0, end_s = 0;  // seconds on the stage's steady clock
  // CPU seconds the stage's thread spent in the op: its compute alone, not the time other
  // processes on the same cores took from it (with one compute thread per rank).
  double cpu_s = 0;
};

// What one stage ran in one step, in order.
struct PipelineTimeline {
  std::vector<PipelineEvent> events;
  // From the start of the first op to the end of the last, and the time inside ops.
  double span_s() const;
  double busy_s() const;
  // (span - busy) / span: the share of this stage's own span spent waiting.
  double idle_fraction() const;
};

// The pipeline's bubble: the share of p stages x the step's span that no stage computed,
// 1 - sum(busy) / (p * span). Stage 0 runs the step's first op and its last (the gradient
// chain ends there) in both schedules, so the step's span is stage 0's: only durations are
// compared across processes, never one clock against another.
double pipeline_bubble(const std::vector<double>& busy_s, double span_s);
// GPipe's (p - 1) / (m + p - 1), for equal work on every stage.
double theoretical_bubble(int stages, int micro_batches);

// Every stage's ops in order, each with how long it takes, placed on a logical clock: an op
// starts when its stage is free and its input is there (a forward: the previous stage's
// forward of that micro-batch; a backward: the next stage's backward of it), as if every stage
// had a processor of its own. One timeline per stage. Refuses orders that cannot finish (no
// stage can start its next op), naming the stages' next ops.
std::vector<PipelineTimeline> replay_pipeline(const std::vector<std::vector<PipelineEvent>>& ops);
// The schedule's pipeline_ops replayed with forwards of `forward_slots` and backwards of
// `backward_slots`.
std::vector<PipelineTimeline> simulate_pipeline(PipelineSchedule schedule, int stages,
                                                int micro_batches, double forward_slots = 1,
                                                double backward_slots = 2);

// ---- the cut and the refusals ----
struct StageBlocks {
  int64_t begin = 0, end = 0;  // blocks [begin, end)
};
// Stage s's blocks: [s·n/p, (s+1)·n/p), contiguous, counts differing by at most one (5 blocks
// on 2 stages: 2 + 3).
StageBlocks pipeline_stage_blocks(int64_t blocks, int stage, int stages);
// Whether stage `stage` of `stages` holds the full model's parameter `name` (a GPT-2 or Llama
// of `blocks` blocks, its Hugging Face names): a block's when the block is the stage's, the
// position embedding on the first stage, the token embedding on the first (and, `tied`, its
// head's copy on the last), the final norm and an untied head on the last. The stages are
// built to this rule, and check it as they are built.
bool pipeline_stage_holds(const std::string& name, int stage, int stages, int64_t blocks,
                          bool tied);
// Refuses a pp_size < 1 or larger than the model's blocks, naming both (`model`: "GPT-2").
void check_pipeline_parallel(int64_t blocks, int pp_size, const std::string& model);
// Refuses a micro-batch count < 1 or one that does not divide the batch's rows.
void check_micro_batches(int micro_batches, int64_t batch_rows);
// Collective over `world`: splits it into world.size() / pp_size pipelines of consecutive
// ranks ([0, p), [p, 2p), ...; rank r of a pipeline is stage r) and returns this rank's.
// Refuses, before any communication, a pp_size < 1 or one that does not divide the world size.
GroupPtr pipeline_parallel_group(ProcessGroup& world, int pp_size);

// ---- the model ----
// A container whose children keep the full model's numbering (a stage's blocks a..b are "a" ..
// "b", not "0" ..).
class StageModuleList : public nn::Module {
 public:
  std::string type_name() const override { return "ModuleList"; }
};

struct PipelineOptions {
  int micro_batches = 1;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
};
// Refuses micro_batches < 1, naming it.
void check_pipeline_options(const PipelineOptions& options);

// The figures of the last step's timeline (PipelineParallelCausalLM::bubble).
struct PipelineBubble {
  double measured = 0;  // pipeline_bubble of the stages' wall-clock busy times and span
  double stage0 = 0;    // stage 0's wall-clock idle_fraction (its span is the step's)
  // The ops every stage recorded, in the order it ran them, replayed (replay_pipeline) with
  // each op's CPU time: the bubble of the run's own order and work with a processor per stage.
  double replayed = 0;
  // The same order replayed in op slots (1 per forward, 2 per backward).
  double logical = 0;
  double theory = 0;  // theoretical_bubble
  double span_s = 0;  // the step's wall-clock span, seconds
  // The replay behind `replayed`, one timeline per stage (seconds from the step's start), for
  // a chart of it (tests/dist/dist_pp_check --timeline, scripts/parallel_timeline.py).
  std::vector<PipelineTimeline> replayed_timelines;
};

// An nn::GPT or nn::Llama cut into the stages of a pipeline group. Stage s holds blocks
// pipeline_stage_blocks(n, s, p); the first stage also the embeddings, the last the final norm,
// the head and the loss. With tied embeddings the last stage keeps a copy of the token
// embedding for its head, and after every step's backward the two copies' gradients are
// all-reduced between the first and the last stage (as Megatron-LM does), so the copies get the
// same gradient, the same optimizer step and stay equal. parameters() are the stage's own under
// the full model's names (the tied copy under the embedding's name on both stages), so
// optim::AdamW steps them as they are.
class PipelineParallelCausalLM : public nn::Module, public MeshParallelModel {
 public:
  ~PipelineParallelCausalLM() override;
  const GroupPtr& group() const { return group_; }
  int stage() const { return group_->rank(); }
  int stages() const { return group_->size(); }
  bool first_stage() const { return stage() == 0; }
  bool last_stage() const { return stage() == stages() - 1; }
  const StageBlocks& blocks() const { return blocks_; }
  const PipelineOptions& options() const { return options_; }
  // Refuses micro_batches < 1, naming it (check_pipeline_options).
  void set_options(const PipelineOptions& options);
  // "stage s of p: blocks a..b (+ embeddings, + head)" and the full model's description.
  std::string describe() const;

  // One step's forward and backward: idx and targets [B, T] (the same on every stage; the
  // first stage reads idx, the last targets, the others their shapes) are cut into
  // micro_batches of B / micro_batches rows, run through this stage in the schedule's order.
  // Afterwards the stage's parameters hold (added to what .grad held) the gradients of the
  // mean cross-entropy over every target != -100 of the whole batch, as one process's
  // loss(idx, targets).backward() gives; returns that loss (detached) on every stage, broadcast
  // from the last. Refuses, on every stage before any communication: idx that is not integer
  // [B, T], targets of another shape, T past the context, micro-batches that do not divide B,
  // a batch with no target.
  Tensor train_step(const Tensor& idx, const Tensor& targets);
  // What this stage ran in the last train_step, seconds from that step's start.
  const PipelineTimeline& timeline() const { return timeline_; }
  // Collective over the pipeline: the bubble of the last train_step's timeline.
  PipelineBubble bubble() const { return bubble({timeline_}); }
  // The same over several steps' timelines of this stage (timeline() after each, one schedule):
  // the wall-clock figures are the median step's, the replay takes each op's median CPU time
  // over them, so one step or op slowed by whatever else ran on the machine does not move them.
  // Refuses an empty list or timelines whose orders differ.
  PipelineBubble bubble(const std::vector<PipelineTimeline>& steps) const;

  // Collective over the pipeline: every parameter of the full model, under its name, on
  // every stage (each broadcast from the stage that holds it).
  std::map<std::string, Tensor> full_state_dict() const;
  // Copies this stage's parameters out of a full model's (same names and shapes).
  void load_full_state_dict(const nn::Module& full);
  // A full model of the same configuration holding full_state_dict() (collective).
  std::unique_ptr<nn::CausalLM> gather_full_model() const override;
  // MeshParallelModel: each tensor broadcast from the lowest stage holding its parameter; a
  // stage's piece is the whole tensor.
  std::map<std::string, Tensor> gather_full(
      const std::map<std::string, Tensor>& pieces) const override;
  Tensor piece_of(const std::string& name, const Tensor& full) const override;
  // The pipeline, or with tensor-parallel stages the tp x pp ranks of this replica.
  ProcessGroup& model_group() const override { return model_group_ ? *model_group_ : *group_; }
  bool counts_in_model_sums(const std::string& name) const override;
  // The tensor-parallel group each stage's blocks are split over (null: whole blocks).
  const GroupPtr& tensor_group() const { return tensor_; }
  // Collective: stage 0 writes the full model directory; every stage waits for it.
  void save_pretrained(const std::string& dir) const;

 protected:
  // Collective over `group`; the derived constructor registers the stage's modules and then
  // calls finish_construction. With `tensor` (tensor-parallel stages, dist::parallelize) each
  // stage's layers are split over that group and `model_group` holds the tp x pp ranks of the
  // replica (the group a norm over the whole model sums over).
  PipelineParallelCausalLM(GroupPtr group, const nn::CausalLM& full, bool tied,
                           GroupPtr tensor = nullptr, GroupPtr model_group = nullptr);
  // After the modules are registered: which stage holds each of the full model's parameters
  // (one all-reduce), their full shapes, the width `hidden` of the activations between the
  // stages, and the full model's train/eval mode. `shards`: how a tensor-parallel stage cuts
  // each of its parameters (TensorShards; empty: every parameter whole).
  void finish_construction(const nn::CausalLM& full, int64_t hidden, TensorShards shards = {});
  // The first stage's embeddings of idx [b, T] -> [b, T, C].
  virtual Tensor embed(const Tensor& idx) = 0;
  // The stage's blocks on x [b, T, C].
  virtual Tensor run_blocks(const Tensor& x) = 0;
  // The last stage's final norm and head: h [b, T, C] -> logits [b, T, V].
  virtual Tensor head_logits(const Tensor& h) = 0;
  // The last stage's summed cross-entropy of micro-batch h [b, T, C] against targets [b, T]
  // (targets -100 left out): of head_logits by default; a tensor-parallel stage's is
  // vocabulary-parallel (its logits never gathered).
  virtual Tensor summed_loss(const Tensor& h, const Tensor& targets);
  // The token embedding's weight (tied models, on the first and the last stage).
  virtual Tensor tied_weight() const = 0;
  // A fresh full model of this configuration (its values overwritten by the caller).
  virtual std::unique_ptr<nn::CausalLM> new_full_model() const = 0;
  // The first stage, and the last of a tied model (its head's copy).
  bool holds_token_embedding() const { return first_stage() || (last_stage() && tied_model_); }
  // Whether the stage runs the fast blocks (the full model's choice at construction).
  bool fast_blocks() const { return fast_blocks_; }

 private:
  struct StepState;
  void check_step_inputs(const Tensor& idx, const Tensor& targets) const;
  void forward_micro_batch(int m, StepState& step);
  void backward_micro_batch(int m, StepState& step);
  void reduce_tied_gradient();

  GroupPtr group_;      // activations forward, the loss, the state dict
  GroupPtr gradients_;  // the gradients backward: a second channel over the same ranks, so a
                        // send of one direction never queues behind one of the other
  GroupPtr tied_;       // {first, last} stage, tied models with p > 1 (null elsewhere)
  GroupPtr tensor_;     // tensor-parallel stages: the group their layers are split over
  GroupPtr model_group_;  // and the tp x pp ranks of this replica
  // Tensor-parallel stages: how each parameter of this stage is cut, and its full shape.
  TensorShards shards_;
  const ShardSpec* spec_of(const std::string& name) const;
  bool tied_model_ = false;
  bool fast_blocks_ = true;
  int64_t hidden_ = 0, context_ = 0;
  TensorOptions activations_;  // the parameters' dtype and device
  StageBlocks blocks_;
  PipelineOptions options_;
  PipelineTimeline timeline_;
  std::string full_description_;
  struct FullParameter {
    std::string name;
    Shape shape;
    int stage = 0;  // the lowest stage holding it
  };
  std::vector<FullParameter> layout_;
};

// `model` (an nn::GPT or nn::Llama; anything else is refused, naming it) cut into the stages
// of `group` (this rank's pipeline: pipeline_parallel_group). Refuses, before anything is built
// or sent, a pipeline of more stages than the model has blocks, micro_batches < 1, and dropout
// (the stages' draws could not be one process's). Collective over the group.
std::unique_ptr<PipelineParallelCausalLM> pipeline_parallel(const nn::CausalLM& model,
                                                            GroupPtr group,
                                                            const PipelineOptions& options = {});

}  // namespace tessera::dist
