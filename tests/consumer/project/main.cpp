#include <tessera/tessera.h>

#include <iostream>

int main() {
  using namespace tessera;
  Tensor t = arange(0, 6, 1, {.dtype = DType::f32}).view({2, 3});
  double sum = 0;
  for (float v : t.transpose(0, 1).contiguous().to_vector<float>()) sum += v + 1;
  std::cout << "consumer ok: sum=" << sum << "\n" << t << "\n";
  return sum == 21 ? 0 : 1;
}
