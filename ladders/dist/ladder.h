// The shared harness of the distributed ladders (ladders/dist/README.md). Everything here is
// the part every step repeats and no step is about: the command line, joining the job, the
// small model and its seeded data, the one-process reference run, the traffic counter and
// the final comparison. What a step teaches (which collectives it calls, when, on what)
// stays in its own file, readable top to bottom.
//
// Only Tessera's public API is used: tensors, autograd, nn::Linear, optim::AdamW and the
// process group's collectives (dist/process_group.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/env.h"
#include "tessera/dist/process_group.h"
#include "tessera/nn/layers.h"
#include "tessera/optim/adamw.h"

namespace ladder {

using namespace tessera;
using dist::WorkPtr;

// ---- the command line: [--steps N] [--rows N] [--device cpu|cuda] ----
struct Options {
  int steps = 3;              // AdamW steps
  int64_t rows_per_rank = 5;  // odd on purpose: nothing divides evenly by accident
  bool cuda = false;          // --device cuda: one GPU per rank over NCCL (untested on CPU CI)
};

inline Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    TESSERA_CHECK(i + 1 < argc, "ladder: ", flag,
                  " needs a value (usage: [--steps N] [--rows N] "
                  "[--device cpu|cuda])");
    const std::string value = argv[++i];
    if (flag == "--steps")
      o.steps = std::stoi(value);
    else if (flag == "--rows")
      o.rows_per_rank = std::stoll(value);
    else if (flag == "--device" && (value == "cpu" || value == "cuda"))
      o.cuda = value == "cuda";
    else
      TESSERA_CHECK(false, "ladder: unknown argument '", flag, " ", value, "'");
  }
  TESSERA_CHECK(o.steps > 0 && o.rows_per_rank > 0, "ladder: --steps and --rows must be positive");
  return o;
}

// ---- counting what a step sends ----
// The convention: payload bytes are the bytes of the tensor handed to the collective (for
// all_reduce the tensor reduced in place, for reduce_scatter its full input, for all_gather
// its full output). That number is exact whatever algorithm the backend runs. A ring
// implementation then sends, from each rank, 2(W-1)/W of the payload for an all-reduce and
// (W-1)/W of it for a reduce-scatter or an all-gather; we print that too.
// send and recv (point to point, the pipeline's) count the tensor sent or received.
enum Collective { kAllReduce, kReduceScatter, kAllGather, kSend, kRecv, kCollectives };
inline const char* collective_name(int c) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "send", "recv"};
  return names[c];
}

struct Traffic {
  int64_t calls[kCollectives] = {};
  int64_t payload_bytes[kCollectives] = {};
  void add(Collective c, int64_t calls_made, int64_t bytes) {
    calls[c] += calls_made;
    payload_bytes[c] += bytes;
  }
  bool operator==(const Traffic&) const = default;
};

// The world group with a tally in front: steps call the collectives through this.
class CountingGroup {
 public:
  explicit CountingGroup(dist::ProcessGroup& pg) : pg_(pg) {}
  int rank() const { return pg_.rank(); }
  int size() const { return pg_.size(); }

  WorkPtr all_reduce(const Tensor& t, dist::ReduceOp op) {
    now_.add(kAllReduce, 1, static_cast<int64_t>(t.nbytes()));
    return pg_.all_reduce(t, op);
  }
  WorkPtr reduce_scatter(const Tensor& output, const Tensor& input, dist::ReduceOp op) {
    now_.add(kReduceScatter, 1, static_cast<int64_t>(input.nbytes()));
    return pg_.reduce_scatter(output, input, op);
  }
  WorkPtr all_gather(const Tensor& output, const Tensor& input) {
    now_.add(kAllGather, 1, static_cast<int64_t>(output.nbytes()));
    return pg_.all_gather(output, input);
  }
  WorkPtr send(const Tensor& t, int dst) {
    now_.add(kSend, 1, static_cast<int64_t>(t.nbytes()));
    return pg_.send(t, dst);
  }
  WorkPtr recv(const Tensor& t, int src) {
    now_.add(kRecv, 1, static_cast<int64_t>(t.nbytes()));
    return pg_.recv(t, src);
  }
  // Closes one training step's tally.
  void end_step() {
    per_step_.push_back(now_);
    now_ = Traffic();
  }
  const std::vector<Traffic>& per_step() const { return per_step_; }

