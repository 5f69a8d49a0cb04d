// What the end-to-end training-step benchmarks (bench_gpt2_train, bench_llama_train) share:
// timing warm-up and timed optimizer steps (with an optional per-phase breakdown), running
// their PyTorch reference script once per mode, and the table they print.
#pragma once
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "benchmarks/bench_common.h"
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/tensor.h"
#include "tessera/nn/causal_lm.h"
#include "tessera/optim/adamw.h"
#include "tessera/optim/clip.h"

namespace tessera::bench {

struct StepTiming {
  double ms_per_step = 0, loss = 0;
  cuda::MemoryStats memory;
  std::map<std::string, double> phase_ms;  // per step, with profiling only
};

// Ends a phase of a step (a no-op unless profiling, where it synchronises the device).
using PhaseMark = std::function<void(const char* name)>;

// Runs `warmup` steps, then times `steps` between device synchronisations. step(mark) runs
// one optimizer step and returns its loss; it calls mark(name) at the end of each phase.
// The peak memory is that of the timed steps, or with `peak_from_start` of the whole run:
// a replayed CUDA graph allocates nothing, its memory was taken while it was recorded.
inline StepTiming time_training_steps(int warmup, int steps, bool profile,
                                      const std::function<Tensor(const PhaseMark&)>& step,
                                      bool peak_from_start = false) {
  using Clock = std::chrono::steady_clock;
  StepTiming timing;
  auto phase_start = Clock::now();
  const PhaseMark mark = [&](const char* name) {
    if (!profile) return;
    cuda::synchronize();
    const auto now = Clock::now();
    timing.phase_ms[name] += std::chrono::duration<double, std::milli>(now - phase_start).count();
    phase_start = now;
  };
  auto one_step = [&] {
    phase_start = Clock::now();
    return step(mark);
  };
  if (peak_from_start) cuda::reset_peak_memory_stats();
  for (int i = 0; i < warmup; ++i) timing.loss = one_step().item();
  timing.phase_ms.clear();
  cuda::synchronize();
  if (!peak_from_start) cuda::reset_peak_memory_stats();
  const auto start = Clock::now();
  Tensor last;
  for (int i = 0; i < steps; ++i) last = one_step();
  cuda::synchronize();
  timing.ms_per_step =
      std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
  timing.loss = last.item();
  timing.memory = cuda::memory_stats();
  for (auto& [name, total] : timing.phase_ms) total /= steps;
  return timing;
}

// The language-model step both training benchmarks time: forward + loss, backward, global
// clipping at 1.0, AdamW.
inline StepTiming time_language_model_steps(int warmup, int steps, bool profile,
                                            nn::CausalLM& model, optim::AdamW& opt,
                                            const Tensor& idx, const Tensor& targets) {
  return time_training_steps(warmup, steps, profile, [&](const PhaseMark& phase) {
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
  });
}

struct TorchResult {
  bool ok = false;
  double ms_per_step = 0, tokens_per_s = 0, peak_gib = 0, loss = 0;
  std::string torch_version;
};

// Runs `python script --mode mode args` (its last line a JSON object of figures).
inline TorchResult run_torch_reference(const std::string& script, const std::string& args,
                                       const char* mode) {
  const std::string cmd =
      python_interpreter() + " " + script + " --mode " + mode + " " + args + " 2>&1";
  TorchResult r;
  bool ok = false;
  const std::string out = run_reference(cmd, ok);
  if (!ok) return r;
  r.ms_per_step = json_number(out, "ms_per_step");
  r.tokens_per_s = json_number(out, "tokens_per_s");
  r.peak_gib = json_number(out, "peak_gib");
  r.loss = json_number(out, "loss");
  r.torch_version = json_string(out, "torch");
  r.ok = r.ms_per_step > 0;
  return r;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The table: Tessera's row (and phases), then each PyTorch mode with the ratios.
// flops_per_token and peak_flops give the MFU column.
inline void print_results(const StepTiming& t, double tokens_per_step, double flops_per_token,
                          double peak_flops, const std::string& script, const std::string& args,
                          bool run_torch, bool run_compile) {
  auto mfu = [&](double ms) { return flops_per_token * tokens_per_step / (ms / 1e3) / peak_flops; };
  const double tessera_tps = tokens_per_step / (t.ms_per_step / 1e3);
  std::printf("  %-16s %10s %12s %7s %10s %9s\n", "engine", "ms/step", "tokens/s", "MFU",
              "peak GiB", "loss");
  std::printf("  %-16s %10.2f %12.0f %6.1f%% %10.2f %9.4f   (peak reserved %.2f GiB)\n", "tessera",
              t.ms_per_step, tessera_tps, 100 * mfu(t.ms_per_step),
              t.memory.peak_allocated_bytes / kGiB, t.loss, t.memory.peak_reserved_bytes / kGiB);
  if (!t.phase_ms.empty()) {
    std::printf("  phases (ms/step, device synchronised after each):\n");
    for (const auto& [name, ms] : t.phase_ms) std::printf("    %-26s %8.2f\n", name.c_str(), ms);
  }
  if (!run_torch) return;
  for (const char* mode : {"eager", "compile"}) {
    if (!run_compile && std::string(mode) == "compile") continue;
    const TorchResult r = run_torch_reference(script, args, mode);
    if (!r.ok) {
      std::printf("  pytorch %-8s not available\n", mode);
      continue;
    }
    std::printf("  pytorch %-8s %10.2f %12.0f %6.1f%% %10.2f %9.4f   (torch %s)\n", mode,
                r.ms_per_step, r.tokens_per_s, 100 * mfu(r.ms_per_step), r.peak_gib, r.loss,
                r.torch_version.c_str());
    std::printf("    tessera / pytorch %s: tokens/s ratio %.2fx, peak memory ratio %.2fx\n", mode,
                tessera_tps / r.tokens_per_s, (t.memory.peak_allocated_bytes / kGiB) / r.peak_gib);
  }
}

}  // namespace tessera::bench
