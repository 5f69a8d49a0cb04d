// Shared pieces of the CUDA kernels: element types, loads/stores with run-time
// dtypes, strided index arithmetic, warp/block reductions and the per-call
// context (device guard + current stream).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tessera/core/cuda/cuda_check.h"
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/tensor.h"

namespace tessera::cuda {

// ---- element types: Tessera's Half/BFloat16 hold bits; convert with the hardware ----
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(double v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(Half v) { return __half2float(__ushort_as_half(v.bits)); }
__device__ __forceinline__ float to_float(BFloat16 v) {
  return __bfloat162float(__ushort_as_bfloat16(v.bits));
}

template <class T>
__device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_float<double>(float v) { return v; }
template <> __device__ __forceinline__ Half from_float<Half>(float v) {
  return Half::from_bits(__half_as_ushort(__float2half_rn(v)));
}
template <> __device__ __forceinline__ BFloat16 from_float<BFloat16>(float v) {
  return BFloat16::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}

// Accumulation type: f32 for every float type but f64.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class A, class T>
__device__ __forceinline__ A to_acc(T v) {
  if constexpr (std::is_same_v<A, double> && std::is_same_v<T, double>) return v;
  else return to_float(v);
}
template <class T, class A>
__device__ __forceinline__ T from_acc(A v) {
  if constexpr (std::is_same_v<T, double>) return static_cast<double>(v);
  else return from_float<T>(static_cast<float>(v));
}

// ---- loads/stores whose dtype is known only at run time (branch is uniform per launch) ----
// C is the compute type: float, double or int64_t.
template <class C>
__device__ __forceinline__ C load_as(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<C>(static_cast<const float*>(base)[i]);
    case DType::f16: return static_cast<C>(__half2float(static_cast<const __half*>(base)[i]));
    case DType::bf16:
      return static_cast<C>(__bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]));
    case DType::f64: return static_cast<C>(static_cast<const double*>(base)[i]);
    case DType::i32: return static_cast<C>(static_cast<const int32_t*>(base)[i]);
    case DType::i64: return static_cast<C>(static_cast<const int64_t*>(base)[i]);
    case DType::u8: return static_cast<C>(static_cast<const uint8_t*>(base)[i]);
    case DType::boolean: return static_cast<C>(static_cast<const uint8_t*>(base)[i] != 0);
  }
  return C(0);
}

template <class C>
__device__ __forceinline__ void store_as(void* base, DType t, int64_t i, C v) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DType::f16: static_cast<__half*>(base)[i] = __float2half_rn(static_cast<float>(v)); break;
    case DType::bf16:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(static_cast<float>(v));
      break;
    case DType::f64: static_cast<double*>(base)[i] = static_cast<double>(v); break;
    case DType::i32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); break;
    case DType::boolean: static_cast<uint8_t*>(base)[i] = v != C(0) ? 1 : 0; break;
  }
}

// The compute type for values of these dtypes (float for f32/f16/bf16, double for f64,
// int64 when everything is integral).
enum class ComputeKind { F32, F64, I64 };
ComputeKind compute_kind(std::initializer_list<DType> dtypes);

template <class Fn>
void visit_compute(ComputeKind k, Fn&& fn) {
  switch (k) {
    case ComputeKind::F32: fn(float{}); break;
    case ComputeKind::F64: fn(double{}); break;
    case ComputeKind::I64: fn(int64_t{}); break;
  }
}

// Calls fn(T{}) for the floating dtypes kernels template on; error naming `op` otherwise.
template <class Fn>
void visit_float(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::f32: fn(float{}); return;
    case DType::f16: fn(Half{}); return;
    case DType::bf16: fn(BFloat16{}); return;
    case DType::f64: fn(double{}); return;
    default: TESSERA_FAIL(op, ": CUDA kernel needs a floating dtype, got ", dtype_name(t));
  }
}

// Calls fn(T{}) for f32, f16 or bf16 (callers have checked the dtype is one of them).
template <class Fn>
void visit_half_float(DType t, Fn&& fn) {
  if (t == DType::f32) fn(float{});
  else if (t == DType::f16) fn(Half{});
  else fn(BFloat16{});
}