 private:
  dist::ProcessGroup& pg_;
  Traffic now_;
  std::vector<Traffic> per_step_;
};

// ---- the job ----
struct Job {
  Options options;
  Device device = Device::cpu();
  dist::ProcessGroup* world = nullptr;
  int rank = 0, size = 1;
  TensorOptions floats() const { return {.dtype = DType::f32, .device = device}; }
  // The mean of one number over the ranks (the printed loss); not counted as a step's traffic.
  double mean_over_ranks(double value) const {
    Tensor t = ops::to(from_vector(std::vector<float>{static_cast<float>(value)}, {1}), device,
                       DType::f32);
    world->all_reduce(t, dist::ReduceOp::Avg)->wait();
    return ops::to(t, Device::cpu(), DType::f64).to_vector<double>()[0];
  }
  // Rank `root`'s number on every rank (a pipeline's loss lives on its last stage); not counted.
  double from_rank(double value, int root) const {
    Tensor t = ops::to(from_vector(std::vector<double>{value}, {1}), device, DType::f64);
    world->broadcast(t, root)->wait();
    return ops::to(t, Device::cpu(), DType::f64).to_vector<double>()[0];
  }
};

// The same AdamW everywhere, so the distributed run and the reference can be compared: one
// parameter group with weight decay on every parameter, biases too. (AdamW's default groups
// decay only matrices; a flat ZeRO shard mixes weights and biases. dist/zero.cpp keeps one
// view per parameter piece of a shard, each in its parameter's own group.)
constexpr double kLearningRate = 1e-2, kWeightDecay = 0.1;
inline optim::AdamWOptions adamw_options() {
  return {.lr = kLearningRate, .weight_decay = kWeightDecay};
}
inline std::vector<optim::ParamGroup> one_group(const std::vector<Tensor>& params) {
  return {{.params = params, .lr = kLearningRate, .weight_decay = kWeightDecay, .name = "all"}};
}

// ---- the model of steps 1-6: the MLP half of a GPT block, three times, and a classifier ----
// x -> x + proj(gelu(fc(x))) per block -> head -> cross-entropy. Every parameter is the weight
// ([in, out]) or bias of one of the model's linears, listed in the order forward uses them.
constexpr int64_t kFeatures = 20, kHidden = 44, kClasses = 7, kBlocks = 3;
constexpr uint64_t kInitSeed = 2026;

struct LinearShape {
  int64_t in, out;
};
inline std::vector<LinearShape> mlp_linear_shapes() {
  std::vector<LinearShape> shapes;
  for (int64_t b = 0; b < kBlocks; ++b) {
    shapes.push_back({kFeatures, kHidden});  // fc
    shapes.push_back({kHidden, kFeatures});  // proj
  }
  shapes.push_back({kFeatures, kClasses});  // head
  return shapes;
}
// Written out from the dimensions (not counted from the model): the theory's N.
constexpr int64_t kMlpParameters =
    kBlocks * (kFeatures * kHidden + kHidden + kHidden * kFeatures + kFeatures) +
    kFeatures * kClasses + kClasses;
constexpr int64_t kMlpTensors = 2 * (2 * kBlocks + 1);  // a weight and a bias per linear

// The forward, given how to apply linear number `layer` (steps 1-5: nn::Linear; step 6: a
// linear whose parameters are gathered just in time).
using LinearFn = std::function<Tensor(size_t layer, const Tensor& x)>;
// Units [first, end) of the model: units 0..kBlocks-1 are the blocks, unit kBlocks the head
// (a pipeline stage runs some of them; everyone else runs all).
constexpr int kUnits = kBlocks + 1;
inline Tensor mlp_forward(const Tensor& x, const LinearFn& linear, int first = 0,
                          int end = kUnits) {
  Tensor h = x;
  for (int unit = first; unit < end; ++unit) {
    const size_t layer = 2 * static_cast<size_t>(unit);  // a block's fc, proj; or the head
    h = unit == kBlocks ? linear(layer, h) : h + linear(layer + 1, gelu(linear(layer, h)));
  }
  return h;
}

