// Differentiable matmul, linear, embedding and cross_entropy.
#include "tessera/autograd/autocast.h"
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/fused_dispatch.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::add_into_destination;
using autograd::util::overwrite_target;
using autograd::util::sum_to_shape;
using Grads = std::vector<Tensor>;

namespace {

// The fused Linear GEMMs of x2d's device (cuBLASLt epilogues on CUDA); null entries where the
// device has none.
const FusedKernelTable& fused_for(const Tensor& x2d) { return fused_kernel_table(x2d.device().type); }

// True when operands suit the fused Linear GEMMs: tensors on one device of one 16/32-bit
// float dtype (a bias in that dtype or f32, as under autocast).
bool fused_linear_operands(const Tensor& x2d, const Tensor& w, const Tensor& bias) {
  const DType t = x2d.dtype();
  const bool float_type = t == DType::f32 || t == DType::f16 || t == DType::bf16;
  const bool bias_ok = !bias.defined() || (bias.device() == x2d.device() &&
                                           (bias.dtype() == t || bias.dtype() == DType::f32));
  return float_type && w.dtype() == t && w.device() == x2d.device() && bias_ok;
}

// The matrix transpose of the last two dims.
Tensor mT(const Tensor& t) { return raw::transpose(t, -2, -1); }

// t as a matrix [rows, last dim] with every leading dim folded into the rows; unlike a
// reshape to {-1, n} this also holds when a dim is 0 (the -1 would be ambiguous).
Tensor fold_rows(const Tensor& t) {
  const Shape leading(t.shape().begin(), t.shape().end() - 1);
  return raw::reshape(t, {shape_numel(leading), t.size(-1)});
}

// True when t [K, N] is the transpose of a contiguous [N, K] matrix (a torch-layout weight
// used as weight.t()). Its gradient is then computed as the transpose of a contiguous [N, K]
// product, so the weight's own gradient arrives contiguous and needs no layout copy.
bool is_transposed_matrix(const Tensor& t) {
  return t.dim() == 2 && !t.is_contiguous() && t.stride(0) == 1 && t.stride(1) == t.size(0);
}

// a @ b of two matrices: into `into` (contiguous, of the product's shape) when defined.
Tensor product(const Tensor& a, const Tensor& b, const Tensor& into) {
  if (!into.defined()) return ops::matmul(a, b);
  ops::matmul_out(a, b, into);
  return into;
}

// Gradients of y = a @ b for operands of rank >= 2 (broadcast batch dims summed back).
Tensor matmul_grad_a(const Tensor& g, const Tensor& b, const Shape& a_shape) {
  return sum_to_shape(ops::matmul(g, mT(b)), a_shape);
}
// `into`: where a matrix b's gradient is written (matmul_weight_grad_target), or undefined.
Tensor matmul_grad_b(const Tensor& g, const Tensor& a, const Shape& b_shape, bool b_transposed,
                     const Tensor& into) {
  if (b_shape.size() == 2 && a.dim() >= 2) {
    // A matrix shared by every batch: fold the batch into the rows, one [K, N] product
    // instead of a batch of them summed afterwards.
    if (b_transposed) return mT(product(mT(fold_rows(g)), fold_rows(a), into));
    if (a.dim() > 2) return product(mT(fold_rows(a)), fold_rows(g), into);
  }
  return sum_to_shape(product(mT(a), g, into), b_shape);
}

// The memory the gradient of a matrix b [K, N] (in matmul) is computed into: b's offered
// destination when the product matmul_grad_b computes has its layout ([K, N], or [N, K] for a
// transposed b); undefined otherwise (vectors, batched b).
Tensor matmul_weight_grad_target(const BackwardArgs& x, const Shape& a_shape, const Shape& b_shape,
                                 bool b_transposed, DType dtype) {
  if (a_shape.size() < 2 || b_shape.size() != 2) return Tensor();
  const Shape product_shape =
      b_transposed ? Shape{b_shape[1], b_shape[0]} : Shape{b_shape[0], b_shape[1]};
  return autograd::util::overwrite_target(x, 1, product_shape, dtype, b_transposed);
}

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  // Under an AutocastGuard both operands run in the compute dtype; their casts are on the
  // tape, so gradients return in the operands' own dtypes.
  const Tensor a = autograd::autocast(a_in), b = autograd::autocast(b_in);
  Tensor y = ops::matmul(a, b);
  if (!autograd::any_requires_grad({a, b})) return y;
  SavedTensor saved_a = b.requires_grad() ? SavedTensor::input(a) : SavedTensor();
  SavedTensor saved_b = a.requires_grad() ? SavedTensor::input(b) : SavedTensor();
  record("MatmulBackward", {a, b}, {y},
         [saved_a, saved_b, a_shape = a.shape(), b_shape = b.shape(),
          b_transposed = is_transposed_matrix(b)](const BackwardArgs& x) {
           // 1-D operands are a row (a) or a column (b); the gradient gets that dim back.
           const bool a_vector = a_shape.size() == 1, b_vector = b_shape.size() == 1;
           Tensor g = x.grad();
           if (a_vector) g = raw::unsqueeze(g, g.dim() - (b_vector ? 0 : 1));
           if (b_vector) g = raw::unsqueeze(g, g.dim());
           const Shape a2 = a_vector ? Shape{1, a_shape[0]} : a_shape;
           const Shape b2 = b_vector ? Shape{b_shape[0], 1} : b_shape;
           Tensor grad_a, grad_b;
           if (x.needs(0)) {
             grad_a = raw::reshape(
                 matmul_grad_a(g, raw::reshape(saved_b.unpack("MatmulBackward"), b2), a2), a_shape);
           }
           if (x.needs(1)) {
             const Tensor a = raw::reshape(saved_a.unpack("MatmulBackward"), a2);
             const Tensor into = matmul_weight_grad_target(x, a_shape, b_shape, b_transposed, g.dtype());
             grad_b = raw::reshape(matmul_grad_b(g, a, b2, b_transposed, into), b_shape);
             // Written into b's destination: that tensor itself is the gradient.
             if (into.defined()) grad_b = x.destination(1)->tensor;
           }
           return Grads{grad_a, add_into_destination(x, 1, grad_b)};
         });
  return y;
}

