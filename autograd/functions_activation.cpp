// Differentiable activations and the MLPs built around them: gelu (tanh form, its own
// kernel), gelu_erf, silu, swiglu (one kernel each way where the device has them), and
// GPT-2's MLP mlp_gelu, one node with the GELU in the GEMMs' epilogues where the device has
// them. relu, sigmoid and tanh are element-wise unaries (autograd/functions_elementwise.cpp).
#include <cmath>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/fused_table.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;
namespace util = autograd::util;

Tensor gelu(const Tensor& x) {
  Tensor y = ops::gelu(x);
  record("GeluBackward", {x}, {y}, [saved_x = SavedTensor::input(x)](const BackwardArgs& a) {
    return Grads{ops::gelu_backward(saved_x.unpack("GeluBackward"), a.grad())};
  });
  return y;
}

// PyTorch's order of operations, x * 0.5 * (1 + erf(x * (1 / sqrt 2))), so the f32 results
// round alike; the gradient is the composition's, Phi(x) + x phi(x) up to rounding. Where the
// device has the fused entries (gelu_erf_takes) one kernel each way computes the same formula
// (core/activation_math.h: in f32 the composition's bits; 16-bit dtypes round once) instead of
// five element-wise passes forward and more backward.
Tensor gelu_erf(const Tensor& x) {
  if (!gelu_erf_takes(x)) return x * 0.5 * (1.0 + erf(x * M_SQRT1_2));
  const FusedKernelTable& fused = fused_kernel_table(x.device().type);
  Tensor y = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  fused.gelu_erf_forward(x, y);
  if (!autograd::any_requires_grad({x})) return y;
  record("GeluErfBackward", {x}, {y},
         [sx = SavedTensor::input(x), backward = fused.gelu_erf_backward](const BackwardArgs& a) {
           const Tensor x = sx.unpack("GeluErfBackward");
           const Tensor dy = ops::contiguous(ops::to(a.grad(), x.device(), x.dtype()));
           Tensor dx = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
           backward(dy, x, dx);
           return Grads{dx};
         });
  return y;
}

Tensor silu(const Tensor& x) {
  Tensor s = ops::unary(UnaryOp::Sigmoid, x);
  Tensor y = ops::mul(x, s);
  if (!autograd::any_requires_grad({x})) return y;
  // d(x s)/dx = s (1 + x (1 - s))
  record("SiluBackward", {x}, {y}, [sx = SavedTensor::input(x)](const BackwardArgs& a) {
    const Tensor x = sx.unpack("SiluBackward");
    const Tensor s = ops::unary(UnaryOp::Sigmoid, x);
    const Tensor slope =
        ops::mul(s, ops::add(ops::mul(x, ops::sub(util::scalar_like(1.0, s), s)), 1.0));
    return Grads{ops::mul(a.grad(), slope)};
  });
  return y;
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  TESSERA_CHECK(gate.defined() && up.defined(), "swiglu: gate and up must be defined tensors");
  // Elsewhere (another device, views, mixed dtypes, broadcasting): the composition.
  if (!swiglu_takes(gate, up)) return silu(gate) * up;
  const FusedKernelTable& fused = fused_kernel_table(gate.device().type);
  Tensor out = empty(gate.shape(), {.dtype = gate.dtype(), .device = gate.device()});
  fused.swiglu_forward(gate, up, out);
  if (!autograd::any_requires_grad({gate, up})) return out;
  record("SwigluBackward", {gate, up}, {out},
         [sg = SavedTensor::input(gate), su = SavedTensor::input(up),
          backward = fused.swiglu_backward](const BackwardArgs& a) {
           const Tensor g = sg.unpack("SwigluBackward"), u = su.unpack("SwigluBackward");
           const Tensor dout = ops::contiguous(ops::to(a.grad(), g.device(), g.dtype()));
           const TensorOptions like{.dtype = g.dtype(), .device = g.device()};
           Tensor dgate = empty(g.shape(), like), dup = empty(g.shape(), like);
           backward(dout, g, u, dgate, dup);
           return std::vector<Tensor>{dgate, dup};
         });
  return out;
}

namespace {

// The backward of mlp_gelu's fused route: y = act @ w_proj + b_proj with act = gelu(pre) and
// pre = x @ w_fc + b_fc. Inputs in mlp_gelu's order (x, w_fc, b_fc, w_proj, b_proj).
struct MlpGeluBackward {
  SavedTensor x, w_fc, w_proj;
  Tensor pre, act;  // [rows, hidden], private to this node
  Shape x_shape;

  Grads operator()(const BackwardArgs& a) const {
    const char* op = "MlpGeluBackward";
    const Tensor g = util::fold_rows(ops::to(a.grad(), act.device(), act.dtype()));
    const int64_t in = x_shape.back(), hidden = pre.defined() ? pre.size(1) : act.size(1),
                  out = g.size(1);
    const DType t = g.dtype();
    Grads grads(5);
    // c_proj: dW_proj and db_proj from one GEMM (into the parameters' offered destinations,
    // a DDP bucket's slots, where their layout is the GEMM's; so below).
    std::tie(grads[3], grads[4]) = util::weight_and_bias_grads(
        act, g, a.needs(3), a.needs(4), util::overwrite_target(a, 3, {hidden, out}, t),
        util::overwrite_target(a, 4, {out}, t));
    if (a.needs(0) || a.needs(1) || a.needs(2)) {
      // Through c_proj and the GELU into pre in one GEMM, db_fc from the same GEMM.
      const TensorOptions like{.dtype = pre.dtype(), .device = pre.device()};
      const Tensor dpre = empty(pre.shape(), like);
      if (a.needs(2)) {
        grads[2] = util::overwrite_target(a, 2, {hidden}, t);
        if (!grads[2].defined()) grads[2] = empty({hidden}, like);
      }
      fused_kernel_table(pre.device().type)
          .linear_input_grad_dgelu(g, w_proj.unpack(op), pre, dpre, grads[2]);
      if (a.needs(1))
        grads[1] = util::weight_and_bias_grads(util::fold_rows(x.unpack(op)), dpre, true, false,
                                               util::overwrite_target(a, 1, {in, hidden}, t))
                       .first;
      if (a.needs(0))
        grads[0] = ops::reshape(ops::matmul(dpre, util::mT(w_fc.unpack(op))), x_shape);
    }
    for (size_t i = 1; i < grads.size(); ++i) grads[i] = util::add_into_destination(a, i, grads[i]);
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
  const Tensor x2d = util::fold_rows(x);
  if (!linear_gelu_takes(x2d, w_fc, b_fc, w_proj, b_proj))
    return linear(gelu(linear(x, w_fc, b_fc)), w_proj, b_proj);
  const FusedKernelTable& fused = fused_kernel_table(x2d.device().type);

  const TensorOptions like{.dtype = x2d.dtype(), .device = x2d.device()};
  const Tensor pre = empty({x2d.size(0), hidden}, like), act = empty({x2d.size(0), hidden}, like);
  fused.linear_gelu_forward(x2d, w_fc, b_fc, act, pre);
  Shape out_shape = x.shape();
  out_shape.back() = out;
  Tensor y = ops::reshape(util::linear_rows(act, w_proj, b_proj), out_shape);
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

}  // namespace tessera