struct TinyMlp : nn::Module {
  std::vector<nn::Linear*> linears;
  explicit TinyMlp(Device device) {
    Generator gen(kInitSeed);  // every rank and the reference start from the same weights
    const auto shapes = mlp_linear_shapes();
    for (size_t l = 0; l < shapes.size(); ++l) {
      auto linear = std::make_unique<nn::Linear>(shapes[l].in, shapes[l].out, true,
                                                 1.0 / std::sqrt(double(shapes[l].in)), &gen);
      linears.push_back(&register_module("linear" + std::to_string(l), std::move(linear)));
    }
    to(device);
  }
  Tensor forward(const Tensor& x) override {
    return mlp_forward(x, [&](size_t l, const Tensor& h) { return (*linears[l])(h); });
  }
};

// Training step `step`'s global batch: rows of seeded random features and class targets, the
// same on every rank. Rank r trains on rows [r·B, (r+1)·B).
struct Batch {
  Tensor x, y;
  Batch rows(int64_t first, int64_t count) const {
    return {x.narrow(0, first, count), y.narrow(0, first, count)};
  }
};
inline Batch global_batch(int step, int64_t rows, Device device) {
  Generator gen(7000 + step);
  Tensor x = randn({rows, kFeatures}, {}, &gen);
  Tensor y = randint(0, kClasses, {rows}, {.dtype = DType::i64}, &gen);
  return {ops::to(x, device, DType::f32), ops::to(y, device, DType::i64)};
}

// What one process computes on the whole global batch of W·B rows: the losses and the
// model after the steps, the answer every distributed step must reproduce.
struct Reference {
  std::vector<double> losses;
  std::unique_ptr<TinyMlp> model;
};
// `global_rows`: the rows of a step's batch (0: W·B, each rank's B rows of data parallelism).
inline Reference train_one_process(const Job& job, int64_t global_rows = 0) {
  if (global_rows == 0) global_rows = job.size * job.options.rows_per_rank;
  Reference ref{{}, std::make_unique<TinyMlp>(job.device)};
  optim::AdamW opt(one_group(ref.model->parameters()), adamw_options());
  for (int s = 0; s < job.options.steps; ++s) {
    Batch batch = global_batch(s, global_rows, job.device);
    Tensor loss = cross_entropy((*ref.model)(batch.x), batch.y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    ref.losses.push_back(loss.item());
  }
  return ref;
}

// The data-parallel loop of steps 1-5: each rank runs its own rows of every step's global
// batch through its replica and backward; then `after_backward` does what the step is about
// (synchronise the gradients, update the parameters). Returns the losses, averaged over the
// ranks as the one process sees them.
template <typename Model>  // TinyMlp, or anything else called as model(x)
std::vector<double> train_data_parallel(Job& job, CountingGroup& comm, Model& model,
                                        const std::function<void()>& after_backward) {
  const int64_t rows = job.options.rows_per_rank;
  std::vector<double> losses;
  for (int step = 0; step < job.options.steps; ++step) {
    Batch mine = global_batch(step, job.size * rows, job.device).rows(job.rank * rows, rows);
    Tensor loss = cross_entropy(model(mine.x), mine.y);
    loss.backward();
    after_backward();
    comm.end_step();
    losses.push_back(job.mean_over_ranks(loss.item()));
  }
  return losses;
}

// ---- comparing with the reference ----
// Per tensor, the norm-wise relative difference ||got - want||₂ / ||want||₂, which must stay
// within 1e-6. Norm-wise, because AdamW divides each gradient by its own running magnitude:
// an element whose gradient nearly cancels over the batch gets a full-size update out of a
// last-bit difference in the summation order, so a single element's error says little about
// the run. Also reports the largest single-element difference and counts the values that are
// not bit-identical.
class ResultCheck {
 public:
  static constexpr double kLimit = 1e-6;
  void values(const std::string& what, const std::vector<double>& got,
              const std::vector<double>& want) {
    TESSERA_CHECK(got.size() == want.size(), what, ": ", got.size(), " values, want ", want.size());
    double diff_squares = 0, want_squares = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double diff = got[i] - want[i];
      diff_squares += diff * diff;
      want_squares += want[i] * want[i];
      largest_element_diff_ = std::max(largest_element_diff_, std::fabs(diff));
      not_bit_exact_ += static_cast<float>(got[i]) != static_cast<float>(want[i]);
    }
    elements_ += static_cast<int64_t>(want.size());
    ++tensors_;
    const double relative = std::sqrt(diff_squares / std::max(want_squares, 1e-300));
    if (relative > worst_) worst_ = relative, worst_name_ = what;
  }
  void tensor(const std::string& what, const Tensor& got, const Tensor& want) {
    values(what, to_doubles(got), to_doubles(want));
  }
  static std::vector<double> to_doubles(const Tensor& t) {
    return ops::to(t.detach(), Device::cpu(), DType::f64).contiguous().to_vector<double>();
  }
  bool passed() const { return worst_ <= kLimit; }
  std::string summary() const {
    char line[320];
    std::snprintf(line, sizeof line,
                  "%d tensors (losses included): largest relative difference %.3g in %s (limit "
                  "%g), largest element difference %.3g; %lld of %lld values not bit-identical",
                  tensors_, worst_, worst_name_.c_str(), kLimit, largest_element_diff_,
                  static_cast<long long>(not_bit_exact_), static_cast<long long>(elements_));
    return line;
  }

 private:
  double worst_ = 0, largest_element_diff_ = 0;
  std::string worst_name_ = "-";
  int tensors_ = 0;
  int64_t elements_ = 0, not_bit_exact_ = 0;
};

