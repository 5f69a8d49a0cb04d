// The Hopper (sm_90a) path of tensor_core_gemm: C[M, N] = A[M, K] @ B[K, N], bf16/f16 in, f32
// accumulation, all row-major. Used when M % 128, N % 256 and K % 64 are 0 (see gemm.cu).
//
// Why a separate kernel: on Hopper, mma.sync/WMMA (what gemm.cu's tiled kernel uses) reaches only
// a fifth of the tensor cores' rate. The full rate needs
//   * warpgroup MMA (wgmma.mma_async): 4 warps (128 threads) issue one 64xNx16 product together;
//     its A and B operands are read straight from shared memory through "matrix descriptors",
//     so no thread spends instructions loading fragments; it runs asynchronously and is waited
//     for with commit/wait groups;
//   * the TMA copy engine (cp.async.bulk.tensor): one thread asks the hardware to copy a whole
//     2-D box of a matrix from global into shared memory, already in the swizzled layout wgmma
//     reads without bank conflicts; completion is counted in bytes on an mbarrier.
//
// Block: 384 threads = 3 warpgroups; the grid is persistent (one block per SM) and each block
// walks the 128 x 256 tiles of C tile += gridDim.x, so while the consumers store tile i the
// producer is already loading tile i+1.
//   warpgroup 0 (producer): one thread issues the TMA copies of the K-tiles (A: 128x64, B: 64x256)
//                           into a ring of kStages shared-memory stages;
//   warpgroups 1, 2 (consumers): each owns 64 rows x 256 columns of the tile, i.e. 128 f32
//                           accumulators per thread, and issues 4 wgmma m64n256k16 per K-tile.
// Per stage two mbarriers hand the buffer back and forth:
//   full[s]:  the producer announces the byte count (expect_tx); the TMA unit completes the phase
//             when all 48 KiB have landed; consumers wait on it.
//   empty[s]: every consumer warp arrives once it no longer reads the stage (8 arrivals); the
//             producer waits on it before overwriting the stage.
// A barrier's phase flips each time it completes; waits name the parity of the phase they wait for.
// Producer and consumers count the K-tiles they handled over all the block's tiles (`step`); step
// uses stage step % kStages for the (step / kStages)-th time and waits for that phase's parity.
#include <algorithm>

#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/cuda/sm90_common.cuh"

namespace tessera::cuda::detail {
namespace {
using namespace sm90;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kConsumerRows = 64;  // rows of C per consumer warpgroup (wgmma's M)
constexpr int kWgmmaThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerWarps = 8;
// The 128-byte swizzle works on rows of 128 bytes = 64 bf16/f16: B's 256 columns arrive as 4 boxes
// of 64 columns x 64 k-rows, each one "column panel" in shared memory.
constexpr int kPanelCols = 64;
constexpr int kATileBytes = kBM * kBK * 2;            // 16 KiB
constexpr int kBPanelBytes = kBK * kPanelCols * 2;    // 8 KiB
constexpr int kBTileBytes = kBK * kBN * 2;            // 32 KiB
constexpr int kStageBytes = kATileBytes + kBTileBytes;  // 48 KiB, the TMA byte count per stage
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 1024;  // +1024: alignment slack
static_assert(kBK * 2 == 128, "a K-tile row of A must be exactly one 128-byte swizzle row");

// acc[64 x 256 per warpgroup] += A(desc_a: 64x16, K-major) * B(desc_b: 16x256, N-major).
// Immediates: scale-a = scale-b = 1 (no negation), transpose-a = 0 (A rows are K-contiguous),
// transpose-b = 1 (B rows are N-contiguous, "MN-major"). scale-d = 1: accumulate.
#define TESSERA_WGMMA_M64N256K16(ELEM)                                                           \
  asm volatile(                                                                                  \
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %130, 0;\n"                          \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." ELEM "." ELEM " {"                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                   \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "         \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "         \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "         \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "         \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "         \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "   \
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "     \
      "%125, %126, %127}, %128, %129, accumulate, 1, 1, 0, 1;\n}\n"                              \
      : TESSERA_SM90_ACC8(acc, 0), TESSERA_SM90_ACC8(acc, 8),                        \
        TESSERA_SM90_ACC8(acc, 16), TESSERA_SM90_ACC8(acc, 24),                      \
        TESSERA_SM90_ACC8(acc, 32), TESSERA_SM90_ACC8(acc, 40),                      \
        TESSERA_SM90_ACC8(acc, 48), TESSERA_SM90_ACC8(acc, 56),                      \
        TESSERA_SM90_ACC8(acc, 64), TESSERA_SM90_ACC8(acc, 72),                      \
        TESSERA_SM90_ACC8(acc, 80), TESSERA_SM90_ACC8(acc, 88),                      \
        TESSERA_SM90_ACC8(acc, 96), TESSERA_SM90_ACC8(acc, 104),                     \
        TESSERA_SM90_ACC8(acc, 112), TESSERA_SM90_ACC8(acc, 120)                     \
      : "l"(desc_a), "l"(desc_b), "r"(1))

template <class T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&acc)[128], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same_v<T, BFloat16>) TESSERA_WGMMA_M64N256K16("bf16");
  else TESSERA_WGMMA_M64N256K16("f16");
}
#undef TESSERA_WGMMA_M64N256K16

