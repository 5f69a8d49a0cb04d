// Helper program for the device-mesh tests of test_dist: an Accelerator over a mesh of --tp x
// --pp x dp ranks (dp: what the world leaves) trains a small GPT-2 (tied embeddings) or Llama
// split over the mesh by dist::parallelize: over the tp group, the pp group (--micro-batches,
// 1F1B) or both at once (a pipeline of tensor-parallel stages), prepared with DDP (or --zero 1|2:
// ZeRO-1/2) on the dp axis, each dp rank
// reading its rows of the global batch of --rows rows through the prepared DataLoader. Every
// rank trains the same model in one process beside it on the whole batch (plain AdamW, a loader
// of --rows rows in a world of one): every step's loss (the mean over the dp ranks) and, after
// --steps steps, every parameter (full_state_dict) must equal the one process's within --rtol,
// norm-wise. tp = pp = 1 trains the plain model under the Accelerator (a resume at tp1 x dp1).
//
// Checkpoints: --save-at S --save-dir DIR saves the Accelerator's state after step S;
// --resume DIR loads it first and trains the remaining steps. --record FILE (rank 0) writes the
// run's losses and final parameters; --compare FILE checks this run's against them (the steps
// it ran) within --compare-rtol (0: bit for bit).
//
// Each rank prints one line ending in "-> OK" (or FAILED, exit 1) with "largest relative
// difference X in NAME"; an error (the mesh's refusals) as "rank R: refused: MESSAGE" (exit 2).
//
// --metrics N: no training; Accelerator::split_between_processes of items 0..N-1 (padded) and
// gather_for_metrics of each rank's share (rows [item, dp rank]), with and without the padding
// remembered: every item must come back exactly once, in order, on every rank, and the ranks of
// one replica (tp and pp peers) must have been given the same share. One line "gather_for_metrics:
// ... -> OK" per rank.
//
// usage: dist_mesh_check --data DIR [--model gpt|llama] [--tp N] [--pp N] [--dp N (-1)]
//          [--zero 0|1|2] [--steps S (10)] [--rows G (16)] [--micro-batches M (8)] [--f64]
//          [--rtol R (1e-6)] [--lr LR (1e-3)] [--eps EPS (1e-5)] [--save-at S --save-dir DIR]
//          [--resume DIR] [--record FILE] [--compare FILE] [--compare-rtol R (0)]
//          [--clip MAX_NORM (global-norm clipping, both runs; 0: none)]
//          [--save-model DIR (Accelerator::save_model, read back: the gathered parameters)]
//          [--whole (prepare the unsplit model: refused on a mesh that splits models)]
//          [--metrics N] [--kv-heads N (Llama's, 4)]
//          [--flip-tie (GPT-2 with an untied head, Llama with a tied one)] [--verbose]
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel_check.h"
#include "tessera/core/safetensors.h"
#include "tessera/data/dataloader.h"
#include "tessera/data/token_file.h"
#include "tessera/dist/accelerator.h"
#include "tessera/dist/parallelize.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/dist/tensor_parallel_models.h"
#include "tessera/optim/clip.h"

using namespace tessera;
using parallel_check::relative_difference;

