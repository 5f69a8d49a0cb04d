// Helper program for the pipeline-parallelism tests of test_dist: on every rank, a small GPT-2
// (tied embeddings unless --untied) or Llama (grouped-query attention; untied unless --tied) of
// --layers blocks is built from one seed, its parameters perturbed (so biases and norms start
// away from 0 and 1), and trained for --steps AdamW steps twice: in one process on the whole
// batch (loss().backward()), and cut into the stages of pipelines of --pp ranks
// (dist::pipeline_parallel) running --micro-batches micro-batches per step with --schedule.
// Every step's loss and, after the steps, every parameter gathered whole (full_state_dict) must
// equal the one process's within --rtol, each tensor compared norm-wise:
// ||pp - one||₂ / ||one||₂. Each rank prints one line, "rank R: ... largest relative
// difference ... -> OK" (or FAILED, exit 1), and an error (the refusals) as
// "rank R: refused: MESSAGE" (exit 2). With --save-dir, the model directory save_pretrained
// writes is read back by nn::load_causal_lm and must hold the gathered parameters, to the bit.
//
// With --bubble there is no comparison: a wider model (--width, default 384;
// --blocks-per-stage, default 2; tokens 32) trains --steps steps (default 8) and each rank
// prints the bubble of the timelines of every step after the first, a warm-up
// (PipelineParallelCausalLM::bubble: the wall-clock figures are the median step's, the replay
// takes each op's median CPU time over those steps): "rank R: bubble p P m M SCHEDULE:
// wall-clock W (stage 0 S, span ...), replayed CPU time C, logical L, theory T -> OK", where OK
// means the logical figure (the stages' recorded orders in op slots) is within 10% of the
// theory, and with --assert-replayed / --assert-wall-clock those figures too. --timeline
// prints every stage's ops (ms: start, end, CPU time) and rank 0 the replay of them behind the
// replayed figure ("replayed stage S (ms): F0[start,end] ...").
//
// usage: dist_pp_check [--model gpt|llama] [--pp N (world size)] [--micro-batches M (8)]
//                      [--schedule afab|1f1b] [--steps S] [--layers L (5)] [--vocab V (97)]
//                      [--rows B (16)] [--untied] [--tied] [--rtol R] [--lr LR] [--eps EPS]
//                      [--save-dir DIR] [--bubble] [--width C] [--blocks-per-stage K]
//                      [--assert-wall-clock]
//                      [--assert-replayed] [--timeline] [--verbose (rank 0 prints every figure)]
#include <malloc.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "parallel_check.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/dist/process_group.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"
#include "tessera/optim/adamw.h"

using namespace tessera;
using parallel_check::adamw;
using parallel_check::relative_difference;

