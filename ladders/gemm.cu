// GEMM ladder: C[M, N] = A[M, K] @ B[K, N], row-major bf16 in and out, f32 accumulation.
// Compute-bound at large sizes: each rung is about how many multiply-adds a byte loaded from
// memory (then from shared memory, then from registers) is used for.
//   v1 one thread per element of C: a K-long dot product straight from global memory; every
//      element of A and B is loaded M or N times over (the caches soften it).
//   v2 32 x 32 tiles of A and B staged in shared memory: each global load is reused 32 times.
//   v3 register blocking on the CUDA cores: a block owns a 128 x 128 tile of C, each thread
//      an 8 x 8 sub-tile, so each value read from shared memory (128-bit reads) feeds 8 FMAs.
//   v4 the tensor cores through WMMA (mma.sync): 8 warps each own 64 x 32 of a 128 x 128 tile
//      as 4 x 2 fragments of 16 x 16, fed from bf16 tiles in shared memory (rows padded by 16
//      bytes against bank conflicts), 128-bit global loads where the row length allows.
//   v5 production (tessera::cuda::tensor_core_gemm, kernels/cuda/gemm.cu + gemm_sm90.cu): on
//      H100 the TMA copy engine fills a 4-stage shared-memory ring that warpgroup MMA (wgmma)
//      reads, with producer and consumer warps; elsewhere a cp.async-pipelined WMMA kernel.
//   cuBLAS, the ceiling every rate is printed against, as the last row.
#include <mma.h>

#include "ladder_harness.cuh"
#include "production.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace ladders {
namespace {

struct GemmArgs {
  const bf16* a;
  const bf16* b;
  bf16* c;
  int M, N, K;
};

__global__ void gemm_v1_naive(GemmArgs g) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;  // a warp: one row, 32 columns
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  if (row >= g.M || col >= g.N) return;
  float acc = 0.f;
  for (int k = 0; k < g.K; ++k)
    acc += f32(g.a[size_t(row) * g.K + k]) * f32(g.b[size_t(k) * g.N + col]);
  g.c[size_t(row) * g.N + col] = __float2bfloat16_rn(acc);
}

constexpr int kV2Tile = 32;
__global__ void __launch_bounds__(kV2Tile* kV2Tile) gemm_v2_shared_tiles(GemmArgs g) {
  __shared__ float a_tile[kV2Tile][kV2Tile], b_tile[kV2Tile][kV2Tile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * kV2Tile + ty, col = blockIdx.x * kV2Tile + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < g.K; k0 += kV2Tile) {
    // Out-of-range elements load as 0, so partial tiles need no other special case.
    a_tile[ty][tx] = row < g.M && k0 + tx < g.K ? f32(g.a[size_t(row) * g.K + k0 + tx]) : 0.f;
    b_tile[ty][tx] = k0 + ty < g.K && col < g.N ? f32(g.b[size_t(k0 + ty) * g.N + col]) : 0.f;
    __syncthreads();
    for (int k = 0; k < kV2Tile; ++k)
      acc += a_tile[ty][k] * b_tile[k][tx];  // broadcast, consecutive
    __syncthreads();                         // before the next tile overwrites these
  }
  if (row < g.M && col < g.N) g.c[size_t(row) * g.N + col] = __float2bfloat16_rn(acc);
}

constexpr int kV3Tile = 128, kV3K = 8, kV3Sub = 8,
              kV3Threads = (kV3Tile / kV3Sub) * (kV3Tile / kV3Sub);
