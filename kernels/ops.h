// The tape-free operations of Tessera (namespace tessera::ops).
//
// Each function validates its operands once (shapes, dtypes, devices: errors
// name the op and all of them), computes the output shape/dtype, allocates the
// output and calls the kernel of the inputs' device through the dispatch table
// (core/dispatch.h). autograd/ builds the differentiable ops on these; nothing
// here records gradients.
//
// Two vocabularies, one per kind of call: `ops::` is every tape-free operation (the compute
// below and core's views, copies and conversions, re-exported here from `raw::` so that the
// layers above kernels/ name them one way), and the functions of autograd/functions.h
// (namespace tessera) are the recorded ones. `raw::` itself is for core/ and kernels/.
#pragma once
#include <optional>
#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera::ops {

// ---- views, copies and conversions (core/tensor.cpp's raw::, the same functions) ----
using raw::alias;
using raw::as_strided;
using raw::broadcast_shapes;
using raw::clone;
using raw::contiguous;
using raw::copy_;
using raw::expand;
using raw::fill_;
using raw::flatten;
using raw::make;
using raw::narrow;
using raw::permute;
using raw::reshape;
using raw::select;
using raw::slice;
using raw::squeeze;
using raw::to;
using raw::transpose;
using raw::unsqueeze;
using raw::view;

// ---- element-wise (kernels/ops_elementwise.cpp; broadcasting, promotion; comparisons: bool) ----
Tensor unary(UnaryOp op, const Tensor& x);
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
Tensor binary(BinaryOp op, const Tensor& a, double b);  // scalar keeps a's dtype
// True when two elements of t share one memory location (an expanded view, a stride-0 dim,
// an overlapping as_strided view): an in-place write there would depend on the write order.
bool has_internal_overlap(const Tensor& t);
// Raises PyTorch's "unsupported operation" error, naming `op` and t, when t overlaps itself.
void check_no_internal_overlap(const char* op, const Tensor& t);
// a = op(a, b) in place (a must not overlap itself); b broadcast to a's shape, result converted to
// a's dtype.
void binary_(BinaryOp op, const Tensor& a, const Tensor& b);
void binary_(BinaryOp op, const Tensor& a, double b);

inline Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Add, a, b); }
inline Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Sub, a, b); }
inline Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Mul, a, b); }
inline Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Div, a, b); }
inline Tensor add(const Tensor& a, double b) { return binary(BinaryOp::Add, a, b); }
inline Tensor mul(const Tensor& a, double b) { return binary(BinaryOp::Mul, a, b); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// a + alpha * b, fused
Tensor add_scaled(const Tensor& a, const Tensor& b, double alpha);

// ---- reductions (kernels/ops_reduce.cpp; float accumulation: f32 at least, f64 for f64) ----
// Empty `dims` reduces over all dimensions.
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor prod(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);
// Sums a broadcast gradient back down to `shape` (the inverse of broadcasting).
Tensor sum_to(const Tensor& x, const Shape& shape);

// ---- softmax (kernels/ops_reduce.cpp), layer norm (ops_norm.cpp), GELU (ops_activation.cpp) ----
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
Tensor softmax_backward(const Tensor& y, const Tensor& dy, int64_t dim, bool log);
struct LayerNormOutput {
  Tensor out, mean, rstd;
};
// Normalises over the last dimension; weight/bias may be undefined.
LayerNormOutput layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
struct LayerNormGrads {
  Tensor dx, dweight, dbias;
  Tensor dx_bias;  // layer_norm_backward_residual with need_x_bias_grad: the column sums of dx
};
LayerNormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                   const Tensor& mean, const Tensor& rstd, bool need_weight_grads);
// The residual add of a pre-norm block and the LayerNorm after it (GPT-2's ln_1, ln_2, ln_f
// fed by the residual stream): sum = x + residual (rounded to the dtype), out = layer_norm(sum,
// weight, bias) with its mean and rstd. One fused kernel where the device has it
// (FusedKernelTable::residual_layer_norm), the adds and the norm otherwise. x and residual:
// one shape, dtype and device. x_bias (optional, [C] of x's dtype): the bias of the
// projection that produced x, added here instead of in its GEMM: sum = (x + x_bias) +
// residual, each add rounded, so its gradient (the column sums of the sum's) comes out of the
// norm's backward pass instead of a pass of its own.
struct ResidualLayerNormOutput {
  Tensor sum, out, mean, rstd;
};
ResidualLayerNormOutput residual_layer_norm(const Tensor& x, const Tensor& residual,
                                            const Tensor& weight, const Tensor& bias, double eps,
                                            const Tensor& x_bias = Tensor());
// layer_norm_backward of (dy, x = the normalised sum) with dresidual, the gradient reaching the
// sum along the residual stream, added into dx: dx = layer_norm_backward(dy).dx + dresidual
// (an undefined dresidual adds nothing: the stream ends there); with need_x_bias_grad also
// dx_bias = dx summed over all rows.
LayerNormGrads layer_norm_backward_residual(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                            const Tensor& mean, const Tensor& rstd,
                                            const Tensor& dresidual, bool need_weight_grads,
                                            bool need_x_bias_grad = false);
Tensor gelu(const Tensor& x);  // tanh approximation
Tensor gelu_backward(const Tensor& x, const Tensor& dy);

// ---- linear algebra (kernels/ops_linalg.cpp) ----
// PyTorch matmul semantics: 1-D operands, batched with broadcast batch dims; transposed
// operands are used without copies where the kernel allows.
Tensor matmul(const Tensor& a, const Tensor& b);
// out = a @ b for matrices a [M, K], b [K, N] (any strides) into a contiguous out [M, N] of
// their dtype and device (a weight gradient written into the memory it will live in); the
// same kernel and the same values as matmul(a, b).
void matmul_out(const Tensor& a, const Tensor& b, const Tensor& out);

