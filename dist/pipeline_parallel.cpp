// Pipeline parallelism (dist/pipeline_parallel.h): the schedules, the timeline and its bubble,
// the refusals, and the stage machinery both models share (the sends and receives of one
// step, the tied embedding's gradient, the loss, the full state dict). The models' own parts
// (embeddings, blocks, head) are in dist/pipeline_parallel_models.cpp.
#include "tessera/dist/pipeline_parallel.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <map>
#include <sstream>

#include "tessera/autograd/functions.h"
#include "tessera/dist/rank_groups.h"

namespace tessera::dist {

// ---- the schedules ----
PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  if (name == "afab") return PipelineSchedule::afab;
  if (name == "1f1b") return PipelineSchedule::one_f_one_b;
  TESSERA_CHECK(false, "pipeline parallelism: unknown schedule '", name,
                "' (expected afab or 1f1b)");
}

const char* pipeline_schedule_name(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::afab ? "afab" : "1f1b";
}

std::vector<PipelineOp> pipeline_ops(PipelineSchedule schedule, int stage, int stages,
                                     int micro_batches) {
  TESSERA_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1,
                "pipeline_ops: stage ", stage, " of ", stages, " with ", micro_batches,
                " micro-batches");
  std::vector<PipelineOp> ops;
  int forwards = 0, backwards = 0;
  auto forward = [&] { ops.push_back({PipelineOp::forward, forwards++}); };
  auto backward = [&] { ops.push_back({PipelineOp::backward, backwards++}); };
  // AFAB fills the pipe with every micro-batch; 1F1B only with the p - 1 - s forwards that
  // must run here before the first gradient can come back, then alternates.
  const int warmup = schedule == PipelineSchedule::afab
                         ? micro_batches
                         : std::min(stages - 1 - stage, micro_batches);
  while (forwards < warmup) forward();
  while (forwards < micro_batches) forward(), backward();
  while (backwards < micro_batches) backward();
  return ops;
}

// ---- the timeline ----
double PipelineTimeline::span_s() const {
  return events.empty() ? 0 : events.back().end_s - events.front().start_s;
}

double PipelineTimeline::busy_s() const {
  double busy = 0;
  for (const PipelineEvent& e : events) busy += e.end_s - e.start_s;
  return busy;
}

double PipelineTimeline::idle_fraction() const {
  const double span = span_s();
  return span > 0 ? (span - busy_s()) / span : 0;
}

double pipeline_bubble(const std::vector<double>& busy_s, double span_s) {
  TESSERA_CHECK(!busy_s.empty() && span_s > 0, "pipeline_bubble: ", busy_s.size(),
                " stages over a span of ", span_s, " s");
  double busy = 0;
  for (double b : busy_s) busy += b;
  return 1 - busy / (static_cast<double>(busy_s.size()) * span_s);
}

double theoretical_bubble(int stages, int micro_batches) {
  return double(stages - 1) / double(micro_batches + stages - 1);
}

std::vector<PipelineTimeline> replay_pipeline(const std::vector<std::vector<PipelineEvent>>& ops) {
  const int stages = static_cast<int>(ops.size());
  int micro_batches = 0;
  size_t remaining = 0;
  for (const auto& stage_ops : ops) {
    for (const PipelineEvent& e : stage_ops)
      micro_batches = std::max(micro_batches, e.op.micro_batch + 1);
    remaining += stage_ops.size();
  }
  // When each stage's forward / backward of each micro-batch ended (< 0: not yet run).
  std::vector<std::vector<double>> forward_end(stages, std::vector<double>(micro_batches, -1));
  std::vector<std::vector<double>> backward_end = forward_end;
  std::vector<PipelineTimeline> timelines(stages);
  std::vector<size_t> next(stages, 0);
  std::vector<double> free_at(stages, 0);
  while (remaining > 0) {
    bool progressed = false;
    for (int s = 0; s < stages; ++s) {
      for (; next[s] < ops[s].size(); ++next[s], --remaining, progressed = true) {
        const PipelineEvent& e = ops[s][next[s]];
        const int m = e.op.micro_batch;
        const bool fwd = e.op.kind == PipelineOp::forward;
        // The input of this op: the previous stage's forward, or the next stage's backward.
        double ready = 0;
        if (fwd && s > 0) ready = forward_end[s - 1][m];
        if (!fwd && s < stages - 1) ready = backward_end[s + 1][m];
        if (!fwd && forward_end[s][m] < 0) ready = -1;
        if (ready < 0) break;
        const double start = std::max(free_at[s], ready);
        free_at[s] = (fwd ? forward_end : backward_end)[s][m] = start + (e.end_s - e.start_s);
        timelines[s].events.push_back({e.op, start, free_at[s], e.end_s - e.start_s});
      }
    }
    if (!progressed) {
      std::ostringstream waiting;
      for (int s = 0; s < stages; ++s) {
        if (next[s] == ops[s].size()) continue;
        const PipelineOp& op = ops[s][next[s]].op;
        waiting << " stage " << s << ": "
                << (op.kind == PipelineOp::forward ? "forward " : "backward ") << op.micro_batch;
      }
      TESSERA_CHECK(false,
                    "replay_pipeline: the stages' orders cannot finish (next:", waiting.str(), ")");
    }
  }
  return timelines;
}

