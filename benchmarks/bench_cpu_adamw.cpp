// AdamW's CPU update (optim::AdamW on host tensors: the path ZeRO-Offload runs every step)
// over one large parameter: f32, and bf16 parameters with f32 masters. Reports elements per
// second; the update reads and writes the parameter, both moments (and the master) and reads
// the gradient, so it is bound by memory bandwidth once every core works.
#include <benchmark/benchmark.h>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"
#include "tessera/optim/adamw.h"

namespace {

using namespace tessera;

void run_adamw(benchmark::State& state, DType dtype, bool master_weights) {
  const int64_t n = state.range(0);
  Generator gen(1);
  // A matrix (rank 2), so weight decay applies.
  Tensor p = normal({n / 64, 64}, 0, 1, {.dtype = dtype}, &gen);
  p.requires_grad_(true);
  p.set_grad(normal(p.shape(), 0, 1, {.dtype = dtype}, &gen));
  optim::AdamW opt({p}, {.lr = 1e-3, .weight_decay = 0.1, .master_weights = master_weights});
  opt.step();  // creates the moments (and the master)
  for (auto _ : state) opt.step();
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_AdamWCpuF32(benchmark::State& state) { run_adamw(state, DType::f32, false); }
void BM_AdamWCpuBf16Master(benchmark::State& state) { run_adamw(state, DType::bf16, true); }

BENCHMARK(BM_AdamWCpuF32)->Arg(1 << 16)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamWCpuBf16Master)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
