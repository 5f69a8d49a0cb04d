// End-to-end Llama training step on one GPU at GPT-2-small size (12 layers, 12 query heads
// sharing 4 key/value heads, 768 channels, SwiGLU width 2048, vocab 50304, context 1024,
// batch 16, untied head, bf16 compute with fp32 master weights and AdamW moments, clipping
// at 1.0) on random tokens, next to the same model in plain PyTorch on the same card in the
// same invocation (benchmarks/cuda/llama_train_torch.py as a subprocess: eager and
// torch.compile). Prints ms/step, tokens/s, MFU, peak memory and the ratios.
//
// Tessera's step runs the fused paths: RMSNorm and RoPE kernels, grouped-query flash
// attention reading the shared key/value heads in place (cuDNN's by default where it is
// available, --attention flash for the hand-written kernels), the fused SwiGLU kernel, the
// cuBLASLt / sm90 GEMMs and the fused classifier.
//
//   bench_llama_train [--steps N] [--warmup N] [--batch N] [--seq N] [--layers N]
//                     [--heads N] [--kv-heads N] [--channels N] [--intermediate N] [--tied]
//                     [--attention flash|cudnn]
//                     [--no-torch] [--no-compile] [--profile]
//   TESSERA_PYTHON=...  the interpreter for the PyTorch side (default /usr/bin/python3)
//
// MFU counts 6 flops per token per matmul weight (every parameter but the embedding lookup
// table; the tied table counts, as it is the head) plus 12·L·C·T for the attention products,
// against the dense bf16 peak of an H100/H200 SXM (989 TFLOP/s).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "benchmarks/cuda/train_step_bench.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/cuda/cudnn_attention.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

constexpr double kPeakBf16Flops = 989e12;

struct Args {
  int steps = 10, warmup = 3;
  int64_t batch = 16, seq = 1024, layers = 12, heads = 12, kv_heads = 4, channels = 768,
          intermediate = 2048, vocab = 50304;
  bool tied = false, torch = true, compile = true, profile = false;
  std::string attention;  // "" = cudnn where available, else flash
};

[[noreturn]] void usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s [--steps N] [--warmup N] [--batch N] [--seq N] [--layers N] "
               "[--heads N] [--kv-heads N] [--channels N] [--intermediate N] [--tied] [--attention "
               "flash|cudnn] [--no-torch] [--no-compile] "
               "[--profile]\n",
               program);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    auto value = [&] { return bench::flag_value(i, argc, argv); };
    if (!std::strcmp(argv[i], "--steps"))
      a.steps = value();
    else if (!std::strcmp(argv[i], "--warmup"))
      a.warmup = value();
    else if (!std::strcmp(argv[i], "--batch"))
      a.batch = value();
    else if (!std::strcmp(argv[i], "--seq"))
      a.seq = value();
    else if (!std::strcmp(argv[i], "--layers"))
      a.layers = value();
    else if (!std::strcmp(argv[i], "--heads"))
      a.heads = value();
    else if (!std::strcmp(argv[i], "--kv-heads"))
      a.kv_heads = value();
    else if (!std::strcmp(argv[i], "--channels"))
      a.channels = value();
    else if (!std::strcmp(argv[i], "--intermediate"))
      a.intermediate = value();
    else if (!std::strcmp(argv[i], "--tied"))
      a.tied = true;
    else if (!std::strcmp(argv[i], "--attention") && i + 1 < argc)
      a.attention = argv[++i];
    else if (!std::strcmp(argv[i], "--no-torch"))
      a.torch = false;
    else if (!std::strcmp(argv[i], "--no-compile"))
      a.compile = false;
    else if (!std::strcmp(argv[i], "--profile"))
      a.profile = true;
    else
      usage(argv[0]);
  }
  return a;
}

// The attention backend of this run: the one asked for, else cuDNN where it is available.
AttentionBackend choose_attention(const Args& a) {
  if (!a.attention.empty()) return parse_attention_backend(a.attention, "--attention");
  return cuda::cudnn_attention_available() ? AttentionBackend::Cudnn : AttentionBackend::Flash;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (!cuda_is_available()) {
    std::printf("bench_llama_train: no CUDA device\n");
    return 0;
  }
  set_attention_backend(choose_attention(a));
  const Device gpu = Device::cuda(0);
  const nn::LlamaConfig cfg{.vocab_size = a.vocab,
                            .hidden_size = a.channels,
                            .intermediate_size = a.intermediate,
                            .num_hidden_layers = a.layers,
                            .num_attention_heads = a.heads,
                            .num_key_value_heads = a.kv_heads,
                            .max_position_embeddings = a.seq,
                            .tie_word_embeddings = a.tied};
  Generator gen(0);
  nn::Llama model(cfg, &gen, {.device = gpu});
  const int64_t n_params = model.num_parameters();
  // Mixed precision as bench_gpt2_train: a bf16 model, fp32 masters and moments in AdamW.
  model.to(DType::bf16);
  optim::AdamW opt(model.parameters(), {.lr = 6e-4,
                                        .beta1 = 0.9,
                                        .beta2 = 0.95,
                                        .eps = 1e-8,
                                        .weight_decay = 0.1,
                                        .master_weights = true});
  const Tensor idx =
      randint(0, a.vocab, {a.batch, a.seq}, {.dtype = DType::i64, .device = gpu}, &gen);
  const Tensor targets =
      randint(0, a.vocab, {a.batch, a.seq}, {.dtype = DType::i64, .device = gpu}, &gen);
  const bench::StepTiming timing =
      bench::time_language_model_steps(a.warmup, a.steps, a.profile, model, opt, idx, targets);

  const double tokens = double(a.batch * a.seq);
  const double lookup_params = a.tied ? 0.0 : double(a.vocab * a.channels);
  const double flops_per_token =
      6.0 * (double(n_params) - lookup_params) + 12.0 * double(a.layers * a.channels * a.seq);
  std::printf(
      "Llama training step on %s: %lld layers, %lld heads (%lld key/value), %lld channels, SwiGLU "
      "%lld, vocab %lld, context %lld, batch %lld, %s head, bf16 (fp32 masters), AdamW, clip "
      "1.0, %s attention; %d steps after %d warm-up; %lld parameters\n",
      cuda::device_name(0).c_str(), (long long)a.layers, (long long)a.heads, (long long)a.kv_heads,
      (long long)a.channels, (long long)a.intermediate, (long long)a.vocab, (long long)a.seq,
      (long long)a.batch, a.tied ? "tied" : "untied", attention_backend_name(attention_backend()),
      a.steps, a.warmup, (long long)n_params);
  const std::string torch_args =
      "--steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup) + " --batch " +
      std::to_string(a.batch) + " --seq " + std::to_string(a.seq) + " --layers " +
      std::to_string(a.layers) + " --heads " + std::to_string(a.heads) + " --kv-heads " +
      std::to_string(a.kv_heads) + " --channels " + std::to_string(a.channels) +
      " --intermediate " + std::to_string(a.intermediate) + " --vocab " + std::to_string(a.vocab) +
      (a.tied ? " --tied" : "");
  bench::print_results(timing, tokens, flops_per_token, kPeakBf16Flops,
                       TESSERA_SOURCE_DIR "/benchmarks/cuda/llama_train_torch.py", torch_args,
                       a.torch, a.compile);
  return 0;
}