Tensor linear(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias) {
  const Tensor x = autograd::autocast(x_in), weight = autograd::autocast(weight_in);
  TESSERA_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(0),
                "linear: input of shape ", shape_str(x.shape()), " does not match weight of shape ",
                shape_str(weight.shape()), " (expected [in, out] with in = the input's last dim)");
  const int64_t in = weight.size(0), out = weight.size(1);
  TESSERA_CHECK(!bias.defined() || bias.shape() == Shape{out}, "linear: bias of shape ",
                shape_str(bias.shape()), " for weight of shape ", shape_str(weight.shape()));
  // Rows of the input as one matrix: a single GEMM, and dW = x^T g without a batch.
  const Tensor x2d = fold_rows(x);
  Tensor y2;
  if (auto fused = fused_for(x2d).linear_forward; fused && fused_linear_operands(x2d, weight, bias)) {
    // One GEMM with the bias added in its epilogue.
    y2 = empty({x2d.size(0), out}, {.dtype = x2d.dtype(), .device = x2d.device()});
    fused(x2d, weight, bias, y2);
  } else {
    y2 = ops::matmul(x2d, weight);
    if (bias.defined()) ops::binary_(BinaryOp::Add, y2, bias);
  }
  Shape out_shape = x.shape();
  out_shape.back() = out;
  Tensor y = raw::reshape(y2, out_shape);
  if (!autograd::any_requires_grad({x, weight, bias})) return y;
  SavedTensor saved_x = weight.requires_grad() ? SavedTensor::input(x) : SavedTensor();
  SavedTensor saved_w = x.requires_grad() ? SavedTensor::input(weight) : SavedTensor();
  record("LinearBackward", {x, weight, bias}, {y},
         [saved_x, saved_w, x_shape = x.shape(), in, out,
          w_transposed = is_transposed_matrix(weight)](const BackwardArgs& a) {
           const Tensor g = fold_rows(a.grad());
           Tensor grad_x, grad_w, grad_b;
           if (a.needs(0))
             grad_x = raw::reshape(ops::matmul(g, mT(saved_w.unpack("LinearBackward"))), x_shape);
           // Weight and bias gradients go straight into the memory the engine offers for them
           // (a DDP bucket's slots) when its layout is the GEMM's.
           const TensorOptions like{.dtype = g.dtype(), .device = g.device()};
           const Tensor bias_into = overwrite_target(a, 2, {out}, g.dtype());
           if (a.needs(1)) {
             const Tensor x2d = fold_rows(saved_x.unpack("LinearBackward"));
             auto fused = fused_for(x2d).linear_weight_grad;
             if (w_transposed && !a.needs(2)) {
               // weight is a torch-layout [out, in] matrix seen as [in, out]: dWᵀ = gᵀ x is written
               // contiguous [out, in], and its transpose is the gradient of the view.
               Tensor grad_wt = overwrite_target(a, 1, {out, in}, g.dtype(), /*transposed=*/true);
               const bool into_destination = grad_wt.defined();
               if (fused && fused_linear_operands(g, x2d, Tensor())) {
                 if (!into_destination) grad_wt = empty({out, in}, like);
                 fused(g, x2d, grad_wt, Tensor());
               } else {
                 grad_wt = product(mT(g), x2d, grad_wt);
               }
               grad_w = into_destination ? a.destination(1)->tensor : mT(grad_wt);
             } else {
               grad_w = overwrite_target(a, 1, {in, out}, g.dtype());
               if (fused && fused_linear_operands(x2d, g, Tensor())) {
                 // dW = x^T g and, when wanted, db = the column sums of g from the same GEMM.
                 if (!grad_w.defined()) grad_w = empty({in, out}, like);
                 if (a.needs(2)) grad_b = bias_into.defined() ? bias_into : empty({out}, like);
                 fused(x2d, g, grad_w, grad_b);
               } else {
                 grad_w = product(mT(x2d), g, grad_w);
               }
             }
           }
           if (a.needs(2) && !grad_b.defined()) {
             grad_b = ops::sum(g, {0});
             if (bias_into.defined()) {
               raw::copy_(bias_into, grad_b);  // [out] only: the weight's GEMM is what counts
               grad_b = bias_into;
             }
           }
           return Grads{grad_x, add_into_destination(a, 1, grad_w), add_into_destination(a, 2, grad_b)};
         });
  return y;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  Tensor y = ops::embedding(weight, indices);
  record("EmbeddingBackward", {weight, indices}, {y},
         [saved = SavedTensor::input(indices), rows = weight.size(0)](const BackwardArgs& a) {
           const Tensor& dy = a.grad();
           // The gradient goes into a fresh tensor (accumulate=false writes every row). Where
           // the engine offers a destination that already holds a gradient of this weight (a
           // tied lm_head), writing there with accumulate=true saves the separate add.
           Tensor grad_weight =
               empty({rows, dy.shape().back()}, {.dtype = dy.dtype(), .device = dy.device()});
           ops::embedding_backward_into(grad_weight, dy, saved.unpack("EmbeddingBackward"),
                                        /*accumulate=*/false);
           return Grads{grad_weight, Tensor()};
         });
  return y;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     Reduction reduction) {
  const ops::Reduction op_reduction = reduction == Reduction::Mean  ? ops::Reduction::Mean
                                      : reduction == Reduction::Sum ? ops::Reduction::Sum
                                                                    : ops::Reduction::None;
  Tensor loss = ops::cross_entropy(logits, targets, ignore_index, op_reduction);
  record("CrossEntropyBackward", {logits, targets}, {loss},
         [sl = SavedTensor::input(logits), st = SavedTensor::input(targets), ignore_index, op_reduction](const BackwardArgs& a) {
           const Tensor logits = sl.unpack("CrossEntropyBackward"), targets = st.unpack("CrossEntropyBackward");
           if (op_reduction != ops::Reduction::None) {
             // One scalar scales every row; reading it costs one sync, cheaper than a pass over [N, V].
             return Grads{ops::cross_entropy_backward(logits, targets, a.grad().item(), ignore_index, op_reduction),
                          Tensor()};
           }
           // Per-row losses: (softmax - onehot) of each row times that row's gradient.
           Tensor per_row = ops::cross_entropy_backward(logits, targets, 1.0, ignore_index, ops::Reduction::Sum);
           return Grads{ops::mul(per_row, raw::unsqueeze(a.grad(), a.grad().dim())), Tensor()};
         });
  return loss;
}

}  // namespace tessera