// Compares every parameter of a replicated model (and the losses) with the reference.
inline void check_against(ResultCheck& check, const std::vector<double>& losses, TinyMlp& model,
                          const Reference& ref) {
  check.values("losses", losses, ref.losses);
  const auto got = model.named_parameters(), want = ref.model->named_parameters();
  for (size_t i = 0; i < want.size(); ++i)
    check.tensor(want[i].first, got[i].second, want[i].second);
}

// ---- the flat layout of ZeRO (steps 4 and 5) ----
// The model's parameters laid end to end in one flat vector, padded with zeros to W equal
// shards of `shard` values; rank r owns [r·shard, (r+1)·shard). The padding stays zero (zero
// gradient, zero weight: AdamW leaves it there).
struct FlatLayout {
  std::vector<Tensor> params;
  int64_t shard = 0, padded = 0;
  FlatLayout(std::vector<Tensor> model_params, int world) : params(std::move(model_params)) {
    int64_t numel = 0;
    for (const Tensor& p : params) numel += p.numel();
    shard = (numel + world - 1) / world;
    padded = shard * world;
  }
  Tensor owned(const Tensor& flat, int rank) const { return flat.narrow(0, rank * shard, shard); }
  // Copies each parameter's gradient (or value) into its place in `flat`, or back out.
  void pack_grads(const Tensor& flat) const {
    walk(flat,
         [](const Tensor& p, const Tensor& place) { ops::copy_(place, p.grad().reshape({-1})); });
  }
  void pack_values(const Tensor& flat) const {
    walk(flat,
         [](const Tensor& p, const Tensor& place) { ops::copy_(place, p.detach().reshape({-1})); });
  }
  void unpack_values(const Tensor& flat) const {
    walk(flat, [](const Tensor& p, const Tensor& place) { ops::copy_(p, place.view(p.shape())); });
  }

 private:
  void walk(const Tensor& flat, const std::function<void(const Tensor&, const Tensor&)>& f) const {
    int64_t offset = 0;
    for (const Tensor& p : params) f(p, flat.narrow(0, offset, p.numel())), offset += p.numel();
  }
};
constexpr int64_t padded_to(int64_t n, int world) { return (n + world - 1) / world * world; }

