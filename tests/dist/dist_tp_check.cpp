// Helper program for the tensor-parallelism tests of test_dist: on every rank, a small GPT-2
// (tied embeddings) or Llama (grouped-query attention) is built from one seed, its parameters
// perturbed (so biases and norms start away from 0 and 1), and trained for --steps AdamW steps
// twice: in one process on the whole batch, and tensor-parallel over groups of --tp ranks
// (dist::tensor_parallel). Every step's loss and, after the steps, every parameter gathered
// whole (full_state_dict) and the full logits of forward() must equal the one process's within
// --rtol, each tensor compared norm-wise: ||tp - one||₂ / ||one||₂. Each rank prints one line,
// "rank R: ... largest relative difference ... -> OK" (or FAILED, exit 1), and an error
// (tensor_parallel's refusals) as "rank R: refused: MESSAGE" (exit 2). Greedy generation (the
// KV cache of the rank's heads) must give the one process's tokens; with --save-dir, the model
// directory save_pretrained writes, read back by a fresh split model, the same parameters.
// With --timeline, the tensor-parallel group is timed (TimedGroup below): each rank prints
// the collectives of the last step, "rank R tp timeline (ms): loss L backward B ops...", each
// op "KIND BYTES [start,end]" in ms from the step's start (forward until L, backward until B;
// compute is the time between them). scripts/parallel_timeline.py draws it (docs/mesh.md).
//
// usage: dist_tp_check [--model gpt|llama] [--tp N (world size)] [--steps S] [--vocab V]
//                      [--heads H] [--kv-heads K] [--untied] [--tied] [--rtol R]
//                      [--checkpointing] [--lr LR (1e-3)] [--eps EPS (1e-8)]
//                      [--sequence-parallel] [--tokens T (11)] [--save-dir DIR]
//                      [--f64 (both models in float64)] [--width C (32)] [--timeline]
//                      [--verbose (rank 0 prints every figure)]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "parallel_check.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/tensor_parallel_models.h"
#include "tessera/optim/adamw.h"

using namespace tessera;
using parallel_check::adamw;
using parallel_check::relative_difference;

namespace {

struct Options {
  std::string model = "gpt";
  int tp = 0, steps = 10;
  int64_t vocab = 97, heads = 0, kv_heads = 0;
  bool untied = false, tied = false, checkpointing = false, verbose = false,
       sequence_parallel = false, f64 = false, timeline = false;
  int64_t tokens = 11, width = 32;
  std::string save_dir;
  double rtol = 1e-6, lr = 1e-3, eps = 1e-8;
};

std::unique_ptr<nn::CausalLM> build(const Options& o) {
  Generator gen(2026);
  std::unique_ptr<nn::CausalLM> model;
  if (o.model == "gpt") {
    nn::GPTConfig cfg{.vocab_size = o.vocab,
                      .block_size = 16,
                      .n_layer = 2,
                      .n_head = o.heads ? o.heads : 4,
                      .n_embd = o.width};
    cfg.tie_word_embeddings = !o.untied;
    model = std::make_unique<nn::GPT>(cfg, &gen);
  } else {
    nn::LlamaConfig cfg{.vocab_size = o.vocab,
                        .hidden_size = o.width,
                        .intermediate_size = o.width * 3 / 2,
                        .num_hidden_layers = 2,
                        .num_attention_heads = o.heads ? o.heads : 8,
                        .num_key_value_heads = o.kv_heads ? o.kv_heads : 4,
                        .max_position_embeddings = 16};
    cfg.tie_word_embeddings = o.tied;
    model = std::make_unique<nn::Llama>(cfg, &gen);
  }
  if (o.f64) model->to(DType::f64);
  parallel_check::perturb(*model, gen);
  if (o.checkpointing) model->gradient_checkpointing_enable(nn::CheckpointPolicy::every_k(2));
  return model;
}

// Every step's batch, the same on every rank: B = 3 rows of T = --tokens tokens.
std::pair<Tensor, Tensor> batch(int step, const Options& o) {
  return parallel_check::random_batch(step, 3, o.tokens, o.vocab);
}

// A tensor-parallel group that times its collectives: each call runs on the group it wraps
// and is waited for at once (as the tensor-parallel layers wait for theirs), and its kind,
// payload bytes and start and end are kept while `recording`.
class TimedGroup : public dist::ProcessGroup {
 public:
  struct Event {
    const char* kind;
    int64_t bytes;
    double start_s, end_s;
  };
  explicit TimedGroup(dist::GroupPtr inner)
      : ProcessGroup(inner->rank(), inner->size(), inner->options()), inner_(std::move(inner)) {}
  std::string backend_name() const override { return inner_->backend_name(); }
  void start_recording() {
    events.clear();
    origin_ = std::chrono::steady_clock::now();
  }
  double now_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count();
  }
  std::vector<Event> events;

