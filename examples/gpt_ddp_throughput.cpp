// Training throughput of GPT-2 (124M by default) through the Accelerator: tokens
// per second per process, to compare one process with several under DDP.
//
//   example_gpt_ddp_throughput [--batch 16] [--seq 1024] [--steps 10] [--layers 12]
//                              [--n-embd 768] [--n-head 12] [--warmup 3]
//                              [--mixed-precision bf16|fp16|no] [--profile 1]
//                              [--zero-stage N] [--offload none|optimizer|param]
//                              [--prefetch ELEMENTS] [--memory 1]
//   --profile 1: also time forward, backward (with DDP's gradient sync) and the optimizer step,
//                synchronising the device after each
//   --memory 1:  every process prints its device's peak memory and its host memory (resident
//                set now and at its peak); an out-of-memory error is printed, naming the size
//                asked for, and the program exits with status 3
//   tessera launch --nproc-per-node 2 example_gpt_ddp_throughput ...
//
// Synthetic tokens; the first 3 steps are warm-up and not timed. With mixed precision
// (bf16 by default) the Accelerator's policy holds the weights in bf16, AdamW keeps f32
// masters and moments (its fused master-weights update), and DDP averages the gradients
// in f32; TESSERA_ZERO_STAGE=1|2|3 runs a ZeRO stage instead of DDP.
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/core/memory_stats.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/adamw.h"

using namespace tessera;

namespace {

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
  std::cout << os.str() << std::flush;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 16, seq = 1024, steps = 10, layers = 12, n_embd = 768, n_head = 12, warmup = 3;
  int64_t zero_stage = -1, prefetch = 50'000'000;
  std::string mixed_precision = "bf16", offload = "none";
  bool profile = false, memory = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--mixed-precision") {
      mixed_precision = argv[i + 1];
      continue;
    }
    if (flag == "--offload") {
      offload = argv[i + 1];
      continue;
    }
    int64_t v = std::stoll(argv[i + 1]);
    if (flag == "--profile") profile = v != 0;
    if (flag == "--batch") batch = v;
    else if (flag == "--seq") seq = v;
    else if (flag == "--steps") steps = v;
    else if (flag == "--layers") layers = v;
    else if (flag == "--n-embd")
      n_embd = v;
    else if (flag == "--n-head")
      n_head = v;
    else if (flag == "--warmup")
      warmup = v;
    else if (flag == "--zero-stage")
      zero_stage = v;
    else if (flag == "--prefetch")
      prefetch = v;
    else if (flag == "--memory")
      memory = v != 0;
  }
  if (offload != "none" && offload != "optimizer" && offload != "param") {
    std::cerr << "--offload must be none, optimizer or param; got '" << offload << "'\n";
    return 2;
  }
  dist::Accelerator acc({.mixed_precision = mixed_precision,
                         .zero_stage = static_cast<int>(zero_stage),
                         .offload_optimizer = offload == "optimizer",
                         .offload_param = offload == "param",
                         .stage3_prefetch_bucket_size = prefetch});
  try {
    default_generator().manual_seed(0);
    // Initialised on the device (each process its own copy; the strategy broadcasts rank 0's).
    nn::GPT model(nn::GPTConfig{.vocab_size = 50304,
                                .block_size = seq,
                                .n_layer = layers,
                                .n_head = n_head,
                                .n_embd = n_embd},
                  nullptr, {.device = acc.device()});
    int64_t parameters = 0;
    for (const Tensor& p : model.parameters()) parameters += p.numel();
    acc.print("GPT: ", parameters / 1e9, " billion parameters (", layers, " layers, n_embd ",
              n_embd, "): ", 16.0 * parameters / double(1 << 30),
              " GiB of mixed-precision training state (16 bytes per parameter); ",
              acc.zero_stage() == 0 ? std::string("DDP")
                                    : "ZeRO stage " + std::to_string(acc.zero_stage()),
              ", offload ", offload);
    optim::AdamW opt(model.parameters(), {.lr = 3e-4, .weight_decay = 0.1});
    acc.prepare(model, opt);
    Generator g(1 + acc.process_index());
    Tensor tokens = raw::to(randint(0, 50304, {batch, seq + 1}, {.dtype = DType::i64}, &g),
                            acc.device(), DType::i64);
    Tensor x = raw::narrow(tokens, 1, 0, seq), y = raw::narrow(tokens, 1, 1, seq);
    x = raw::contiguous(x);
    y = raw::contiguous(y);
    std::chrono::steady_clock::time_point start;
    double loss = 0;
    // --profile: milliseconds per phase over the timed steps, the device synchronised after each.
    std::map<std::string, double> phase_ms;
    auto phase_start = std::chrono::steady_clock::now();
    auto phase = [&](const std::string& name, bool timed) {
      if (!profile) return;
      if (acc.device().is_cuda()) device_backend(DeviceType::CUDA).synchronize(acc.device().index);
      const auto now = std::chrono::steady_clock::now();
      if (timed)
        phase_ms[name] += std::chrono::duration<double, std::milli>(now - phase_start).count();
      phase_start = now;
    };
    for (int64_t step = 0; step < warmup + steps; ++step) {
      if (step == warmup) {
        acc.wait_for_everyone();
        start = std::chrono::steady_clock::now();
      }
      const bool timed = step >= warmup;
      phase("", false);
      auto micro = acc.accumulate(model);
      Tensor l = model.loss(x, y);
      phase("1 forward + loss", timed);
      acc.backward(l);
      phase("2 backward + gradient sync", timed);
      opt.step();
      opt.zero_grad();
      phase("3 optimizer", timed);
      loss = l.item();  // also synchronises with the device
    }
    acc.wait_for_everyone();
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    acc.print(acc.num_processes(), " process(es) on ", acc.device().str(), ": ",
              static_cast<double>(batch * seq * steps) / seconds,
              " tokens/s per process (B=", batch, ", T=", seq, ", ", layers,
              " layers, mixed precision ", acc.mixed_precision(), ", ", seconds / steps * 1000,
              " ms/step, last loss ", loss, ")");
    for (const auto& [name, total] : phase_ms)
      acc.print("  ", name, ": ", total / steps, " ms/step (rank 0)");
    if (memory) print_memory(acc);
  } catch (const OutOfMemoryError& e) {
    std::cout << ("rank " + std::to_string(acc.process_index()) + ": out of memory: " + e.what() +
                  "\n")
              << std::flush;
    if (memory) print_memory(acc);
    return 3;
  }
  acc.end_training();
  return 0;
}
