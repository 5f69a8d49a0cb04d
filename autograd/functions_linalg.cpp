// Differentiable matmul, linear, embedding and cross_entropy.
#include "tessera/autograd/autocast.h"
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/fused_dispatch.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::sum_to_shape;
using Grads = std::vector<Tensor>;

namespace {

// The fused Linear GEMMs of x2d's device (cuBLASLt epilogues on CUDA); null entries where the
// device has none.
const FusedKernelTable& fused_for(const Tensor& x2d) { return fused_kernel_table(x2d.device().type); }

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

// y2 [rows, out] = x2d @ w (+ bias): one GEMM with the bias added in its epilogue where the
// device has one, else a matmul and an add.
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

// {dW = x2dᵀ g, db = g's column sums}, each only when wanted (else undefined); both from one
// GEMM (the bias gradient in its epilogue) where the device has it.
std::pair<Tensor, Tensor> weight_and_bias_grads(const Tensor& x2d, const Tensor& g, bool want_w,
                                                bool want_b) {
  if (!want_w) return {Tensor(), want_b ? ops::sum(g, {0}) : Tensor()};
  if (auto fused = fused_for(x2d).linear_weight_grad;
      fused && fused_linear_operands(x2d, g, Tensor())) {
    const TensorOptions like{.dtype = g.dtype(), .device = g.device()};
    Tensor grad_w = empty({x2d.size(1), g.size(1)}, like);
    Tensor grad_b = want_b ? empty({g.size(1)}, like) : Tensor();
    fused(x2d, g, grad_w, grad_b);
    return {grad_w, grad_b};
  }
  return {ops::matmul(mT(x2d), g), want_b ? ops::sum(g, {0}) : Tensor()};
}

// Gradients of y = a @ b for operands of rank >= 2 (broadcast batch dims summed back).
Tensor matmul_grad_a(const Tensor& g, const Tensor& b, const Shape& a_shape) {
  return sum_to_shape(ops::matmul(g, mT(b)), a_shape);
}
Tensor matmul_grad_b(const Tensor& g, const Tensor& a, const Shape& b_shape, bool b_transposed) {
  if (b_shape.size() == 2 && a.dim() >= 2) {
    // A matrix shared by every batch: fold the batch into the rows, one [K, N] product
    // instead of a batch of them summed afterwards.
    if (b_transposed) return mT(ops::matmul(mT(fold_rows(g)), fold_rows(a)));
    if (a.dim() > 2) return ops::matmul(mT(fold_rows(a)), fold_rows(g));
  }
  return sum_to_shape(ops::matmul(mT(a), g), b_shape);
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
             grad_b =
                 raw::reshape(matmul_grad_b(g, raw::reshape(saved_a.unpack("MatmulBackward"), a2),
                                            b2, b_transposed),
                              b_shape);
           }
           return Grads{grad_a, grad_b};
         });
  return y;
}

Tensor linear(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias) {
  const Tensor x = autograd::autocast(x_in), weight = autograd::autocast(weight_in);
  TESSERA_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(0),
                "linear: input of shape ", shape_str(x.shape()), " does not match weight of shape ",
                shape_str(weight.shape()), " (expected [in, out] with in = the input's last dim)");
  const int64_t out = weight.size(1);
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
  record("LinearBackward", {x, weight, bias}, {y},
         [saved_x, saved_w, x_shape = x.shape(),
          w_transposed = is_transposed_matrix(weight)](const BackwardArgs& a) {
           const Tensor g = fold_rows(a.grad());
           Tensor grad_x, grad_w, grad_b;
           if (a.needs(0))
             grad_x = raw::reshape(ops::matmul(g, mT(saved_w.unpack("LinearBackward"))), x_shape);
           if (a.needs(1)) {
             const Tensor x2d = fold_rows(saved_x.unpack("LinearBackward"));
             if (w_transposed && !a.needs(2)) {
               // weight is a torch-layout [out, in] matrix seen as [in, out]: dWᵀ = gᵀ x is written
               // contiguous [out, in], and its transpose is the gradient of the view.
               grad_w = mT(weight_and_bias_grads(g, x2d, true, false).first);
             } else {
               std::tie(grad_w, grad_b) = weight_and_bias_grads(x2d, g, true, a.needs(2));
             }
           }
           if (a.needs(2) && !grad_b.defined()) grad_b = ops::sum(g, {0});
           return Grads{grad_x, grad_w, grad_b};
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
    Grads grads(5);
    // c_proj: dW_proj and db_proj from one GEMM.
    std::tie(grads[3], grads[4]) = weight_and_bias_grads(act, g, a.needs(3), a.needs(4));
    if (!a.needs(0) && !a.needs(1) && !a.needs(2)) return grads;
    // Through c_proj and the GELU into pre in one GEMM, db_fc from the same GEMM.
    const TensorOptions like{.dtype = pre.dtype(), .device = pre.device()};
    const Tensor dpre = empty(pre.shape(), like);
    if (a.needs(2)) grads[2] = empty({pre.size(1)}, like);
    fused_kernel_table(pre.device().type)
        .linear_input_grad_dgelu(g, w_proj.unpack(op), pre, dpre, grads[2]);
    if (a.needs(1))
      grads[1] = weight_and_bias_grads(fold_rows(x.unpack(op)), dpre, true, false).first;
    if (a.needs(0)) grads[0] = raw::reshape(ops::matmul(dpre, mT(w_fc.unpack(op))), x_shape);
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
