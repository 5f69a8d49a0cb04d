// CPU matrix multiply: Eigen's GEMM run directly on the strided operands.
//
// Each operand matrix is handed to Eigen as a Map over the tensor's memory: row-major when
// its last dim is unit-stride, column-major when its second-to-last is (a transposed view,
// e.g. k^T in attention or x^T in a weight gradient), so neither case copies. Only operands
// with no unit-stride matrix dim (or overlapping rows) are packed first.
//
// Threads: a large product is cut into per-thread blocks of the output (gemm_threaded);
// many small products (attention's per-head matmuls) run one per thread. Eigen is always
// called from inside our parallel region (or with one thread), so it stays single-threaded
// and regions never nest.
// Eigen's AVX-512 kernels trip GCC 12's -Wmaybe-uninitialized inside its own intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>
#include <omp.h>

#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/lanes.h"

namespace tessera::cpu {
namespace {

template <class T>
using RowMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0,
                          Eigen::OuterStride<>>;
template <class T>
using ColMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>, 0,
                          Eigen::OuterStride<>>;

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

// One operand matrix in memory: element (r, c) is at p + r * outer + c (row-major) or
// p + r + c * outer (column-major).
template <class T>
struct MatrixRef {
  const T* p;
  MatrixLayout layout;
  int64_t outer;
  MatrixRef at(int64_t r, int64_t c) const {
    return {layout == MatrixLayout::RowMajor ? p + r * outer + c : p + r + c * outer, layout, outer};
  }
};

template <class T>
using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0,
                          Eigen::OuterStride<>>;

// c[M, N] (row stride ldc) = A[M, K] @ B[K, N], one Eigen product.
template <class T>
void gemm(const MatrixRef<T>& A, const MatrixRef<T>& B, T* c, int64_t ldc, int64_t M, int64_t K,
          int64_t N) {
  OutMap<T> C(c, M, N, Eigen::OuterStride<>(ldc));
  auto with_rhs = [&](const auto& lhs) {
    if (B.layout == MatrixLayout::RowMajor) {
      C.noalias() = lhs * RowMap<T>(B.p, K, N, Eigen::OuterStride<>(B.outer));
    } else {
      C.noalias() = lhs * ColMap<T>(B.p, K, N, Eigen::OuterStride<>(B.outer));
    }
  };
  if (A.layout == MatrixLayout::RowMajor) with_rhs(RowMap<T>(A.p, M, K, Eigen::OuterStride<>(A.outer)));
  else with_rhs(ColMap<T>(A.p, M, K, Eigen::OuterStride<>(A.outer)));
}

// One product over all threads. Rather than Eigen's own threading (whose threads meet at
// every packed block, costly when cores are shared), the output is cut into one block of
// rows (or columns) per thread, each an independent single-threaded Eigen product; when both
// M and N are small the K dimension is split and the partial products summed.
template <class T>
void gemm_threaded(const MatrixRef<T>& A, const MatrixRef<T>& B, T* c, int64_t M, int64_t K,
                   int64_t N) {
  constexpr int64_t kMinThreadedWork = 64 * 64 * 64;
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads == 1 || M * N * K < kMinThreadedWork) {
    gemm(A, B, c, N, M, K, N);
    return;
  }
  constexpr int64_t kMinBlock = 16;
  if (M >= N && M >= kMinBlock * threads) {
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t m0 = M * t / nt, m1 = M * (t + 1) / nt;
      gemm(A.at(m0, 0), B, c + m0 * N, N, m1 - m0, K, N);
    }
  } else if (N >= kMinBlock * threads) {
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
      gemm(A, B.at(0, n0), c + n0, N, M, K, n1 - n0);
    }
  } else {
    std::vector<T> partial(static_cast<size_t>(threads - 1) * M * N, T(0));
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      if (t == 0) used = nt;
      const int64_t k0 = K * t / nt, k1 = K * (t + 1) / nt;
      T* target = t == 0 ? c : partial.data() + (t - 1) * M * N;
      gemm(A.at(0, k0), B.at(k0, 0), target, N, M, k1 - k0, N);
    }
    for (int t = 1; t < used; ++t) {
      const T* part = partial.data() + (t - 1) * M * N;
      for (int64_t i = 0; i < M * N; ++i) c[i] += part[i];
    }
  }
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
  auto lhs = [&](int64_t i) { return MatrixRef<T>{ap + offset(a.t, i), a.layout, a.outer}; };
  auto rhs = [&](int64_t i) { return MatrixRef<T>{bp + offset(b.t, i), b.layout, b.outer}; };
  // Many small products (attention heads) go one per thread; large ones are threaded inside.
  constexpr int64_t kSmallProduct = 128 * 128 * 128;
  if (batch > 1 && M * N * K <= kSmallProduct) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; ++i) gemm(lhs(i), rhs(i), cp + i * M * N, N, M, K, N);
  } else {
    for (int64_t i = 0; i < batch; ++i) gemm_threaded(lhs(i), rhs(i), cp + i * M * N, M, K, N);
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