// What a ZeRO-1/2 rank holds: the whole model (for forward and backward), its flat gradient
// and parameter buffers, its own shard of the parameters as the only thing the optimizer
// updates (so AdamW's moments exist for `layout.shard` values, not for the whole model), and
// the reduced gradient of that shard.
struct FlatZeroReplica {
  TinyMlp model;
  FlatLayout layout;
  Tensor flat_grads, flat_params, my_shard, my_grad;
  optim::AdamW opt;
  explicit FlatZeroReplica(const Job& job)
      : model(job.device),
        layout(model.parameters(), job.size),
        flat_grads(zeros({layout.padded}, job.floats())),
        flat_params(flat_values(layout, job)),
        my_shard(layout.owned(flat_params, job.rank).clone().requires_grad_()),
        my_grad(zeros({layout.shard}, job.floats())),
        opt(one_group({my_shard}), adamw_options()) {}
  // After the gradient's collective: AdamW on this rank's shard, then the all-gather of every
  // rank's updated shard, so that every rank holds the whole new model again.
  void update_shard_and_all_gather(CountingGroup& comm) {
    opt.step();
    comm.all_gather(flat_params, my_shard.detach())->wait();
    layout.unpack_values(flat_params);
    model.zero_grad();
  }
  static Tensor flat_values(const FlatLayout& layout, const Job& job) {
    Tensor flat = zeros({layout.padded}, job.floats());
    layout.pack_values(flat);
    return flat;
  }
};

// ---- running a step ----
struct LadderInfo {
  const char* name;        // "01_naive_all_reduce"
  const char* production;  // the Tessera file doing this for real
};
// What a step hands back: the theory of one training step's traffic (with a sentence saying
// where it comes from) and the comparison with one process.
struct Outcome {
  Traffic theory;
  std::string theory_reason;
  ResultCheck check;
};

// The outcome of a data-parallel step (1-6) whose replica `model` holds the whole trained
// model: the theory, and the comparison with one process.
// The traffic of ZeRO-1/2 per step: the gradients' collective and the parameters' all-gather,
// each over the flat buffer of all parameters padded to W equal shards.
inline Traffic zero_theory(Collective gradient_collective, int world) {
  Traffic theory;
  theory.add(gradient_collective, 1, 4 * padded_to(kMlpParameters, world));
  theory.add(kAllGather, 1, 4 * padded_to(kMlpParameters, world));
  return theory;
}

inline Outcome replicated_outcome(const Job& job, const std::vector<double>& losses, TinyMlp& model,
                                  const Traffic& theory, std::string reason) {
  Outcome out{theory, std::move(reason), {}};
  check_against(out.check, losses, model, train_one_process(job));
  return out;
}

// ---- a pipeline stage (steps 9 and 10: the same stage, two schedules) ----
// Rank s is stage s: it owns units [first, end) of the model (contiguous, as even as they come;
// the last stage has the head and the loss). A step's batch is cut into kMicroBatches
// micro-batches; forward(m) and backward(m) run micro-batch m through this stage, receiving
// from and sending to the neighbour stages. Sends are not waited for until the step ends, so
// no schedule can deadlock on two stages sending to each other at once.
constexpr int kMicroBatches = 6;
constexpr const char* kPipelineProduction =
    "dist/pipeline_parallel.cpp (the schedules, the stage's sends and receives; GPT-2 and Llama "
    "stages in dist/pipeline_parallel_models.cpp)";

