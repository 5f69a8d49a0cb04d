// End-to-end CPU training throughput: a char-level GPT (4 layers, 4 heads, 128
// channels, context 128, batch 32, vocab 65, fp32, AdamW + clipping) trained by
// Tessera and, in the same invocation on the same cores, by PyTorch
// (benchmarks/cpu_gpt_train_torch.py as a subprocess). Prints ms/step, tokens/s
// and the ratio.
//
//   bench_cpu_gpt_train [--steps N] [--warmup N] [--threads N] [--no-torch]
//   TESSERA_PYTHON=...  the interpreter for the PyTorch side (default /usr/bin/python3)
//   TESSERA_PROFILE=1   also time the phases (forward, backward, clip, optimizer)
//                       and the forward/backward time of each module type (via module hooks).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "tessera/autograd/functions.h"
#include "benchmarks/bench_common.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  int steps = 20;
  int warmup = 3;
  int threads = 0;  // 0: OpenMP's default (OMP_NUM_THREADS or all cores)
  bool torch = true;
  int64_t batch = 32, seq = 128, vocab = 65, layers = 4, heads = 4, channels = 128;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    auto value = [&] { return bench::flag_value(i, argc, argv); };
    if (!std::strcmp(argv[i], "--steps")) a.steps = value();
    else if (!std::strcmp(argv[i], "--warmup")) a.warmup = value();
    else if (!std::strcmp(argv[i], "--threads")) a.threads = value();
    else if (!std::strcmp(argv[i], "--no-torch")) a.torch = false;
    else {
      std::fprintf(stderr, "usage: %s [--steps N] [--warmup N] [--threads N] [--no-torch]\n", argv[0]);
      std::exit(2);
    }
  }
  return a;
}

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Forward time per module type (inclusive, from forward pre/post hooks) and backward
// time per leaf module type (Linear, LayerNorm, ...): each stretch of backward is
// attributed to the leaf module whose backward began most recently (backward pre-hooks
// mark those starts), so attention's score ops count under the Linear that precedes them.
class ModuleTimer {
 public:
  explicit ModuleTimer(nn::Module& root) {
    for (auto& [name, m] : root.named_modules()) {
      if (name.empty()) continue;
      m->register_forward_pre_hook([this](nn::Module& mod, const Tensor&) { starts_[&mod] = Clock::now(); });
      m->register_forward_hook([this](nn::Module& mod, const Tensor&, const Tensor&) {
        forward_[mod.type_name()] += ms_since(starts_[&mod]);
      });
      if (m->named_children().empty())
        m->register_backward_pre_hook([this](nn::Module& mod) { mark_backward(mod.type_name()); });
    }
  }
  void begin_backward() { mark_backward("(before any module: loss, head)"); }
  void end_backward() { mark_backward(""); }
  void reset() {
    forward_.clear();
    backward_.clear();
  }
  const std::map<std::string, double>& forward() const { return forward_; }
  const std::map<std::string, double>& backward() const { return backward_; }

 private:
  void mark_backward(const std::string& type) {
    const auto now = Clock::now();
    if (!current_.empty())
      backward_[current_] += std::chrono::duration<double, std::milli>(now - since_).count();
    current_ = type;
    since_ = now;
  }
  std::map<const nn::Module*, Clock::time_point> starts_;
  std::map<std::string, double> forward_, backward_;
  std::string current_;
  Clock::time_point since_;
};

struct TorchResult {
  bool ok = false;
  double ms_per_step = 0, tokens_per_s = 0;
  std::string blas;  // the BLAS library PyTorch loaded
};

