// The one dispatch table: for each device type, a set of kernel entry points.
// kernels/cpu and kernels/cuda fill their row at start-up (static registration
// in the shared library); the front-end in kernels/ops.cpp validates shapes,
// dtypes and devices once, allocates outputs and calls the row of the input's
// device. Adding a device adds a row, not branches in callers.
//
// Conventions for every entry: outputs are preallocated by the caller with the
// final shape and dtype (contiguous unless stated); inputs may be arbitrary
// strided views (broadcast inputs arrive expanded, stride 0); all tensors are
// on the same device. Entries never allocate outputs the caller will see.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera {

enum class UnaryOp : uint8_t {
  Neg, Exp, Log, Sqrt, Rsqrt, Abs, Tanh, Sigmoid, Relu, Gelu, Sin, Cos, Square, Reciprocal,
  Sign, Floor, Ceil, Round, LogicalNot, Log1p, Expm1, Erf,
};
enum class BinaryOp : uint8_t {
  Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge, LogicalAnd, LogicalOr,
  GeluBackward,  // a = x, b = dy: dy * gelu'(x)
};
enum class ReduceOp : uint8_t { Sum, Mean, Max, Min, Prod };

const char* unary_op_name(UnaryOp op);
const char* binary_op_name(BinaryOp op);
const char* reduce_op_name(ReduceOp op);

struct KernelTable {
  // out = value
  void (*fill)(const Tensor& out, double value) = nullptr;
  // dst = src (same shape; src may be broadcast; dtypes may differ -> conversion; dst may be
  // strided).
  void (*copy)(const Tensor& dst, const Tensor& src) = nullptr;
  // out (contiguous) filled from the Philox stream; a, b = low/high or mean/std.
  void (*random)(const Tensor& out, RandomKind kind, uint64_t seed, uint64_t offset, double a,
                 double b) = nullptr;

  // out = op(x); x already expanded to out's shape.
  void (*unary)(UnaryOp op, const Tensor& x, const Tensor& out) = nullptr;
  // out = op(a, b); a and b expanded to out's shape, any dtypes (computed in the promoted type).
  void (*binary)(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) = nullptr;
  // out = cond ? a : b, all expanded to out's shape.
  void (*where)(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) = nullptr;
  // out = a + alpha * b in one pass (a, b expanded to out's shape, any float dtypes, computed
  // in out's dtype via f32 for f16/bf16). Optional: when null, ops::add_scaled composes it
  // from two `binary` calls.
  void (*add_scaled)(const Tensor& a, const Tensor& b, double alpha, const Tensor& out) = nullptr;
  // Reduce x over `dims` (sorted, unique); out has x's shape with those dims set to 1.
  void (*reduce)(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims,
                 const Tensor& out) = nullptr;
  // Index of the max (or min) along dim; out (i64) has x's shape with dim set to 1.
  void (*arg_reduce)(bool is_max, const Tensor& x, int64_t dim, const Tensor& out) = nullptr;

  void (*softmax)(const Tensor& x, int64_t dim, bool log, const Tensor& out) = nullptr;
  // dx from y = softmax(x) (or log_softmax) and dy.
  void (*softmax_backward)(const Tensor& y, const Tensor& dy, int64_t dim, bool log,
                           const Tensor& dx) = nullptr;

  // Over the last dim: out = (x - mean) * rstd * w + b; mean, rstd (f32; f64 for f64 x) have
  // x's shape minus the last dim. w or b may be undefined.
  void (*layer_norm)(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                     const Tensor& out, const Tensor& mean, const Tensor& rstd) = nullptr;
  // dx; dw and db accumulate (+=) when defined.
  void (*layer_norm_backward)(const Tensor& dy, const Tensor& x, const Tensor& w,
                              const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                              const Tensor& dw, const Tensor& db) = nullptr;

  // out[..., M, N] = a[..., M, K] @ b[..., K, N]; batch dims already broadcast.
  void (*matmul)(const Tensor& a, const Tensor& b, const Tensor& out) = nullptr;