// Two f32 values rounded to T and packed into one 32-bit store.
template <class T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// a_map: A as a [M][K] tensor, box 64 (K) x 128 (M); b_map: B as [K][N], box 64 (N) x 64 (K);
// both with the 128-byte swizzle. __grid_constant__ keeps the maps in parameter space, where the
// TMA unit can read them by address.
template <class T>
__global__ void __launch_bounds__(kWgmmaThreads, 1)
    wgmma_gemm_kernel(const __grid_constant__ CUtensorMap a_map,
                      const __grid_constant__ CUtensorMap b_map, T* __restrict__ c, int N, int K,
                      int num_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages], empty_bar[kStages];
  // The 128-byte swizzle pattern repeats every 1024 bytes and both TMA and the descriptors assume
  // each tile starts on such a boundary: round the dynamic buffer up (kSmemBytes has the slack).
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  auto a_stage = [&](int s) { return base + uint32_t(s) * kATileBytes; };
  auto b_stage = [&](int s) { return base + uint32_t(kStages) * kATileBytes + uint32_t(s) * kBTileBytes; };
  auto full = [&](int s) { return smem_addr(&full_bar[s]); };
  auto empty = [&](int s) { return smem_addr(&empty_bar[s]); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full(s), 1);                // the producer's arrive_expect_bytes
      mbarrier_init(empty(s), kConsumerWarps);  // one arrival per consumer warp
    }
    mbarrier_init_fence();  // visible to the TMA unit (the async proxy) before any copy
  }
  __syncthreads();

  const int k_tiles = K / kBK;
  const int n_tiles = N / kBN;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---- producer: one thread keeps up to kStages K-tiles in flight, across tile boundaries ----
    if (threadIdx.x == 0) {
      int step = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const int m0 = (tile / n_tiles) * kBM, n0 = (tile % n_tiles) * kBN;
        for (int kt = 0; kt < k_tiles; ++kt, ++step) {
          const int s = step % kStages;
          // Reusing stage s: wait until the consumers released its previous use (step - kStages).
          if (step >= kStages) mbarrier_wait(empty(s), ((step / kStages) - 1) & 1);
          mbarrier_arrive_expect_bytes(full(s), kStageBytes);
          tma_load_2d(a_stage(s), &a_map, full(s), kt * kBK, m0);
          for (int p = 0; p < kBN / kPanelCols; ++p)
            tma_load_2d(b_stage(s) + uint32_t(p) * kBPanelBytes, &b_map, full(s),
                        n0 + p * kPanelCols, kt * kBK);
        }
      }
    }
    return;
  }

  // ---- consumers: warpgroup 1 computes rows 0-63 of each tile, warpgroup 2 rows 64-127 ----
  const int consumer = warpgroup - 1;
  const bool releases = threadIdx.x % 32 == 0;  // one arrival per warp on `empty`
  float acc[128];
  int step = 0;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int m0 = (tile / n_tiles) * kBM, n0 = (tile % n_tiles) * kBN;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    pin_registers(acc);

    for (int kt = 0; kt < k_tiles; ++kt, ++step) {
      const int s = step % kStages;
      mbarrier_wait(full(s), (step / kStages) & 1);
      wgmma_fence();  // order the accumulator registers' earlier uses before the async MMAs
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        // A (K-major): this warpgroup's 64 rows start 64 * 128 bytes into the tile; the k-step of
        // 16 elements = 32 bytes moves the start inside the 128-byte swizzled row (the hardware
        // applies the XOR to the final address). Rows go in groups of 8 every 1024 bytes (stride
        // offset); the leading offset is unused for a swizzled K-major operand (1 by convention).
        const uint64_t desc_a = swizzle128_descriptor(
            a_stage(s) + uint32_t(consumer * kConsumerRows * 128 + kk * 32), 16, 1024);
        // B (N-major, transposed in the instruction): 16 k-rows of 128 bytes per k-step; inside
        // a panel, 8 k-rows form one 1024-byte swizzle block (stride offset); the next 64 columns
        // are the next panel, kBPanelBytes further (leading offset).
        const uint64_t desc_b =
            swizzle128_descriptor(b_stage(s) + uint32_t(kk * 16 * 128), kBPanelBytes, 1024);
        wgmma_m64n256k16<T>(acc, desc_a, desc_b);
      }
      wgmma_commit();
      // Keep this K-tile's MMAs in flight, but wait for the previous one's: its stage can go.
      wgmma_wait<1>();
      if (kt > 0 && releases) mbarrier_arrive(empty((step - 1) % kStages));
    }
    wgmma_wait<0>();
    pin_registers(acc);
    if (releases) mbarrier_arrive(empty((step - 1) % kStages));  // the tile's last K-tile

    // ---- epilogue: the wgmma accumulator layout, per warp of the warpgroup, is that of mma.sync
    // m16n8 repeated over N: warp w holds rows 16w..16w+15; for each 8-column slice j, lane l has
    // (row l/4, columns 8j + 2(l%4) + {0,1}) in acc[4j], acc[4j+1] and the same 8 rows lower in
    // acc[4j+2], acc[4j+3]. Stored straight from registers, two elements per 32-bit store.
    const int lane = threadIdx.x % 32, warp_in_group = (threadIdx.x / 32) % 4;
    const int64_t row = m0 + consumer * kConsumerRows + warp_in_group * 16 + lane / 4;
    uint32_t* upper = reinterpret_cast<uint32_t*>(c + row * N + n0 + 2 * (lane % 4));
    uint32_t* lower = reinterpret_cast<uint32_t*>(c + (row + 8) * N + n0 + 2 * (lane % 4));
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
      upper[j * 4] = pack_pair<T>(acc[4 * j], acc[4 * j + 1]);  // 8 columns = 4 pairs further
      lower[j * 4] = pack_pair<T>(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
#else
  __trap();  // built without sm_90a code: the host side never launches this (see applies below)
#endif
}

