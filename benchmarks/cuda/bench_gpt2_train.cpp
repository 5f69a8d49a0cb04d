// End-to-end GPT-2 124M training step on one GPU (12 layers, 12 heads, 768 channels,
// vocab 50304, context 1024, batch 16, bf16 compute with fp32 master weights and AdamW
// moments, global-norm clipping at 1.0) on random tokens, next to PyTorch on the same card
// in the same invocation (benchmarks/cuda/gpt2_train_torch.py as a subprocess: eager and
// torch.compile, bf16 autocast, fused AdamW). Prints ms/step, tokens/s, MFU, peak memory
// and the ratios.
//
//   bench_gpt2_train [--steps N] [--warmup N] [--batch N] [--seq N] [--layers N]
//                    [--no-torch] [--no-compile] [--profile]
//   --profile           also time the phases of a step (forward + loss, backward, clipping,
//                       AdamW), synchronising the device after each
//   TESSERA_PYTHON=...  the interpreter for the PyTorch side (default /usr/bin/python3)
//
// MFU counts 6·N + 12·L·C·T flops per token (N parameters without the position table,
// attention's score and value products counted in full, as nanoGPT/llm.c do) against the
// dense bf16 peak of an H100/H200 SXM (989 TFLOP/s).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "tessera/autograd/functions.h"
#include "benchmarks/bench_common.h"
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;
using Clock = std::chrono::steady_clock;

namespace {

constexpr double kPeakBf16Flops = 989e12;

struct Args {
  int steps = 10, warmup = 3;
  int64_t batch = 16, seq = 1024, layers = 12, heads = 12, channels = 768, vocab = 50304;
  bool torch = true, compile = true, profile = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    auto value = [&] { return bench::flag_value(i, argc, argv); };
    if (!std::strcmp(argv[i], "--steps")) a.steps = value();
    else if (!std::strcmp(argv[i], "--warmup")) a.warmup = value();
    else if (!std::strcmp(argv[i], "--batch")) a.batch = value();
    else if (!std::strcmp(argv[i], "--seq")) a.seq = value();
    else if (!std::strcmp(argv[i], "--layers")) a.layers = value();
    else if (!std::strcmp(argv[i], "--no-torch")) a.torch = false;
    else if (!std::strcmp(argv[i], "--no-compile")) a.compile = false;
    else if (!std::strcmp(argv[i], "--profile")) a.profile = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--steps N] [--warmup N] [--batch N] [--seq N] [--layers N] [--no-torch] "
                   "[--no-compile] [--profile]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return a;
}

struct Result {
  bool ok = false;
  double ms_per_step = 0, tokens_per_s = 0, peak_gib = 0, loss = 0;
};