// ---- strided index arithmetic ----
constexpr int kMaxDims = 10;

// N operands walking the same shape with their own strides; dims merged where all operands
// are laid out contiguously, so most views collapse to one or two dims.
template <int N>
struct StridedIter {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[N][kMaxDims];

  __device__ __forceinline__ void offsets(int64_t linear, int64_t (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t idx = linear % sizes[d];
      linear /= sizes[d];
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
    }
  }
};

template <int N>
StridedIter<N> make_iter(const Shape& shape, const std::array<const Shape*, N>& strides) {
  StridedIter<N> it;
  std::vector<int64_t> sz;
  std::array<std::vector<int64_t>, N> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = !sz.empty();
    for (int k = 0; k < N && merge; ++k) merge = st[k].back() == (*strides[k])[d] * shape[d];
    if (merge) {
      sz.back() *= shape[d];
      for (int k = 0; k < N; ++k) st[k].back() = (*strides[k])[d];
    } else {
      sz.push_back(shape[d]);
      for (int k = 0; k < N; ++k) st[k].push_back((*strides[k])[d]);
    }
  }
  TESSERA_CHECK(sz.size() <= static_cast<size_t>(kMaxDims), "CUDA kernels support at most ",
                kMaxDims, " non-mergeable dimensions, got shape ", shape_str(shape));
  it.ndim = static_cast<int>(sz.size());
  for (int d = 0; d < it.ndim; ++d) {
    it.sizes[d] = sz[d];
    for (int k = 0; k < N; ++k) it.strides[k][d] = st[k][d];
  }
  return it;
}

// True when the iterator is one dense run with unit strides for every operand.
template <int N>
bool iter_is_contiguous(const StridedIter<N>& it) {
  if (it.ndim == 0) return true;
  if (it.ndim != 1) return false;
  for (int k = 0; k < N; ++k)
    if (it.strides[k][0] != 1) return false;
  return true;
}

