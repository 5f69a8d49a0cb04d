// Differentiable rotary position embeddings (kernels/ops_rope.cpp; kernels/cpu/rope.cpp,
// kernels/cuda/rope.cu). Attention that rotates q and k inside its fused route:
// rotary_causal_attention_qkv (autograd/functions_attention.cpp).
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using Grads = std::vector<Tensor>;

Tensor rotary_embedding(const Tensor& x, const ops::RopeTables& tables) {
  Tensor y = ops::rope(x, tables);
  // A rotation's gradient is the opposite rotation of the output's gradient.
  record("RotaryEmbeddingBackward", {x}, {y}, [tables](const BackwardArgs& a) {
    return Grads{ops::rope(a.grad(), tables, /*inverse=*/true)};
  });
  return y;
}

}  // namespace tessera