  // Inclusive running sum of x along dim (from the last element backwards when reverse), in
  // out (x's shape and dtype; f32 accumulation for f16/bf16, f64 for f32/f64, int64 for
  // integers).
  void (*cumsum)(const Tensor& x, int64_t dim, bool reverse, const Tensor& out) = nullptr;
  // The k largest (or smallest) entries of x along dim, in order (largest first, or smallest
  // first), with their positions: values (x's dtype) and indices (i64) have x's shape with
  // dim set to k. Ties keep the lower index first; NaN counts as the largest.
  void (*topk)(const Tensor& x, int64_t k, int64_t dim, bool largest, const Tensor& values,
               const Tensor& indices) = nullptr;

  // RMSNorm over the last dim: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) per row
  // (f32; f64 for f64 x), of x's shape minus the last dim; w may be undefined.
  void (*rms_norm)(const Tensor& x, const Tensor& w, double eps, const Tensor& out,
                   const Tensor& rstd) = nullptr;
  // dx; dw accumulates (+=) when defined.
  void (*rms_norm_backward)(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const Tensor& dx, const Tensor& dw) = nullptr;
  // Rotary position embedding, Hugging Face's rotate_half convention: x [B, T, H, D] (any
  // strides), cos and sin [T, D/2] contiguous (f32; f64 for f64 x); with h = D/2 and i < h,
  //   out[.., i]     = x[.., i] cos[t, i] - x[.., i + h] sin[t, i]
  //   out[.., i + h] = x[.., i + h] cos[t, i] + x[.., i] sin[t, i]
  // out [B, T, H, D], any strides that do not overlap (and not x's memory). inverse rotates
  // by -angle (the backward).
  void (*rope)(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse,
               const Tensor& out) = nullptr;

  // out[i, :] = weight[idx[i], :] (idx flattened, i32 or i64); error on out-of-range ids.
  void (*embedding)(const Tensor& weight, const Tensor& idx, const Tensor& out) = nullptr;
  // out.index_add_(dim, idx, src): out[..., idx[i], ...] += src[..., i, ...].
  void (*index_add)(const Tensor& out, int64_t dim, const Tensor& idx, const Tensor& src) = nullptr;
  // The embedding's weight gradient: out[r, :] = (out[r, :] +) the sum over positions p with
  // idx[p] == r of dy[p, :], summed in position order in f32 (f64 when out or dy is f64) and
  // rounded once into out. dy [n, C] (any strides, f32/f16/bf16/f64), idx [n] (i32/i64, any
  // strides), out [rows, C] contiguous (its dtype may differ from dy's). Without accumulate
  // rows that no index names become 0. Deterministic: the same inputs give the same bits.
  // An index outside [0, rows) is an error naming its value and position. scale != 1: each dy
  // element is multiplied by scale in the compute type and rounded to out's dtype before it
  // is summed (ops::embedding_backward_into).
  void (*embedding_backward)(const Tensor& dy, const Tensor& idx, bool accumulate, double scale,
                             const Tensor& out) = nullptr;

  // Cross-entropy summed over the rows of logits [N, V] (any float dtype, computed in f32, f64
  // for f64) with targets [N] (i32/i64); rows whose target is ignore_index are skipped.
  // loss: 0-d f32 (f64 for f64 logits) = sum over counted rows of (logsumexp(row) - row[target]); count: 0-d i64 =
  // number of counted rows. The front-end divides by count for the mean. A target outside
  // [0, V) other than ignore_index is an error naming it and V.
  void (*cross_entropy)(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                        const Tensor& loss, const Tensor& count) = nullptr;
  // dlogits = scale * (softmax(logits) - onehot(target)) for counted rows, 0 for ignored;
  // dlogits [N, V] contiguous, same dtype as logits.
  void (*cross_entropy_backward)(const Tensor& logits, const Tensor& targets,
                                 int64_t ignore_index, double scale,
                                 const Tensor& dlogits) = nullptr;
};

// The row for a device type; entries left null report "op X is not implemented for <device>".
KernelTable& kernel_table(DeviceType type);

// Helper used by the front-end: the entry or a clear error.
template <class Fn>
Fn checked_kernel(Fn fn, const char* op, Device device) {
  TESSERA_CHECK(fn != nullptr, op, ": not implemented for device ", device.str());
  return fn;
}

}  // namespace tessera
