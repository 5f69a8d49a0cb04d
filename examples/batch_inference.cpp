// Distributed batch inference: each process completes its share of the prompts
// (split_between_processes with padding, so every process runs the same number
// of batches) and the main process prints all completions, gathered in order
// with the padding dropped (gather_for_metrics).
//
//   tessera launch --nproc-per-node 3 example_batch_inference [--model DIR] [--new 8]
//
// Without --model a small randomly initialised GPT is used (same seed on every rank).
#include <iostream>
#include <string>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/gpt.h"

using namespace tessera;

int main(int argc, char** argv) {
  std::string model_dir;
  int64_t new_tokens = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--model") model_dir = argv[i + 1];
    else if (flag == "--new") new_tokens = std::stoll(argv[i + 1]);
  }
  dist::Accelerator acc;
  std::unique_ptr<nn::GPT> model;
  if (!model_dir.empty()) {
    model = nn::GPT::from_pretrained(model_dir, {.device = acc.device()});
  } else {
    default_generator().manual_seed(1);  // identical weights on every process
    model = std::make_unique<nn::GPT>(
        nn::GPTConfig{.vocab_size = 128, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 32},
        nullptr, TensorOptions{.device = acc.device()});
  }
  model->eval();

  // 10 prompts of 6 tokens each: prompt p is p, p+1, ..., p+5.
  const int64_t prompt_len = 6, num_prompts = 10;
  std::vector<int64_t> prompt_ids(num_prompts);
  for (int64_t p = 0; p < num_prompts; ++p) prompt_ids[p] = p;
  std::vector<int64_t> mine = acc.split_between_processes(prompt_ids, /*apply_padding=*/true);

  std::vector<int64_t> tokens;
  for (int64_t p : mine)
    for (int64_t t = 0; t < prompt_len; ++t) tokens.push_back((p + t) % 128);
  const int64_t rows = static_cast<int64_t>(mine.size());
  Tensor idx = from_vector(tokens, {rows, prompt_len}, {.dtype = DType::i64});
  Tensor out = model->generate(idx, new_tokens, {.temperature = 0});  // greedy: deterministic

  // Rows of every process in rank order, padding rows dropped: one per prompt.
  Tensor all = acc.gather_for_metrics(out);
  if (acc.is_main_process()) {
    std::vector<int64_t> values = all.to_vector<int64_t>();
    const int64_t width = all.size(1);
    for (int64_t p = 0; p < all.size(0); ++p) {
      std::cout << "prompt " << p << ":";
      for (int64_t t = 0; t < width; ++t) std::cout << (t == prompt_len ? " |" : "") << " " << values[p * width + t];
      std::cout << "\n";
    }
    std::cout << "completed " << all.size(0) << " prompts on " << acc.num_processes()
              << " process(es)" << std::endl;
  }
  acc.end_training();
  return 0;
}
