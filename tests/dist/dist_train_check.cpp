// Helper program for the DDP equivalence tests of test_dist: trains a small MLP with
// AdamW through the Accelerator on the sequential data order and, on the main process,
// writes each optimizer step's loss and the final weights to --out. Run as one process
// with W·B rows, or as W ranks with B rows each (or B/A rows and A accumulation
// micro-steps): the files must agree.
//
// --schedule adds a linear warmup/decay schedule stepped with the optimizer. --literal
// writes the loop as examples/train_template.cpp does: opt.step(); sched.step(); opt.zero_grad()
// on every micro-step, relying on the gates the Accelerator installs (otherwise the loop
// calls them only when scope.sync_gradients()).
//
// usage: dist_train_check --rows B --accum A --steps S --out FILE [--bucket-bytes N]
//                         [--backend auto|tcp|mpi|nccl] [--unused [--find-unused]] [--cuda]
//                         [--schedule] [--literal] [--mixed-precision no|bf16|fp16]
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/layers.h"
#include "tessera/optim/adamw.h"
#include "tessera/optim/schedule.h"
#include "tests/dist/dump_parameters.h"

using namespace tessera;

namespace {

constexpr int64_t kFeatures = 12, kHidden = 32, kClasses = 5, kDatasetRows = 96;

struct Mlp : nn::Module {
  nn::Linear fc1{kFeatures, kHidden, true, 0.3};
  nn::Linear fc2{kHidden, kClasses, true, 0.3};
  nn::Linear unused{kHidden, 2, true, 0.3};  // never in the loss
  explicit Mlp(bool with_unused) {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    if (with_unused) register_module("unused", unused);
  }
  Tensor forward(const Tensor& x) override { return fc2(gelu(fc1(x))); }
};

// Rows [start, start + n) of a fixed data set (wrapping), as llm.c's sequential order reads.
std::pair<Tensor, Tensor> rows(int64_t start, int64_t n) {
  std::vector<float> x(n * kFeatures);
  std::vector<int64_t> y(n);
  for (int64_t b = 0; b < n; ++b) {
    int64_t i = (start + b) % kDatasetRows;
    for (int64_t j = 0; j < kFeatures; ++j)
      x[b * kFeatures + j] = std::sin(0.37 * (i * kFeatures + j) + 0.1);
    y[b] = (i * 7 + i / 3) % kClasses;
  }
  return {from_vector(x, {n, kFeatures}), from_vector(y, {n}, {.dtype = DType::i64})};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows_per_rank = 4, accum = 1, steps = 10;
  size_t bucket_bytes = 1024;  // small, so the model spans several buckets
  std::string out_path, backend = "auto", precision = "no";
  bool with_unused = false, find_unused = false, on_cuda = false, with_schedule = false,
       literal_loop = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return std::string(argv[++i]); };
    if (a == "--rows")
      rows_per_rank = std::stoll(next());
    else if (a == "--accum")
      accum = std::stoll(next());
    else if (a == "--steps")
      steps = std::stoll(next());
    else if (a == "--out")
      out_path = next();
    else if (a == "--bucket-bytes")
      bucket_bytes = std::stoull(next());
    else if (a == "--backend")
      backend = next();
    else if (a == "--unused")
      with_unused = true;
    else if (a == "--find-unused")
      find_unused = true;
    else if (a == "--cuda")
      on_cuda = true;  // GPU tensors (nccl backend under auto)
    else if (a == "--schedule")
      with_schedule = true;
    else if (a == "--literal")
      literal_loop = true;
    else if (a == "--mixed-precision")
      precision = next();
  }
  int rank = -1;
  try {
    dist::Accelerator acc({.mixed_precision = precision,
                           .gradient_accumulation_steps = static_cast<int>(accum),
                           .backend = backend,
                           .bucket_bytes = bucket_bytes,
                           .find_unused_parameters = find_unused,
                           .cpu = !on_cuda});
    rank = acc.process_index();
    // Different seeds per rank: DDP must make every rank start from rank 0's weights.
    default_generator().manual_seed(1234 + rank);
    Mlp model(with_unused);
    model.to(acc.device());
    optim::AdamW opt(model.parameters(), {.lr = 1e-2, .weight_decay = 0.1});
    acc.prepare(model, opt);
    // Built only when asked: building it sets the warmup lr.
    std::optional<optim::LinearSchedule> sched;
    if (with_schedule) {
      sched.emplace(opt, optim::ScheduleOptions{.warmup = 3, .total = steps});
      acc.prepare(*sched);
    }

    const int64_t world = acc.num_processes();
    std::ofstream out;
    if (acc.is_main_process()) out.open(out_path);
    int64_t micro = 0;
    for (int64_t step = 0; step < steps; ++step) {
      double step_loss = 0;
      for (int64_t a = 0; a < accum; ++a, ++micro) {
        auto scope = acc.accumulate(model);
        auto [x, y] = rows((micro * world + rank) * rows_per_rank, rows_per_rank);
        Tensor loss = cross_entropy(model(raw::to(x, acc.device(), x.dtype())),
                                    raw::to(y, acc.device(), y.dtype()));
        acc.backward(loss);
        step_loss += acc.reduce(loss.detach().to(DType::f32), "mean").item() / accum;
        if (literal_loop || scope.sync_gradients()) {
          opt.step();
          if (sched) sched->step();
          opt.zero_grad();
        }
      }
      if (acc.is_main_process()) {
        char line[64];
        std::snprintf(line, sizeof line, "loss %lld %.9g\n", static_cast<long long>(step),
                      step_loss);
        out << line;
      }
    }
    if (acc.is_main_process()) dist_check::dump_parameters(model, out);
    acc.end_training();
  } catch (const std::exception& e) {
    // One write, so the line does not interleave with other ranks' output.
    std::cerr << ("rank " + std::to_string(rank) + ": error: " + e.what() + "\n") << std::flush;
    return 1;
  }
  return 0;
}
