// Training throughput of GPT-2 (124M by default) through the Accelerator: tokens
// per second per process, to compare one process with several under DDP and the ZeRO stages.
//
//   example_gpt_ddp_throughput [--batch 16] [--seq 1024] [--steps 10] [--warmup 3]
//                              [--layers 12] [--heads 12] [--channels 768] [--vocab 50304]
//                              [--mixed-precision bf16|fp16|no] [--zero-stages 0,1,2,3]
//                              [--memory-report 1] [--profile 1] [--memory 1]
//                              [--offload none|optimizer|param] [--prefetch ELEMENTS]
//                              [--grad-accum 1]
//   --zero-stages: run these strategies one after the other in this process (0 = DDP), each
//                  with a fresh model; default: TESSERA_ZERO_STAGE (or DDP);
//                  --zero-stage N is the same for one stage
//   --offload: ZeRO-Offload of the optimizer state (and, with param, of the stage-3 shard)
//   --prefetch: stage 3's prefetch of the next units' gathers, in elements
//   --grad-accum N: N micro-batches of --batch rows per optimizer step (acc.accumulate), so a
//                   step trains N x batch x seq tokens per process
//   --memory 1: every process prints its device's peak and its host memory (resident set now
//               and at its peak); an out-of-memory error is printed, naming the size asked
//               for, and the program exits with status 3
//   --memory-report 1: every rank prints its bytes by category next to ZeRO's formula
//   --profile 1: also time forward, backward (with the gradient sync) and the optimizer step,
//                synchronising the device after each
//   tessera launch --nproc-per-node 2 example_gpt_ddp_throughput ...
//
// Synthetic tokens; the warm-up steps are not timed. With mixed precision (bf16 by default)
// the Accelerator's policy holds the weights in bf16, AdamW keeps f32 masters and moments
// (its fused master-weights update), and gradients are averaged in bf16 (TESSERA_REDUCE_DTYPE=fp32:
// in f32). Besides the human
// line, rank 0 prints one `RESULT stage=S world=W tokens_per_s_per_gpu=X ms_per_step=M
// loss=L` line per strategy for scripts (benchmarks/cuda/bench_scaling.sh).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/core/memory_stats.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/adamw.h"

using namespace tessera;

namespace {

struct Settings {
  int64_t batch = 16, seq = 1024, steps = 10, warmup = 3;
  int64_t layers = 12, heads = 12, channels = 768, vocab = 50304;
  int64_t prefetch = dist::kDefaultStage3PrefetchElements, grad_accum = 1;
  std::string mixed_precision = "bf16", offload = "none";
  std::vector<int> stages;  // empty: TESSERA_ZERO_STAGE
  bool profile = false, memory_report = false, memory = false;
};

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--mixed-precision") {
      s.mixed_precision = value;
    } else if (flag == "--offload") {
      TESSERA_CHECK(value == "none" || value == "optimizer" || value == "param",
                    "example_gpt_ddp_throughput: --offload must be none, optimizer or param; got '",
                    value, "'");
      s.offload = value;
    } else if (flag == "--zero-stages" || flag == "--zero-stage") {
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) s.stages.push_back(std::stoi(item));
    } else {
      std::map<std::string, int64_t*> numbers = {
          {"--batch", &s.batch},       {"--seq", &s.seq},
          {"--steps", &s.steps},       {"--warmup", &s.warmup},
          {"--layers", &s.layers},     {"--heads", &s.heads},
          {"--channels", &s.channels}, {"--vocab", &s.vocab},
          {"--n-embd", &s.channels},   {"--n-head", &s.heads},
          {"--prefetch", &s.prefetch}, {"--grad-accum", &s.grad_accum}};
      int64_t on = 0;
      if (flag == "--profile" || flag == "--memory-report" || flag == "--memory")
        numbers[flag] = &on;
      TESSERA_CHECK(numbers.count(flag), "example_gpt_ddp_throughput: unknown flag '", flag, "'");
      *numbers[flag] = std::stoll(value);
      if (flag == "--profile") s.profile = on != 0;
      if (flag == "--memory-report") s.memory_report = on != 0;
      if (flag == "--memory") s.memory = on != 0;
    }
  }
  return s;
}

