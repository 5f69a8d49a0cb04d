// Fine-tuning speed of a BERT-base-shaped sequence classifier (issue 42, point 4): the same
// padded batches through Tessera and through transformers' BertForSequenceClassification
// (eager and torch.compile, bert_classify_torch.py), timed the same way in one run.
//
//   bench_bert_classify [--steps N] [--warmup N] [--batch N] [--max-len N] [--layers N]
//                       [--heads N] [--channels N] [--dropout P] [--batches N] [--no-torch]
//                       [--no-compile] [--profile]
//
// The batches: --batches distinct batches of --batch rows, cycled. Row r of batch b has
// length 32 + hash(b * batch + r) % (max_len - 31), so lengths are mixed up to --max-len; each
// batch is padded on the right to its longest row rounded up to a multiple of 8 (HF's
// DataCollatorWithPadding with pad_to_multiple_of=8), with the attention mask. Token ids and
// labels come from the same hash, so bert_classify_torch.py builds the same batches.
//
// The step: logits, cross-entropy over 2 labels, backward, global clipping at 1.0, AdamW
// (bf16 parameters with f32 masters here; bf16 autocast with f32 parameters in PyTorch).
// Dropout is HF's default 0.1 unless --dropout says otherwise. tokens/s counts the padded
// positions both engines process; samples/s is the figure HF's Trainer prints. MFU counts
// 6·N + 12·L·C·T flops per padded token (N without the embedding tables) against the dense
// bf16 peak of an H100/H200 SXM (989 TFLOP/s).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/cuda/train_step_bench.h"
#include "tessera/nn/bert.h"
#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

constexpr double kPeakBf16Flops = 989e12;

struct Args {
  int steps = 20, warmup = 5, batches = 8;
  int64_t batch = 32, max_len = 512, layers = 12, heads = 12, channels = 768, vocab = 30522;
  double dropout = 0.1;
  bool torch = true, compile = true, profile = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    auto value = [&] { return bench::flag_value(i, argc, argv); };
    if (!std::strcmp(argv[i], "--steps"))
      a.steps = value();
    else if (!std::strcmp(argv[i], "--warmup"))
      a.warmup = value();
    else if (!std::strcmp(argv[i], "--batches"))
      a.batches = value();
    else if (!std::strcmp(argv[i], "--batch"))
      a.batch = value();
    else if (!std::strcmp(argv[i], "--max-len"))
      a.max_len = value();
    else if (!std::strcmp(argv[i], "--layers"))
      a.layers = value();
    else if (!std::strcmp(argv[i], "--heads"))
      a.heads = value();
    else if (!std::strcmp(argv[i], "--channels"))
      a.channels = value();
    else if (!std::strcmp(argv[i], "--dropout") && i + 1 < argc)
      a.dropout = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--no-torch"))
      a.torch = false;
    else if (!std::strcmp(argv[i], "--no-compile"))
      a.compile = false;
    else if (!std::strcmp(argv[i], "--profile"))
      a.profile = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--steps N] [--warmup N] [--batches N] [--batch N] [--max-len N] "
                   "[--layers N] [--heads N] [--channels N] [--dropout P] [--no-torch] "
                   "[--no-compile] [--profile]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return a;
}

