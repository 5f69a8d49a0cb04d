// LayerNorm over the last dim, forward and backward, with an optional fused
// residual add in front (residual_out = x + residual; out = LN(residual_out)) and, in the
// backward, the residual stream's gradient added into dx in the same pass
// (dx = LN_backward(dy) + dresidual): GPT-2's pre-norm blocks (ops::residual_layer_norm).
//
// Forward: one warp per row; a first mean, then the mean and variance of d = x - that
// mean are warp reductions, so the variance does not suffer the cancellation of
// E[x^2] - E[x]^2. The first mean is only a shift: with a large mean (1e3 over C = 4096) a
// plain f32 sum of x loses the mean's low digits, and x - that mean carried the error into
// every element. d is of the size of the row's spread, so its sum keeps f32 precision
// relative to it: the mean is shift + mean(d), the variance mean(d^2) - mean(d)^2 (the
// corrected two-pass algorithm), and x - mean is taken as d - mean(d), as on the CPU.
// Backward: dx one warp per row; dweight and dbias are summed over rows in two
// fixed-order stages (partial sums per block or chunk of rows, then over those), so they
// repeat bitwise and need no atomics.
//
// Fast paths (f32/f16/bf16, rows of a multiple of 8 elements up to 2048, 16-byte
// aligned): the row lives in registers, lane l of the warp owning 8-element packs l,
// l + 32, ..., so x (and dy) are read from global memory exactly once. The
// forward sums in the same order as the general kernel (bitwise equal
// results). The backward is one persistent kernel: each warp walks rows with a
// grid stride, writes dx and keeps its column partials (dweight, dbias, and the
// column sums of dx when a projection's bias was added in the forward) in shared
// memory; the block adds its warps' partials in warp order and writes one
// partial row, then the finish kernel sums the blocks' rows in a fixed order.
// Other rows (longer, odd lengths, f64) take the general kernels. Their statistics (mean,
// rstd) and column partials are kept in the accumulation type, so f64 inputs stay f64 end
// to end (f64 mean/rstd, as on the CPU) and the other dtypes keep f32 ones.
#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/cuda/norm_common.cuh"
#include "tessera/kernels/fused_table.h"

