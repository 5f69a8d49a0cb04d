// Cross-entropy over the last (class) dim, loss and dlogits, in f32 (f64 for f64 logits) from
// the online row statistics of kernels/cuda/row_softmax.cuh: a block of kLongRowThreads per
// row for long rows (a 50k vocabulary), a warp per row otherwise. The fused classifier (loss
// and gradient in one pass): classifier.cu.
#include <cmath>
#include <string>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/device_flag.cuh"
#include "tessera/kernels/cuda/row_softmax.cuh"

namespace tessera::cuda {
namespace {

// ---- cross-entropy ----
// Per row: loss_r = log(sum exp(x - max)) + max - x[target]; ignored rows give 0 and count 0.
// loss = sum of the rows' losses and count = rows counted (the front-end divides for Mean).
// A target outside [0, V) that is not ignore_index raises bad_target.
template <class T>
__global__ void __launch_bounds__(kLongRowThreads) cross_entropy_rows_kernel(const T* logits, const void* targets, DType tt,
                                          int64_t rows, int64_t vocab, int64_t ignore_index,
                                          double* row_loss, int* row_counted, int* bad_target,
                                          bool packed) {
  using A = acc_t<T>;
  const int64_t r = group_row(rows);
  if (r < 0) return;
  const int64_t target = load_as<int64_t>(targets, tt, r);
  const bool ignored = target == ignore_index;
  if (!ignored && (target < 0 || target >= vocab)) {
    if (threadIdx.x == 0) *bad_target = 1;
    return;  // the group leaves together: `target` is the same for all its threads
  }
  if (ignored) {
    if (threadIdx.x == 0) {
      row_loss[r] = 0.0;
      row_counted[r] = 0;
    }
    return;
  }
  const T* xr = logits + r * vocab;
  MaxSum<A> s{A(-INFINITY), A(0)};
  row_read(xr, vocab, threadIdx.x, blockDim.x, packed, [&](int64_t, T v) { s = push(s, to_acc<A>(v)); });
  s = group_merge(s);
  if (threadIdx.x == 0) {
    row_loss[r] = static_cast<double>(log(s.sum) + s.max - to_acc<A>(xr[target]));
    row_counted[r] = 1;
  }
}

// One block sums the rows in a fixed order: the loss is the same bits on every run.
__global__ void cross_entropy_finish_kernel(const double* row_loss, const int* row_counted,
                                            int64_t rows, void* loss, DType lt, void* count,
                                            DType ct) {
  double s = 0;
  long long c = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    s += row_loss[r];
    c += row_counted[r];
  }
  s = block_sum(s);
  c = block_sum(c);
  if (threadIdx.x == 0) {
    store_as<double>(loss, lt, 0, s);  // the sum, as the CPU kernel: the front-end divides for Mean
    store_as<double>(count, ct, 0, static_cast<double>(c));
  }
}

void cross_entropy(const Tensor& logits_in, const Tensor& targets_in, int64_t ignore_index,
                   const Tensor& loss, const Tensor& count) {
  TESSERA_CHECK(logits_in.dim() == 2 && targets_in.dim() == 1 &&
                    targets_in.size(0) == logits_in.size(0),
                "cross_entropy (cuda): logits must be [N, V] and targets [N], got ",
                shape_str(logits_in.shape()), " and ", shape_str(targets_in.shape()));
  TESSERA_CHECK(loss.dtype() == DType::f32 || loss.dtype() == DType::f64,
                "cross_entropy (cuda): loss must be float32 or float64");
  KernelContext ctx(loss);
  Tensor logits = raw::contiguous(logits_in), targets = raw::contiguous(targets_in);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  Tensor row_loss = empty({std::max<int64_t>(rows, 1)}, {.dtype = DType::f64, .device = loss.device()});
  Tensor flags = zeros({std::max<int64_t>(rows, 1) + 1}, {.dtype = DType::i32, .device = loss.device()});
  int* row_counted = flags.data<int32_t>();
  int* bad = row_counted + std::max<int64_t>(rows, 1);
  visit_float(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    RowLaunch l = row_launch<T>(rows, vocab);
    if (rows > 0)
      cross_entropy_rows_kernel<T><<<l.grid, l.block, 0, ctx.stream>>>(
          static_cast<const T*>(logits.raw_data()), targets.raw_data(), targets.dtype(), rows,
          vocab, ignore_index, row_loss.data<double>(), row_counted, bad,
          rows_packable(logits.raw_data(), vocab));
  });
  TESSERA_KERNEL_CHECK("cross_entropy_rows_kernel");
  cross_entropy_finish_kernel<<<1, 1024, 0, ctx.stream>>>(row_loss.data<double>(), row_counted,
                                                         rows, loss.raw_data(), loss.dtype(),
                                                         count.raw_data(), count.dtype());
  TESSERA_KERNEL_CHECK("cross_entropy_finish_kernel");
  check_flag(bad, ctx.stream,
             ::tessera::detail::concat("cross_entropy: a target is outside [0, ", vocab,
                            ") and is not ignore_index ", ignore_index));
}

// dlogits = scale * (softmax(x) - onehot(target)); ignored rows get zeros.
template <class T>
__global__ void __launch_bounds__(kLongRowThreads) cross_entropy_backward_kernel(const T* logits, const void* targets, DType tt,
                                              int64_t rows, int64_t vocab, int64_t ignore_index,
                                              float scale, T* dlogits, bool packed) {
  using A = acc_t<T>;
  const int64_t r = group_row(rows);
  if (r < 0) return;
  const int64_t target = load_as<int64_t>(targets, tt, r);
  const T* xr = logits + r * vocab;
  T* dr = dlogits + r * vocab;
  if (target == ignore_index) {
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) dr[i] = from_acc<T>(A(0));
    return;
  }
  MaxSum<A> s{A(-INFINITY), A(0)};
  row_read(xr, vocab, threadIdx.x, blockDim.x, packed, [&](int64_t, T v) { s = push(s, to_acc<A>(v)); });
  s = group_merge(s);
  const A inv = A(1) / s.sum;
  row_map_from_end(xr, dr, vocab, threadIdx.x, blockDim.x, packed, [&](int64_t i, T x) {
    const A p = exp(to_acc<A>(x) - s.max) * inv;
    return from_acc<T>(A(scale) * (p - (i == target ? A(1) : A(0))));
  });
}

void cross_entropy_backward(const Tensor& logits_in, const Tensor& targets_in,
                            int64_t ignore_index, double scale, const Tensor& dlogits) {
  TESSERA_CHECK(dlogits.is_contiguous() && dlogits.dtype() == logits_in.dtype() &&
                    logits_in.dim() == 2,
                "cross_entropy_backward (cuda): dlogits must be contiguous [N, V] in the logits' "
                "dtype");
  if (dlogits.numel() == 0) return;
  KernelContext ctx(dlogits);
  Tensor logits = raw::contiguous(logits_in), targets = raw::contiguous(targets_in);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  visit_float(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    RowLaunch l = row_launch<T>(rows, vocab);
    cross_entropy_backward_kernel<T><<<l.grid, l.block, 0, ctx.stream>>>(
        static_cast<const T*>(logits.raw_data()), targets.raw_data(), targets.dtype(), rows,
        vocab, ignore_index, static_cast<float>(scale), static_cast<T*>(dlogits.raw_data()),
        rows_packable(logits.raw_data(), vocab) && aligned16({dlogits.raw_data()}));
  });
  TESSERA_KERNEL_CHECK("cross_entropy_backward_kernel");
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.cross_entropy = cross_entropy;
  t.cross_entropy_backward = cross_entropy_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