double mib(double bytes) { return bytes / double(1 << 20); }

// "VmRSS" (now) or "VmHWM" (peak) of this process in GiB, from /proc/self/status.
double resident_gib(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) / (1 << 20);
  return 0;
}

// One line per process: its device's peak and its host memory.
void print_memory(const dist::Accelerator& acc) {
  std::ostringstream os;
  os << "memory rank " << acc.process_index() << ": ";
  if (auto stats = device_memory_stats(acc.device()))
    os << acc.device().str() << " peak reserved " << stats->peak_reserved_bytes / double(1 << 30)
       << " GiB, ";
  os << "host resident " << resident_gib("VmRSS") << " GiB (peak " << resident_gib("VmHWM")
     << " GiB)\n";
  std::printf("%s", os.str().c_str());
  std::fflush(stdout);
}

// This rank's bytes by category next to ZeRO's prediction for psi parameters: parameters and
// gradients in the parameters' dtype, optimizer state 12 bytes a parameter with f32 masters
// (8 without), each divided by the world size from the stage that shards it.
void report_memory(dist::Accelerator& acc, const nn::Module& model, int64_t psi) {
  const dist::MemoryUsage m = acc.memory_usage(model);
  const double w = acc.num_processes(), stage = acc.zero_stage();
  const bool low = acc.mixed_precision() != "no";
  const double p = (low ? 2.0 : 4.0) * psi, o = (low ? 12.0 : 8.0) * psi;
  const auto device = device_memory_stats(acc.device());
  std::printf(
      "MEMORY stage=%d rank=%d MiB: params %.1f grads %.1f optimizer %.1f communication %.1f | "
      "formula: params %.1f grads %.1f optimizer %.1f | device allocated %.1f peak reserved "
      "%.1f\n",
      acc.zero_stage(), acc.process_index(), mib(m.parameters), mib(m.gradients), mib(m.optimizer),
      mib(m.communication), mib(stage >= 3 ? p / w : p), mib(stage >= 2 ? p / w : p),
      mib(stage >= 1 ? o / w : o), device ? mib(device->allocated_bytes) : 0.0,
      device ? mib(device->peak_reserved_bytes) : 0.0);
  std::fflush(stdout);
}

void print_result(const dist::Accelerator& acc, const Settings& s, int64_t psi, double seconds,
                  double loss) {
  const double tokens_per_s =
      static_cast<double>(s.batch * s.seq * s.grad_accum * s.steps) / seconds;
  const double ms = seconds / static_cast<double>(s.steps) * 1000;
  acc.print(acc.num_processes(), " process(es) on ", acc.device().str(), ", ",
            acc.zero_stage() == 0 ? "DDP" : "ZeRO-" + std::to_string(acc.zero_stage()), ": ",
            tokens_per_s, " tokens/s per process (B=", s.batch, ", T=", s.seq, ", ", s.layers,
            " layers, ", s.channels, " channels, ", s.grad_accum, " micro-batch(es) per step, ",
            psi, " parameters, mixed precision ", acc.mixed_precision(), ", ", ms,
            " ms/step, last loss ", loss, ")");
  if (acc.is_main_process()) {
    std::printf("RESULT stage=%d world=%d tokens_per_s_per_gpu=%.1f ms_per_step=%.3f loss=%.4f\n",
                acc.zero_stage(), acc.num_processes(), tokens_per_s, ms, loss);
    std::fflush(stdout);
  }
}