namespace tessera::cuda {
namespace {

template <class T>
__global__ void layer_norm_kernel(const T* x, const T* x_bias, const T* residual, T* residual_out,
                                  const T* w, const T* b, double eps, T* out, acc_t<T>* mean_out,
                                  acc_t<T>* rstd_out, int64_t rows, int64_t C, bool packed) {
  using A = acc_t<T>;
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.y;
  if (r >= rows) return;
  const int lane = threadIdx.x;
  const T* xr = x + r * C;
  // With a residual, the sum is the row this LN normalises; it is written once here.
  const T* src = xr;
  if (residual) {
    const T* rr = residual + r * C;
    T* ro = residual_out + r * C;
    row_map(xr, ro, C, lane, 32, packed, [&](int64_t i, T v) {
      if (x_bias) v = from_acc<T>(to_acc<A>(v) + to_acc<A>(x_bias[i]));
      return from_acc<T>(to_acc<A>(v) + to_acc<A>(rr[i]));
    });
    __syncwarp();
    src = ro;
  }
  A sum = 0;
  row_read(src, C, lane, 32, packed, [&](int64_t, T v) { sum += to_acc<A>(v); });
  const A shift = warp_sum(sum) / A(C);  // the first mean (see the top)
  A sum_d = 0, sum_dd = 0;
  row_read(src, C, lane, 32, packed, [&](int64_t, T v) {
    const A d = to_acc<A>(v) - shift;
    sum_d += d;
    sum_dd += d * d;
  });
  const A offset = warp_sum(sum_d) / A(C);  // mean - shift
  const A mean = shift + offset;
  const A variance = warp_sum(sum_dd) / A(C) - offset * offset;
  const A rstd = A(1) / sqrt((variance > A(0) ? variance : A(0)) + A(eps));
  row_map(src, out + r * C, C, lane, 32, packed, [&](int64_t i, T v) {
    A y = ((to_acc<A>(v) - shift) - offset) * rstd;
    if (w) y *= to_acc<A>(w[i]);
    if (b) y += to_acc<A>(b[i]);
    return from_acc<T>(y);
  });
  if (lane == 0) {
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

// ---- register-resident fast path ----
// A warp row of up to 32 * 8 * kPacks elements; the dispatcher picks the smallest kPacks.
constexpr int kMaxForwardPacks = 8, kMaxBackwardPacks = 8;

template <class T, int kPacks>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    layer_norm_regs_kernel(const T* x, const T* x_bias, const T* residual, T* residual_out,
                           const T* w, const T* b, float eps, T* out, float* mean_out,
                           float* rstd_out, int64_t rows, int64_t C) {
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.y;
  if (r >= rows) return;
  const int lane = threadIdx.x;
  const int64_t packs = C / kPack;
  float v[kPacks][kPack];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    Pack8<T> a = load_pack(x + r * C, p);
    if (residual) {  // the stored (rounded) sum is what gets normalised
      const Pack8<T> rr = load_pack(residual + r * C, p);
      if (x_bias) {  // rounded first, as the composition (x + x_bias) + residual
        const Pack8<T> xb = load_pack(x_bias, p);
#pragma unroll
        for (int j = 0; j < kPack; ++j)
          a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(xb.v[j]));
      }
#pragma unroll
      for (int j = 0; j < kPack; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(rr.v[j]));
      store_pack(residual_out + r * C, p, a);
    }
#pragma unroll
    for (int j = 0; j < kPack; ++j) v[k][j] = to_float(a.v[j]);
  }
  // Same per-lane order as row_read in the general kernel, so the statistics are bitwise equal.
  float sum = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
    if (lane + 32 * k < packs)
#pragma unroll
      for (int j = 0; j < kPack; ++j) sum += v[k][j];
  const float shift = warp_sum(sum) / float(C);
  float sum_d = 0, sum_dd = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
    if (lane + 32 * k < packs)
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const float d = v[k][j] - shift;
        sum_d += d;
        sum_dd += d * d;
      }
  const float offset = warp_sum(sum_d) / float(C);
  const float mean = shift + offset;
  const float variance = warp_sum(sum_dd) / float(C) - offset * offset;
  const float rstd = 1.f / sqrt((variance > 0.f ? variance : 0.f) + eps);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    Pack8<T> wp, bp, o;
    if (w) wp = load_pack(w, p);
    if (b) bp = load_pack(b, p);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      float y = ((v[k][j] - shift) - offset) * rstd;
      if (w) y *= to_float(wp.v[j]);
      if (b) y += to_float(bp.v[j]);
      o.v[j] = from_float<T>(y);
    }
    store_pack(out + r * C, p, o);
  }
  if (lane == 0) {
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

void check_param(const Tensor& p, const Tensor& x, const char* what) {
  if (!p.defined()) return;
  TESSERA_CHECK(p.numel() == x.size(-1) && p.dtype() == x.dtype() && p.device() == x.device(),
                "layer_norm (cuda): ", what, " must have ", x.size(-1), " elements of ",
                dtype_name(x.dtype()), " on ", x.device().str(), ", got ", shape_str(p.shape()),
                " ", dtype_name(p.dtype()));
}

void layer_norm_impl(const Tensor& x_in, const Tensor& x_bias_in, const Tensor& residual_in,
                     const Tensor& residual_out, const Tensor& w_in, const Tensor& b_in, double eps,
                     const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  TESSERA_CHECK(x_in.dim() >= 1 && out.is_contiguous() && out.dtype() == x_in.dtype() &&
                    out.shape() == x_in.shape(),
                "layer_norm (cuda): out must be contiguous, same shape and dtype as x ",
                shape_str(x_in.shape()));
  const DType stat_dtype = x_in.dtype() == DType::f64 ? DType::f64 : DType::f32;
  TESSERA_CHECK(is_floating(mean.dtype()) && mean.dtype() == rstd.dtype() &&
                    mean.is_contiguous() && rstd.is_contiguous(),
                "layer_norm (cuda): mean and rstd must be contiguous floating tensors of one dtype");
  check_param(w_in, x_in, "weight");
  check_param(b_in, x_in, "bias");
  check_param(x_bias_in, x_in, "x_bias");
  if (x_in.numel() == 0) return;
  if (mean.dtype() != stat_dtype) {
    // The kernels write the statistics in their accumulation type (f64 for f64 inputs).
    Tensor m = empty(mean.shape(), {.dtype = stat_dtype, .device = mean.device()});
    Tensor r = empty(rstd.shape(), {.dtype = stat_dtype, .device = rstd.device()});
    layer_norm_impl(x_in, x_bias_in, residual_in, residual_out, w_in, b_in, eps, out, m, r);
    raw::copy_(mean, m);
    raw::copy_(rstd, r);
    return;
  }
  KernelContext ctx(out);
  Tensor x = raw::contiguous(x_in);
  Tensor residual = residual_in.defined() ? raw::contiguous(residual_in) : Tensor();
  Tensor w = w_in.defined() ? raw::contiguous(w_in) : Tensor();
  Tensor b = b_in.defined() ? raw::contiguous(b_in) : Tensor();
  const Tensor xb = x_bias_in.defined() ? raw::contiguous(x_bias_in) : Tensor();
  const int64_t C = x.size(-1), rows = x.numel() / C;
  const bool packed = rows_packable(x.raw_data(), C) && aligned16({out.raw_data()}) &&
                      (!residual.defined() ||
                       aligned16({residual.raw_data(), residual_out.raw_data()}));
  const bool params_aligned = (!w.defined() || aligned16({w.raw_data()})) &&
                              (!b.defined() || aligned16({b.raw_data()})) &&
                              (!xb.defined() || aligned16({xb.raw_data()}));
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  visit_float(x.dtype(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      if (packed && params_aligned && with_row_packs<kMaxForwardPacks>(C, [&](auto packs) {
            layer_norm_regs_kernel<T, decltype(packs)::value>
                <<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
                    static_cast<const T*>(x.raw_data()), ptr_or_null<T>(xb),
                    ptr_or_null<T>(residual),
                    residual.defined() ? static_cast<T*>(residual_out.raw_data()) : nullptr,
                    ptr_or_null<T>(w), ptr_or_null<T>(b), static_cast<float>(eps),
                    static_cast<T*>(out.raw_data()), mean.data<float>(), rstd.data<float>(), rows,
                    C);
          }))
        return;
    }
    layer_norm_kernel<T><<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
        static_cast<const T*>(x.raw_data()), ptr_or_null<T>(xb), ptr_or_null<T>(residual),
        residual.defined() ? static_cast<T*>(residual_out.raw_data()) : nullptr, ptr_or_null<T>(w),
        ptr_or_null<T>(b), eps, static_cast<T*>(out.raw_data()), mean.data<acc_t<T>>(),
        rstd.data<acc_t<T>>(), rows, C, packed);
  });
  TESSERA_KERNEL_CHECK("layer_norm_kernel");
}

