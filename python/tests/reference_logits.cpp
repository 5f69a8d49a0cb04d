// The C++ side of test_gpt.py's bit-for-bit check: loads a model directory, runs the
// forward of a [B, T] batch of token ids and writes the logits.
//
//   python_reference_logits MODEL_DIR B T TOKENS OUT
//   TOKENS: B*T little-endian int64 ids; OUT: the [B, T, V] float32 logits, row-major.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "tessera/autograd/autograd.h"
#include "tessera/nn/gpt.h"

using namespace tessera;

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: " << argv[0] << " MODEL_DIR B T TOKENS OUT\n";
    return 2;
  }
  try {
    const int64_t batch = std::stoll(argv[2]), seq = std::stoll(argv[3]);
    std::vector<int64_t> ids(batch * seq);
    std::ifstream in(argv[4], std::ios::binary);
    in.read(reinterpret_cast<char*>(ids.data()),
            static_cast<std::streamsize>(ids.size() * sizeof(int64_t)));
    if (in.gcount() != static_cast<std::streamsize>(ids.size() * sizeof(int64_t))) {
      std::cerr << "reference_logits: '" << argv[4] << "' holds fewer than " << ids.size()
                << " int64 ids\n";
      return 1;
    }
    auto model = nn::GPT::from_pretrained(argv[1]);
    model->eval();
    autograd::NoGradGuard no_grad;
    const Tensor logits =
        model->forward(from_vector(ids, {batch, seq}, {.dtype = DType::i64})).contiguous();
    const std::vector<float> values = logits.to_vector<float>();
    std::ofstream out(argv[5], std::ios::binary);
    out.write(reinterpret_cast<const char*>(values.data()),
              static_cast<std::streamsize>(values.size() * sizeof(float)));
    return out ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "reference_logits: " << e.what() << "\n";
    return 1;
  }
}