 protected:
  bool supports_device(Device d) const override { return inner_->handles(d); }
  dist::WorkPtr do_all_reduce(const dist::CollectiveSignature&, const Tensor& t,
                              dist::ReduceOp op) override {
    return timed("all_reduce", t.nbytes(), [&] { inner_->all_reduce(t, op)->wait(); });
  }
  dist::WorkPtr do_reduce_scatter(const dist::CollectiveSignature&, const Tensor& output,
                                  const Tensor& input, dist::ReduceOp op) override {
    return timed("reduce_scatter", input.nbytes(),
                 [&] { inner_->reduce_scatter(output, input, op)->wait(); });
  }
  dist::WorkPtr do_all_gather(const dist::CollectiveSignature&, const std::vector<Tensor>& outputs,
                              const Tensor& input) override {
    size_t bytes = 0;
    for (const Tensor& t : outputs) bytes += t.nbytes();
    return timed("all_gather", bytes, [&] { inner_->all_gather(outputs, input)->wait(); });
  }
  dist::WorkPtr do_broadcast(const dist::CollectiveSignature&, const Tensor& t, int root) override {
    return timed("broadcast", t.nbytes(), [&] { inner_->broadcast(t, root)->wait(); });
  }
  dist::WorkPtr do_barrier(const dist::CollectiveSignature&) override {
    return timed("barrier", 0, [&] { inner_->barrier()->wait(); });
  }
  dist::WorkPtr do_send(const Tensor& t, int dst, int tag) override {
    return inner_->send(t, dst, tag);
  }
  dist::WorkPtr do_recv(const Tensor& t, int src, int tag) override {
    return inner_->recv(t, src, tag);
  }
  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>&, uint64_t,
                                             dist::ProcessGroupOptions) override {
    TESSERA_FAIL("TimedGroup: sub-groups are not timed");
  }

 private:
  template <class Run>
  dist::WorkPtr timed(const char* kind, size_t bytes, Run&& run) {
    const double start = now_s();
    run();
    events.push_back({kind, static_cast<int64_t>(bytes), start, now_s()});
    return dist::completed_work();
  }
  dist::GroupPtr inner_;
  std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  return parallel_check::run_on_every_rank([&](dist::ProcessGroup& world) {
    // A bad flag is refused on every rank, as any other error.
    parallel_check::parse_flags(argc, argv,
                                {{"--model", &o.model},
                                 {"--tp", &o.tp},
                                 {"--steps", &o.steps},
                                 {"--vocab", &o.vocab},
                                 {"--heads", &o.heads},
                                 {"--kv-heads", &o.kv_heads},
                                 {"--untied", &o.untied},
                                 {"--tied", &o.tied},
                                 {"--rtol", &o.rtol},
                                 {"--checkpointing", &o.checkpointing},
                                 {"--verbose", &o.verbose},
                                 {"--sequence-parallel", &o.sequence_parallel},
                                 {"--tokens", &o.tokens},
                                 {"--save-dir", &o.save_dir},
                                 {"--lr", &o.lr},
                                 {"--eps", &o.eps},
                                 {"--f64", &o.f64},
                                 {"--width", &o.width},
                                 {"--timeline", &o.timeline}});
    const int rank = world.rank();
    const int tp_size = o.tp ? o.tp : world.size();
    std::unique_ptr<nn::CausalLM> one = build(o);
    dist::GroupPtr group = dist::tensor_parallel_group(world, tp_size);
    std::shared_ptr<TimedGroup> timed;
    if (o.timeline) group = timed = std::make_shared<TimedGroup>(group);
    std::unique_ptr<dist::TensorParallelCausalLM> tp = dist::tensor_parallel(*build(o), group);
    if (o.checkpointing) tp->gradient_checkpointing_enable(nn::CheckpointPolicy::every_k(2));
    tp->set_sequence_parallel(o.sequence_parallel);
    optim::AdamW opt_one = adamw(one->parameters(), o.lr, o.eps),
                 opt_tp = adamw(tp->parameters(), o.lr, o.eps);

    parallel_check::Worst worst{.print = o.verbose && rank == 0};
    for (int step = 0; step < o.steps; ++step) {
      auto [x, y] = batch(step, o);
      Tensor loss_one = one->loss(x, y);
      loss_one.backward();
      if (timed) {  // the ranks start the step together (the one process's step came first)
        world.barrier()->wait();
        timed->start_recording();
      }
      Tensor loss_tp = tp->loss(x, y);
      const double loss_s = timed ? timed->now_s() : 0;
      loss_tp.backward();
      if (timed && step == o.steps - 1) {
        std::string ops;
        for (const TimedGroup::Event& e : timed->events) {
          char item[96];
          std::snprintf(item, sizeof item, " %s %lld [%.3f,%.3f]", e.kind, (long long)e.bytes,
                        1e3 * e.start_s, 1e3 * e.end_s);
          ops += item;
        }
        std::printf("rank %d tp timeline (ms): loss %.3f backward %.3f%s\n", rank, 1e3 * loss_s,
                    1e3 * timed->now_s(), ops.c_str());
      }
      opt_one.step(), opt_tp.step();
      opt_one.zero_grad(), opt_tp.zero_grad();
      worst.note("loss " + std::to_string(step), relative_difference(loss_tp, loss_one));
    }
    const std::map<std::string, Tensor> gathered = tp->full_state_dict();
    const int tensors = parallel_check::note_gathered(gathered, *one, worst);
    auto [x, y] = batch(o.steps, o);
    {
      autograd::NoGradGuard no_grad;
      worst.note("logits", relative_difference(tp->forward(x), one->forward(x)));
    }
    // Greedy decoding on a KV cache of this rank's heads gives the one process's tokens.
    const Tensor prompt = ops::contiguous(ops::narrow(x, 1, 0, 4));
    const nn::GenerateOptions greedy{.temperature = 0};
    const bool same_tokens = tp->generate(prompt, 6, greedy).to_vector<int64_t>() ==
                             one->generate(prompt, 6, greedy).to_vector<int64_t>();
    // The model directory rank 0 of the group writes holds the gathered parameters: a fresh
    // split model reading it back has them all, to the bit.
    if (!o.save_dir.empty()) {
      const std::string dir = o.save_dir + "/group" + std::to_string(rank / tp_size);
      tp->save_pretrained(dir);
      std::unique_ptr<dist::TensorParallelCausalLM> fresh = dist::tensor_parallel(*build(o), group);
      fresh->load_safetensors_weights(dir + "/model.safetensors");
      for (const auto& [name, value] : fresh->full_state_dict())
        worst.note("reloaded " + name, relative_difference(value, gathered.at(name)) == 0 ? 0 : 1);
    }
    const bool ok = worst.value <= o.rtol && same_tokens;
    std::printf(
        "rank %d: %s%s; tp %d of %d ranks, %d AdamW steps, %d parameters and %d losses and "
        "the logits: largest relative difference %.3g in %s (limit %g); greedy tokens %s -> "
        "%s\n",
        rank, tp->describe().c_str(), o.sequence_parallel ? ", sequence-parallel" : "", tp_size,
        world.size(), o.steps, tensors, o.steps, worst.value, worst.name.c_str(), o.rtol,
        same_tokens ? "equal" : "DIFFER", ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
  });
}