void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& out,
                const Tensor& mean, const Tensor& rstd) {
  layer_norm_impl(x, Tensor(), Tensor(), Tensor(), w, b, eps, out, mean, rstd);
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dresidual), g = w * dy.
template <class T>
__global__ void layer_norm_dx_kernel(const T* dy, const T* x, const T* w, const acc_t<T>* mean,
                                     const acc_t<T>* rstd, const T* dresidual, T* dx, int64_t rows,
                                     int64_t C, bool packed) {
  using A = acc_t<T>;
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.y;
  if (r >= rows) return;
  const int lane = threadIdx.x;
  const T* dyr = dy + r * C;
  const T* xr = x + r * C;
  const A m = mean[r], rs = rstd[r];
  A sum_g = 0, sum_gx = 0;
  row_read(dyr, C, lane, 32, packed, [&](int64_t i, T d) {
    const A g = to_acc<A>(d) * (w ? to_acc<A>(w[i]) : A(1));
    sum_g += g;
    sum_gx += g * (to_acc<A>(xr[i]) - m) * rs;
  });
  const A mean_g = warp_sum(sum_g) / A(C), mean_gx = warp_sum(sum_gx) / A(C);
  row_map(dyr, dx + r * C, C, lane, 32, packed, [&](int64_t i, T d) {
    const A g = to_acc<A>(d) * (w ? to_acc<A>(w[i]) : A(1));
    const A xhat = (to_acc<A>(xr[i]) - m) * rs;
    A out = rs * (g - mean_g - xhat * mean_gx);
    if (dresidual) out += to_acc<A>(dresidual[r * C + i]);
    return from_acc<T>(out);
  });
}

