// A hand-written tensor-core GEMM, C[M, N] = A[M, K] @ B[K, N] (bf16/f16 in, f32 accumulate),
// kept to show how a matrix kernel reaches the tensor cores; Tessera's matmul uses cuBLAS.
//
//   naive:  one thread per output element, a dot product over K in f32 (any sizes).
//   tiled:  a block computes a 128x256 tile of C with 8 warps (each 64x64 = 4x4 WMMA 16x16
//           fragments); 128x64 tiles of A and 64x256 of B are copied into shared memory with
//           cp.async in a 3-stage pipeline, so the copies of tiles k+1 and k+2 overlap the
//           math on tile k. Rows are padded by 8 elements (16 bytes) against bank conflicts.
//           Used when M is a multiple of 128, N of 256 and K of 64 and the sm_90 path below
//           does not apply (other GPUs); it is the readable version of the same tiling.
//   sm_90:  on H100/H200 (sm_90a code), the same tile sizes go to gemm_sm90.cu: TMA copies and
//           warpgroup MMA (wgmma) with a producer/consumer mbarrier pipeline.
#include <mma.h>

#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace tessera::cuda {
namespace detail {
// Defined in gemm_sm90.cu: launches the wgmma/TMA kernel and returns true when the device and
// the sizes allow it, else returns false without doing anything.
bool try_wgmma_gemm(const Tensor& a, const Tensor& b, const Tensor& c, cudaStream_t stream);
}  // namespace detail

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

constexpr int kBM = 128, kBN = 256, kBK = 64, kPad = 8, kStages = 3;
constexpr int kGemmThreads = 256;  // 8 warps: 2 along M x 4 along N
constexpr int kWarpM = 64, kWarpN = 64;
constexpr int kFragM = kWarpM / 16, kFragN = kWarpN / 16;
constexpr int kAPitch = kBK + kPad, kBPitch = kBN + kPad;
constexpr int kStageElems = kBM * kAPitch + kBK * kBPitch;
constexpr size_t kGemmSmem = size_t(kStages) * kStageElems * 2;

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <class T>
__global__ void __launch_bounds__(kGemmThreads, 1)
    tiled_gemm_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, int M,
                      int N, int K) {
  using W = typename WmmaType<T>::type;
  using namespace nvcuda;
  // kStages x (A tile [kBM][kBK], B tile [kBK][kBN]), rows padded by 8 elements.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  W* smem = reinterpret_cast<W*>(smem_raw);
  auto a_tile = [&](int stage) { return smem + stage * kStageElems; };
  auto b_tile = [&](int stage) { return smem + stage * kStageElems + kBM * kAPitch; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / 4, warp_n = warp % 4;
  const int64_t row0 = int64_t(blockIdx.y) * kBM, col0 = int64_t(blockIdx.x) * kBN;
  const W* ag = reinterpret_cast<const W*>(a);
  const W* bg = reinterpret_cast<const W*>(b);

  // 16-byte pieces: A's tile has kBM * kBK / 8 of them, B's kBK * kBN / 8.
  auto load_stage = [&](int stage, int k0) {
    W* as = a_tile(stage);
    W* bs = b_tile(stage);
#pragma unroll
    for (int piece = threadIdx.x; piece < kBM * kBK / 8; piece += kGemmThreads) {
      const int r = piece / (kBK / 8), col = (piece % (kBK / 8)) * 8;
      cp_async_16(as + r * kAPitch + col, ag + (row0 + r) * K + k0 + col);
    }
#pragma unroll
    for (int piece = threadIdx.x; piece < kBK * kBN / 8; piece += kGemmThreads) {
      const int r = piece / (kBN / 8), col = (piece % (kBN / 8)) * 8;
      cp_async_16(bs + r * kBPitch + col, bg + int64_t(k0 + r) * N + col0 + col);
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragM][kFragN];
#pragma unroll
  for (int i = 0; i < kFragM; ++i)
#pragma unroll
    for (int j = 0; j < kFragN; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  // Keep kStages - 1 tiles in flight: tile kt is computed while kt+1 and kt+2 are copied.
  const int k_tiles = K / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s * kBK);
    cp_async_commit();  // an empty group keeps the counting uniform
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // tile kt has landed
    __syncthreads();               // ... for every thread, and tile kt-1 is no longer read
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next * kBK);
    cp_async_commit();
    const W* as = a_tile(kt % kStages);
    const W* bs = b_tile(kt % kStages);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, W, wmma::row_major> fa[kFragM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, W, wmma::row_major> fb[kFragN];
#pragma unroll
      for (int i = 0; i < kFragM; ++i)
        wmma::load_matrix_sync(fa[i], as + (warp_m * kWarpM + i * 16) * kAPitch + kk, kAPitch);
#pragma unroll
      for (int j = 0; j < kFragN; ++j)
        wmma::load_matrix_sync(fb[j], bs + kk * kBPitch + warp_n * kWarpN + j * 16, kBPitch);
#pragma unroll
      for (int i = 0; i < kFragM; ++i)
#pragma unroll
        for (int j = 0; j < kFragN; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory is reused for the epilogue

  // Epilogue: each fragment goes through the warp's 16x16 scratch tile to be rounded to T.
  float* scratch = reinterpret_cast<float*>(smem_raw) + warp * 256;
#pragma unroll
  for (int i = 0; i < kFragM; ++i)
#pragma unroll
    for (int j = 0; j < kFragN; ++j) {
      wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int64_t r0 = row0 + warp_m * kWarpM + i * 16, c0 = col0 + warp_n * kWarpN + j * 16;
      for (int e = lane; e < 256; e += 32)
        c[(r0 + e / 16) * N + c0 + e % 16] = from_float<T>(scratch[e]);
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
  if (detail::try_wgmma_gemm(a, b, c, ctx.stream)) {
    TESSERA_KERNEL_CHECK("tensor_core_gemm (sm_90 wgmma)");
    return;
  }
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
      TESSERA_CUDA_CHECK(cudaFuncSetAttribute(tiled_gemm_kernel<T>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(kGemmSmem)));
      tiled_gemm_kernel<T><<<grid, kGemmThreads, kGemmSmem, ctx.stream>>>(
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