namespace {

struct Options {
  std::string model = "gpt", schedule = "1f1b", save_dir;
  int pp = 0, steps = -1, micro_batches = 8;
  int64_t layers = 5, vocab = 97, rows = 16, tokens = 11, width = 32, blocks_per_stage = 2;
  bool untied = false, tied = false, verbose = false, bubble = false, assert_wall_clock = false,
       assert_replayed = false, timeline = false;
  double rtol = 1e-6, lr = 1e-3, eps = 1e-8;
};

std::unique_ptr<nn::CausalLM> build(const Options& o) {
  Generator gen(2026);
  std::unique_ptr<nn::CausalLM> model;
  if (o.model == "gpt") {
    nn::GPTConfig cfg{.vocab_size = o.vocab,
                      .block_size = 32,
                      .n_layer = o.layers,
                      .n_head = 4,
                      .n_embd = o.width};
    cfg.tie_word_embeddings = !o.untied;
    model = std::make_unique<nn::GPT>(cfg, &gen);
  } else {
    nn::LlamaConfig cfg{.vocab_size = o.vocab,
                        .hidden_size = o.width,
                        .intermediate_size = o.width * 3 / 2,
                        .num_hidden_layers = o.layers,
                        .num_attention_heads = 8,
                        .num_key_value_heads = 4,
                        .max_position_embeddings = 32};
    cfg.tie_word_embeddings = o.tied;
    model = std::make_unique<nn::Llama>(cfg, &gen);
  }
  parallel_check::perturb(*model, gen);
  return model;
}

// Every step's batch, the same on every rank: --rows rows of --tokens tokens.
std::pair<Tensor, Tensor> batch(int step, const Options& o) {
  return parallel_check::random_batch(step, o.rows, o.tokens, o.vocab);
}

Options parse(int argc, char** argv) {
  Options o;
  parallel_check::parse_flags(argc, argv,
                              {{"--model", &o.model},
                               {"--pp", &o.pp},
                               {"--micro-batches", &o.micro_batches},
                               {"--schedule", &o.schedule},
                               {"--steps", &o.steps},
                               {"--layers", &o.layers},
                               {"--blocks-per-stage", &o.blocks_per_stage},
                               {"--vocab", &o.vocab},
                               {"--rows", &o.rows},
                               {"--width", &o.width},
                               {"--untied", &o.untied},
                               {"--tied", &o.tied},
                               {"--rtol", &o.rtol},
                               {"--lr", &o.lr},
                               {"--eps", &o.eps},
                               {"--save-dir", &o.save_dir},
                               {"--bubble", &o.bubble},
                               {"--assert-wall-clock", &o.assert_wall_clock},
                               {"--assert-replayed", &o.assert_replayed},
                               {"--timeline", &o.timeline},
                               {"--verbose", &o.verbose}});
  if (o.steps < 0) o.steps = o.bubble ? 8 : 10;
  return o;
}

// The bubble run: 2 blocks per stage of a model wide enough that a micro-batch's compute
// dwarfs its messages; no one-process comparison.
int check_bubble(Options o, dist::ProcessGroup& world) {
  const int pp = o.pp ? o.pp : world.size();
  o.layers = o.blocks_per_stage * pp, o.tokens = 32, o.vocab = 64;
  if (o.width == 32) o.width = 384;
  // glibc returns a freed buffer above its mmap threshold (128 KiB to start) to the kernel, so
  // every step faults its activations in again, a cost that lands on whichever op allocates
  // first: keep freed memory in the heap, as a caching allocator would.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
  dist::GroupPtr group = dist::pipeline_parallel_group(world, pp);
  auto pipe = dist::pipeline_parallel(
      *build(o), group,
      {.micro_batches = o.micro_batches, .schedule = dist::parse_pipeline_schedule(o.schedule)});
  optim::AdamW opt = adamw(pipe->parameters(), o.lr, o.eps);
  std::vector<dist::PipelineTimeline> timelines;  // every step's but the first (a warm-up)
  for (int step = 0; step < o.steps; ++step) {
    auto [x, y] = batch(step, o);
    pipe->train_step(x, y);
    // Gradients stay allocated between steps (zeroed in place, as Megatron-LM's persistent
    // gradient buffers are): a fresh allocation would slow every stage's first backward, and
    // those backwards are the critical path.
    opt.step(), opt.zero_grad(/*set_to_none=*/false);
    if (step > 0 || o.steps == 1) timelines.push_back(pipe->timeline());
  }
  const dist::PipelineBubble b = pipe->bubble(timelines);
  if (o.timeline) {
    std::string ops;
    for (const dist::PipelineEvent& e : pipe->timeline().events) {
      char item[64];
      std::snprintf(item, sizeof item, " %c%d[%.1f,%.1f cpu %.1f]", e.op.kind ? 'B' : 'F',
                    e.op.micro_batch, 1e3 * e.start_s, 1e3 * e.end_s, 1e3 * e.cpu_s);
      ops += item;
    }
    std::printf("rank %d timeline (ms):%s\n", world.rank(), ops.c_str());
    if (world.rank() == 0)  // every stage's order replayed with its CPU times
      for (size_t s = 0; s < b.replayed_timelines.size(); ++s) {
        std::string replayed;
        for (const dist::PipelineEvent& e : b.replayed_timelines[s].events) {
          char item[48];
          std::snprintf(item, sizeof item, " %c%d[%.2f,%.2f]", e.op.kind ? 'B' : 'F',
                        e.op.micro_batch, 1e3 * e.start_s, 1e3 * e.end_s);
          replayed += item;
        }
        std::printf("replayed stage %zu (ms):%s\n", s, replayed.c_str());
      }
  }
  auto within = [&](double figure) { return std::fabs(figure - b.theory) <= 0.1 * b.theory; };
  const bool ok = within(b.logical) && (!o.assert_replayed || within(b.replayed)) &&
                  (!o.assert_wall_clock || within(b.measured));
  std::printf(
      "rank %d: bubble p %d m %d %s: wall-clock %.4f (stage 0 %.4f, span %.1f ms), replayed "
      "CPU time %.4f, logical %.4f, theory %.4f -> %s\n",
      world.rank(), pp, o.micro_batches, o.schedule.c_str(), b.measured, b.stage0, 1e3 * b.span_s,
      b.replayed, b.logical, b.theory, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

int check_equal_to_one_process(const Options& o, dist::ProcessGroup& world) {
  const int rank = world.rank();
  const int pp = o.pp ? o.pp : world.size();
  std::unique_ptr<nn::CausalLM> one = build(o);
  dist::GroupPtr group = dist::pipeline_parallel_group(world, pp);
  auto pipe = dist::pipeline_parallel(
      *build(o), group,
      {.micro_batches = o.micro_batches, .schedule = dist::parse_pipeline_schedule(o.schedule)});
  optim::AdamW opt_one = adamw(one->parameters(), o.lr, o.eps),
               opt_pp = adamw(pipe->parameters(), o.lr, o.eps);

  parallel_check::Worst worst{.print = o.verbose && rank == 0};
  for (int step = 0; step < o.steps; ++step) {
    auto [x, y] = batch(step, o);
    Tensor loss_one = one->loss(x, y);
    loss_one.backward();
    const Tensor loss_pp = pipe->train_step(x, y);
    opt_one.step(), opt_pp.step();
    opt_one.zero_grad(), opt_pp.zero_grad();
    worst.note("loss " + std::to_string(step), relative_difference(loss_pp, loss_one));
  }
  const std::map<std::string, Tensor> gathered = pipe->full_state_dict();
  const int tensors = parallel_check::note_gathered(gathered, *one, worst);
  // The model directory stage 0 writes holds the gathered parameters, to the bit.
  if (!o.save_dir.empty()) {
    const std::string dir = o.save_dir + "/pipe" + std::to_string(rank / pp);
    pipe->save_pretrained(dir);
    const std::unique_ptr<nn::CausalLM> reloaded = nn::load_causal_lm(dir);
    for (const auto& [name, value] : reloaded->named_parameters())
      worst.note("reloaded " + name, relative_difference(value, gathered.at(name)) == 0 ? 0 : 1);
  }
  const bool ok = worst.value <= o.rtol;
  std::printf(
      "rank %d: %s; pp %d of %d ranks, %d AdamW steps, %d parameters and %d losses: largest "
      "relative difference %.3g in %s (limit %g) -> %s\n",
      rank, pipe->describe().c_str(), pp, world.size(), o.steps, tensors, o.steps, worst.value,
      worst.name.c_str(), o.rtol, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return parallel_check::run_on_every_rank([&](dist::ProcessGroup& world) {
    const Options o = parse(argc, argv);
    return o.bubble ? check_bubble(o, world) : check_equal_to_one_process(o, world);
  });
}