TorchResult run_torch(const Args& a, int threads) {
  const std::string cmd = bench::python_interpreter() +
                          " " TESSERA_SOURCE_DIR "/benchmarks/cpu_gpt_train_torch.py" +
                          std::string(" --steps ") + std::to_string(a.steps) + " --warmup " +
                          std::to_string(a.warmup) + " --threads " + std::to_string(threads);
  TorchResult r;
  bool ok = false;
  const std::string out = bench::run_reference(cmd, ok);
  if (!ok) return r;
  r.ms_per_step = bench::json_number(out, "ms_per_step");
  r.tokens_per_s = bench::json_number(out, "tokens_per_s");
  r.ok = r.ms_per_step > 0;
  r.blas = bench::json_string(out, "blas");
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  // OpenMP reads OMP_NUM_THREADS when the library loads: to change it, run again with it set.
  const char* env_threads = std::getenv("OMP_NUM_THREADS");
  if (a.threads > 0 && (!env_threads || std::atoi(env_threads) != a.threads)) {
    setenv("OMP_NUM_THREADS", std::to_string(a.threads).c_str(), 1);
    execv("/proc/self/exe", argv);
    std::perror("re-exec with OMP_NUM_THREADS");
    return 1;
  }
  const int threads = env_threads && std::atoi(env_threads) > 0
                          ? std::atoi(env_threads)
                          : static_cast<int>(std::thread::hardware_concurrency());
  const bool profile = std::getenv("TESSERA_PROFILE") && std::strcmp(std::getenv("TESSERA_PROFILE"), "0");

  Generator gen(0);
  nn::GPT model(nn::GPTConfig{.vocab_size = a.vocab, .block_size = a.seq, .n_layer = a.layers,
                              .n_head = a.heads, .n_embd = a.channels},
                &gen);
  optim::AdamW opt(model.parameters(), {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.1});
  const Tensor idx = randint(0, a.vocab, {a.batch, a.seq}, {.dtype = DType::i64}, &gen);
  const Tensor targets = randint(0, a.vocab, {a.batch, a.seq}, {.dtype = DType::i64}, &gen);
  std::unique_ptr<ModuleTimer> module_timer;
  if (profile) module_timer = std::make_unique<ModuleTimer>(model);

  std::map<std::string, double> phases;
  double last_loss = 0;
  auto step = [&] {
    auto t = Clock::now();
    opt.zero_grad();
    Tensor loss = model.loss(idx, targets);
    phases["forward"] += ms_since(t);
    t = Clock::now();
    if (module_timer) module_timer->begin_backward();
    loss.backward();
    if (module_timer) module_timer->end_backward();
    phases["backward"] += ms_since(t);
    t = Clock::now();
    optim::clip_grad_norm_(model.parameters(), 1.0);
    phases["clip"] += ms_since(t);
    t = Clock::now();
    opt.step();
    phases["optimizer"] += ms_since(t);
    last_loss = loss.item();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  phases.clear();
  if (module_timer) module_timer->reset();
  const auto start = Clock::now();
  for (int i = 0; i < a.steps; ++i) step();
  const double tessera_ms = ms_since(start) / a.steps;
  const double tokens = double(a.batch * a.seq);

  std::printf("CPU GPT training step: %lld layers, %lld heads, %lld channels, context %lld, batch %lld, "
              "vocab %lld, fp32, AdamW; %d threads, %d steps after %d warm-up\n",
              (long long)a.layers, (long long)a.heads, (long long)a.channels, (long long)a.seq,
              (long long)a.batch, (long long)a.vocab, threads, a.steps, a.warmup);
  std::printf("  %-10s %10s %12s\n", "engine", "ms/step", "tokens/s");
  std::printf("  %-10s %10.2f %12.0f   (loss %.4f)\n", "tessera", tessera_ms, tokens / (tessera_ms / 1000),
              last_loss);
  if (a.torch) {
    const TorchResult t = run_torch(a, threads);
    if (t.ok) {
      std::printf("  %-10s %10.2f %12.0f   (torch BLAS: %s)\n", "pytorch", t.ms_per_step,
                  t.tokens_per_s, t.blas.c_str());
      std::printf("  tessera/pytorch time ratio: %.2fx (below 1 = Tessera faster)\n",
                  tessera_ms / t.ms_per_step);
    } else {
      std::printf("  pytorch: not available (needs /usr/bin/python3 with torch)\n");
    }
  }
  if (profile) {
    std::printf("\nphases (ms/step):\n");
    for (auto& [name, ms] : phases) std::printf("  %-22s %8.2f\n", name.c_str(), ms / a.steps);
    std::printf("module forward time, inclusive (ms/step):\n");
    for (auto& [name, ms] : module_timer->forward())
      std::printf("  %-22s %8.2f\n", name.c_str(), ms / a.steps);
    std::printf("backward time by the leaf module whose backward began last (ms/step):\n");
    for (auto& [name, ms] : module_timer->backward())
      std::printf("  %-32s %8.2f\n", name.c_str(), ms / a.steps);
  }
  return 0;
}