std::vector<PipelineTimeline> simulate_pipeline(PipelineSchedule schedule, int stages,
                                                int micro_batches, double forward_slots,
                                                double backward_slots) {
  std::vector<std::vector<PipelineEvent>> ops(stages);
  for (int s = 0; s < stages; ++s)
    for (const PipelineOp& op : pipeline_ops(schedule, s, stages, micro_batches))
      ops[s].push_back({op, 0, op.kind == PipelineOp::forward ? forward_slots : backward_slots});
  return replay_pipeline(ops);
}

// ---- the cut and the refusals ----
StageBlocks pipeline_stage_blocks(int64_t blocks, int stage, int stages) {
  return {stage * blocks / stages, (stage + 1) * blocks / stages};
}

bool pipeline_stage_holds(const std::string& name, int stage, int stages, int64_t blocks,
                          bool tied) {
  const bool first = stage == 0, last = stage == stages - 1;
  for (const std::string prefix : {"transformer.h.", "model.layers."})
    if (name.starts_with(prefix)) {
      const int64_t block = std::stoll(name.substr(prefix.size()));
      const StageBlocks mine = pipeline_stage_blocks(blocks, stage, stages);
      return block >= mine.begin && block < mine.end;
    }
  if (name.starts_with("transformer.wte.") || name.starts_with("model.embed_tokens."))
    return first || (last && tied);
  if (name.starts_with("transformer.wpe.")) return first;
  return last;  // the final norm, an untied lm_head
}

void check_pipeline_parallel(int64_t blocks, int pp_size, const std::string& model) {
  TESSERA_CHECK(pp_size >= 1, "pipeline parallelism: pp_size must be >= 1, got ", pp_size);
  TESSERA_CHECK(pp_size <= blocks, "pipeline parallelism: pp_size ", pp_size, " exceeds the ",
                blocks, " blocks of ", model, " (every stage needs at least one block)");
}

void check_pipeline_options(const PipelineOptions& options) {
  TESSERA_CHECK(options.micro_batches >= 1,
                "pipeline parallelism: micro_batches must be >= 1, got ", options.micro_batches);
}

void check_micro_batches(int micro_batches, int64_t batch_rows) {
  check_pipeline_options({.micro_batches = micro_batches});
  TESSERA_CHECK(batch_rows % micro_batches == 0, "pipeline parallelism: micro_batches ",
                micro_batches, " does not divide the batch of ", batch_rows, " rows");
}

GroupPtr pipeline_parallel_group(ProcessGroup& world, int pp_size) {
  return consecutive_rank_group(world, pp_size, "pipeline parallelism: pp_size");
}

// ---- the model ----
namespace {
double seconds_since(std::chrono::steady_clock::time_point origin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin).count();
}
double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
std::vector<int> all_ranks(const ProcessGroup& group) {
  std::vector<int> ranks(group.size());
  for (int r = 0; r < group.size(); ++r) ranks[r] = r;
  return ranks;
}
}  // namespace

// What one train_step keeps between the ops of its micro-batches.
struct PipelineParallelCausalLM::StepState {
  Tensor idx, targets;
  int64_t rows = 0;                     // per micro-batch
  double target_count = 0;              // targets != -100 in the whole batch
  std::vector<Tensor> inputs, outputs;  // per micro-batch: the received input, the output
  double loss = 0;
  std::vector<Tensor> sent;  // alive until their sends are done
  std::vector<WorkPtr> sends;
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
};