// ---- indexing (kernels/ops_index.cpp) ----
Tensor embedding(const Tensor& weight, const Tensor& indices);  // out: indices.shape + [C]
// Gradient of embedding: out [num_rows, C] (f32/f16/bf16/f64, any dtype of dy's C) gets, for
// each row r, the sum of the dy rows at the positions whose index is r, summed in position
// order in f32 (f64 for f64) and rounded once: out[r] = out[r] + sum with accumulate, sum
// without (rows no index names become 0). dy: indices.shape + [C], any strides. Deterministic
// on every device (the same inputs give the same bits). scale != 1 multiplies each dy element
// by scale and rounds it to out's dtype before it is summed: the bits of scaling dy in out's
// dtype first (DDP's average of gathered rows), without that pass over dy.
void embedding_backward_into(const Tensor& out, const Tensor& dy, const Tensor& indices,
                             bool accumulate, double scale = 1.0);
// embedding_backward_into a new [num_rows, C] tensor of dy's dtype.
Tensor embedding_backward(const Tensor& dy, const Tensor& indices, int64_t num_rows);
// out.index_add_(dim, index, src) in place.
void index_add_(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);

// ---- running sums, selection, gather/scatter, sampling (kernels/ops_select.cpp) ----
// Inclusive running sum along dim (from the end when reverse); integers sum in int64.
Tensor cumsum(const Tensor& x, int64_t dim, bool reverse = false);
struct TopK {
  Tensor values, indices;  // indices i64
};
// The k largest (smallest) entries along dim, largest (smallest) first; ties keep the lower
// index first.
TopK topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true);
// out[i][j] = x[i][index[i][j]] for dim 1 (and likewise for any dim and rank); index has x's
// rank and sizes at most x's outside dim; values out of range are an error naming them.
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// A copy of x with src[i][j] added at x[i][index[i][j]] (dim 1); repeated positions sum.
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// A copy of x with src[i][j] written at x[i][index[i][j]]; an index naming one position twice
// is refused.
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// num_samples categories (i64, with replacement) per row of probs [V] or [B, V] (non-negative,
// not necessarily normalised), drawn on probs' device.
Tensor multinomial(const Tensor& probs, int64_t num_samples, Generator* gen = nullptr);
// One token per row of logits [B, V] -> [B] i64, on logits' device: argmax for temperature 0,
// else softmax(logits / temperature) restricted to the top_k largest (0 = all) and sampled.
Tensor sample_logits(const Tensor& logits, double temperature, int64_t top_k,
                     Generator* gen = nullptr);

// ---- RMSNorm (kernels/ops_norm.cpp) and rotary embeddings (ops_rope.cpp) ----
struct RmsNormOutput {
  Tensor out, rstd;  // rstd: f32 (f64 for f64 x), x's shape without the last dim
};
// x * rsqrt(mean(x^2, -1) + eps) * weight over the last dim; weight [C] may be undefined.
RmsNormOutput rms_norm(const Tensor& x, const Tensor& weight, double eps);
struct RmsNormGrads {
  Tensor dx, dweight;
};
RmsNormGrads rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd, bool need_weight_grad);
// The residual add of a pre-norm block and the RMSNorm after it: sum = x + residual (rounded
// to the dtype), out = rms_norm(sum, weight). One fused kernel where the device has it
// (FusedKernelTable::residual_rms_norm), the add and the norm otherwise.
struct ResidualRmsNormOutput {
  Tensor sum, out, rstd;
};
ResidualRmsNormOutput residual_rms_norm(const Tensor& x, const Tensor& residual,
                                        const Tensor& weight, double eps);
// rms_norm_backward of (dy, x = the normalised sum) with dresidual, the gradient reaching the
// sum along the residual stream, added into dx: dx = rms_norm_backward(dy).dx + dresidual.
RmsNormGrads rms_norm_backward_residual(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                        const Tensor& rstd, const Tensor& dresidual,
                                        bool need_weight_grad);
struct RopeTables {
  Tensor cos, sin;  // [count, head_dim / 2], f32 (f64 when asked for f64)
};
// cos/sin of position p * theta^(-2i/head_dim) for positions [start, start + count).
RopeTables rope_tables(int64_t start, int64_t count, int64_t head_dim, double theta,
                       DType dtype = DType::f32, Device device = Device::cpu());
// Rotary embedding of x [B, T, H, D] with tables for its T positions (Hugging Face's
// rotate_half pairing of element i with i + D/2); inverse rotates back (the backward).
Tensor rope(const Tensor& x, const RopeTables& tables, bool inverse = false);
// The same written into out (x's shape and dtype, any strides that do not overlap, memory
// apart from x's): e.g. straight into the q|k part of a fused projection's gradient.
void rope_into(const Tensor& x, const RopeTables& tables, bool inverse, const Tensor& out);

// ---- joining and splitting (kernels/ops_index.cpp; views where possible) ----
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim);
std::vector<Tensor> split_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);

// ---- losses (kernels/ops_loss.cpp) ----
enum class Reduction { Mean, Sum, None };
// logits [..., V], targets [...] (i32/i64). Mean is over non-ignored targets.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::Mean);
// dlogits for cross_entropy (Mean/Sum reductions) times the upstream scalar gradient.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, double grad,
                              int64_t ignore_index = -100, Reduction reduction = Reduction::Mean);

// ---- comparison helpers for tests and clipping ----
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);
// Max |a-b| / max(|b|) over elements, in float64; for test tolerances.
double max_rel_error(const Tensor& a, const Tensor& b);

}  // namespace tessera::ops
