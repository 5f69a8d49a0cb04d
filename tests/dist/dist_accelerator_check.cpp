// Helper program for test_dist, run as a multi-process job: the Accelerator's
// process-level helpers (split_between_processes, gather, gather_for_metrics, reduce,
// pad_across_processes, triggers) against values each rank computes locally, and a
// save_state/load_state round trip that must resume training bit for bit.
// Prints "rank R: accelerator checks passed" or the first failure (exit 1).
//
// usage: dist_accelerator_check STATE_DIR
#include <iostream>
#include <numeric>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/layers.h"
#include "tessera/optim/adamw.h"
#include "tessera/optim/schedule.h"

using namespace tessera;

namespace {

void check_equal(const std::vector<double>& got, const std::vector<double>& want,
                 const std::string& what) {
  TESSERA_CHECK(got == want, what, ": got ", got.size(), " values that differ from the ",
                want.size(), " expected");
}

std::vector<double> values(const Tensor& t) {
  return ops::to(t, Device::cpu(), DType::f64).to_vector<double>();
}

void check_collectives(dist::Accelerator& acc) {
  const int r = acc.process_index(), w = acc.num_processes();
  std::vector<int> items(10);
  std::iota(items.begin(), items.end(), 0);
  // Contiguous shares in rank order; sizes differ by at most one.
  std::vector<int> mine = acc.split_between_processes(items);
  const int base = 10 / w, extra = 10 % w;
  const int begin = r * base + std::min(r, extra), size = base + (r < extra ? 1 : 0);
  TESSERA_CHECK(mine == std::vector<int>(items.begin() + begin, items.begin() + begin + size),
                "split_between_processes without padding");
  std::vector<int> padded = acc.split_between_processes(items, true);
  TESSERA_CHECK(static_cast<int>(padded.size()) == base + (extra > 0) &&
                    std::equal(mine.begin(), mine.end(), padded.begin()),
                "split_between_processes with padding");

  // gather_for_metrics drops the padding again.
  std::vector<double> mine_values(padded.begin(), padded.end());
  Tensor t = from_vector(mine_values, {static_cast<int64_t>(padded.size())}, {.dtype = DType::f32});
  std::vector<double> want(10);
  std::iota(want.begin(), want.end(), 0.0);
  check_equal(values(acc.gather_for_metrics(t, 10)), want, "gather_for_metrics with the total");
  // Without the total it comes from the last padded split (Accelerate's behaviour).
  check_equal(values(acc.gather_for_metrics(t)), want, "gather_for_metrics");
  // After a split without padding nothing is dropped.
  std::vector<int> unpadded = acc.split_between_processes(items);
  Tensor u = from_vector(std::vector<double>(unpadded.begin(), unpadded.end()),
                         {static_cast<int64_t>(unpadded.size())}, {.dtype = DType::f32});
  check_equal(values(acc.gather_for_metrics(u)), want,
              "gather_for_metrics after an unpadded split");

  // Uneven gather: rank k contributes k + 1 rows of [k, -k].
  Tensor rows = empty({r + 1, 2});
  for (int i = 0; i <= r; ++i) {
    ops::fill_(ops::select(ops::select(rows, 0, i), 0, 0), r);
    ops::fill_(ops::select(ops::select(rows, 0, i), 0, 1), -r);
  }
  std::vector<double> gathered_want;
  for (int k = 0; k < w; ++k)
    for (int i = 0; i <= k; ++i) gathered_want.insert(gathered_want.end(), {double(k), double(-k)});
  Tensor gathered = acc.gather(rows);
  TESSERA_CHECK(gathered.size(0) == w * (w + 1) / 2 && gathered.size(1) == 2, "gather shape ",
                shape_str(gathered.shape()));
  check_equal(values(gathered), gathered_want, "gather");

  Tensor x = full({3}, r + 1.0, {.dtype = DType::f64});
  const double sum = w * (w + 1) / 2.0;
  check_equal(values(acc.reduce(x, "sum")), std::vector<double>(3, sum), "reduce sum");
  check_equal(values(acc.reduce(x, "mean")), std::vector<double>(3, sum / w), "reduce mean");
  check_equal(values(acc.reduce(x, "max")), std::vector<double>(3, w), "reduce max");
  check_equal(values(x), std::vector<double>(3, r + 1.0), "reduce leaves its input alone");

  // Pad dim 1 to the longest (w) with -1.
  Tensor ragged = full({2, r + 1}, 5.0);
  Tensor p = acc.pad_across_processes(ragged, 1, -1.0);
  std::vector<double> pw;
  for (int row = 0; row < 2; ++row)
    for (int c = 0; c < w; ++c) pw.push_back(c <= r ? 5.0 : -1.0);
  check_equal(values(p), pw, "pad_across_processes");

  // Triggers: one rank sets it, every rank sees it once.
  if (r == w - 1) acc.set_trigger();
  TESSERA_CHECK(acc.check_trigger(), "check_trigger after rank ", w - 1, " set it");
  TESSERA_CHECK(!acc.check_trigger(), "check_trigger resets");
}

struct Net : nn::Module {
  nn::Linear fc{6, 3, true, 0.5};
  Net() { register_module("fc", fc); }
  Tensor forward(const Tensor& x) override { return fc(x); }
};

// Trains `steps` steps; batches depend on the step number, dropout-free so only the
// weights, optimizer moments and schedule carry state.
void train(dist::Accelerator& acc, Net& net, optim::AdamW& opt, optim::LRSchedule& sched,
           int first_step, int steps) {
  for (int s = first_step; s < first_step + steps; ++s) {
    Generator g(100 + s * acc.num_processes() + acc.process_index());
    Tensor x = randn({4, 6}, {}, &g);
    Tensor y =
        from_vector(std::vector<int64_t>{s % 3, (s + 1) % 3, 2, 0}, {4}, {.dtype = DType::i64});
    auto scope = acc.accumulate(net);
    acc.backward(cross_entropy(net(x), y));
    opt.step();
    sched.step();
    opt.zero_grad();
  }
}

void check_save_and_resume(dist::Accelerator& acc, const std::string& dir) {
  default_generator().manual_seed(7);
  Net net;
  optim::AdamW opt(net.parameters(), {.lr = 0.05});
  optim::CosineSchedule sched(opt, {.warmup = 2, .total = 10});
  acc.prepare(net, opt, sched);
  train(acc, net, opt, sched, 0, 3);
  acc.save_state(dir);
  train(acc, net, opt, sched, 3, 3);
  std::vector<double> want = values(net.fc.weight.detach());

  acc.load_state(dir);
  train(acc, net, opt, sched, 3, 3);
  check_equal(values(net.fc.weight.detach()), want, "training resumed from save_state");
}

}  // namespace

int main(int argc, char** argv) {
  int rank = -1;
  try {
    TESSERA_CHECK(argc > 1, "usage: dist_accelerator_check STATE_DIR");
    dist::Accelerator acc({.cpu = true});
    rank = acc.process_index();
    check_collectives(acc);
    check_save_and_resume(acc, argv[1]);
    acc.wait_for_everyone();
    std::cout << ("rank " + std::to_string(rank) + ": accelerator checks passed\n") << std::flush;
    acc.end_training();
  } catch (const std::exception& e) {
    std::cerr << ("rank " + std::to_string(rank) + ": FAILED: " + e.what() + "\n") << std::flush;
    return 1;
  }
  return 0;
}