PipelineParallelCausalLM::PipelineParallelCausalLM(GroupPtr group, const nn::CausalLM& full,
                                                   bool tied, GroupPtr tensor, GroupPtr model_group)
    : group_(std::move(group)),
      tensor_(std::move(tensor)),
      model_group_(std::move(model_group)),
      tied_model_(tied),
      fast_blocks_(full.runs_fast_blocks()),
      context_(full.context_length()),
      full_description_(full.describe()) {
  TESSERA_CHECK(group_ != nullptr, "pipeline parallelism: this rank is in no pipeline group");
  blocks_ = pipeline_stage_blocks(full.num_blocks(), stage(), stages());
  gradients_ = group_->new_group(all_ranks(*group_));
  if (tied_model_ && stages() > 1) tied_ = group_->new_group({0, stages() - 1});
}

PipelineParallelCausalLM::~PipelineParallelCausalLM() = default;

void PipelineParallelCausalLM::finish_construction(const nn::CausalLM& full, int64_t hidden,
                                                   TensorShards shards) {
  shards_ = std::move(shards);
  const nn::NamedTensors mine = named_parameters();
  TESSERA_CHECK(!mine.empty(), "pipeline parallelism: stage ", stage(), " holds no parameter");
  hidden_ = hidden;
  activations_ = {.dtype = mine.front().second.dtype(), .device = mine.front().second.device()};
  train(full.is_training());
  const nn::NamedTensors all = full.named_parameters();
  std::map<std::string, Tensor> held(mine.begin(), mine.end());
  // Each of the full model's parameters: this stage holds it (its shape, or its tensor-parallel
  // slice's) exactly when pipeline_stage_holds says so, and the layout names the lowest stage
  // that holds it (tied: the first), from the same rule on every rank: no communication.
  for (const auto& [name, whole] : all) {
    const bool rule = pipeline_stage_holds(name, stage(), stages(), full.num_blocks(), tied_model_);
    auto it = held.find(name);
    TESSERA_CHECK(rule == (it != held.end()), "pipeline parallelism: stage ", stage(),
                  rule ? " does not hold " : " holds ", name,
                  " against pipeline_stage_holds' layout");
    if (it != held.end()) {
      Shape local = whole.shape();
      if (const ShardSpec* spec = spec_of(name); spec && !spec->replicated())
        local[spec->dim] = spec->local_size(tensor_->rank());
      TESSERA_CHECK(it->second.shape() == local, "pipeline parallelism: ", name, " is ",
                    shape_str(it->second.shape()), " on stage ", stage(), " but ",
                    shape_str(local), " in the full model", tensor_ ? "'s slice" : "");
      held.erase(it);
    }
    int holder = 0;
    while (holder < stages() &&
           !pipeline_stage_holds(name, holder, stages(), full.num_blocks(), tied_model_))
      ++holder;
    TESSERA_CHECK(holder < stages(), "pipeline parallelism: no stage holds ", name);
    layout_.push_back({name, whole.shape(), holder});
  }
  TESSERA_CHECK(held.empty(), "pipeline parallelism: stage ", stage(), " holds ",
                held.empty() ? std::string() : held.begin()->first,
                ", which the full model does not have");
}

void PipelineParallelCausalLM::set_options(const PipelineOptions& options) {
  check_pipeline_options(options);
  options_ = options;
}

std::string PipelineParallelCausalLM::describe() const {
  std::ostringstream out;
  out << full_description_ << "; pipeline stage " << stage() << " of " << stages() << ": blocks "
      << blocks_.begin << ".." << blocks_.end - 1 << (first_stage() ? " + embeddings" : "")
      << (last_stage() ? " + head" : "") << ", " << options_.micro_batches << " micro-batches, "
      << pipeline_schedule_name(options_.schedule);
  if (tensor_)
    out << "; split over tensor-parallel rank " << tensor_->rank() << " of " << tensor_->size();
  return out.str();
}