// The backward fast path: dx as layer_norm_dx_kernel (same per-lane order, so dx is bitwise
// equal), plus this block's column partials [C] of dweight, dbias and dx itself (the sum's
// gradient summed over rows: the bias gradient of a projection whose bias the forward added
// inside the norm, ops::residual_layer_norm's x_bias) in part_dw/part_db/part_dsum (each may be
// null). Persistent: the grid is what fits on the device, warps stride over rows.
// Each warp keeps its column partials in shared memory ([kBackwardWarps][3][C] floats, a lane
// touching only its own columns), not in registers, so the registers hold just the row's dy,
// x and dresidual, all loaded before the row's reductions (one round trip to memory per row),
// and rows up to 2048 wide take this path. Blocks of 4 warps: up to 3 packs of a 2-byte
// dtype (C <= 768) the registers are held to 96 so that 5 blocks (20 warps) fit on an SM;
// warps resident bound the bandwidth here (ncu: 16 warps reached 52% of DRAM's).
constexpr int kBackwardWarps = 4;
// Makes the compiler forget what it knows of a pack in registers, so that a second pass over
// it converts the elements to float again instead of keeping the first pass's floats alive:
// fewer registers, and with them more warps per SM.
template <class T>
__device__ __forceinline__ void forget_pack(Pack8<T>& p) {
  static_assert(sizeof(Pack8<T>) % 4 == 0);
  uint32_t* words = reinterpret_cast<uint32_t*>(p.v);
#pragma unroll
  for (size_t i = 0; i < sizeof(Pack8<T>) / 4; ++i) asm volatile("" : "+r"(words[i]));
}
constexpr int kBackwardParts = 3;  // dweight, dbias, dsum

