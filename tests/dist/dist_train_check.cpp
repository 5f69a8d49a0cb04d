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
// --check-slots (DDP, A = 1) checks after every backward that each parameter's .grad lives
// in its bucket slot, written there by backward (nothing copied into the buckets), and equals
// the gradient of the whole global batch computed by one plain model on every rank.
//
// usage: dist_train_check --rows B --accum A --steps S --out FILE [--bucket-bytes N]
//                         [--backend auto|tcp|mpi|nccl] [--unused [--find-unused]] [--cuda]
//                         [--schedule] [--literal] [--mixed-precision no|bf16|fp16]
//                         [--check-slots]
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
#include "tessera/dist/ddp.h"
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

// --check-slots after the synced backward of rows [first, first + count) of the global batch.
void check_gradients_in_bucket_slots(dist::Accelerator& acc, Mlp& model, int64_t first,
                                     int64_t count) {
  auto* ddp = dynamic_cast<dist::DistributedDataParallel*>(acc.strategy_of(model));
  TESSERA_CHECK(ddp != nullptr, "--check-slots: the model is not wrapped in DDP");
  Mlp plain(false);
  plain.to(acc.device());
  const std::vector<Tensor> from = model.parameters(), to = plain.parameters();
  {
    autograd::NoGradGuard no_grad;
    for (size_t i = 0; i < to.size(); ++i) ops::copy_(to[i], from[i]);
  }
  auto [x, y] = rows(first, count);
  cross_entropy(plain(ops::to(x, acc.device(), x.dtype())), ops::to(y, acc.device(), y.dtype()))
      .backward();
  const std::vector<Tensor>& params = ddp->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = ddp->parameter_names()[i];
    const Tensor grad = params[i].grad();
    TESSERA_CHECK(grad.defined() && grad.raw_data() == ddp->gradient_slot(i).raw_data(),
                  "--check-slots: the gradient of '", name, "' is not in its bucket slot");
    const auto got = ops::to(grad, Device::cpu(), DType::f64).contiguous().to_vector<double>();
    const auto want =
        ops::to(to[i].grad(), Device::cpu(), DType::f64).contiguous().to_vector<double>();
    for (size_t k = 0; k < want.size(); ++k)
      TESSERA_CHECK(std::fabs(got[k] - want[k]) <= 1e-6 * (1 + std::fabs(want[k])),
                    "--check-slots: '", name, "' element ", k, " is ", got[k],
                    ", the global batch's gradient ", want[k]);
  }
  TESSERA_CHECK(
      ddp->adoption_counts().copied == 0 && autograd::grad_destination_counts().copied == 0,
      "--check-slots: ", ddp->adoption_counts().copied,
      " gradients were copied into "
      "the buckets and ",
      autograd::grad_destination_counts().copied, " into their slots by autograd");
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows_per_rank = 4, accum = 1, steps = 10;
  size_t bucket_bytes = 1024;  // small, so the model spans several buckets
  std::string out_path, backend = "auto", precision = "no";
  bool with_unused = false, find_unused = false, on_cuda = false, with_schedule = false,
       literal_loop = false, check_slots = false;
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
    else if (a == "--check-slots")
      check_slots = true;
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
        Tensor loss = cross_entropy(model(ops::to(x, acc.device(), x.dtype())),
                                    ops::to(y, acc.device(), y.dtype()));
        acc.backward(loss);
        if (check_slots)
          check_gradients_in_bucket_slots(acc, model, micro * world * rows_per_rank,
                                          world * rows_per_rank);
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
    if (check_slots) {
      const auto& counts =
          dynamic_cast<dist::DistributedDataParallel&>(*acc.strategy_of(model)).adoption_counts();
      std::cout << ("rank " + std::to_string(rank) + ": " + std::to_string(counts.in_place) +
                    " gradients written into their bucket slots, " + std::to_string(counts.copied) +
                    " copied (by backward: " +
                    std::to_string(autograd::grad_destination_counts().written) + ")\n")
                << std::flush;
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
