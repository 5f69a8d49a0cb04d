// The tape-free operations of Tessera (namespace tessera::ops).
//
// Each function validates its operands once (shapes, dtypes, devices: errors
// name the op and all of them), computes the output shape/dtype, allocates the
// output and calls the kernel of the inputs' device through the dispatch table
// (core/dispatch.h). autograd/ builds the differentiable ops on these; nothing
// here records gradients.
#pragma once
#include <optional>
#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/core/tensor.h"

namespace tessera::ops {

// ---- element-wise (broadcasting, type promotion; comparisons return bool) ----
Tensor unary(UnaryOp op, const Tensor& x);
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
Tensor binary(BinaryOp op, const Tensor& a, double b);  // scalar keeps a's dtype
// a = op(a, b) in place; b broadcast to a's shape, result converted to a's dtype.
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

// ---- reductions (float accumulation: f32 at least, f64 for f64) ----
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

// ---- normalisation and activations ----
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
};
LayerNormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                   const Tensor& mean, const Tensor& rstd, bool need_weight_grads);
Tensor gelu(const Tensor& x);                                 // tanh approximation
Tensor gelu_backward(const Tensor& x, const Tensor& dy);

// ---- linear algebra ----
// PyTorch matmul semantics: 1-D operands, batched with broadcast batch dims; transposed
// operands are used without copies where the kernel allows.
Tensor matmul(const Tensor& a, const Tensor& b);

// ---- indexing ----
Tensor embedding(const Tensor& weight, const Tensor& indices);  // out: indices.shape + [C]
// Gradient of embedding: zeros [num_rows, C] with dy rows added at their indices.
Tensor embedding_backward(const Tensor& dy, const Tensor& indices, int64_t num_rows);
// out.index_add_(dim, index, src) in place.
void index_add_(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);

// ---- joining and splitting (views where possible) ----
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim);
std::vector<Tensor> split_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);

// ---- losses ----
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