// The 32-bit mix both sides use to draw lengths, token ids and labels (Murmur3's finaliser).
uint32_t mix(uint64_t x) {
  uint32_t h = static_cast<uint32_t>(x ^ (x >> 32));
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

struct Batch {
  Tensor ids, mask, labels;
  int64_t padded_tokens = 0;
};

std::vector<Batch> make_batches(const Args& a, Device device) {
  std::vector<Batch> out;
  for (int b = 0; b < a.batches; ++b) {
    std::vector<int64_t> lengths(a.batch);
    int64_t longest = 0;
    for (int64_t r = 0; r < a.batch; ++r) {
      lengths[r] = 32 + mix(uint64_t(b) * a.batch + r) % uint32_t(a.max_len - 31);
      longest = std::max(longest, lengths[r]);
    }
    const int64_t T = std::min(a.max_len, (longest + 7) / 8 * 8);
    std::vector<int64_t> ids(a.batch * T, 0), mask(a.batch * T, 0), labels(a.batch);
    for (int64_t r = 0; r < a.batch; ++r) {
      const uint64_t row = uint64_t(b) * a.batch + r;
      labels[r] = mix(row * 7919 + 1) % 2;
      for (int64_t t = 0; t < lengths[r]; ++t) {
        // [CLS] first, then ids above the special tokens (1000..vocab-1), as WordPiece gives.
        ids[r * T + t] = t == 0 ? 101 : 1000 + mix(row * 100003 + t) % uint32_t(a.vocab - 1000);
        mask[r * T + t] = 1;
      }
    }
    const TensorOptions o{.dtype = DType::i64, .device = device};
    out.push_back({from_vector(ids, {a.batch, T}, o), from_vector(mask, {a.batch, T}, o),
                   from_vector(labels, {a.batch}, o), a.batch * T});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (!cuda_is_available()) {
    std::printf("bench_bert_classify: no CUDA device\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  nn::BertConfig cfg;
  cfg.vocab_size = a.vocab;
  cfg.hidden_size = a.channels;
  cfg.num_hidden_layers = a.layers;
  cfg.num_attention_heads = a.heads;
  cfg.intermediate_size = 4 * a.channels;
  cfg.max_position_embeddings = a.max_len;
  cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = a.dropout;
  cfg.labels.num_labels = 2;
  Generator gen(0);
  nn::BertForSequenceClassification model(cfg, &gen, {.device = gpu});
  model.train();
  const int64_t n_params = model.num_parameters();
  const int64_t embedding_params = (a.vocab + a.max_len + cfg.type_vocab_size) * a.channels;
  model.to(DType::bf16);
  optim::AdamW opt(model.parameters(), {.lr = 2e-5,
                                        .beta1 = 0.9,
                                        .beta2 = 0.999,
                                        .eps = 1e-8,
                                        .weight_decay = 0.01,
                                        .master_weights = true});
  const std::vector<Batch> batches = make_batches(a, gpu);
  int64_t next = 0, padded = 0, steps_taken = 0;
  const bench::StepTiming timing =
      bench::time_training_steps(a.warmup, a.steps, a.profile, [&](const bench::PhaseMark& phase) {
        const Batch& b = batches[next++ % batches.size()];
        if (steps_taken++ >= a.warmup) padded += b.padded_tokens;
        Tensor loss = model.loss(model.logits(b.ids, b.mask), b.labels);
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
  const double tokens_per_step = double(padded) / a.steps;
  // Attention's two products over the padded length of a typical batch, as the GPT benchmarks
  // count them (12·L·C·T per token, T the mean padded length).
  const double mean_T = tokens_per_step / double(a.batch);
  const double flops_per_token =
      6.0 * double(n_params - embedding_params) + 12.0 * double(a.layers * a.channels) * mean_T;
  std::printf(
      "BERT sequence classification on %s: %lld layers, %lld heads, %lld channels, "
      "batch %lld, lengths 32..%lld padded to the batch's longest (mean %.0f), dropout "
      "%.2f, bf16 (fp32 masters), AdamW, clip 1.0; %d steps after %d warm-up; %lld "
      "parameters\n",
      cuda::device_name(0).c_str(), (long long)a.layers, (long long)a.heads, (long long)a.channels,
      (long long)a.batch, (long long)a.max_len, mean_T, a.dropout, a.steps, a.warmup,
      (long long)n_params);
  std::printf("  samples/s: tessera %.1f\n", a.batch / (timing.ms_per_step / 1e3));
  const std::string torch_args =
      "--steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup) +
      " --batches " + std::to_string(a.batches) + " --batch " + std::to_string(a.batch) +
      " --max-len " + std::to_string(a.max_len) + " --layers " + std::to_string(a.layers) +
      " --heads " + std::to_string(a.heads) + " --channels " + std::to_string(a.channels) +
      " --dropout " + std::to_string(a.dropout);
  bench::print_results(timing, tokens_per_step, flops_per_token, kPeakBf16Flops,
                       TESSERA_SOURCE_DIR "/benchmarks/cuda/bert_classify_torch.py", torch_args,
                       a.torch, a.compile);
  return 0;
}
