// End-to-end GPT-2 124M training step on one GPU (12 layers, 12 heads, 768 channels,
// vocab 50304, context 1024, batch 16, bf16 compute with fp32 master weights and AdamW
// moments, global-norm clipping at 1.0) on random tokens, next to PyTorch on the same card
// in the same invocation (benchmarks/cuda/gpt2_train_torch.py as a subprocess: eager and
// torch.compile, bf16 autocast, fused AdamW). Prints ms/step, tokens/s, MFU, peak memory
// and the ratios.
//
//   bench_gpt2_train [--steps N] [--warmup N] [--batch N] [--seq N] [--layers N]
//                    [--heads N] [--channels N] [--no-torch] [--no-compile] [--profile]
//                    [--no-graphs]
//   GPT-2 350M: --layers 24 --heads 16 --channels 1024; 774M: --layers 36 --heads 20 --channels 1280
//   --profile           also time the phases of a step (forward + loss, backward, clipping,
//                       AdamW), synchronising the device after each (eager steps)
//   --no-graphs         time eager steps; by default the step runs as `tessera train` runs
//                       it: recorded once as a CUDA graph and replayed (train::StepGraphRunner),
//                       the clipping decided on the device
//   TESSERA_PYTHON=...  the interpreter for the PyTorch side (default /usr/bin/python3)
//
// MFU counts 6·N + 12·L·C·T flops per token (N parameters without the position table,
// attention's score and value products counted in full, as nanoGPT/llm.c do) against the
// dense bf16 peak of an H100/H200 SXM (989 TFLOP/s).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "benchmarks/cuda/train_step_bench.h"
#include "tessera/autograd/functions.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"
#include "tessera/train/step_graph.h"

using namespace tessera;

namespace {

constexpr double kPeakBf16Flops = 989e12;

struct Args {
  int steps = 10, warmup = 3;
  int64_t batch = 16, seq = 1024, layers = 12, heads = 12, channels = 768, vocab = 50304;
  bool torch = true, compile = true, profile = false, graphs = true;
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
    else if (!std::strcmp(argv[i], "--heads")) a.heads = value();
    else if (!std::strcmp(argv[i], "--channels")) a.channels = value();
    else if (!std::strcmp(argv[i], "--no-torch")) a.torch = false;
    else if (!std::strcmp(argv[i], "--no-compile")) a.compile = false;
    else if (!std::strcmp(argv[i], "--profile")) a.profile = true;
    else if (!std::strcmp(argv[i], "--no-graphs")) a.graphs = false;
    else {
      std::fprintf(stderr,
                   "usage: %s [--steps N] [--warmup N] [--batch N] [--seq N] [--layers N] [--heads N] "
                   "[--channels N] [--no-torch] "
                   "[--no-compile] [--profile] [--no-graphs]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return a;
}

// The step of time_language_model_steps as `tessera train` runs it on one GPU: recorded as
// a CUDA graph after a warm-up step and replayed, with the clipping coefficient computed on
// the device (a host read of the norm could not be recorded) and applied by AdamW's kernel.
bench::StepTiming time_graphed_steps(const Args& a, nn::GPT& model, optim::AdamW& opt,
                                     const Tensor& idx, const Tensor& targets) {
  dist::Accelerator acc;
  train::StepGraphRunner runner(
      acc, opt,
      [&](const std::vector<data::Batch>& batches) {
        train::StepOutputs out;
        out.loss = model.loss(batches[0].x, batches[0].y);
        out.loss.backward();
        out.grad_norm = optim::clip_grad_norm_on_device_(opt.parameters(), 0.0);
        opt.clip_grads_in_next_step(out.grad_norm, 1.0);  // as tessera train: in AdamW's pass
        opt.step();
        opt.zero_grad();
        return out;
      },
      {.enabled = true});
  const std::vector<data::Batch> batches{{idx, targets}};
  bench::StepTiming timing = bench::time_training_steps(
      a.warmup, a.steps, false, [&](const bench::PhaseMark&) { return runner.run(batches).loss; },
      /*peak_from_start=*/true);
  std::printf("CUDA graphs: %s, %lld steps replayed, %lld eager (peak memory: over the whole "
              "run, the recorded step's included)\n",
              runner.status().c_str(),
              static_cast<long long>(runner.replayed_steps()),
              static_cast<long long>(runner.eager_steps()));
  return timing;
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
  const bench::StepTiming timing =
      a.graphs && !a.profile
          ? time_graphed_steps(a, model, opt, idx, targets)
          : bench::time_language_model_steps(a.warmup, a.steps, a.profile, model, opt, idx, targets);

  const double tokens = double(a.batch * a.seq);
  const double flops_per_token =
      6.0 * double(n_params - a.seq * a.channels) + 12.0 * double(a.layers * a.channels * a.seq);
  std::printf("GPT-2 training step on %s: %lld layers, %lld heads, %lld channels, vocab %lld, context %lld, "
              "batch %lld, bf16 (fp32 masters), AdamW, clip 1.0; %d steps after %d warm-up; %lld parameters\n",
              cuda::device_name(0).c_str(), (long long)a.layers, (long long)a.heads, (long long)a.channels,
              (long long)a.vocab, (long long)a.seq, (long long)a.batch, a.steps, a.warmup, (long long)n_params);
  const std::string torch_args = "--steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup) +
                                 " --batch " + std::to_string(a.batch) + " --seq " + std::to_string(a.seq) +
                                 " --layers " + std::to_string(a.layers) + " --heads " + std::to_string(a.heads) +
                                 " --channels " + std::to_string(a.channels);
  bench::print_results(timing, tokens, flops_per_token, kPeakBf16Flops,
                       TESSERA_SOURCE_DIR "/benchmarks/cuda/gpt2_train_torch.py", torch_args, a.torch,
                       a.compile);
  return 0;
}