// Runs the PyTorch reference once per mode; each prints one JSON line.
Result run_torch(const Args& a, const char* mode) {
  const std::string cmd = bench::python_interpreter() +
                          " " TESSERA_SOURCE_DIR "/benchmarks/cuda/gpt2_train_torch.py --mode " + mode +
                          " --steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup) +
                          " --batch " + std::to_string(a.batch) + " --seq " + std::to_string(a.seq) +
                          " --layers " + std::to_string(a.layers) + " 2>&1";
  Result r;
  bool ok = false;
  const std::string out = bench::run_reference(cmd, ok);
  if (!ok) return r;
  r.ms_per_step = bench::json_number(out, "ms_per_step");
  r.tokens_per_s = bench::json_number(out, "tokens_per_s");
  r.peak_gib = bench::json_number(out, "peak_gib");
  r.loss = bench::json_number(out, "loss");
  r.ok = r.ms_per_step > 0;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (!cuda_is_available()) {
    std::printf("bench_gpt2_train: no CUDA device\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  const nn::GPTConfig cfg{.vocab_size = a.vocab, .block_size = a.seq, .n_layer = a.layers,
                          .n_head = a.heads, .n_embd = a.channels};
  Generator gen(0);
  nn::GPT model(cfg, &gen, {.device = gpu});
  const int64_t n_params = model.num_parameters();
  // Mixed precision: the model computes in bf16; AdamW keeps fp32 master weights and fp32
  // moments in its state and updates them (and rounds into the bf16 model) in one
  // multi-tensor launch that reads the bf16 gradients.
  model.to(DType::bf16);
  optim::AdamW opt(model.parameters(), {.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                                        .weight_decay = 0.1, .master_weights = true});
  const Tensor idx = randint(0, a.vocab, {a.batch, a.seq}, {.dtype = DType::i64, .device = gpu}, &gen);
  const Tensor targets = randint(0, a.vocab, {a.batch, a.seq}, {.dtype = DType::i64, .device = gpu}, &gen);

  double loss_value = 0;
  std::map<std::string, double> phase_ms;
  auto phase_start = Clock::now();
  // With --profile: the device time of the phase that ends here (a sync per phase).
  auto phase = [&](const char* name) {
    if (!a.profile) return;
    cuda::synchronize();
    const auto now = Clock::now();
    phase_ms[name] += std::chrono::duration<double, std::milli>(now - phase_start).count();
    phase_start = now;
  };
  auto step = [&] {
    phase_start = Clock::now();
    Tensor loss = model.loss(idx, targets);
    phase("1 forward + loss");
    loss.backward();
    phase("2 backward");
    optim::clip_grad_norm_(opt.parameters(), 1.0);
    phase("3 clip");
    opt.step();
    opt.zero_grad();
    phase("4 AdamW");
    return loss;
  };
  for (int i = 0; i < a.warmup; ++i) loss_value = step().item();
  phase_ms.clear();
  cuda::synchronize();
  cuda::reset_peak_memory_stats();
  const auto start = Clock::now();
  Tensor last;
  for (int i = 0; i < a.steps; ++i) last = step();
  cuda::synchronize();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count() / a.steps;
  loss_value = last.item();
  const cuda::MemoryStats mem = cuda::memory_stats();

  const double tokens = double(a.batch * a.seq);
  const double flops_per_token =
      6.0 * double(n_params - a.seq * a.channels) + 12.0 * double(a.layers * a.channels * a.seq);
  auto mfu = [&](double ms_per_step) { return flops_per_token * tokens / (ms_per_step / 1e3) / kPeakBf16Flops; };
  const double gib = 1024.0 * 1024.0 * 1024.0;

  std::printf("GPT-2 training step on %s: %lld layers, %lld heads, %lld channels, vocab %lld, context %lld, "
              "batch %lld, bf16 (fp32 masters), AdamW, clip 1.0; %d steps after %d warm-up; %lld parameters\n",
              cuda::device_name(0).c_str(), (long long)a.layers, (long long)a.heads, (long long)a.channels,
              (long long)a.vocab, (long long)a.seq, (long long)a.batch, a.steps, a.warmup, (long long)n_params);
  std::printf("  %-16s %10s %12s %7s %10s %9s\n", "engine", "ms/step", "tokens/s", "MFU", "peak GiB", "loss");
  std::printf("  %-16s %10.2f %12.0f %6.1f%% %10.2f %9.4f   (peak reserved %.2f GiB)\n", "tessera", ms,
              tokens / (ms / 1e3), 100 * mfu(ms), mem.peak_allocated_bytes / gib, loss_value,
              mem.peak_reserved_bytes / gib);
  if (a.profile) {
    std::printf("  phases (ms/step, device synchronised after each):\n");
    for (const auto& [name, total] : phase_ms) std::printf("    %-26s %8.2f\n", name.c_str(), total / a.steps);
  }
  if (!a.torch) return 0;
  for (const char* mode : {"eager", "compile"}) {
    if (!a.compile && !std::strcmp(mode, "compile")) continue;
    const Result t = run_torch(a, mode);
    if (!t.ok) {
      std::printf("  pytorch %-8s not available\n", mode);
      continue;
    }
    std::printf("  pytorch %-8s %10.2f %12.0f %6.1f%% %10.2f %9.4f\n", mode, t.ms_per_step, t.tokens_per_s,
                100 * mfu(t.ms_per_step), t.peak_gib, t.loss);
    std::printf("    tessera / pytorch %s: tokens/s ratio %.2fx, peak memory ratio %.2fx\n", mode,
                (tokens / (ms / 1e3)) / t.tokens_per_s, (mem.peak_allocated_bytes / gib) / t.peak_gib);
  }
  return 0;
}