// Trains s.warmup + s.steps steps of a fresh model under acc's strategy; rank 0 prints the figures.
void run_strategy(dist::Accelerator& acc, const Settings& s) {
  default_generator().manual_seed(0);
  // Initialised on the device (each process its own copy; the strategy broadcasts rank 0's).
  nn::GPT model(nn::GPTConfig{.vocab_size = s.vocab,
                              .block_size = s.seq,
                              .n_layer = s.layers,
                              .n_head = s.heads,
                              .n_embd = s.channels},
                nullptr, {.device = acc.device()});
  const int64_t psi = model.num_parameters();
  optim::AdamW opt(model.parameters(), {.lr = 3e-4, .weight_decay = 0.1});
  acc.prepare(model, opt);
  Generator g(1 + acc.process_index());
  Tensor tokens = ops::to(randint(0, s.vocab, {s.batch, s.seq + 1}, {.dtype = DType::i64}, &g),
                          acc.device(), DType::i64);
  Tensor x = ops::contiguous(ops::narrow(tokens, 1, 0, s.seq));
  Tensor y = ops::contiguous(ops::narrow(tokens, 1, 1, s.seq));
  std::chrono::steady_clock::time_point start;
  double loss = 0;
  // --profile: milliseconds per phase over the timed steps, the device synchronised after each.
  std::map<std::string, double> phase_ms;
  auto phase_start = std::chrono::steady_clock::now();
  auto phase = [&](const std::string& name, bool timed) {
    if (!s.profile) return;
    if (acc.device().is_cuda()) device_backend(DeviceType::CUDA).synchronize(acc.device().index);
    const auto now = std::chrono::steady_clock::now();
    if (timed)
      phase_ms[name] += std::chrono::duration<double, std::milli>(now - phase_start).count();
    phase_start = now;
  };
  // One optimizer step. The memory report's step keeps its gradients (ZeRO's formula counts
  // them; zero_grad releases them).
  auto train_step = [&](bool timed, bool keep_gradients) {
    phase("", false);
    Tensor l;
    for (int64_t m = 0; m < s.grad_accum; ++m) {
      auto micro = acc.accumulate(model);
      l = model.loss(x, y);
      phase("1 forward + loss", timed);
      acc.backward(l);
      phase("2 backward + gradient sync", timed);
    }
    acc.clip_grad_norm_(model.parameters(), 1.0);
    opt.step();
    if (!keep_gradients) opt.zero_grad();
    phase("3 clipping + optimizer", timed);
    return l.item();  // also synchronises with the device
  };
  for (int64_t step = 0; step < s.warmup + s.steps; ++step) {
    if (step == s.warmup) {
      acc.wait_for_everyone();
      start = std::chrono::steady_clock::now();
    }
    loss = train_step(step >= s.warmup, false);
  }
  acc.wait_for_everyone();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  print_result(acc, s, psi, seconds, loss);
  for (const auto& [name, total] : phase_ms)
    acc.print("  ", name, ": ", total / static_cast<double>(s.steps), " ms/step (rank 0)");
  if (s.memory_report) {
    train_step(false, true);
    report_memory(acc, model, psi);
    opt.zero_grad();
  }
}

// One strategy (stage -1: TESSERA_ZERO_STAGE) on a fresh model; rank 0 prints the figures.
// Returns 3 after an out-of-memory error (printed by every rank that met it).
int run(const Settings& s, int stage) {
  TESSERA_CHECK(s.grad_accum >= 1,
                "example_gpt_ddp_throughput: --grad-accum must be at least 1, got ", s.grad_accum);
  dist::Accelerator acc({.mixed_precision = s.mixed_precision,
                         .gradient_accumulation_steps = static_cast<int>(s.grad_accum),
                         .zero_stage = stage,
                         .offload_optimizer = s.offload == "optimizer",
                         .offload_param = s.offload == "param",
                         .stage3_prefetch_bucket_size = s.prefetch});
  try {
    run_strategy(acc, s);
  } catch (const OutOfMemoryError& e) {
    std::printf("rank %d: out of memory: %s\n", acc.process_index(), e.what());
    std::fflush(stdout);
    if (s.memory) print_memory(acc);
    return 3;
  }
  if (s.memory) print_memory(acc);
  acc.wait_for_everyone();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Settings s = parse(argc, argv);
    // One process group for every strategy run here (each Accelerator finds it initialised).
    dist::InitOptions init;
    init.device = cuda_is_available() ? DeviceType::CUDA : DeviceType::CPU;
    dist::init_process_group(init);
    int status = 0;
    if (s.stages.empty()) status = run(s, -1);
    for (int stage : s.stages) status = std::max(status, run(s, stage));
    dist::destroy_process_group();
    if (status != 0) return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_gpt_ddp_throughput: %s\n", e.what());
    return 1;
  }
  return 0;
}