// A row-major [rows][cols] matrix of 16-bit elements as a 2-D tensor map read in boxes of
// box_rows x box_cols (box_cols * 2 must be 128 bytes for the 128-byte swizzle).
CUtensorMap make_tensor_map(const Tensor& t, int64_t rows, int64_t cols, uint32_t box_rows,
                            uint32_t box_cols) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t row_stride_bytes[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUtensorMapDataType type = sm90::tensor_map_type(t.dtype());
  const CUresult status = sm90::tensor_map_encoder()(
      &map, type, 2, const_cast<void*>(t.raw_data()), dims, row_stride_bytes, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TESSERA_CHECK(status == CUDA_SUCCESS, "tensor_core_gemm: cuTensorMapEncodeTiled failed (error ",
                static_cast<int>(status), ") for a ", rows, "x", cols, " ", dtype_name(t.dtype()),
                " matrix, box ", box_rows, "x", box_cols);
  return map;
}

}  // namespace

bool try_wgmma_gemm(const Tensor& a, const Tensor& b, const Tensor& c, cudaStream_t stream) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const auto aligned16 = [](const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0;
  };
  const bool fits = M % kBM == 0 && N % kBN == 0 && K % kBK == 0 && M > 0 && N > 0 && K > 0 &&
                    (M / kBM) * (N / kBN) <= INT32_MAX && M <= INT32_MAX && N <= INT32_MAX &&
                    K <= INT32_MAX &&
                    aligned16(a) && aligned16(b) && aligned16(c);
  if (!fits || !sm90::device_runs_sm90a(a.device().index, wgmma_gemm_kernel<BFloat16>)) return false;

  const CUtensorMap a_map = make_tensor_map(a, M, K, kBM, kBK);
  const CUtensorMap b_map = make_tensor_map(b, K, N, kBK, kPanelCols);
  // Persistent grid: one block per SM (the shared memory allows no more), each looping over tiles.
  const int64_t num_tiles = (M / kBM) * (N / kBN);
  const int blocks = static_cast<int>(std::min<int64_t>(num_tiles, multiprocessor_count(a.device().index)));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(wgmma_gemm_kernel<T>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kSmemBytes)));
    wgmma_gemm_kernel<T><<<blocks, kWgmmaThreads, kSmemBytes, stream>>>(
        a_map, b_map, static_cast<T*>(c.raw_data()), static_cast<int>(N), static_cast<int>(K),
        static_cast<int>(num_tiles));
  };
  if (a.dtype() == DType::bf16) launch(BFloat16{});
  else launch(Half{});
  return true;
}

}  // namespace tessera::cuda::detail