namespace {

struct Options {
  std::string model = "gpt", data, save_dir, resume, record, compare, save_model;
  int tp = 1, pp = 1, dp = -1, zero = 0, steps = 10, micro_batches = 8, save_at = -1, metrics = 0;
  int kv_heads = 4;  // Llama's
  int64_t rows = 16, tokens = 11, vocab = 97;
  bool f64 = false, verbose = false, whole = false;
  bool flip_tie = false;  // GPT-2 untied, Llama tied (the defaults the other way round)
  double rtol = 1e-6, lr = 1e-3, eps = 1e-5, compare_rtol = 0, clip = 0;
};

std::unique_ptr<nn::CausalLM> build(const Options& o) {
  Generator gen(2026);
  std::unique_ptr<nn::CausalLM> model;
  if (o.model == "gpt") {
    model = std::make_unique<nn::GPT>(nn::GPTConfig{.vocab_size = o.vocab,
                                                    .block_size = 16,
                                                    .n_layer = 2,
                                                    .n_head = 4,
                                                    .n_embd = 32,
                                                    .tie_word_embeddings = !o.flip_tie},
                                      &gen);
  } else {
    model = std::make_unique<nn::Llama>(nn::LlamaConfig{.vocab_size = o.vocab,
                                                        .hidden_size = 32,
                                                        .intermediate_size = 48,
                                                        .num_hidden_layers = 2,
                                                        .num_attention_heads = 8,
                                                        .num_key_value_heads = o.kv_heads,
                                                        .max_position_embeddings = 16,
                                                        .tie_word_embeddings = o.flip_tie},
                                        &gen);
  }
  if (o.f64) model->to(DType::f64);
  parallel_check::perturb(*model, gen);
  return model;
}

// The corpus every rank reads: 4000 tokens of one seed, written once by rank 0.
std::string token_file(const Options& o, dist::ProcessGroup& world) {
  const std::string path = o.data + "/tokens.bin";
  if (world.rank() == 0 && !std::filesystem::exists(path)) {
    Generator gen(77);
    std::vector<uint32_t> tokens;
    for (int64_t v : randint(0, o.vocab, {4000}, {.dtype = DType::i64}, &gen).to_vector<int64_t>())
      tokens.push_back(static_cast<uint32_t>(v));
    std::filesystem::create_directories(o.data);
    data::write_token_file(path + ".tmp", tokens, o.vocab);
    std::filesystem::rename(path + ".tmp", path);
  }
  world.barrier()->wait();
  return path;
}

// The split model's parameters whole (collective over its group), or the plain model's.
std::map<std::string, Tensor> whole_parameters(nn::Module& model) {
  if (auto* tp = dynamic_cast<dist::TensorParallelCausalLM*>(&model)) return tp->full_state_dict();
  if (auto* pp = dynamic_cast<dist::PipelineParallelCausalLM*>(&model))
    return pp->full_state_dict();
  std::map<std::string, Tensor> whole;
  for (const auto& [name, p] : model.named_parameters()) whole[name] = p;
  return whole;
}

// --metrics: every item of a padded split comes back once from gather_for_metrics, whatever
// the mesh (the tp and pp peers of a replica hold the same rows: only the dp axis gathers).
int check_metrics(const Options& o, dist::Accelerator& acc, dist::ProcessGroup& world) {
  const dist::DeviceMesh& mesh = acc.mesh();
  std::vector<int64_t> items(o.metrics);
  for (int64_t i = 0; i < o.metrics; ++i) items[i] = 1000 + 7 * i;  // not their positions
  const std::vector<int64_t> mine = acc.split_between_processes(items, /*apply_padding=*/true);
  std::vector<double> rows;
  for (int64_t item : mine) rows.insert(rows.end(), {double(item), double(mesh.dp_rank())});
  const Tensor share =
      from_vector(rows, {static_cast<int64_t>(mine.size()), 2}, {.dtype = DType::f64});
  bool ok = true;
  std::string why;
  auto expect_items = [&](const Tensor& got, const std::string& what) {
    std::vector<double> want;
    for (int64_t item : items) want.push_back(double(item));
    const Tensor values = ops::contiguous(ops::select(got, 1, 0));
    if (got.size(0) != o.metrics || values.to_vector<double>() != want) {
      ok = false;
      why += " " + what + ": " + std::to_string(got.size(0)) + " rows";
    }
  };
  expect_items(acc.gather_for_metrics(share), "padded split");
  expect_items(acc.gather_for_metrics(share, o.metrics), "with the total");
  // The ranks of one replica got the same share: every rank's first item and share size, summed
  // over the replica's ranks, is tp x pp times its own.
  const std::vector<double> first = {mine.empty() ? -1.0 : double(mine.front()),
                                     double(mine.size())};
  Tensor summed = from_vector(first, {2}, {.dtype = DType::f64});
  mesh.model_group()->all_reduce(summed)->wait();
  const double peers = mesh.tp_size() * mesh.pp_size();
  if (summed.to_vector<double>() != std::vector<double>{first[0] * peers, first[1] * peers}) {
    ok = false;
    why += " the replica's ranks were given different shares";
  }
  world.barrier()->wait();
  std::printf(
      "rank %d: %s; gather_for_metrics of %d items split over the dp axis (%zu here):%s "
      "every item once -> %s\n",
      world.rank(), mesh.describe().c_str(), o.metrics, mine.size(), ok ? "" : why.c_str(),
      ok ? "OK" : "FAILED");
  acc.end_training();
  return ok ? 0 : 1;
}

int check(const Options& o, dist::ProcessGroup& world) {
  TESSERA_CHECK(!o.data.empty(), "--data DIR is needed");
  dist::AcceleratorOptions options;
  options.cpu = true;
  options.zero_stage = o.zero;
  options.dp_size = o.dp;
  options.tp_size = o.tp;
  options.pp_size = o.pp;
  dist::Accelerator acc(options);  // refuses a mesh that is not the world before any work
  const dist::DeviceMesh& mesh = acc.mesh();
  if (o.metrics > 0) return check_metrics(o, acc, world);
  const std::string file = token_file(o, world);

  // The one process: the whole batch, plain AdamW, every step (the uninterrupted run).
  std::unique_ptr<nn::CausalLM> one = build(o);
  optim::AdamW opt_one = parallel_check::adamw(one->parameters(), o.lr, o.eps);
  data::DataLoader loader_one(data::TokenFile(file), {.batch = o.rows, .seq = o.tokens});
  std::vector<double> losses_one, norms_one;
  for (int step = 0; step < o.steps; ++step) {
    const data::Batch b = loader_one.next();
    Tensor loss = one->loss(b.x, b.y);
    loss.backward();
    if (o.clip > 0) norms_one.push_back(optim::clip_grad_norm_(one->parameters(), o.clip));
    opt_one.step(), opt_one.zero_grad();
    losses_one.push_back(ops::to(loss, Device::cpu(), DType::f64).item());
  }

  // The mesh run.
  // The mesh's sizes: the flags, else what `tessera launch --tp-size/--pp-size` passed on.
  std::unique_ptr<nn::Module> model =
      o.whole ? build(o)  // the unsplit model on a mesh that splits models: refused
              : dist::parallelize(build(o), mesh, {.pipeline = {.micro_batches = o.micro_batches}});
  TESSERA_CHECK(o.rows % mesh.dp_size() == 0, "--rows ", o.rows, " does not split over dp ",
                mesh.dp_size());
  optim::AdamW opt = parallel_check::adamw(model->parameters(), o.lr, o.eps);
  data::DataLoader loader(data::TokenFile(file),
                          {.batch = o.rows / mesh.dp_size(), .seq = o.tokens});
  acc.prepare(*model, opt, loader);
  if (!o.resume.empty()) acc.load_state(o.resume);
  const int first = static_cast<int>(loader.position());

  parallel_check::Worst worst{.print = o.verbose && world.rank() == 0};
  parallel_check::Worst recorded{.print = o.verbose && world.rank() == 0};
  std::map<std::string, Tensor> reference;
  if (!o.compare.empty()) reference = load_safetensors(o.compare, {.memory_map = false}).tensors;
  std::vector<double> losses(o.steps, 0.0);
  for (int step = first; step < o.steps; ++step) {
    const data::Batch b = loader.next();
    Tensor loss;
    {
      dist::AccumulateScope scope = acc.accumulate(*model);
      loss = dist::mesh_train_step(acc, *model, b.x, b.y);
    }
    if (o.clip > 0) {
      const double norm = acc.clip_grad_norm_(model->parameters(), o.clip);
      worst.note("gradient norm " + std::to_string(step) + " (" + std::to_string(norm) + ")",
                 std::abs(norm - norms_one[step]) / norms_one[step]);
    }
    opt.step(), opt.zero_grad();
    // Each dp rank's mean over its rows (every target counts): their mean is the batch's.
    const Tensor mean = acc.reduce(ops::to(loss.detach(), Device::cpu(), DType::f64), "mean");
    losses[step] = mean.item();
    const Tensor want = full({}, losses_one[step], {.dtype = DType::f64});
    worst.note("loss " + std::to_string(step), relative_difference(mean, want));
    if (!reference.empty())
      recorded.note("recorded loss " + std::to_string(step),
                    relative_difference(mean, ops::narrow(reference.at("loss"), 0, step, 1)));
    if (step + 1 == o.save_at) acc.save_state(o.save_dir);
  }
  const std::map<std::string, Tensor> gathered = whole_parameters(*model);
  const int tensors = parallel_check::note_gathered(gathered, *one, worst);
  for (const auto& [name, value] : gathered)
    if (!reference.empty())
      recorded.note("recorded " + name, relative_difference(value, reference.at(name)));
  // Accelerate's save_model of a split model: the full model, as one process writes it.
  if (!o.save_model.empty()) {
    acc.save_model(*model, o.save_model);
    const std::map<std::string, Tensor> saved =
        load_safetensors(o.save_model + "/model.safetensors", {.memory_map = false}).tensors;
    for (const auto& [name, value] : gathered)
      worst.note("save_model " + name, relative_difference(saved.at(name), value) == 0 ? 0 : 1);
  }
  if (!o.record.empty() && world.rank() == 0) {
    std::vector<std::pair<std::string, Tensor>> out(gathered.begin(), gathered.end());
    out.emplace_back("loss", from_vector(losses, {o.steps}, {.dtype = DType::f64}));
    save_safetensors(o.record, out);
  }
  world.barrier()->wait();
  const bool ok = worst.value <= o.rtol && (reference.empty() || recorded.value <= o.compare_rtol);
  std::printf(
      "rank %d: %s, %s on the dp axis, %s, steps %d..%d of %d; %d parameters and the "
      "losses against one process: largest relative difference %.3g in %s (limit %g)",
      world.rank(), mesh.describe().c_str(), acc.strategy_of(*model)->name().c_str(),
      o.model.c_str(), first, o.steps - 1, o.steps, tensors, worst.value, worst.name.c_str(),
      o.rtol);
  if (!reference.empty())
    std::printf("; against the recorded run: largest relative difference %.3g in %s (limit %g)",
                recorded.value, recorded.name.c_str(), o.compare_rtol);
  std::printf(" -> %s\n", ok ? "OK" : "FAILED");
  // The strategies (their hooks on the model's parameters) go before the model does.
  acc.end_training();
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  return parallel_check::run_on_every_rank([&](dist::ProcessGroup& world) {
    parallel_check::parse_flags(argc, argv,
                                {{"--data", &o.data},
                                 {"--model", &o.model},
                                 {"--tp", &o.tp},
                                 {"--pp", &o.pp},
                                 {"--dp", &o.dp},
                                 {"--zero", &o.zero},
                                 {"--steps", &o.steps},
                                 {"--rows", &o.rows},
                                 {"--micro-batches", &o.micro_batches},
                                 {"--f64", &o.f64},
                                 {"--rtol", &o.rtol},
                                 {"--lr", &o.lr},
                                 {"--eps", &o.eps},
                                 {"--save-at", &o.save_at},
                                 {"--save-dir", &o.save_dir},
                                 {"--resume", &o.resume},
                                 {"--record", &o.record},
                                 {"--compare", &o.compare},
                                 {"--compare-rtol", &o.compare_rtol},
                                 {"--clip", &o.clip},
                                 {"--save-model", &o.save_model},
                                 {"--whole", &o.whole},
                                 {"--metrics", &o.metrics},
                                 {"--kv-heads", &o.kv_heads},
                                 {"--flip-tie", &o.flip_tie},
                                 {"--verbose", &o.verbose}});
    return check(o, world);
  });
}
