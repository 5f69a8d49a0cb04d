// A hand-written tensor-core GEMM, C[M, N] = A[M, K] @ B[K, N] (bf16/f16 in, f32 accumulate),
// kept to show how a matrix kernel reaches the tensor cores; Tessera's matmul uses cuBLAS.
//
//   naive:  one thread per output element, a dot product over K in f32 (any sizes).
//   tiled:  a block computes a 128x128 tile of C with 8 warps (each 64x32 = 4x2 WMMA 16x16
//           fragments); 128x32 tiles of A and 32x128 of B are copied into shared memory with
//           cp.async, double-buffered so the copy of tile k+1 overlaps the math on tile k.
//           Rows are padded by 8 elements (16 bytes) so fragment loads avoid bank conflicts.
//           Used when M, N are multiples of 128 and K of 32.
#include <mma.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fused.h"

namespace tessera::cuda {
namespace {

template <class T> struct WmmaType;
template <> struct WmmaType<BFloat16> { using type = __nv_bfloat16; };
template <> struct WmmaType<Half> { using type = __half; };

template <class T>
__global__ void naive_gemm_kernel(const T* a, const T* b, T* c, int64_t M, int64_t N, int64_t K) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < M * N;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / N, j = e % N;
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += to_float(a[i * K + k]) * to_float(b[k * N + j]);
    c[e] = from_float<T>(acc);
  }
}

constexpr int kBM = 128, kBN = 128, kBK = 32, kPad = 8;
constexpr int kGemmThreads = 256;  // 8 warps: 2 along M x 4 along N
constexpr int kWarpM = 64, kWarpN = 32;

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <class T>
__global__ void __launch_bounds__(kGemmThreads)
    tiled_gemm_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, int M,
                      int N, int K) {
  using W = typename WmmaType<T>::type;
  using namespace nvcuda;
  __shared__ __align__(128) W as[2][kBM][kBK + kPad];
  __shared__ __align__(128) W bs[2][kBK][kBN + kPad];
  __shared__ __align__(128) float scratch[8][16 * 16];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / 4, warp_n = warp % 4;
  const int64_t row0 = int64_t(blockIdx.y) * kBM, col0 = int64_t(blockIdx.x) * kBN;
  const W* ag = reinterpret_cast<const W*>(a);
  const W* bg = reinterpret_cast<const W*>(b);

  // Each thread copies 2 16-byte pieces of A's tile and 2 of B's.
  auto load_tiles = [&](int buf, int k0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int piece = threadIdx.x + i * kGemmThreads;  // 512 pieces of 8 elements each
      const int ar = piece / (kBK / 8), ac = (piece % (kBK / 8)) * 8;
      cp_async_16(&as[buf][ar][ac], ag + (row0 + ar) * K + k0 + ac);
      const int br = piece / (kBN / 8), bc = (piece % (kBN / 8)) * 8;
      cp_async_16(&bs[buf][br][bc], bg + int64_t(k0 + br) * N + col0 + bc);
    }
    cp_async_commit();
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  const int k_tiles = K / kBK;
  load_tiles(0, 0);
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int buf = kt % 2;
    if (kt + 1 < k_tiles) {
      load_tiles(buf ^ 1, (kt + 1) * kBK);
      cp_async_wait<1>();  // tile kt has landed; kt+1 may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, W, wmma::row_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, W, wmma::row_major> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        wmma::load_matrix_sync(fa[i], &as[buf][warp_m * kWarpM + i * 16][kk], kBK + kPad);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(fb[j], &bs[buf][kk][warp_n * kWarpN + j * 16], kBN + kPad);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();  // the next iteration's copy overwrites this buffer
  }

  // Epilogue: each fragment goes through the warp's scratch tile to be rounded to T.
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(scratch[warp], acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int64_t r0 = row0 + warp_m * kWarpM + i * 16, c0 = col0 + warp_n * kWarpN + j * 16;
      for (int e = lane; e < 256; e += 32)
        c[(r0 + e / 16) * N + c0 + e % 16] = from_float<T>(scratch[warp][e]);
      __syncwarp();
    }
}

}  // namespace

void tensor_core_gemm(const Tensor& a, const Tensor& b, const Tensor& c) {
  TESSERA_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) &&
                    c.size(0) == a.size(0) && c.size(1) == b.size(1),
                "tensor_core_gemm: shapes ", shape_str(a.shape()), " @ ", shape_str(b.shape()),
                " -> ", shape_str(c.shape()), " do not agree");
  TESSERA_CHECK((a.dtype() == DType::bf16 || a.dtype() == DType::f16) && b.dtype() == a.dtype() &&
                    c.dtype() == a.dtype(),
                "tensor_core_gemm: a, b, c must all be bfloat16 or all float16");
  TESSERA_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous() && a.device().is_cuda() &&
                    b.device() == a.device() && c.device() == a.device(),
                "tensor_core_gemm: operands must be contiguous and on one CUDA device");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (c.numel() == 0) return;
  KernelContext ctx(c);
  auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; };
  const bool tiled = M % kBM == 0 && N % kBN == 0 && K % kBK == 0 && K > 0 && M <= INT32_MAX &&
                     N <= INT32_MAX && K <= INT32_MAX && aligned(a) && aligned(b);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    const T* ap = static_cast<const T*>(a.raw_data());
    const T* bp = static_cast<const T*>(b.raw_data());
    T* cp = static_cast<T*>(c.raw_data());
    if (tiled) {
      const dim3 grid(static_cast<unsigned>(N / kBN), static_cast<unsigned>(M / kBM));
      tiled_gemm_kernel<T><<<grid, kGemmThreads, 0, ctx.stream>>>(
          ap, bp, cp, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K));
    } else {
      naive_gemm_kernel<T><<<grid_for(M * N), kThreads, 0, ctx.stream>>>(ap, bp, cp, M, N, K);
    }
  };
  if (a.dtype() == DType::bf16) launch(BFloat16{});
  else launch(Half{});
  TESSERA_KERNEL_CHECK("tensor_core_gemm");
}

}  // namespace tessera::cuda
