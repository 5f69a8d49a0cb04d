// Batched matrix multiply through cuBLAS (cublasGemmStridedBatchedEx): f32, f16, bf16 with
// f32 accumulation, f64 in f64. Row-major tensors are handed to column-major cuBLAS as
// their transposes (C^T = B^T A^T), so a transposed view is just the other op flag and no
// copy is made unless an operand's batch dims cannot be described by one stride.
#include <mutex>

#include "core/dispatch.h"
#include "kernels/cuda/common.cuh"

namespace tessera::cuda {

// One cuBLAS handle per (thread, device): handles are cheap to keep and not meant to be
// shared between threads that set different streams.
cublasHandle_t cublas_handle() {
  thread_local cublasHandle_t handles[64] = {};
  const int d = current_device();
  if (!handles[d]) TESSERA_CUBLAS_CHECK(cublasCreate(&handles[d]));
  return handles[d];
}

namespace {

// One operand as cuBLAS sees it: a column-major matrix of the transposed logical matrix.
struct GemmOperand {
  Tensor t;                   // possibly a contiguous copy of the input
  cublasOperation_t op = CUBLAS_OP_N;
  int64_t ld = 1;
  int64_t batch_stride = 0;
};

// Single stride over the batch dims (all broadcast -> 0), or -1 when none describes them.
int64_t batch_stride_of(const Tensor& t, int64_t batch_dims) {
  int64_t stride = -1, expected_next = -1;
  for (int64_t d = batch_dims - 1; d >= 0; --d) {
    const int64_t n = t.size(d), s = t.stride(d);
    if (n == 1) continue;
    if (stride < 0) {
      stride = s;
      expected_next = s * n;
    } else if (s == expected_next || (s == 0 && stride == 0)) {
      expected_next = s * n;
    } else {
      return -1;
    }
  }
  return stride < 0 ? 0 : stride;
}

// The logical matrix is [rows, cols] (last two dims); cuBLAS gets its transpose [cols, rows].
GemmOperand describe(const Tensor& in, int64_t batch_dims) {
  GemmOperand g;
  g.t = in;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int64_t rows = g.t.size(-2), cols = g.t.size(-1);
    const int64_t sr = g.t.stride(-2), sc = g.t.stride(-1);
    const int64_t bs = batch_stride_of(g.t, batch_dims);
    if (bs >= 0) {
      if (sc == 1 || cols == 1) {  // row-major: as column-major it is already the transpose
        g.op = CUBLAS_OP_N;
        g.ld = std::max<int64_t>({sr, cols, 1});
        if (rows == 1) g.ld = std::max<int64_t>(cols, 1);
        g.batch_stride = bs;
        return g;
      }
      if (sr == 1 || rows == 1) {  // column-major (a transposed view): transpose it back
        g.op = CUBLAS_OP_T;
        g.ld = std::max<int64_t>({sc, rows, 1});
        if (cols == 1) g.ld = std::max<int64_t>(rows, 1);
        g.batch_stride = bs;
        return g;
      }
    }
    g.t = raw::contiguous(g.t);
  }
  TESSERA_FAIL("matmul (cuda): could not describe operand ", shape_str(in.shape()));
}

struct GemmTypes {
  cudaDataType_t data;
  cublasComputeType_t compute;
};

GemmTypes gemm_types(DType t) {
  switch (t) {
    case DType::f32: return {CUDA_R_32F, CUBLAS_COMPUTE_32F};  // true fp32, no TF32 rounding
    case DType::f16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
    case DType::bf16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    case DType::f64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F};
    default:
      TESSERA_FAIL("matmul (cuda): dtype ", dtype_name(t),
                   " is not supported (float32, float16, bfloat16, float64)");
  }
}

void matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  TESSERA_CHECK(a.dim() >= 2 && b.dim() == a.dim() && out.dim() == a.dim(),
                "matmul (cuda): operands must have equal rank >= 2, got ", shape_str(a.shape()),
                " @ ", shape_str(b.shape()), " -> ", shape_str(out.shape()));
  TESSERA_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), "matmul (cuda): dtypes ",
                dtype_name(a.dtype()), ", ", dtype_name(b.dtype()), " -> ",
                dtype_name(out.dtype()), " must be equal");
  TESSERA_CHECK(out.is_contiguous(), "matmul (cuda): output must be contiguous");
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  TESSERA_CHECK(b.size(-2) == K && out.size(-2) == M && out.size(-1) == N,
                "matmul (cuda): shapes ", shape_str(a.shape()), " @ ", shape_str(b.shape()),
                " -> ", shape_str(out.shape()), " do not agree");
  if (out.numel() == 0) return;
  const GemmTypes types = gemm_types(out.dtype());
  KernelContext ctx(out);
  if (K == 0) {
    TESSERA_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), ctx.stream));
    return;
  }
  const int64_t batch_dims = a.dim() - 2;
  const int64_t batch = out.numel() / (M * N);
  // C^T[N, M] = B^T[N, K] * A^T[K, M] in cuBLAS's column-major terms.
  GemmOperand A = describe(a, batch_dims), B = describe(b, batch_dims);
  TESSERA_CHECK(M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX && batch <= INT32_MAX,
                "matmul (cuda): dimensions over 2^31 are not supported");
  cublasHandle_t h = cublas_handle();
  TESSERA_CUBLAS_CHECK(cublasSetStream(h, ctx.stream));
  const float alpha32 = 1.f, beta32 = 0.f;
  const double alpha64 = 1.0, beta64 = 0.0;
  const bool f64 = out.dtype() == DType::f64;
  const void* alpha = f64 ? static_cast<const void*>(&alpha64) : &alpha32;
  const void* beta = f64 ? static_cast<const void*>(&beta64) : &beta32;
  TESSERA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, B.op, A.op, static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), alpha,
      B.t.raw_data(), types.data, static_cast<int>(B.ld), B.batch_stride, A.t.raw_data(),
      types.data, static_cast<int>(A.ld), A.batch_stride, beta, out.raw_data(), types.data,
      static_cast<int>(N), M * N, static_cast<int>(batch), types.compute, CUBLAS_GEMM_DEFAULT));
}

const bool registered = [] {
  kernel_table(DeviceType::CUDA).matmul = matmul;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
