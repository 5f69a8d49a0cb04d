// Differentiable matmul and linear (the fused MLP mlp_gelu: autograd/functions_activation.cpp).
#include "tessera/autograd/autocast.h"
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/fused_table.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::add_into_destination;
using autograd::util::fold_rows;
using autograd::util::mT;
using autograd::util::overwrite_target;
using autograd::util::sum_to_shape;
using autograd::util::weight_and_bias_grads;
using Grads = std::vector<Tensor>;

namespace {

// The fused Linear GEMMs of x2d's device (cuBLASLt epilogues on CUDA); null entries where the
// device has none.
const FusedKernelTable& fused_for(const Tensor& x2d) {
  return fused_kernel_table(x2d.device().type);
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

// g's column sums, written into `into` when defined (a bias gradient's offered destination).
Tensor column_sums(const Tensor& g, const Tensor& into) {
  Tensor sums = ops::sum(g, {0});
  if (!into.defined()) return sums;
  ops::copy_(into, sums);  // [out] only: what counts is that the weight's GEMM writes in place
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

namespace autograd::util {

std::pair<Tensor, Tensor> weight_and_bias_grads(const Tensor& x2d, const Tensor& g, bool want_w,
                                                bool want_b, const Tensor& into_w,
                                                const Tensor& into_b) {
  if (!want_w) return {Tensor(), want_b ? column_sums(g, into_b) : Tensor()};
  if (auto fused = fused_for(x2d).linear_weight_grad;
      fused && fused_linear_operands(x2d, g, Tensor())) {
    const TensorOptions like{.dtype = g.dtype(), .device = g.device()};
    Tensor grad_w = into_w.defined() ? into_w : empty({x2d.size(1), g.size(1)}, like);
    Tensor grad_b = !want_b ? Tensor() : into_b.defined() ? into_b : empty({g.size(1)}, like);
    fused(x2d, g, grad_w, grad_b);
    return {grad_w, grad_b};
  }
  return {product(mT(x2d), g, into_w), want_b ? column_sums(g, into_b) : Tensor()};
}

Tensor linear_rows(const Tensor& x2d, const Tensor& w, const Tensor& bias) {
  if (auto fused = fused_for(x2d).linear_forward; fused && fused_linear_operands(x2d, w, bias)) {
    Tensor y2 = empty({x2d.size(0), w.size(1)}, {.dtype = x2d.dtype(), .device = x2d.device()});
    fused(x2d, w, bias, y2);
    return y2;
  }
  Tensor y2 = ops::matmul(x2d, w);
  if (bias.defined()) ops::binary_(BinaryOp::Add, y2, bias);
  return y2;
}

Tensor linear_weight_grad(const Tensor& x2d, const Tensor& g, const Tensor& into) {
  return weight_and_bias_grads(x2d, g, true, false, into).first;
}

}  // namespace autograd::util

using autograd::util::linear_rows;

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
           if (a_vector) g = ops::unsqueeze(g, g.dim() - (b_vector ? 0 : 1));
           if (b_vector) g = ops::unsqueeze(g, g.dim());
           const Shape a2 = a_vector ? Shape{1, a_shape[0]} : a_shape;
           const Shape b2 = b_vector ? Shape{b_shape[0], 1} : b_shape;
           Tensor grad_a, grad_b;
           if (x.needs(0)) {
             grad_a = ops::reshape(
                 matmul_grad_a(g, ops::reshape(saved_b.unpack("MatmulBackward"), b2), a2), a_shape);
           }
           if (x.needs(1)) {
             const Tensor a = ops::reshape(saved_a.unpack("MatmulBackward"), a2);
             const Tensor into =
                 matmul_weight_grad_target(x, a_shape, b_shape, b_transposed, g.dtype());
             grad_b = ops::reshape(matmul_grad_b(g, a, b2, b_transposed, into), b_shape);
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
  const Tensor y2 = linear_rows(fold_rows(x), weight, bias);
  Shape out_shape = x.shape();
  out_shape.back() = out;
  Tensor y = ops::reshape(y2, out_shape);
  if (!autograd::any_requires_grad({x, weight, bias})) return y;
  SavedTensor saved_x = weight.requires_grad() ? SavedTensor::input(x) : SavedTensor();
  SavedTensor saved_w = x.requires_grad() ? SavedTensor::input(weight) : SavedTensor();
  record(
      "LinearBackward", {x, weight, bias}, {y},
      [saved_x, saved_w, x_shape = x.shape(), in, out,
       w_transposed = is_transposed_matrix(weight)](const BackwardArgs& a) {
        const Tensor g = fold_rows(a.grad());
        Tensor grad_x, grad_w, grad_b;
        if (a.needs(0))
          grad_x = ops::reshape(ops::matmul(g, mT(saved_w.unpack("LinearBackward"))), x_shape);
        // Weight and bias gradients go straight into the memory the engine offers for them
        // (a DDP bucket's slots) when its layout is the GEMM's.
        const Tensor bias_into = overwrite_target(a, 2, {out}, g.dtype());
        if (a.needs(1)) {
          const Tensor x2d = fold_rows(saved_x.unpack("LinearBackward"));
          if (w_transposed && !a.needs(2)) {
            // weight is a torch-layout [out, in] matrix seen as [in, out]: dWᵀ = gᵀ x is written
            // contiguous [out, in], and its transpose is the gradient of the view.
            const Tensor into = overwrite_target(a, 1, {out, in}, g.dtype(), /*transposed=*/true);
            const Tensor grad_wt = weight_and_bias_grads(g, x2d, true, false, into).first;
            grad_w = into.defined() ? a.destination(1)->tensor : mT(grad_wt);
          } else {
            std::tie(grad_w, grad_b) = weight_and_bias_grads(
                x2d, g, true, a.needs(2), overwrite_target(a, 1, {in, out}, g.dtype()), bias_into);
          }
        }
        if (a.needs(2) && !grad_b.defined()) grad_b = column_sums(g, bias_into);
        return Grads{grad_x, add_into_destination(a, 1, grad_w),
                     add_into_destination(a, 2, grad_b)};
      });
  return y;
}

}  // namespace tessera