template <class T, int kPacks>
__global__ void __launch_bounds__(32 * kBackwardWarps, sizeof(T) == 2 && kPacks <= 3 ? 5 : 1)
    layer_norm_backward_regs_kernel(const T* dy, const T* x, const T* w, const float* mean,
                                    const float* rstd, const T* dresidual, T* dx, int64_t rows,
                                    int64_t C, float* part_dw, float* part_db, float* part_dsum) {
  extern __shared__ float4 warp_partials_raw[];  // [kBackwardWarps][kBackwardParts][C]
  float* const warp_partials = reinterpret_cast<float*>(warp_partials_raw);
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t packs = C / kPack;
  const bool want_params = part_dw != nullptr || part_db != nullptr || part_dsum != nullptr;
  float* const acc = warp_partials + int64_t(warp) * kBackwardParts * C;  // this warp's rows
  // Adds v[0..7] into the warp's partial `part` at pack p. A partial keeps the first four
  // columns of every pack in its first half and the last four in its second, so the lanes'
  // 16-byte accesses are contiguous (no bank conflicts); the block sum below maps a column back.
  const int64_t half = C / 2;
  auto accumulate = [&](int part, int64_t p, const float(&v)[kPack]) {
    float4* lo_at = reinterpret_cast<float4*>(acc + part * C) + p;
    float4* hi_at = reinterpret_cast<float4*>(acc + part * C + half) + p;
    float4 lo = *lo_at, hi = *hi_at;
    lo.x += v[0], lo.y += v[1], lo.z += v[2], lo.w += v[3];
    hi.x += v[4], hi.y += v[5], hi.z += v[6], hi.w += v[7];
    *lo_at = lo, *hi_at = hi;
  };
  if (want_params)
    for (int64_t c = lane; c < kBackwardParts * C; c += 32) acc[c] = 0.f;
  __syncwarp();
  const int64_t warps_total = int64_t(gridDim.x) * kBackwardWarps;
  for (int64_t r = blockIdx.x * int64_t(kBackwardWarps) + warp; r < rows; r += warps_total) {
    Pack8<T> dyp[kPacks], xp[kPacks], res[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      dyp[k] = load_pack(dy + r * C, p);
      xp[k] = load_pack(x + r * C, p);
      if (dresidual) res[k] = load_pack(dresidual + r * C, p);
    }
    const float m = mean[r], rs = rstd[r];
    float sum_g = 0, sum_gx = 0;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      Pack8<T> wp;
      if (w) wp = load_pack(w, p);
      float dwv[kPack], dbv[kPack];
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const float d = to_float(dyp[k].v[j]);
        const float g = d * (w ? to_float(wp.v[j]) : 1.f);
        sum_g += g;
        sum_gx += g * (to_float(xp[k].v[j]) - m) * rs;
        dwv[j] = d * (to_float(xp[k].v[j]) - m) * rs;
        dbv[j] = d;
      }
      if (part_dw) {
        accumulate(0, p, dwv);
        accumulate(1, p, dbv);
      }
    }
    const float mean_g = warp_sum(sum_g) / float(C), mean_gx = warp_sum(sum_gx) / float(C);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      forget_pack(dyp[k]);
      forget_pack(xp[k]);
      Pack8<T> wp, o;
      if (w) wp = load_pack(w, p);
      float outv[kPack];
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const float g = to_float(dyp[k].v[j]) * (w ? to_float(wp.v[j]) : 1.f);
        const float xhat = (to_float(xp[k].v[j]) - m) * rs;
        float d = rs * (g - mean_g - xhat * mean_gx);
        if (dresidual) d += to_float(res[k].v[j]);
        o.v[j] = from_float<T>(d);
        outv[j] = to_float(o.v[j]);  // the sum's gradient as stored
      }
      store_pack(dx + r * C, p, o);
      if (part_dsum) accumulate(2, p, outv);
    }
  }
  if (!want_params) return;  // uniform over the grid
  // The block's partials: the warps' added in warp order (fixed), then one row goes out.
  __syncthreads();
  float* const outs[kBackwardParts] = {part_dw, part_db, part_dsum};
  for (int part = 0; part < kBackwardParts; ++part) {
    if (!outs[part]) continue;
    for (int64_t c = warp * 32 + lane; c < C; c += 32 * kBackwardWarps) {
      const int64_t at = (c % kPack < 4 ? 0 : half) + c / kPack * 4 + c % 4;
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < kBackwardWarps; ++v)
        s += warp_partials[(v * kBackwardParts + part) * C + at];
      outs[part][blockIdx.x * C + c] = s;
    }
  }
}

// Stage 1 of the general path: column partials over a chunk of rows, a thread per column:
// dweight/dbias (part_dw null: none) and the column sums of dx (dx null: none).
template <class T>
__global__ void layer_norm_dparams_partial_kernel(const T* dy, const T* x, const acc_t<T>* mean,
                                                  const acc_t<T>* rstd, const T* dx, int64_t rows,
                                                  int64_t C, int64_t rows_per_chunk,
                                                  acc_t<T>* part_dw, acc_t<T>* part_db,
                                                  acc_t<T>* part_dsum) {
  using A = acc_t<T>;
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= C) return;
  const int64_t r0 = chunk * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  A dw = 0, db = 0, ds = 0;
  for (int64_t r = r0; r < r1; ++r) {
    if (part_dw) {
      const A g = to_acc<A>(dy[r * C + c]);
      dw += g * (to_acc<A>(x[r * C + c]) - A(mean[r])) * A(rstd[r]);
      db += g;
    }
    if (dx) ds += to_acc<A>(dx[r * C + c]);
  }
  if (part_dw) {
    part_dw[chunk * C + c] = dw;
    part_db[chunk * C + c] = db;
  }
  if (dx) part_dsum[chunk * C + c] = ds;
}