class PipelineStage {
 public:
  PipelineStage(Job& job, CountingGroup& comm)
      : job_(job), comm_(comm), stage_(job.rank), stages_(job.size), model_(job.device) {
    TESSERA_CHECK(stages_ <= kUnits, "pipeline: ", stages_, " stages for ", kUnits, " units (",
                  kBlocks, " blocks and the head)");
    first_ = stage_ * kUnits / stages_, end_ = (stage_ + 1) * kUnits / stages_;
    std::vector<Tensor> params;
    for (size_t l = 2 * first_; l < std::min<size_t>(2 * end_, model_.linears.size()); ++l) {
      my_linears_.push_back(l);
      params.push_back(model_.linears[l]->weight);
      params.push_back(model_.linears[l]->bias);
    }
    opt_ = std::make_unique<optim::AdamW>(one_group(params), adamw_options());
  }
  int stage() const { return stage_; }
  int stages() const { return stages_; }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }

  // The training steps, `schedule` running this stage's forward(m) and backward(m) of every
  // micro-batch in its order; returns the losses.
  std::vector<double> train(const std::function<void()>& schedule) {
    std::vector<double> losses;
    for (int step = 0; step < job_.options.steps; ++step) {
      start_step(step);
      schedule();
      losses.push_back(finish_step());
    }
    return losses;
  }
  void start_step(int step) {
    batch_ = global_batch(step, kMicroBatches * rows(), job_.device);
    inputs_.assign(kMicroBatches, Tensor());
    outputs_.assign(kMicroBatches, Tensor());
    loss_ = 0;
  }
  // Receive (or read) micro-batch m, run my units, pass the result on (or take the loss).
  void forward(int m) {
    const Batch micro = batch_.rows(m * rows(), rows());
    if (first()) {
      inputs_[m] = micro.x;
    } else {
      inputs_[m] = zeros(activation(), job_.floats());
      comm_.recv(inputs_[m], stage_ - 1)->wait();
      inputs_[m].requires_grad_();  // stage - 1 needs the gradient of this input
    }
    outputs_[m] = mlp_forward(
        inputs_[m], [&](size_t l, const Tensor& x) { return (*model_.linears[l])(x); }, first_,
        end_);
    if (last()) {
      // Each micro-batch's mean loss / M: the gradients add up to the batch's mean loss's.
      outputs_[m] = cross_entropy(outputs_[m], micro.y) / double(kMicroBatches);
      loss_ += outputs_[m].item();
    } else {
      send(outputs_[m].detach().contiguous(), stage_ + 1);
    }
    in_flight_now_++;
    most_in_flight_ = std::max(most_in_flight_, in_flight_now_);
  }
  // The output's gradient comes from stage + 1 (the last stage starts from its loss); the
  // input's goes to stage - 1. Then micro-batch m's activations can go.
  void backward(int m) {
    if (last()) {
      outputs_[m].backward();
    } else {
      Tensor grad = zeros(activation(), job_.floats());
      comm_.recv(grad, stage_ + 1)->wait();
      outputs_[m].backward(grad);
    }
    if (!first()) send(inputs_[m].grad().contiguous(), stage_ - 1);
    inputs_[m] = outputs_[m] = Tensor();
    in_flight_now_--;
  }
  // Every stage steps its own parameters (no collective); returns the step's loss.
  double finish_step() {
    for (WorkPtr& w : sends_) w->wait();
    sends_.clear();
    sent_.clear();
    opt_->step();
    opt_->zero_grad();
    comm_.end_step();
    return job_.from_rank(loss_, stages_ - 1);
  }

  // This stage's parameters against one process on the whole batch, and the theory: per
  // micro-batch a stage sends its output forward unless it is last and its input's gradient
  // backward unless it is first, and receives the same.
  Outcome outcome(const std::vector<double>& losses, const std::string& schedule) const {
    Outcome out;
    const Reference ref = train_one_process(job_, kMicroBatches * rows());
    out.check.values("losses", losses, ref.losses);
    for (size_t l : my_linears_) {
      const std::string name = "linear" + std::to_string(l);
      out.check.tensor(name + ".weight", model_.linears[l]->weight, ref.model->linears[l]->weight);
      out.check.tensor(name + ".bias", model_.linears[l]->bias, ref.model->linears[l]->bias);
    }
    const int64_t messages = kMicroBatches * (int(!last()) + int(!first()));
    const int64_t bytes = 4 * rows() * kFeatures;
    out.theory.add(kSend, messages, messages * bytes);
    out.theory.add(kRecv, messages, messages * bytes);
    out.theory_reason = "stage " + std::to_string(stage_) + " of " + std::to_string(stages_) +
                        " (units " + std::to_string(first_) + ".." + std::to_string(end_ - 1) +
                        "), " + std::to_string(kMicroBatches) + " micro-batches of " +
                        std::to_string(rows()) + " x " + std::to_string(kFeatures) + " floats (" +
                        std::to_string(bytes) + " bytes) each way; " + schedule + "; at most " +
                        std::to_string(most_in_flight_) +
                        " micro-batches' activations held at once on this stage";
    return out;
  }

 private:
  int64_t rows() const { return job_.options.rows_per_rank; }  // per micro-batch
  Shape activation() const { return {rows(), kFeatures}; }     // what crosses a boundary
  void send(const Tensor& t, int peer) {
    sent_.push_back(t);  // alive until the send is done
    sends_.push_back(comm_.send(t, peer));
  }

  Job& job_;
  CountingGroup& comm_;
  int stage_, stages_, first_ = 0, end_ = 0;
  TinyMlp model_;  // whole and seeded; this stage uses and trains only its units
  std::vector<size_t> my_linears_;
  std::unique_ptr<optim::AdamW> opt_;
  Batch batch_;
  std::vector<Tensor> inputs_, outputs_, sent_;
  std::vector<WorkPtr> sends_;
  double loss_ = 0;
  int in_flight_now_ = 0, most_in_flight_ = 0;
};

