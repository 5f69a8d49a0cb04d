// The fused classifier: per row of logits, one online pass for (max, sum of exp), the loss,
// then a second pass that overwrites the logits with their gradient. The probabilities are
// never stored: for a 50k vocabulary that saves writing and re-reading an fp32 [N, V] tensor.
// A row of at most kStagedRowBytes (GPT-2's 50304 bf16 logits: 100 KB) is kept in shared
// memory between the passes, so it is read from memory once: two such blocks of 1024 threads
// fit an SM, one loading while the other reduces. (Re-reading it from L2 instead, walking the
// row backwards, still went to DRAM for most of it: 1.56 ms per GPT-2 124M step, at the
// traffic of three passes.) Longer or unaligned rows take the re-reading kernel.
#include "tessera/core/graph_capture.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace tessera::cuda {
namespace {

constexpr int kClassifierThreads = 1024;

// One logit into this thread's running max m and sum s of exp(x - m).
__device__ __forceinline__ void online_max_sum(float& m, float& s, float x) {
  if (x == -INFINITY) return;  // adds nothing (and -inf - -inf would be NaN)
  if (x > m) {
    s = s * __expf(m - x) + 1.f;
    m = x;
  } else {
    s += __expf(x - m);
  }
}

// Whether row r takes part in the loss. An ignored row gets a zero gradient and loss, a
// target out of range is flagged in *bad; either way the block has nothing more to do.
template <class T>
__device__ bool row_in_loss(T* row, int64_t r, int64_t target, int64_t vocab, int64_t ignore_index,
                            bool packed, float* row_losses, int* bad) {
  if (target == ignore_index) {
    if (packed) {
      Pack8<T> zero;
#pragma unroll
      for (int k = 0; k < kPack; ++k) zero.v[k] = from_float<T>(0.f);
      for (int64_t p = threadIdx.x; p < vocab / kPack; p += blockDim.x) store_pack(row, p, zero);
    } else {
      for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) row[i] = from_float<T>(0.f);
    }
    if (threadIdx.x == 0) row_losses[r] = 0.f;
    return false;
  }
  if (target < 0 || target >= vocab) {
    if (threadIdx.x == 0) *bad = 1;
    return false;
  }
  return true;
}

template <class T>
__global__ void __launch_bounds__(kClassifierThreads, 2)
    fused_classifier_kernel(T* logits, const void* targets, DType tt, int64_t vocab,
                            int64_t ignore_index, float host_scale, const float* device_scale,
                            float* row_losses, int* bad, bool packed) {
  // The target and the scale are first needed after pass 1: their loads overlap it.
  const float scale = device_scale ? *device_scale : host_scale;
  const int64_t r = blockIdx.x;
  T* row = logits + r * vocab;
  const int64_t target = load_as<int64_t>(targets, tt, r);
  // Pass 1: running max and sum of exp(x - max), merged across the block.
  float m = -INFINITY, s = 0.f;
  row_read(row, vocab, threadIdx.x, blockDim.x, packed,
           [&](int64_t, T v) { online_max_sum(m, s, to_float(v)); });
  const float row_max = block_max(m);
  s = m == -INFINITY ? 0.f : s * __expf(m - row_max);
  const float row_sum = block_sum(s);
  if (!row_in_loss(row, r, target, vocab, ignore_index, packed, row_losses, bad)) return;
  // Read the target's logit before pass 2 overwrites it.
  const float target_logit = to_float(row[target]);
  __syncthreads();
  if (threadIdx.x == 0) row_losses[r] = logf(row_sum) + row_max - target_logit;
  // Pass 2: the gradient in place.
  const float inv = 1.f / row_sum;
  row_map_from_end(row, row, vocab, threadIdx.x, blockDim.x, packed, [&](int64_t i, T v) {
    const float p = __expf(to_float(v) - row_max) * inv;
    return from_float<T>(scale * (p - (i == target ? 1.f : 0.f)));
  });
}

// The row lives in dynamic shared memory between the passes (packed rows of at most
// kStagedRowBytes). Each thread takes the packs it would in row_read, in the same order, so
// the sums and the gradient are bit for bit those of fused_classifier_kernel.
constexpr int64_t kStagedRowBytes = 110 * 1024;

