// The pieces the row norms (LayerNorm in layer_norm.cu, RMSNorm in rms_norm.cu) share: the
// rows per block of their warp-per-row kernels, optional operands as null pointers, and, for the
// backwards, how many blocks their persistent register-resident kernel gets, how the general path
// cuts the rows into chunks for the column partials, and the kernel that sums those partials
// into the weight (and bias) gradient in a fixed order, so the result is the same bits on
// every run.
#pragma once
#include <algorithm>

#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {

constexpr int kRowsPerBlock = 8;  // warps per block of the warp-per-row kernels, one row each

// An optional operand's data, or null when it is undefined.
template <class T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

// Lets `kernel` launch with `smem` bytes of dynamic shared memory (above 48 KB it must opt in;
// per device, so it is asked each time, which costs no device work).
template <class Kernel>
void allow_dynamic_shared_memory(Kernel kernel, size_t smem) {
  if (smem > (size_t(48) << 10))
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
}

// Blocks of a persistent backward kernel of `warps` warps (one row per warp at a time, grid
// stride over `rows`): as many as fit on the device at once, at most one warp per row.
template <class Kernel>
int64_t persistent_norm_blocks(Kernel kernel, int warps, size_t smem, int64_t rows) {
  int per_sm = 0;
  TESSERA_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * warps, smem));
  return std::max<int64_t>(
      1, std::min<int64_t>((rows + warps - 1) / warps,
                           int64_t(std::max(per_sm, 1)) * multiprocessor_count()));
}

// The general path's column partials: a thread per column (blocks of kThreads columns) and a
// block row per chunk of rows; enough chunks to give every SM a few blocks, each chunk at
// least 32 rows.
struct NormChunks {
  int64_t col_blocks, rows_per_chunk, count;
};
inline NormChunks norm_chunks(int64_t rows, int64_t C) {
  const int64_t col_blocks = (C + kThreads - 1) / kThreads;
  const int64_t want = std::max<int64_t>(1, 4 * multiprocessor_count() / col_blocks);
  const int64_t rows_per_chunk = std::max<int64_t>(32, (rows + want - 1) / want);
  return {col_blocks, rows_per_chunk, (rows + rows_per_chunk - 1) / rows_per_chunk};
}

// out += the column sums of part [chunks, C] (out = them when not accumulating: out need not
// be initialised), for up to three (part, out) pairs: blockIdx.y k takes pair k (an absent out
// is skipped). Block (8 columns, 32 chunk lanes): lane y adds
// chunks y, y + 32, ... in order, then lane 0 adds the 32 lane sums in order, so the result is
// fixed by the shapes alone. Columns of 8 (one 32-byte segment of f32 partials per row) give
// C / 8 blocks, enough to keep the whole GPU busy even for small C.
constexpr int kFinishCols = 8, kFinishLanes = 32, kFinishPairs = 3;

template <class T>
struct ColumnPartials {
  const acc_t<T>* part[kFinishPairs] = {};
  T* out[kFinishPairs] = {};
};

template <class T>
__global__ void __launch_bounds__(kFinishCols* kFinishLanes)
    add_column_partials_kernel(ColumnPartials<T> pairs, int64_t chunks, int64_t C,
                               bool accumulate) {
  using A = acc_t<T>;
  __shared__ A lanes[kFinishLanes][kFinishCols];
  const A* part = pairs.part[blockIdx.y];
  T* out = pairs.out[blockIdx.y];
  if (!out) return;  // uniform over the block
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = blockIdx.x * int64_t(kFinishCols) + tx;
  A s = 0;
  if (c < C)
    for (int64_t k = ty; k < chunks; k += kFinishLanes) s += part[k * C + c];
  lanes[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || c >= C) return;
  for (int y = 1; y < kFinishLanes; ++y) s += lanes[y][tx];
  out[c] = from_acc<T>(accumulate ? to_acc<A>(out[c]) + s : s);
}

// Launches add_column_partials_kernel; any out may be null (not computed).
template <class T>
void add_column_partials(cudaStream_t stream, bool accumulate, const acc_t<T>* part0,
                         const acc_t<T>* part1, int64_t chunks, int64_t C, T* out0, T* out1,
                         const acc_t<T>* part2 = nullptr, T* out2 = nullptr) {
  const ColumnPartials<T> pairs{{part0, part1, part2}, {out0, out1, out2}};
  const unsigned used = out2 ? 3u : out1 ? 2u : 1u;
  const dim3 grid(static_cast<unsigned>((C + kFinishCols - 1) / kFinishCols), used);
  add_column_partials_kernel<T>
      <<<grid, dim3(kFinishCols, kFinishLanes), 0, stream>>>(pairs, chunks, C, accumulate);
  TESSERA_KERNEL_CHECK("add_column_partials_kernel");
}

}  // namespace tessera::cuda
