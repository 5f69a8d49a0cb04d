// CPU matrix multiply: Eigen's GEMM run directly on the strided operands.
//
// Each operand matrix is handed to Eigen as a Map over the tensor's memory: row-major when
// its last dim is unit-stride, column-major when its second-to-last is (a transposed view,
// e.g. k^T in attention or x^T in a weight gradient), so neither case copies. Only operands
// with no unit-stride matrix dim (or overlapping rows) are packed first.
//
// Threads: one large product uses Eigen's own OpenMP-parallel GEMM. Many small products
// (attention's per-head matmuls) run one per thread instead; Eigen sees it is inside a
// parallel region and stays single-threaded, so regions never nest.
// Eigen's AVX-512 kernels trip GCC 12's -Wmaybe-uninitialized inside its own intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>

#include "core/dispatch.h"
#include "kernels/cpu/lanes.h"

namespace tessera::cpu {
namespace {

template <class T>
using RowMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0,
                          Eigen::OuterStride<>>;
template <class T>
using ColMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>, 0,
                          Eigen::OuterStride<>>;
template <class T>
using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

enum class MatrixLayout { RowMajor, ColMajor };

// How a [rows, cols] matrix with strides (row_stride, col_stride) can be mapped, if at all.
bool mappable(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
              MatrixLayout& layout, int64_t& outer) {
  if ((col_stride == 1 || cols == 1) && (rows == 1 || row_stride >= cols)) {
    layout = MatrixLayout::RowMajor;
    outer = rows == 1 ? cols : row_stride;
    return true;
  }
  if ((row_stride == 1 || rows == 1) && (cols == 1 || col_stride >= rows)) {
    layout = MatrixLayout::ColMajor;
    outer = cols == 1 ? rows : col_stride;
    return true;
  }
  return false;
}

struct Operand {
  Tensor t;  // the tensor to read (the input, or a packed copy of it)
  MatrixLayout layout;
  int64_t outer;
};

// Chooses a mapping for the matrices of t (shape [..., rows, cols]), packing t when needed.
Operand prepare(const Tensor& t) {
  const int64_t nd = t.dim();
  Operand op{t, MatrixLayout::RowMajor, 0};
  if (mappable(t.shape()[nd - 2], t.shape()[nd - 1], t.strides()[nd - 2], t.strides()[nd - 1],
               op.layout, op.outer)) {
    return op;
  }
  op.t = empty(t.shape(), {.dtype = t.dtype(), .device = t.device()});
  kernel_table(DeviceType::CPU).copy(op.t, t);
  mappable(t.shape()[nd - 2], t.shape()[nd - 1], op.t.strides()[nd - 2], op.t.strides()[nd - 1],
           op.layout, op.outer);
  return op;
}

template <class T, class LhsMap, class RhsMap>
void gemm_one(const T* a, int64_t a_outer, const T* b, int64_t b_outer, T* c, int64_t M, int64_t K,
              int64_t N) {
  LhsMap A(a, M, K, Eigen::OuterStride<>(a_outer));
  RhsMap B(b, K, N, Eigen::OuterStride<>(b_outer));
  OutMap<T> C(c, M, N);
  C.noalias() = A * B;
}

template <class T>
void matmul_typed(const Operand& a, const Operand& b, const Tensor& out) {
  const int64_t nd = out.dim();
  const int64_t M = out.shape()[nd - 2], N = out.shape()[nd - 1], K = a.t.shape()[nd - 1];
  const Shape batch_shape(out.shape().begin(), out.shape().end() - 2);
  const int64_t batch = shape_numel(batch_shape);
  const T* ap = static_cast<const T*>(a.t.raw_data());
  const T* bp = static_cast<const T*>(b.t.raw_data());
  T* cp = static_cast<T*>(out.raw_data());
  if (K == 0) {
    std::fill(cp, cp + out.numel(), T(0));
    return;
  }
  auto offset = [&](const Tensor& t, int64_t i) {
    int64_t off = 0;
    for (int64_t d = nd - 3; d >= 0; --d) {
      off += (i % batch_shape[d]) * t.strides()[d];
      i /= batch_shape[d];
    }
    return off;
  };
  auto run = [&](int64_t i) {
    const T* ai = ap + offset(a.t, i);
    const T* bi = bp + offset(b.t, i);
    T* ci = cp + i * M * N;
    const bool a_row = a.layout == MatrixLayout::RowMajor, b_row = b.layout == MatrixLayout::RowMajor;
    if (a_row && b_row) gemm_one<T, RowMap<T>, RowMap<T>>(ai, a.outer, bi, b.outer, ci, M, K, N);
    else if (a_row) gemm_one<T, RowMap<T>, ColMap<T>>(ai, a.outer, bi, b.outer, ci, M, K, N);
    else if (b_row) gemm_one<T, ColMap<T>, RowMap<T>>(ai, a.outer, bi, b.outer, ci, M, K, N);
    else gemm_one<T, ColMap<T>, ColMap<T>>(ai, a.outer, bi, b.outer, ci, M, K, N);
  };
  // Below about 128^3 multiply-adds one product is too small for Eigen to split well, so
  // batches are spread over threads instead.
  constexpr int64_t kSmallProduct = 128 * 128 * 128;
  if (batch > 1 && M * N * K <= kSmallProduct) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; ++i) run(i);
  } else {
    for (int64_t i = 0; i < batch; ++i) run(i);
  }
}

void matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  const DType dt = out.dtype();
  if (dt == DType::f16 || dt == DType::bf16) {  // via f32: read, multiply, round once
    Tensor a32 = empty(a.shape(), {.dtype = DType::f32, .device = a.device()});
    Tensor b32 = empty(b.shape(), {.dtype = DType::f32, .device = b.device()});
    Tensor c32 = empty(out.shape(), {.dtype = DType::f32, .device = out.device()});
    kernel_table(DeviceType::CPU).copy(a32, a);
    kernel_table(DeviceType::CPU).copy(b32, b);
    matmul_typed<float>(prepare(a32), prepare(b32), c32);
    kernel_table(DeviceType::CPU).copy(out, c32);
    return;
  }
  const Operand pa = prepare(a), pb = prepare(b);
  switch (dt) {
    case DType::f32: return matmul_typed<float>(pa, pb, out);
    case DType::f64: return matmul_typed<double>(pa, pb, out);
    case DType::i32: return matmul_typed<int32_t>(pa, pb, out);
    case DType::i64: return matmul_typed<int64_t>(pa, pb, out);
    default: TESSERA_FAIL("matmul: dtype ", dtype_name(dt), " is not supported on cpu");
  }
}

const bool registered = [] {
  kernel_table(DeviceType::CPU).matmul = matmul;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