__global__ void __launch_bounds__(kV3Threads) gemm_v3_register_tiles(GemmArgs g) {
  // A's tile is stored transposed ([k][row]) so a thread's 8 rows are contiguous: 2 float4 reads.
  __shared__ __align__(16) float a_tile[kV3K][kV3Tile];
  __shared__ __align__(16) float b_tile[kV3K][kV3Tile];
  const int tid = threadIdx.x;
  const int row0 = blockIdx.y * kV3Tile, col0 = blockIdx.x * kV3Tile;
  const int sub_row = (tid / (kV3Tile / kV3Sub)) * kV3Sub,
            sub_col = (tid % (kV3Tile / kV3Sub)) * kV3Sub;
  float acc[kV3Sub][kV3Sub] = {};
  for (int k0 = 0; k0 < g.K; k0 += kV3K) {
    // 1024 elements of each tile, 4 per thread.
    for (int e = tid; e < kV3Tile * kV3K; e += kV3Threads) {
      const int r = e / kV3K, k = e % kV3K;  // A: consecutive threads walk along a row
      a_tile[k][r] =
          row0 + r < g.M && k0 + k < g.K ? f32(g.a[size_t(row0 + r) * g.K + k0 + k]) : 0.f;
      const int kb = e / kV3Tile, c = e % kV3Tile;  // B: consecutive threads, consecutive columns
      b_tile[kb][c] =
          k0 + kb < g.K && col0 + c < g.N ? f32(g.b[size_t(k0 + kb) * g.N + col0 + c]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kV3K; ++k) {
      const float4 a0 = *reinterpret_cast<const float4*>(&a_tile[k][sub_row]),
                   a1 = *reinterpret_cast<const float4*>(&a_tile[k][sub_row + 4]),
                   b0 = *reinterpret_cast<const float4*>(&b_tile[k][sub_col]),
                   b1 = *reinterpret_cast<const float4*>(&b_tile[k][sub_col + 4]);
      const float a[kV3Sub] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[kV3Sub] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < kV3Sub; ++i)
#pragma unroll
        for (int j = 0; j < kV3Sub; ++j) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < kV3Sub; ++i)
    for (int j = 0; j < kV3Sub; ++j) {
      const int row = row0 + sub_row + i, col = col0 + sub_col + j;
      if (row < g.M && col < g.N) g.c[size_t(row) * g.N + col] = __float2bfloat16_rn(acc[i][j]);
    }
}

// ---- v4: WMMA ----
constexpr int kV4Tile = 128, kV4K = 32, kV4Pad = 8, kV4Threads = 256;
constexpr int kV4WarpRows = 64, kV4WarpCols = 32;  // 2 x 4 warps over the 128 x 128 tile

// 8 consecutive elements of row `row` of a [rows, cols] matrix from column `col` into shared
// memory: one 128-bit load when the row length is a multiple of 8 (then col % 8 == 0 keeps it
// 16-byte aligned) and all 8 are inside, else one by one with zeros outside.
__device__ __forceinline__ void load_chunk8(bf16* dst, const bf16* src, int row, int col, int rows,
                                            int cols) {
  if (row < rows && cols % 8 == 0 && col + 8 <= cols) {
    *reinterpret_cast<uint4*>(dst) =
        *reinterpret_cast<const uint4*>(src + size_t(row) * cols + col);
    return;
  }
  for (int j = 0; j < 8; ++j)
    dst[j] =
        row < rows && col + j < cols ? src[size_t(row) * cols + col + j] : __float2bfloat16_rn(0.f);
}

__global__ void __launch_bounds__(kV4Threads) gemm_v4_wmma(GemmArgs g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // bf16 WMMA needs sm_80 or newer
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(128) bf16 a_tile[kV4Tile][kV4K + kV4Pad];
  __shared__ __align__(128) bf16 b_tile[kV4K][kV4Tile + kV4Pad];
  __shared__ __align__(128) float staging[kV4Threads / 32][16 * 16];  // per warp, for the store
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row0 = blockIdx.y * kV4Tile, col0 = blockIdx.x * kV4Tile;
  const int warp_row = (warp / 4) * kV4WarpRows, warp_col = (warp % 4) * kV4WarpCols;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
  for (auto& row : acc)
    for (auto& f : row) wmma::fill_fragment(f, 0.f);
  for (int k0 = 0; k0 < g.K; k0 += kV4K) {
    for (int chunk = tid; chunk < kV4Tile * kV4K / 8; chunk += kV4Threads) {
      const int ar = chunk / (kV4K / 8), ac = (chunk % (kV4K / 8)) * 8;
      load_chunk8(&a_tile[ar][ac], g.a, row0 + ar, k0 + ac, g.M, g.K);
      const int br = chunk / (kV4Tile / 8), bc = (chunk % (kV4Tile / 8)) * 8;
      load_chunk8(&b_tile[br][bc], g.b, k0 + br, col0 + bc, g.K, g.N);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kV4K; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b[2];
      for (int i = 0; i < 4; ++i)
        wmma::load_matrix_sync(a[i], &a_tile[warp_row + 16 * i][kk], kV4K + kV4Pad);
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(b[j], &b_tile[kk][warp_col + 16 * j], kV4Tile + kV4Pad);
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  // A fragment's layout in registers is unspecified: store it to shared memory, then write the
  // in-range elements as bf16.
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(staging[warp], acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int row = row0 + warp_row + 16 * i + e / 16, col = col0 + warp_col + 16 * j + e % 16;
        if (row < g.M && col < g.N)
          g.c[size_t(row) * g.N + col] = __float2bfloat16_rn(staging[warp][e]);
      }
      __syncwarp();  // read before the next fragment overwrites the staging area
    }
#else
  __trap();
#endif
}

int climb_at(int M, int N, int K, bool timed) {
  const std::vector<bf16> ha = random_bf16(size_t(M) * K, 61), hb = random_bf16(size_t(K) * N, 62);
  DeviceArray<bf16> a(size_t(M) * K), b(size_t(K) * N), c(size_t(M) * N);
  a.upload(ha), b.upload(hb);
  const GemmArgs args{a.get(), b.get(), c.get(), M, N, K};
  const std::vector<double> A = widen(ha), B = widen(hb);
  auto check = [&] {
    const std::vector<double> got = widen(c.download());
    ErrorStats e("C");
    for (int64_t at : sample_indices(int64_t(M) * N, 4096)) {
      const int64_t i = at / N, j = at % N;
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += A[i * K + k] * B[int64_t(k) * N + j];
      e.add(got[at], ref, at);
    }
    return std::vector<ErrorStats>{e};
  };
  const Workload work{strf("M=%d N=%d K=%d bf16", M, N, K), 0, 2.0 * M * N * K, timed, 1e-2};
  Ladder ladder(
      "gemm", work, [&] { c.poison(); }, check);

  ladder.climb({"v1 one thread per output", "", [&] {
                  gemm_v1_naive<<<dim3(blocks_for(N, 32), blocks_for(M, 8)), dim3(32, 8)>>>(args);
                }});
  ladder.climb({"v2 32x32 shared-memory tiles", "", [&] {
                  gemm_v2_shared_tiles<<<dim3(blocks_for(N, kV2Tile), blocks_for(M, kV2Tile)),
                                         dim3(kV2Tile, kV2Tile)>>>(args);
                }});
  ladder.climb({"v3 128x128 tiles, 8x8 per thread (CUDA cores)", "", [&] {
                  gemm_v3_register_tiles<<<dim3(blocks_for(N, kV3Tile), blocks_for(M, kV3Tile)),
                                           kV3Threads>>>(args);
                }});
  ladder.climb(
      {"v4 tensor cores, WMMA 16x16x16", "", [&] {
         gemm_v4_wmma<<<dim3(blocks_for(N, kV4Tile), blocks_for(M, kV4Tile)), kV4Threads>>>(args);
       }});
  const tessera::Tensor ta = as_tensor(a, {M, K}), tb = as_tensor(b, {K, N}),
                        tc = as_tensor(c, {M, N});
  ladder.climb_library({"v5 production (sm_90: TMA + wgmma)", "",
                        [&] { tessera::cuda::tensor_core_gemm(ta, tb, tc); }});
  ladder.climb_library(
      {"cuBLAS (the ceiling)", "", [&] { cublas_gemm_bf16(a.get(), b.get(), c.get(), M, N, K); }});
  return ladder.failures();
}

}  // namespace

int gemm_ladder() {
  // 77 x 135 x 93: nothing divides a tile; 256 x 512 x 192: the production kernel's fast path.
  return climb_at(77, 135, 93, false) + climb_at(256, 512, 192, false) +
         (check_only() ? 0 : climb_at(4096, 4096, 4096, true));
}

}  // namespace ladders