// dresidual may be undefined (the plain LayerNorm backward); dsum (the column sums of dx,
// added into it) may be undefined. accumulate: dw, db and dsum get the sums added (the plain
// kernel's contract), else overwritten (the fused one's: they need no zero fill first).
void layer_norm_backward_impl(const Tensor& dy_in, const Tensor& x_in, const Tensor& w_in,
                              const Tensor& mean, const Tensor& rstd, const Tensor& dres_in,
                              const Tensor& dx, const Tensor& dw, const Tensor& db,
                              const Tensor& dsum, bool accumulate) {
  TESSERA_CHECK(dx.is_contiguous() && dx.dtype() == x_in.dtype() && dy_in.dtype() == x_in.dtype(),
                "layer_norm_backward (cuda): dx must be contiguous and dy, x, dx share a dtype");
  for (const Tensor* t : {&dw, &db, &dsum})
    TESSERA_CHECK(!t->defined() || (t->is_contiguous() && t->numel() == x_in.size(-1) &&
                                    t->dtype() == x_in.dtype()),
                  "layer_norm_backward (cuda): dweight/dbias/dsum must be contiguous, ",
                  x_in.size(-1), " elements of ", dtype_name(x_in.dtype()), ", got ",
                  shape_str(t->shape()), " ", dtype_name(t->dtype()));
  check_param(w_in, x_in, "weight");
  if (x_in.numel() == 0) return;
  KernelContext ctx(dx);
  Tensor dy = raw::contiguous(dy_in), x = raw::contiguous(x_in);
  Tensor w = w_in.defined() ? raw::contiguous(w_in) : Tensor();
  TESSERA_CHECK(
      !dres_in.defined() || (dres_in.shape() == x_in.shape() && dres_in.dtype() == x_in.dtype()),
      "layer_norm_backward (cuda): the residual gradient ", shape_str(dres_in.shape()),
      " must have the input's shape ", shape_str(x_in.shape()), " and dtype");
  const Tensor dres = dres_in.defined() ? raw::contiguous(dres_in) : Tensor();
  // The statistics in the kernels' accumulation type: f64 for f64 inputs (no f32 detour).
  const DType stat_dtype = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor m = raw::contiguous(raw::to(mean, mean.device(), stat_dtype));
  Tensor rs = raw::contiguous(raw::to(rstd, rstd.device(), stat_dtype));
  const int64_t C = x.size(-1), rows = x.numel() / C;
  const bool want_params = dw.defined() || db.defined(), want_dsum = dsum.defined();
  const bool fast = rows_packable(dy.raw_data(), C) && aligned16({x.raw_data(), dx.raw_data()}) &&
                    (!w.defined() || aligned16({w.raw_data()})) &&
                    (!dres.defined() || aligned16({dres.raw_data()}));
  // Column partials [3, chunks, C] (dweight, dbias, dsum) summed by the finish kernel; chunks =
  // blocks of the fast kernel or chunks of rows of the general one.
  auto finish = [&](auto tag, const acc_t<decltype(tag)>* part, int64_t chunks) {
    using T = decltype(tag);
    auto out = [](const Tensor& t) {
      return t.defined() ? static_cast<T*>(t.raw_data()) : nullptr;
    };
    add_column_partials<T>(ctx.stream, accumulate, part, part + chunks * C, chunks, C, out(dw),
                           out(db), part + 2 * chunks * C, out(dsum));
  };
  auto partials = [&](int64_t chunks, DType dtype) {
    return want_params || want_dsum ? empty({3, chunks, C}, {.dtype = dtype, .device = dx.device()})
                                    : Tensor();
  };
  visit_float(x.dtype(), "layer_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy.raw_data());
    const T* xp = static_cast<const T*>(x.raw_data());
    if constexpr (!std::is_same_v<T, double>) {
      if (fast && with_row_packs<kMaxBackwardPacks>(C, [&](auto packs) {
            constexpr int kPacks = decltype(packs)::value;
            auto kernel = layer_norm_backward_regs_kernel<T, kPacks>;
            const size_t smem =
                want_params || want_dsum ? kBackwardWarps * kBackwardParts * C * sizeof(float) : 0;
            allow_dynamic_shared_memory(kernel, smem);
            const int64_t blocks = persistent_norm_blocks(kernel, kBackwardWarps, smem, rows);
            Tensor part = partials(blocks, DType::f32);
            float* p = part.defined() ? part.data<float>() : nullptr;
            kernel<<<static_cast<unsigned>(blocks), dim3(32, kBackwardWarps), smem, ctx.stream>>>(
                dyp, xp, ptr_or_null<T>(w), m.data<float>(), rs.data<float>(), ptr_or_null<T>(dres),
                static_cast<T*>(dx.raw_data()), rows, C, want_params ? p : nullptr,
                want_params ? p + blocks * C : nullptr, want_dsum ? p + 2 * blocks * C : nullptr);
            TESSERA_KERNEL_CHECK("layer_norm_backward_regs_kernel");
            if (p) finish(tag, p, blocks);
          }))
        return;
    }
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    layer_norm_dx_kernel<T><<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
        dyp, xp, ptr_or_null<T>(w), m.data<acc_t<T>>(), rs.data<acc_t<T>>(), ptr_or_null<T>(dres),
        static_cast<T*>(dx.raw_data()), rows, C,
        rows_packable(dy.raw_data(), C) && aligned16({dx.raw_data()}));
    TESSERA_KERNEL_CHECK("layer_norm_dx_kernel");
    if (!want_params && !want_dsum) return;
    const NormChunks chunks = norm_chunks(rows, C);
    Tensor part = partials(chunks.count, stat_dtype);
    acc_t<T>* p = part.data<acc_t<T>>();
    layer_norm_dparams_partial_kernel<T>
        <<<dim3(static_cast<unsigned>(chunks.col_blocks), static_cast<unsigned>(chunks.count)),
           kThreads, 0, ctx.stream>>>(dyp, xp, m.data<acc_t<T>>(), rs.data<acc_t<T>>(),
                                      want_dsum ? static_cast<const T*>(dx.raw_data()) : nullptr,
                                      rows, C, chunks.rows_per_chunk, want_params ? p : nullptr,
                                      p + chunks.count * C, p + 2 * chunks.count * C);
    TESSERA_KERNEL_CHECK("layer_norm_dparams_partial_kernel");
    finish(tag, p, chunks.count);
  });
}