inline void print_traffic(const Job& job, const Traffic& got, const Traffic& theory,
                          const std::string& reason) {
  const double w = job.size;
  for (int c = 0; c < kCollectives; ++c) {
    if (got.calls[c] == 0 && theory.calls[c] == 0) continue;
    std::printf(
        "  per step: %-14s %4lld calls %9lld payload bytes | theory %4lld calls %9lld bytes",
        collective_name(c), static_cast<long long>(got.calls[c]),
        static_cast<long long>(got.payload_bytes[c]), static_cast<long long>(theory.calls[c]),
        static_cast<long long>(theory.payload_bytes[c]));
    const double ring = (c == kAllReduce ? 2 : 1) * (w - 1) / w * double(got.payload_bytes[c]);
    if (c <= kAllGather)
      std::printf(" | a ring sends %s(W-1)/W of it: %.1f bytes per rank",
                  c == kAllReduce ? "2" : "", ring);
    std::printf("\n");
  }
  std::printf("  theory: %s\n", reason.c_str());
}

// Joins the job, runs `train` (the step's own code) and prints and checks what it did. Exits
// non-zero when the traffic differs from the theory or the result from one process.
inline int run_ladder(int argc, char** argv, const LadderInfo& info,
                      const std::function<Outcome(Job&, CountingGroup&)>& train) {
  try {
    Job job;
    job.options = parse_options(argc, argv);
    dist::InitOptions init;
    init.device = job.options.cuda ? DeviceType::CUDA : DeviceType::CPU;
    dist::init_process_group(init);
    job.world = &dist::world();
    job.rank = job.world->rank();
    job.size = job.world->size();
    if (job.options.cuda) job.device = Device::cuda(dist::read_dist_env().local_rank);
    CountingGroup comm(*job.world);
    Outcome outcome = train(job, comm);
    bool traffic_ok = !comm.per_step().empty();
    for (const Traffic& t : comm.per_step()) traffic_ok = traffic_ok && t == outcome.theory;
    if (job.rank == 0) {
      std::printf("%s: %d ranks over %s, %d AdamW steps, %lld rows per rank\n", info.name, job.size,
                  job.world->backend_name().c_str(), job.options.steps,
                  static_cast<long long>(job.options.rows_per_rank));
      print_traffic(job, comm.per_step().empty() ? Traffic() : comm.per_step().front(),
                    outcome.theory, outcome.theory_reason);
      std::printf("  production: %s\n", info.production);
    }
    std::printf("  rank %d: traffic %s theory in all %zu steps; vs one process: %s -> %s\n",
                job.rank, traffic_ok ? "equals" : "DIFFERS FROM", comm.per_step().size(),
                outcome.check.summary().c_str(),
                traffic_ok && outcome.check.passed() ? "OK" : "FAILED");
    std::fflush(stdout);
    const bool ok = traffic_ok && outcome.check.passed();
    dist::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: FAILED: %s\n", info.name, e.what());
    return 1;
  }
}

}  // namespace ladder