template <class T>
__global__ void __launch_bounds__(kClassifierThreads, 2)
    fused_classifier_staged_kernel(T* logits, const void* targets, DType tt, int64_t vocab,
                                   int64_t ignore_index, float host_scale,
                                   const float* device_scale, float* row_losses, int* bad) {
  extern __shared__ __align__(16) unsigned char staged_bytes[];
  Pack8<T>* staged = reinterpret_cast<Pack8<T>*>(staged_bytes);
  // The target and the scale are first needed after pass 1: their loads overlap it.
  const float scale = device_scale ? *device_scale : host_scale;
  const int64_t r = blockIdx.x, packs = vocab / kPack;
  T* row = logits + r * vocab;
  const int64_t target = load_as<int64_t>(targets, tt, r);
  float m = -INFINITY, s = 0.f;
  auto take = [&](int64_t p, const Pack8<T>& v) {
    staged[p] = v;
#pragma unroll
    for (int k = 0; k < kPack; ++k) online_max_sum(m, s, to_float(v.v[k]));
  };
  // Two packs in flight per thread: both loads are issued before either is used.
  const int64_t step = blockDim.x;
  int64_t p = threadIdx.x;
  for (; p + step < packs; p += 2 * step) {
    const Pack8<T> a = load_pack(row, p), b = load_pack(row, p + step);
    take(p, a);
    take(p + step, b);
  }
  if (p < packs) take(p, load_pack(row, p));
  const float row_max = block_max(m);
  s = m == -INFINITY ? 0.f : s * __expf(m - row_max);
  const float row_sum = block_sum(s);  // its barriers also publish `staged`
  if (!row_in_loss(row, r, target, vocab, ignore_index, /*packed=*/true, row_losses, bad)) return;
  if (threadIdx.x == 0)
    row_losses[r] = logf(row_sum) + row_max - to_float(staged[target / kPack].v[target % kPack]);
  const float inv = 1.f / row_sum;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack8<T> v = staged[p];
    Pack8<T> g;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float prob = __expf(to_float(v.v[k]) - row_max) * inv;
      g.v[k] = from_float<T>(scale * (prob - (p * kPack + k == target ? 1.f : 0.f)));
    }
    store_pack(row, p, g);
  }
}

}  // namespace

void fused_classifier(const Tensor& logits, const Tensor& targets_in, int64_t ignore_index,
                      double dloss_scale, const Tensor& row_losses, const Tensor& device_scale) {
  TESSERA_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cuda(),
                "fused_classifier: logits must be a contiguous [N, V] CUDA tensor, got ",
                shape_str(logits.shape()), " on ", logits.device().str());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TESSERA_CHECK(targets_in.numel() == rows && (targets_in.dtype() == DType::i32 ||
                                               targets_in.dtype() == DType::i64),
                "fused_classifier: targets must be ", rows, " int32/int64 values, got ",
                shape_str(targets_in.shape()), " ", dtype_name(targets_in.dtype()));
  TESSERA_CHECK(row_losses.numel() == rows && row_losses.dtype() == DType::f32 &&
                    row_losses.is_contiguous(),
                "fused_classifier: row_losses must be a contiguous float32 tensor of ", rows,
                " elements");
  TESSERA_CHECK(!device_scale.defined() ||
                    (device_scale.numel() == 1 && device_scale.dtype() == DType::f32 &&
                     device_scale.device() == logits.device()),
                "fused_classifier: device_scale must be one float32 value on ", logits.device().str());
  if (rows == 0) return;
  KernelContext ctx(logits);
  const float* scale_ptr = device_scale.defined() ? device_scale.data<float>() : nullptr;
  Tensor targets = raw::contiguous(targets_in);
  Tensor flag = zeros({1}, {.dtype = DType::i32, .device = logits.device()});
  const bool packed = rows_packable(logits.raw_data(), vocab);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    const size_t row_bytes = static_cast<size_t>(vocab) * sizeof(T);
    if (packed && row_bytes <= static_cast<size_t>(kStagedRowBytes)) {
      static const bool opted_in = [] {  // more than 48 KB of dynamic shared memory
        TESSERA_CUDA_CHECK(cudaFuncSetAttribute(fused_classifier_staged_kernel<T>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(kStagedRowBytes)));
        return true;
      }();
      (void)opted_in;
      fused_classifier_staged_kernel<T>
          <<<static_cast<unsigned>(rows), kClassifierThreads, row_bytes, ctx.stream>>>(
              static_cast<T*>(logits.raw_data()), targets.raw_data(), targets.dtype(), vocab,
              ignore_index, static_cast<float>(dloss_scale), scale_ptr, row_losses.data<float>(),
              flag.data<int32_t>());
      return;
    }
    fused_classifier_kernel<T><<<static_cast<unsigned>(rows), kClassifierThreads, 0, ctx.stream>>>(
        static_cast<T*>(logits.raw_data()), targets.raw_data(), targets.dtype(), vocab,
        ignore_index, static_cast<float>(dloss_scale), scale_ptr, row_losses.data<float>(),
        flag.data<int32_t>(), packed);
  };
  switch (logits.dtype()) {
    case DType::f32: launch(float{}); break;
    case DType::f16: launch(Half{}); break;
    case DType::bf16: launch(BFloat16{}); break;
    default: TESSERA_FAIL("fused_classifier: logits must be f32, f16 or bf16, got ",
                          dtype_name(logits.dtype()));
  }
  TESSERA_KERNEL_CHECK("fused_classifier_kernel");
  if (graph_capture_underway()) return;  // a graph cannot read the flag back (see graph_capture.h)
  int host_flag = 0;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(&host_flag, flag.raw_data(), sizeof(int),
                                     cudaMemcpyDeviceToHost, ctx.stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  TESSERA_CHECK(host_flag == 0, "fused_classifier: a target is outside [0, ", vocab,
                ") and is not ignore_index ", ignore_index);
}

}  // namespace tessera::cuda