void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                         const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  layer_norm_backward_impl(dy, x, w, mean, rstd, Tensor(), dx, dw, db, Tensor(),
                           /*accumulate=*/true);
}

void fused_layer_norm_backward_residual(const Tensor& dy, const Tensor& x, const Tensor& w,
                                        const Tensor& mean, const Tensor& rstd,
                                        const Tensor& dresidual, const Tensor& dx, const Tensor& dw,
                                        const Tensor& db, const Tensor& dsum) {
  layer_norm_backward_impl(dy, x, w, mean, rstd, dresidual, dx, dw, db, dsum,
                           /*accumulate=*/false);
}

}  // namespace

void fused_residual_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& x_bias,
                               const Tensor& weight, const Tensor& bias, double eps,
                               const Tensor& residual_out, const Tensor& out, const Tensor& mean,
                               const Tensor& rstd) {
  TESSERA_CHECK(residual.shape() == x.shape() && residual.dtype() == x.dtype() &&
                    residual_out.shape() == x.shape() && residual_out.dtype() == x.dtype() &&
                    residual_out.is_contiguous() && x.device().is_cuda(),
                "fused_residual_layer_norm: x ", shape_str(x.shape()), " ", dtype_name(x.dtype()),
                ", residual ", shape_str(residual.shape()), " ", dtype_name(residual.dtype()),
                " and residual_out (contiguous) ", shape_str(residual_out.shape()),
                " must match, on a CUDA device");
  layer_norm_impl(x, x_bias, residual, residual_out, weight, bias, eps, out, mean, rstd);
}

namespace {

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.layer_norm = layer_norm;
  t.layer_norm_backward = layer_norm_backward;
  FusedKernelTable& fused = fused_kernel_table(DeviceType::CUDA);
  fused.residual_layer_norm = fused_residual_layer_norm;
  fused.layer_norm_backward_residual = fused_layer_norm_backward_residual;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
