// An outside project: a few training steps of a tiny GPT through the installed package.
// It has a header named core/error.h of its own (include/), used next to Tessera's.
#include <tessera/core/tensor.h>
#include <tessera/tessera.h>

#include <iostream>

#include "core/error.h"

int main() {
  using namespace tessera;
  Tensor t = arange(0, 6, 1, {.dtype = DType::f32}).view({2, 3});
  double sum = 0;
  for (float v : t.transpose(0, 1).contiguous().to_vector<float>()) sum += v + 1;

  manual_seed(7);
  nn::GPT model(nn::GPTConfig{.vocab_size = 11, .block_size = 8, .n_layer = 1, .n_head = 2,
                              .n_embd = 8});
  optim::AdamW opt(model.parameters(), {.lr = 1e-2});
  Tensor x = randint(0, 11, {2, 8});
  Tensor y = randint(0, 11, {2, 8});
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    Tensor loss = model.loss(x, y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    (step == 0 ? first : last) = loss.item();
  }
  if (sum != 21 || !(last < first)) {
    std::cerr << consumer::error_prefix() << "sum " << sum << ", loss " << first << " -> " << last << "\n";
    return 1;
  }
  std::cout << "consumer ok: sum=" << sum << " loss " << first << " -> " << last << "\n";
  return 0;
}