void PipelineParallelCausalLM::check_step_inputs(const Tensor& idx, const Tensor& targets) const {
  TESSERA_CHECK(idx.dim() == 2 && is_integral(idx.dtype()) && idx.dtype() != DType::boolean,
                "pipeline parallelism: idx must be integer [B, T], got ", dtype_name(idx.dtype()),
                " ", shape_str(idx.shape()));
  TESSERA_CHECK(targets.shape() == idx.shape(), "pipeline parallelism: targets ",
                shape_str(targets.shape()), " must have idx's shape ", shape_str(idx.shape()));
  TESSERA_CHECK(idx.size(1) <= context_, "pipeline parallelism: sequence of ", idx.size(1),
                " tokens exceeds the context of ", context_);
  check_micro_batches(options_.micro_batches, idx.size(0));
}

Tensor PipelineParallelCausalLM::train_step(const Tensor& idx, const Tensor& targets) {
  check_step_inputs(idx, targets);
  StepState step;
  step.idx = idx.contiguous(), step.targets = targets.contiguous();
  step.rows = idx.size(0) / options_.micro_batches;
  for (int64_t t : ops::to(step.targets, Device::cpu(), DType::i64).to_vector<int64_t>())
    step.target_count += t != -100;
  TESSERA_CHECK(step.target_count > 0,
                "pipeline parallelism: the batch has no target "
                "(every one is -100)");
  step.inputs.assign(options_.micro_batches, Tensor());
  step.outputs.assign(options_.micro_batches, Tensor());
  timeline_.events.clear();
  for (const PipelineOp& op :
       pipeline_ops(options_.schedule, stage(), stages(), options_.micro_batches))
    op.kind == PipelineOp::forward ? forward_micro_batch(op.micro_batch, step)
                                   : backward_micro_batch(op.micro_batch, step);
  for (const WorkPtr& w : step.sends) w->wait();
  reduce_tied_gradient();
  // The loss lives on the last stage; every stage reports it.
  Tensor loss = full({}, step.loss, {.dtype = DType::f64});
  group_->broadcast(loss, stages() - 1)->wait();
  // f64 models report it unrounded; every other dtype as f32.
  return loss.to(activations_.dtype == DType::f64 ? DType::f64 : DType::f32);
}

void PipelineParallelCausalLM::forward_micro_batch(int m, StepState& step) {
  Tensor input;
  if (!first_stage()) {
    input = empty({step.rows, step.idx.size(1), hidden_}, activations_);
    group_->recv(input, stage() - 1)->wait();
    input.requires_grad_();  // stage - 1 needs the gradient of this input
    step.inputs[m] = input;
  }
  const double start = seconds_since(step.origin), cpu = thread_cpu_s();
  const int64_t row = m * step.rows;
  Tensor x =
      first_stage() ? embed(ops::contiguous(ops::narrow(step.idx, 0, row, step.rows))) : input;
  Tensor out = run_blocks(x);
  if (last_stage()) {
    // Each micro-batch's summed cross-entropy over the whole batch's target count: the
    // micro-batches' losses and gradients add up to those of the batch's mean.
    const Tensor targets = ops::contiguous(ops::narrow(step.targets, 0, row, step.rows));
    out = summed_loss(out, targets) / step.target_count;
    step.loss += out.item();
  } else {
    step.sent.push_back(out.detach().contiguous());
    step.sends.push_back(group_->send(step.sent.back(), stage() + 1));
  }
  step.outputs[m] = out;
  timeline_.events.push_back(
      {{PipelineOp::forward, m}, start, seconds_since(step.origin), thread_cpu_s() - cpu});
}

void PipelineParallelCausalLM::backward_micro_batch(int m, StepState& step) {
  Tensor& out = step.outputs[m];
  TESSERA_CHECK(out.defined(), "pipeline parallelism: backward of micro-batch ", m,
                " before its forward");
  Tensor grad;
  if (!last_stage()) {
    grad = empty(out.shape(), {.dtype = out.dtype(), .device = out.device()});
    gradients_->recv(grad, stage() + 1)->wait();
  }
  const double start = seconds_since(step.origin), cpu = thread_cpu_s();
  out.backward(grad);
  if (!first_stage()) {
    step.sent.push_back(step.inputs[m].grad().contiguous());
    step.sends.push_back(gradients_->send(step.sent.back(), stage() - 1));
  }
  out = step.inputs[m] = Tensor();  // micro-batch m's activations can go
  timeline_.events.push_back(
      {{PipelineOp::backward, m}, start, seconds_since(step.origin), thread_cpu_s() - cpu});
}

