// Training throughput of GPT-2 (124M by default) through the Accelerator: tokens
// per second per process, to compare one process with several under DDP.
//
//   example_gpt_ddp_throughput [--batch 16] [--seq 1024] [--steps 10] [--layers 12]
//                              [--mixed-precision bf16|fp16|no] [--profile 1]
//   --profile 1: also time forward, backward (with DDP's gradient sync) and the optimizer step,
//                synchronising the device after each
//   tessera launch --nproc-per-node 2 example_gpt_ddp_throughput ...
//
// Synthetic tokens; the first 3 steps are warm-up and not timed. float32 weights and
// AdamW state; with mixed precision (bf16 by default) the Accelerator autocasts matmuls
// and attention, as PyTorch AMP does, and DDP averages the f32 gradients.
#include <chrono>
#include <map>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/adamw.h"

using namespace tessera;

int main(int argc, char** argv) {
  int64_t batch = 16, seq = 1024, steps = 10, layers = 12;
  std::string mixed_precision = "bf16";
  bool profile = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--mixed-precision") {
      mixed_precision = argv[i + 1];
      continue;
    }
    int64_t v = std::stoll(argv[i + 1]);
    if (flag == "--profile") profile = v != 0;
    if (flag == "--batch") batch = v;
    else if (flag == "--seq") seq = v;
    else if (flag == "--steps") steps = v;
    else if (flag == "--layers") layers = v;
  }
  dist::Accelerator acc({.mixed_precision = mixed_precision});
  default_generator().manual_seed(0);
  nn::GPT model(nn::GPTConfig{.vocab_size = 50304, .block_size = seq, .n_layer = layers,
                              .n_head = 12, .n_embd = 768},
                nullptr, {.device = acc.device()});
  optim::AdamW opt(model.parameters(), {.lr = 3e-4, .weight_decay = 0.1});
  acc.prepare(model, opt);
  Generator g(1 + acc.process_index());
  Tensor tokens = raw::to(randint(0, 50304, {batch, seq + 1}, {.dtype = DType::i64}, &g),
                          acc.device(), DType::i64);
  Tensor x = raw::narrow(tokens, 1, 0, seq), y = raw::narrow(tokens, 1, 1, seq);
  x = raw::contiguous(x);
  y = raw::contiguous(y);
  const int64_t warmup = 3;
  std::chrono::steady_clock::time_point start;
  double loss = 0;
  // --profile: milliseconds per phase over the timed steps, the device synchronised after each.
  std::map<std::string, double> phase_ms;
  auto phase_start = std::chrono::steady_clock::now();
  auto phase = [&](const std::string& name, bool timed) {
    if (!profile) return;
    if (acc.device().is_cuda()) device_backend(DeviceType::CUDA).synchronize(acc.device().index);
    const auto now = std::chrono::steady_clock::now();
    if (timed) phase_ms[name] += std::chrono::duration<double, std::milli>(now - phase_start).count();
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
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  acc.print(acc.num_processes(), " process(es) on ", acc.device().str(), ": ",
            static_cast<double>(batch * seq * steps) / seconds, " tokens/s per process (B=", batch,
            ", T=", seq, ", ", layers, " layers, mixed precision ", acc.mixed_precision(), ", ",
            seconds / steps * 1000, " ms/step, last loss ",
            loss, ")");
  for (const auto& [name, total] : phase_ms)
    acc.print("  ", name, ": ", total / steps, " ms/step (rank 0)");
  acc.end_training();
  return 0;
}
