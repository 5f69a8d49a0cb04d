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
const FusedKernelTable& fused_for(const Tensor& x2d) {
  return fused_kernel_table(x2d.device().type);
}

// True when operands suit the fused Linear GEMMs: tensors on one device of one 16/32-bit
// float dtype (a bias in that dtype or f32, as under autocast); with allow_f64 also float64,
// which the kernels take through their plain fallback.
bool fused_linear_operands(const Tensor& x2d, const Tensor& w, const Tensor& bias,
                           bool allow_f64 = false) {
  const DType t = x2d.dtype();
  const bool float_type =
      t == DType::f32 || t == DType::f16 || t == DType::bf16 || (allow_f64 && t == DType::f64);
  const bool bias_ok =
      !bias.defined() || (bias.device() == x2d.device() &&
                          (bias.dtype() == t || (bias.dtype() == DType::f32 && t != DType::f64)));
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

// g's column sums, written into `into` when defined (a bias gradient's offered destination).
Tensor column_sums(const Tensor& g, const Tensor& into) {
  Tensor sums = ops::sum(g, {0});
  if (!into.defined()) return sums;
  raw::copy_(into, sums);  // [out] only: what counts is that the weight's GEMM writes in place
  return into;
}

// {dW = x2dᵀ g, db = g's column sums}, each only when wanted (else undefined); both from one
// GEMM (the bias gradient in its epilogue) where the device has it. into_w / into_b: memory
// they are written into (contiguous, of their shapes: offered destinations), or undefined.
std::pair<Tensor, Tensor> weight_and_bias_grads(const Tensor& x2d, const Tensor& g, bool want_w,
                                                bool want_b, const Tensor& into_w = Tensor(),
                                                const Tensor& into_b = Tensor()) {
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
             const Tensor into =
                 matmul_weight_grad_target(x, a_shape, b_shape, b_transposed, g.dtype());
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
  const Tensor y2 = linear_rows(fold_rows(x), weight, bias);
  Shape out_shape = x.shape();
  out_shape.back() = out;
  Tensor y = raw::reshape(y2, out_shape);
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
          grad_x = raw::reshape(ops::matmul(g, mT(saved_w.unpack("LinearBackward"))), x_shape);
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

namespace {

// True when the device has the MLP's fused GEMMs (GELU epilogues) and the operands suit them
// (float64 included: one node either way, and the fused route can be checked in float64).
bool fused_mlp_applies(const FusedKernelTable& fused, const Tensor& x2d, const Tensor& w_fc,
                       const Tensor& b_fc, const Tensor& w_proj, const Tensor& b_proj) {
  return fused.linear_gelu_forward != nullptr && fused.linear_input_grad_dgelu != nullptr &&
         fused_linear_operands(x2d, w_fc, b_fc, /*allow_f64=*/true) &&
         fused_linear_operands(x2d, w_proj, b_proj, /*allow_f64=*/true);
}

// The backward of mlp_gelu's fused route: y = act @ w_proj + b_proj with act = gelu(pre) and
// pre = x @ w_fc + b_fc. Inputs in mlp_gelu's order (x, w_fc, b_fc, w_proj, b_proj).
struct MlpGeluBackward {
  SavedTensor x, w_fc, w_proj;
  Tensor pre, act;  // [rows, hidden], private to this node
  Shape x_shape;

  Grads operator()(const BackwardArgs& a) const {
    const char* op = "MlpGeluBackward";
    const Tensor g = fold_rows(raw::to(a.grad(), act.device(), act.dtype()));
    const int64_t in = x_shape.back(), hidden = pre.defined() ? pre.size(1) : act.size(1),
                  out = g.size(1);
    const DType t = g.dtype();
    Grads grads(5);
    // c_proj: dW_proj and db_proj from one GEMM (into the parameters' offered destinations,
    // a DDP bucket's slots, where their layout is the GEMM's; so below).
    std::tie(grads[3], grads[4]) = weight_and_bias_grads(act, g, a.needs(3), a.needs(4),
                                                         overwrite_target(a, 3, {hidden, out}, t),
                                                         overwrite_target(a, 4, {out}, t));
    if (a.needs(0) || a.needs(1) || a.needs(2)) {
      // Through c_proj and the GELU into pre in one GEMM, db_fc from the same GEMM.
      const TensorOptions like{.dtype = pre.dtype(), .device = pre.device()};
      const Tensor dpre = empty(pre.shape(), like);
      if (a.needs(2)) {
        grads[2] = overwrite_target(a, 2, {hidden}, t);
        if (!grads[2].defined()) grads[2] = empty({hidden}, like);
      }
      fused_kernel_table(pre.device().type)
          .linear_input_grad_dgelu(g, w_proj.unpack(op), pre, dpre, grads[2]);
      if (a.needs(1))
        grads[1] = weight_and_bias_grads(fold_rows(x.unpack(op)), dpre, true, false,
                                         overwrite_target(a, 1, {in, hidden}, t))
                       .first;
      if (a.needs(0)) grads[0] = raw::reshape(ops::matmul(dpre, mT(w_fc.unpack(op))), x_shape);
    }
    for (size_t i = 1; i < grads.size(); ++i) grads[i] = add_into_destination(a, i, grads[i]);
    return grads;
  }
};

}  // namespace

Tensor mlp_gelu(const Tensor& x_in, const Tensor& w_fc_in, const Tensor& b_fc,
                const Tensor& w_proj_in, const Tensor& b_proj) {
  // The casts linear makes under autocast, made once here: both routes then see the same
  // operands (biases stay as they are, which the GEMM epilogues accept in f32).
  const Tensor x = autograd::autocast(x_in), w_fc = autograd::autocast(w_fc_in),
               w_proj = autograd::autocast(w_proj_in);
  TESSERA_CHECK(w_fc.dim() == 2 && w_proj.dim() == 2 && x.dim() >= 1 &&
                    x.size(-1) == w_fc.size(0) && w_proj.size(0) == w_fc.size(1),
                "mlp_gelu: input ", shape_str(x.shape()), ", w_fc ", shape_str(w_fc.shape()),
                " and w_proj ", shape_str(w_proj.shape()),
                " do not chain (expected [.., in], [in, hidden], [hidden, out])");
  const int64_t hidden = w_fc.size(1), out = w_proj.size(1);
  TESSERA_CHECK(!b_fc.defined() || b_fc.shape() == Shape{hidden}, "mlp_gelu: b_fc of shape ",
                shape_str(b_fc.shape()), " for hidden size ", hidden);
  TESSERA_CHECK(!b_proj.defined() || b_proj.shape() == Shape{out}, "mlp_gelu: b_proj of shape ",
                shape_str(b_proj.shape()), " for output size ", out);
  const Tensor x2d = fold_rows(x);
  const FusedKernelTable& fused = fused_kernel_table(x2d.device().type);
  if (!fused_mlp_applies(fused, x2d, w_fc, b_fc, w_proj, b_proj))
    return linear(gelu(linear(x, w_fc, b_fc)), w_proj, b_proj);

  const TensorOptions like{.dtype = x2d.dtype(), .device = x2d.device()};
  const Tensor pre = empty({x2d.size(0), hidden}, like), act = empty({x2d.size(0), hidden}, like);
  fused.linear_gelu_forward(x2d, w_fc, b_fc, act, pre);
  Shape out_shape = x.shape();
  out_shape.back() = out;
  Tensor y = raw::reshape(linear_rows(act, w_proj, b_proj), out_shape);
  if (!autograd::any_requires_grad({x, w_fc, b_fc, w_proj, b_proj})) return y;
  // What the composed graph keeps: x (for dW_fc), the pre-activation, the activation (for
  // dW_proj) and the weights the input gradients need.
  const bool into_fc = x.requires_grad() || w_fc.requires_grad() || b_fc.requires_grad();
  MlpGeluBackward backward{.x = w_fc.requires_grad() ? SavedTensor::input(x) : SavedTensor(),
                           .w_fc = x.requires_grad() ? SavedTensor::input(w_fc) : SavedTensor(),
                           .w_proj = into_fc ? SavedTensor::input(w_proj) : SavedTensor(),
                           .pre = into_fc ? pre : Tensor(),
                           .act = act,
                           .x_shape = x.shape()};
  record("MlpGeluBackward", {x, w_fc, b_fc, w_proj, b_proj}, {y}, std::move(backward));
  return y;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  Tensor y = ops::embedding(weight, indices);
  record("EmbeddingBackward", {weight, indices}, {y},
         [saved = SavedTensor::input(indices), rows = weight.size(0)](const BackwardArgs& a) {
           const Tensor& dy = a.grad();
           const Tensor indices = saved.unpack("EmbeddingBackward");
           // Into the memory the engine offers for the weight's gradient: its DDP bucket slot
           // (overwritten), or a tied lm_head's gradient already there (added into: no zero
           // fill of the table, no separate add).
           if (const autograd::GradDestination* d = a.destination(0);
               d != nullptr && d->tensor.is_contiguous()) {
             ops::embedding_backward_into(d->tensor, dy, indices, d->accumulate);
             return Grads{d->tensor, Tensor()};
           }
           Tensor grad_weight =
               empty({rows, dy.shape().back()}, {.dtype = dy.dtype(), .device = dy.device()});
           ops::embedding_backward_into(grad_weight, dy, indices, /*accumulate=*/false);
           return Grads{grad_weight, Tensor()};
         });
  return y;
}

Tensor embedding(const Tensor& weight, const Tensor& indices,
                 const std::shared_ptr<EmbeddingGradSink>& sink) {
  const bool recording = autograd::is_grad_enabled() && weight.requires_grad();
  if (!sink || !recording || !sink->accepts(weight, indices)) return embedding(weight, indices);
  Tensor y = ops::embedding(weight, indices);
  // No edge into the weight: forced, so the output still carries dY back to the sink.
  record(
      "EmbeddingSinkBackward", {}, {y},
      [sink, saved = SavedTensor::input(indices)](const BackwardArgs& a) {
        const Tensor idx = saved.unpack("EmbeddingSinkBackward");
        const int64_t n = idx.numel();
        sink->take(raw::reshape(idx, {n}).contiguous(),
                   raw::reshape(a.grad(), {n, a.grad().size(-1)}).contiguous());
        return Grads{};
      },
      /*force=*/true);
  return y;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     Reduction reduction) {
  const ops::Reduction op_reduction = reduction == Reduction::Mean  ? ops::Reduction::Mean
                                      : reduction == Reduction::Sum ? ops::Reduction::Sum
                                                                    : ops::Reduction::None;
  Tensor loss = ops::cross_entropy(logits, targets, ignore_index, op_reduction);
  record("CrossEntropyBackward", {logits, targets}, {loss},
         [sl = SavedTensor::input(logits), st = SavedTensor::input(targets), ignore_index,
          op_reduction](const BackwardArgs& a) {
           const Tensor logits = sl.unpack("CrossEntropyBackward"),
                        targets = st.unpack("CrossEntropyBackward");
           if (op_reduction != ops::Reduction::None) {
             // One scalar scales every row; reading it costs one sync, cheaper than a pass over [N,
             // V].
             return Grads{ops::cross_entropy_backward(logits, targets, a.grad().item(),
                                                      ignore_index, op_reduction),
                          Tensor()};
           }
           // Per-row losses: (softmax - onehot) of each row times that row's gradient.
           Tensor per_row =
               ops::cross_entropy_backward(logits, targets, 1.0, ignore_index, ops::Reduction::Sum);
           return Grads{ops::mul(per_row, raw::unsqueeze(a.grad(), a.grad().dim())), Tensor()};
         });
  return loss;
}

}  // namespace tessera