Tensor PipelineParallelCausalLM::summed_loss(const Tensor& h, const Tensor& targets) {
  return cross_entropy(head_logits(h), targets, -100, Reduction::Sum);
}

void PipelineParallelCausalLM::reduce_tied_gradient() {
  if (!tied_) return;
  // The first stage's lookups and the last stage's head both used the token embedding: its
  // gradient is the sum of the two parts, on both copies.
  Tensor weight = tied_weight();
  if (!weight.grad().defined()) weight.set_grad(zeros_like(weight));
  tied_->all_reduce(weight.grad())->wait();
}

PipelineBubble PipelineParallelCausalLM::bubble(const std::vector<PipelineTimeline>& steps) const {
  TESSERA_CHECK(!steps.empty(), "PipelineParallelCausalLM::bubble: no timeline given");
  const PipelineTimeline& last = steps.back();
  for (const PipelineTimeline& t : steps) {
    bool same = t.events.size() == last.events.size();
    for (size_t i = 0; same && i < t.events.size(); ++i)
      same = t.events[i].op.kind == last.events[i].op.kind &&
             t.events[i].op.micro_batch == last.events[i].op.micro_batch;
    TESSERA_CHECK(same, "PipelineParallelCausalLM::bubble: the timelines of stage ", stage(),
                  " ran different orders (", t.events.size(), " and ", last.events.size(),
                  " ops); give the steps of one schedule");
  }
  PipelineBubble out;
  // Every step's busy time of every stage and stage 0's span; durations only, so no two clocks
  // meet. The wall-clock figures are the median step's (by its bubble).
  const int64_t k = static_cast<int64_t>(steps.size()), width = stages() + 1;
  std::vector<double> figures(k * width, 0.0);
  for (int64_t i = 0; i < k; ++i) {
    figures[i * width + stage()] = steps[i].busy_s();
    if (first_stage()) figures[i * width + stages()] = steps[i].span_s();
  }
  Tensor summed = from_vector(figures, {k * width}, {.dtype = DType::f64});
  group_->all_reduce(summed)->wait();
  figures = summed.to_vector<double>();
  std::vector<std::pair<double, int64_t>> by_bubble;
  for (int64_t i = 0; i < k; ++i) {
    const std::vector<double> busy(figures.begin() + i * width,
                                   figures.begin() + i * width + stages());
    by_bubble.push_back({pipeline_bubble(busy, figures[i * width + stages()]), i});
  }
  std::nth_element(by_bubble.begin(), by_bubble.begin() + k / 2, by_bubble.end());
  const int64_t median = by_bubble[k / 2].second;
  out.measured = by_bubble[k / 2].first;
  out.span_s = figures[median * width + stages()];
  out.stage0 = 1 - figures[median * width] / out.span_s;
  // Every stage's ops as it ran them: kind, micro-batch, CPU seconds (2m ops per stage).
  const int64_t n = static_cast<int64_t>(last.events.size());
  std::vector<double> mine;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> cpu;
    for (const PipelineTimeline& t : steps) cpu.push_back(t.events[i].cpu_s);
    std::nth_element(cpu.begin(), cpu.begin() + cpu.size() / 2, cpu.end());
    const PipelineOp& op = last.events[i].op;
    mine.insert(mine.end(), {double(op.kind), double(op.micro_batch), cpu[cpu.size() / 2]});
  }
  Tensor all = empty({stages() * 3 * n}, {.dtype = DType::f64});
  group_->all_gather(all, from_vector(mine, {3 * n}, {.dtype = DType::f64}))->wait();
  const std::vector<double> ops = all.to_vector<double>();
  std::vector<std::vector<PipelineEvent>> by_cpu(stages()), by_slots(stages());
  for (int s = 0; s < stages(); ++s)
    for (int64_t i = 0; i < n; ++i) {
      const double* op = &ops[3 * (s * n + i)];
      const PipelineOp what{op[0] == 0 ? PipelineOp::forward : PipelineOp::backward, int(op[1])};
      by_cpu[s].push_back({what, 0, op[2]});
      by_slots[s].push_back({what, 0, what.kind == PipelineOp::forward ? 1.0 : 2.0});
    }
  auto bubble_of = [&](const std::vector<PipelineTimeline>& replayed) {
    std::vector<double> busy;
    for (const PipelineTimeline& t : replayed) busy.push_back(t.busy_s());
    return pipeline_bubble(busy, replayed.front().span_s());
  };
  out.replayed_timelines = replay_pipeline(by_cpu);
  out.replayed = bubble_of(out.replayed_timelines);
  out.logical = bubble_of(replay_pipeline(by_slots));
  out.theory = theoretical_bubble(stages(), options_.micro_batches);
  return out;
}