// ---- 8-element packs: one 16-byte access for 16-bit types, two for f32 ----
constexpr int kPack = 8;
template <class T>
struct alignas(16) Pack8 {
  T v[kPack];
};
template <class T>
__device__ __forceinline__ Pack8<T> load_pack(const T* p, int64_t pack_index) {
  return reinterpret_cast<const Pack8<T>*>(p)[pack_index];
}
template <class T>
__device__ __forceinline__ void store_pack(T* p, int64_t pack_index, const Pack8<T>& v) {
  reinterpret_cast<Pack8<T>*>(p)[pack_index] = v;
}
// The per-column partial sums that each warp of a block kept in registers (`v[k][j]` for column
// (lane + 32 k) * kPack + j, packs columns / kPack in all) added into `block` [columns] in warp
// order, so the result depends on the shapes alone (the row-wise norm backwards' weight
// gradients). Every thread of the block calls it; it ends with the block synchronised.
template <int kWarps, int kPacks>
__device__ __forceinline__ void add_warp_partials_in_order(float* block,
                                                           const float (&v)[kPacks][kPack],
                                                           int64_t packs, int warp, int lane) {
  for (int turn = 0; turn < kWarps; ++turn) {
    if (warp == turn) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + 32 * k;
        if (p >= packs) continue;
#pragma unroll
        for (int j = 0; j < kPack; ++j) {
          const int64_t c = p * kPack + j;
          block[c] = (turn == 0 ? 0.f : block[c]) + v[k][j];
        }
      }
    }
    __syncthreads();
  }
}
// True when every pointer is 16-byte aligned (packs may be used from element 0).
inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Row walks for kernels where a group of `group` threads (this one is `tid`) shares a row:
// with `packed` (row 16-byte aligned, length a multiple of 8) each thread takes 8-element
// packs, otherwise single elements. fn(i, value) sees every element once.
template <class T, class Fn>
__device__ __forceinline__ void row_read(const T* row, int64_t len, int tid, int group,
                                         bool packed, Fn&& fn) {
  if (packed) {
    for (int64_t p = tid; p < len / kPack; p += group) {
      const Pack8<T> v = load_pack(row, p);
#pragma unroll
      for (int k = 0; k < kPack; ++k) fn(p * kPack + k, v.v[k]);
    }
  } else {
    for (int64_t i = tid; i < len; i += group) fn(i, row[i]);
  }
}
// out[i] = fn(i) for the row (out may alias what fn reads at the same i).
template <class T, class Fn>
__device__ __forceinline__ void row_write(T* out, int64_t len, int tid, int group, bool packed,
                                          Fn&& fn) {
  if (packed) {
    for (int64_t p = tid; p < len / kPack; p += group) {
      Pack8<T> v;
#pragma unroll
      for (int k = 0; k < kPack; ++k) v.v[k] = fn(p * kPack + k);
      store_pack(out, p, v);
    }
  } else {
    for (int64_t i = tid; i < len; i += group) out[i] = fn(i);
  }
}
// dst[i] = fn(i, src[i]) for the row; dst may be src (in place).
template <class T, class U, class Fn>
__device__ __forceinline__ void row_map(const T* src, U* dst, int64_t len, int tid, int group,
                                        bool packed, Fn&& fn) {
  if (packed) {
    for (int64_t p = tid; p < len / kPack; p += group) {
      const Pack8<T> v = load_pack(src, p);
      Pack8<U> r;
#pragma unroll
      for (int k = 0; k < kPack; ++k) r.v[k] = fn(p * kPack + k, v.v[k]);
      store_pack(dst, p, r);
    }
  } else {
    for (int64_t i = tid; i < len; i += group) dst[i] = fn(i, src[i]);
  }
}
// row_map walking the row from its end: run right after a pass over the row
// from its start, the first elements it re-reads are the ones loaded last, still in L1/L2.
template <class T, class U, class Fn>
__device__ __forceinline__ void row_map_from_end(const T* src, U* dst, int64_t len, int tid,
                                                 int group, bool packed, Fn&& fn) {
  if (packed) {
    const int64_t packs = len / kPack;
    for (int64_t q = tid; q < packs; q += group) {
      const int64_t p = packs - 1 - q;
      const Pack8<T> v = load_pack(src, p);
      Pack8<U> r;
#pragma unroll
      for (int k = 0; k < kPack; ++k) r.v[k] = fn(p * kPack + k, v.v[k]);
      store_pack(dst, p, r);
    }
  } else {
    for (int64_t q = tid; q < len; q += group) dst[len - 1 - q] = fn(len - 1 - q, src[len - 1 - q]);
  }
}
inline bool rows_packable(const void* base, int64_t len) { return len % kPack == 0 && aligned16({base}); }

// For kernels that keep a row in registers, lane l of a warp holding packs l, l + 32, ...:
// calls fn(std::integral_constant<int, K>{}) for the smallest K in {1, 2, 3, 4, 5, 8} (up to
// kMax) with 32 * 8 * K >= C and returns true; false when the row is longer.
template <int kMax, class Fn>
bool with_row_packs(int64_t C, Fn&& fn) {
  const int64_t need = (C / kPack + 31) / 32;
  if (need <= 1) return fn(std::integral_constant<int, 1>{}), true;
  if (need <= 2) return fn(std::integral_constant<int, 2>{}), true;
  if (need <= 3) return fn(std::integral_constant<int, 3>{}), true;
  if (need <= 4) return fn(std::integral_constant<int, 4>{}), true;
  if constexpr (kMax >= 8) {
    if (need <= 5) return fn(std::integral_constant<int, 5>{}), true;
    if (need <= 8) return fn(std::integral_constant<int, 8>{}), true;
  }
  return false;
}

// ---- launch helpers ----
constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n items: enough to fill the device, capped.
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535LL * 8)));
}

// Selects the tensor's device and takes its current stream for the duration of one entry.
struct KernelContext {
  DeviceGuard guard;
  cudaStream_t stream;
  explicit KernelContext(const Tensor& t)
      : guard(t.device().index), stream(current_stream(t.device().index)) {}
};

int multiprocessor_count(int device = -1);

// ---- reductions ----
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by an earlier call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  T r = lane < warps ? partial[lane] : T(0);
  return warp_sum(r);
}

template <class T>
__device__ T block_max(T v) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  T r = lane < warps ? partial[lane] : T(-INFINITY);
  return warp_max(r);
}

}  // namespace tessera::cuda