std::map<std::string, Tensor> PipelineParallelCausalLM::full_state_dict() const {
  std::map<std::string, Tensor> mine;
  for (const auto& [name, p] : named_parameters()) mine[name] = p;
  return gather_full(mine);
}

std::map<std::string, Tensor> PipelineParallelCausalLM::gather_full(
    const std::map<std::string, Tensor>& pieces) const {
  TESSERA_CHECK(!pieces.empty(), "pipeline parallelism: gather_full of no tensor");
  // The pieces' dtype (optimizer moments may differ from the parameters').
  const TensorOptions like = {.dtype = pieces.begin()->second.dtype(),
                              .device = pieces.begin()->second.device()};
  std::map<std::string, Tensor> full;
  // The layout is the same on every stage: the broadcasts pair up.
  for (const FullParameter& p : layout_) {
    Tensor value;
    if (p.stage == stage()) {
      auto it = pieces.find(p.name);
      const ShardSpec* spec = spec_of(p.name);
      TESSERA_CHECK(it != pieces.end() && (spec || it->second.shape() == p.shape),
                    "pipeline parallelism: stage ", stage(), " has no piece of ", p.name, " ",
                    shape_str(p.shape));
      value = ops::to(ops::clone(it->second.detach()), like.device, like.dtype);
      // A tensor-parallel stage's slices, whole over its tp group first.
      if (spec) value = gather_shard(value, *spec, p.shape, *tensor_);
    } else {
      value = empty(p.shape, like);
    }
    group_->broadcast(value, p.stage)->wait();
    full[p.name] = value;
  }
  return full;
}

bool PipelineParallelCausalLM::counts_in_model_sums(const std::string& name) const {
  // A parameter kept whole on every rank of a tensor-parallel stage counts on its tp rank 0.
  const ShardSpec* spec = spec_of(name);
  if (spec && spec->replicated() && tensor_->rank() != 0) return false;
  for (const FullParameter& p : layout_)
    if (p.name == name) return p.stage == stage();
  return true;
}

const ShardSpec* PipelineParallelCausalLM::spec_of(const std::string& name) const {
  auto it = shards_.find(name);
  return it == shards_.end() ? nullptr : &it->second.first;
}

Tensor PipelineParallelCausalLM::piece_of(const std::string& name, const Tensor& full) const {
  for (const FullParameter& p : layout_)
    if (p.name == name) {
      TESSERA_CHECK(full.shape() == p.shape, "pipeline parallelism: ", name, " is ",
                    shape_str(p.shape), " in the full model, got ", shape_str(full.shape()));
      const ShardSpec* spec = spec_of(name);
      return spec ? take_shard(full, *spec, tensor_->rank()) : full;
    }
  TESSERA_FAIL("pipeline parallelism: the full model has no parameter ", name);
}

void PipelineParallelCausalLM::load_full_state_dict(const nn::Module& full) {
  autograd::NoGradGuard no_grad;
  for (const auto& [name, p] : named_parameters())
    ops::copy_(p, piece_of(name, full.parameter(name)));
}

std::unique_ptr<nn::CausalLM> PipelineParallelCausalLM::gather_full_model() const {
  std::unique_ptr<nn::CausalLM> full = new_full_model();
  full->load_state_dict(full_state_dict());
  return full;
}

void PipelineParallelCausalLM::save_pretrained(const std::string& dir) const {
  const std::unique_ptr<nn::CausalLM> full = gather_full_model();
  if (first_stage()) full->save_pretrained(dir);
  group_->barrier()->wait();
}

}  // namespace tessera::dist
