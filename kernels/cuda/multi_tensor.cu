// Kernels over many tensors in one launch: AdamW with optional fp32 master weights, and
// the global gradient norm. A host-built table splits every tensor into chunks of
// kChunk elements; block b works on chunk b (the scaling: on every gridDim.x-th chunk from b),
// so one launch covers a whole model however its parameters are sized, and the norm's partial
// sums are added in a fixed order.
#include <algorithm>
#include <cmath>

#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace tessera::cuda {
namespace {

constexpr int64_t kChunk = 32768;
constexpr int kMultiThreads = 512;

struct TensorSlot {
  void* param;         // f32, or f16/bf16 when master is set
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* master;       // null when the param itself is f32
  int64_t numel;
  bool decay;          // weight decay applies (else the decay factor is 1)
  DType param_dtype;
  DType grad_dtype;
};

struct ChunkRef {
  int32_t slot;
  int64_t start;
};

// Copies the slot and chunk tables to the device in one buffer (small, synchronous upload).
template <class Slot>
Tensor upload_tables(const std::vector<Slot>& slots, const std::vector<ChunkRef>& chunks,
                     Device device, const Slot** slot_ptr, const ChunkRef** chunk_ptr) {
  const size_t slot_bytes = (slots.size() * sizeof(Slot) + 15) / 16 * 16;
  std::vector<uint8_t> bytes(slot_bytes + chunks.size() * sizeof(ChunkRef));
  std::memcpy(bytes.data(), slots.data(), slots.size() * sizeof(Slot));
  std::memcpy(bytes.data() + slot_bytes, chunks.data(), chunks.size() * sizeof(ChunkRef));
  Tensor t = from_vector(bytes, {static_cast<int64_t>(bytes.size())}, {.dtype = DType::u8, .device = device});
  auto* base = static_cast<const uint8_t*>(t.raw_data());
  *slot_ptr = reinterpret_cast<const Slot*>(base);
  *chunk_ptr = reinterpret_cast<const ChunkRef*>(base + slot_bytes);
  return t;
}

void append_chunks(std::vector<ChunkRef>& chunks, int32_t slot, int64_t n) {
  for (int64_t s = 0; s < n; s += kChunk) chunks.push_back({slot, s});
}

// Calls fn(typed pointer) for the f32/f16/bf16 slots; false for other dtypes.
template <class Fn>
__device__ bool with_half_float_pointer(const void* data, DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32:
      fn(static_cast<float*>(const_cast<void*>(data)));
      return true;
    case DType::f16:
      fn(static_cast<Half*>(const_cast<void*>(data)));
      return true;
    case DType::bf16:
      fn(static_cast<BFloat16*>(const_cast<void*>(data)));
      return true;
    default:
      return false;
  }
}

// clip_grad_norm_'s factor of the norm at `norm_at`, computed in f64 exactly as the host
// computes it; false when no clipping is due (the factor would be 1).
__device__ bool clip_factor(const float* norm_at, double max_norm, float& factor) {
  const double norm = *norm_at;
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef < 1.0) && isfinite(norm)) return false;
  factor = static_cast<float>(1.0 < coef ? 1.0 : coef);  // std::min(coef, 1.0), NaN kept
  return true;
}

// A gradient element as the update reads it: clipped by `clip` first when `clipped` (rounded to
// the gradient's dtype, as the clip's pass would have stored it), then times grad_scale.
template <class G>
__device__ __forceinline__ float read_grad(G g, bool clipped, float clip, float grad_scale) {
  const float v = clipped ? to_float(from_float<G>(__fmul_rn(to_float(g), clip))) : to_float(g);
  return __fmul_rn(v, grad_scale);
}

// One chunk [start, end) of a tensor's AdamW update on typed pointers: 8-element packs when
// every array is 16-byte aligned at the chunk's start (a 16-bit gradient or parameter one
// 16-byte access per pack, the f32 moments and weights two), then single elements. The
// per-element math is adamw_update_element either way, so the bits do not depend on the path;
// the per-element loads of a run-time dtype used about 60% of the memory's bandwidth.
// `weights` is the f32 copy updated (the master, or the f32 parameter itself); `param` gets
// the rounded result when it is a separate low-precision tensor.
template <class G, class P>
__device__ void adamw_chunk(const G* grad, P* param, float* weights, float* exp_avg,
                            float* exp_avg_sq, bool separate_param, int64_t start, int64_t end,
                            const AdamWCoefficients<float>& coeffs, bool clipped, float clip,
                            float grad_scale) {
  auto aligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  int64_t tail = start;
  if (aligned(grad + start) && aligned(exp_avg + start) && aligned(exp_avg_sq + start) &&
      aligned(weights + start) && (!separate_param || aligned(param + start))) {
    const int64_t packs = (end - start) / kPack;
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack8<G> g = load_pack(grad + start, k);
      Pack8<float> m = load_pack(exp_avg + start, k), v = load_pack(exp_avg_sq + start, k);
      Pack8<float> w = load_pack(weights + start, k);
      Pack8<P> rounded;
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        w.v[j] = adamw_update_element(w.v[j], read_grad(g.v[j], clipped, clip, grad_scale),
                                      m.v[j], v.v[j], coeffs);
        rounded.v[j] = from_float<P>(w.v[j]);
      }
      store_pack(exp_avg + start, k, m);
      store_pack(exp_avg_sq + start, k, v);
      store_pack(weights + start, k, w);
      if (separate_param) store_pack(param + start, k, rounded);
    }
    tail = start + packs * kPack;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x) {
    float m = exp_avg[i], v = exp_avg_sq[i];
    const float w = adamw_update_element(weights[i], read_grad(grad[i], clipped, clip, grad_scale),
                                         m, v, coeffs);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    weights[i] = w;
    if (separate_param) param[i] = from_float<P>(w);
  }
}

// The element update is adamw_update_element (core/adamw_math.h), the CPU's own, with the
// host's coefficients: each operation an _rn intrinsic, so nvcc contracts nothing and the
// result has the CPU's bits.
__global__ void __launch_bounds__(kMultiThreads)
    adamw_kernel(const TensorSlot* slots, const ChunkRef* chunks, AdamWCoefficients<float> coeffs,
                 float grad_scale, const float* replay_scalars, const float* clip_norm,
                 double clip_max_norm) {
  float clip = 1.f;
  const bool clipped = clip_norm && clip_factor(clip_norm, clip_max_norm, clip);
  if (replay_scalars) {  // this replay's coefficients (adamw_replay_scalars)
    coeffs.decay = replay_scalars[0];
    coeffs.step_size = replay_scalars[1];
    coeffs.bias_correction2_sqrt = replay_scalars[2];
  }
  const ChunkRef c = chunks[blockIdx.x];
  const TensorSlot s = slots[c.slot];
  AdamWCoefficients<float> tensor_coeffs = coeffs;
  if (!s.decay) tensor_coeffs.decay = 1.f;  // 1 - lr·0, as the host computes it
  const int64_t end = min(s.numel, c.start + kChunk);
  float* weights = s.master ? s.master : static_cast<float*>(s.param);
  auto half_or_float = [](DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; };
  if (half_or_float(s.grad_dtype) && half_or_float(s.param_dtype)) {
    with_half_float_pointer(s.grad, s.grad_dtype, [&](auto* grad) {
      with_half_float_pointer(s.param, s.param_dtype, [&](auto* param) {
        adamw_chunk(grad, param, weights, s.exp_avg, s.exp_avg_sq, s.master != nullptr, c.start,
                    end, tensor_coeffs, clipped, clip, grad_scale);
      });
    });
    return;
  }
  for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {  // f64 gradients
    float g = load_as<float>(s.grad, s.grad_dtype, i);  // stored back as f32 by the clip's pass
    if (clipped) g = __fmul_rn(g, clip);
    g = __fmul_rn(g, grad_scale);
    float m = s.exp_avg[i], v = s.exp_avg_sq[i];
    const float p = adamw_update_element(weights[i], g, m, v, tensor_coeffs);
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = v;
    weights[i] = p;
    if (s.master) store_as<float>(s.param, s.param_dtype, i, p);
  }
}

struct NormSlot {
  const void* data;
  int64_t numel;
  DType dtype;
};

// The norm's and the scaling's walks over one chunk [start, end) of an f32/f16/bf16 tensor:
// 8-element packs (one 16-byte access for 16-bit types) from the chunk's start when it is
// 16-byte aligned, then single elements. The per-element reads of a run-time dtype moved
// 2 bytes per access, well below the memory's bandwidth.
template <class T>
__device__ float chunk_sum_squares(const T* p, int64_t start, int64_t end) {
  float acc = 0.f;
  int64_t tail = start;
  if (reinterpret_cast<uintptr_t>(p + start) % 16 == 0) {
    const int64_t packs = (end - start) / kPack;
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack8<T> v = load_pack(p + start, k);
#pragma unroll
      for (int j = 0; j < kPack; ++j) acc += to_float(v.v[j]) * to_float(v.v[j]);
    }
    tail = start + packs * kPack;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x)
    acc += to_float(p[i]) * to_float(p[i]);
  return acc;
}

template <class T>
__device__ void chunk_scale(T* p, int64_t start, int64_t end, float factor) {
  int64_t tail = start;
  if (reinterpret_cast<uintptr_t>(p + start) % 16 == 0) {
    const int64_t packs = (end - start) / kPack;
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      Pack8<T> v = load_pack(p + start, k);
#pragma unroll
      for (int j = 0; j < kPack; ++j) v.v[j] = from_float<T>(to_float(v.v[j]) * factor);
      store_pack(p + start, k, v);
    }
    tail = start + packs * kPack;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x)
    p[i] = from_float<T>(to_float(p[i]) * factor);
}

__global__ void __launch_bounds__(kMultiThreads)
    sum_squares_kernel(const NormSlot* slots, const ChunkRef* chunks, float* partial) {
  const ChunkRef c = chunks[blockIdx.x];
  const NormSlot s = slots[c.slot];
  const int64_t end = min(s.numel, c.start + kChunk);
  float acc = 0.f;
  if (!with_half_float_pointer(s.data, s.dtype,
                               [&](auto* p) { acc = chunk_sum_squares(p, c.start, end); })) {
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
      const float g = load_as<float>(s.data, s.dtype, i);
      acc += g * g;
    }
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Where the factor of a scaling comes from.
enum class FactorSource {
  host,            // `factor` as given
  clip_of_norm,    // clip_grad_norm_'s factor of the norm at `device_value`, computed in f64
                   // exactly as the host computes it; nothing to do when no clipping is due
  value_unless_one  // the f32 at `device_value`; nothing to do when it is exactly 1
};

// Blocks with nothing to do (decided on the device) leave the data alone. Each block walks
// over chunks blockIdx.x, + gridDim.x, ... of the n_chunks: a launch of a few blocks per SM
// costs little when the factor turns out to be 1 (one block per chunk of a GPT-2's [N, V]
// logits gradient was 25 us of launching blocks that did nothing).
__global__ void __launch_bounds__(kMultiThreads)
    scale_kernel(const NormSlot* slots, const ChunkRef* chunks, int64_t n_chunks, float factor,
                 FactorSource source, const float* device_value, double max_norm) {
  if (source == FactorSource::clip_of_norm) {
    if (!clip_factor(device_value, max_norm, factor)) return;
  } else if (source == FactorSource::value_unless_one) {
    factor = *device_value;
    if (factor == 1.f) return;
  }
  for (int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const ChunkRef c = chunks[b];
    const NormSlot s = slots[c.slot];
    void* data = const_cast<void*>(s.data);
    const int64_t end = min(s.numel, c.start + kChunk);
    if (with_half_float_pointer(data, s.dtype,
                                [&](auto* p) { chunk_scale(p, c.start, end, factor); }))
      continue;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x)
      store_as<float>(data, s.dtype, i, load_as<float>(data, s.dtype, i) * factor);
  }
}

__global__ void norm_finish_kernel(const float* partial, int64_t n, float* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = static_cast<float>(sqrt(acc));
}

}  // namespace

void multi_tensor_adamw(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                        const std::vector<Tensor>& master, const std::vector<bool>& decay,
                        const AdamWConfig& cfg) {
  const size_t n = params.size();
  TESSERA_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n &&
                    decay.size() == n && (master.empty() || master.size() == n),
                "multi_tensor_adamw: ", n, " params but ", grads.size(), " grads, ",
                exp_avg.size(), " exp_avg, ", exp_avg_sq.size(), " exp_avg_sq, ", master.size(),
                " master copies and ", decay.size(), " decay flags");
  TESSERA_CHECK(cfg.step >= 1, "multi_tensor_adamw: step must be >= 1, got ", cfg.step);
  if (n == 0) return;
  const Device device = params[0].device();
  std::vector<TensorSlot> slots;
  std::vector<ChunkRef> chunks;
  for (size_t i = 0; i < n; ++i) {
    const Tensor& p = params[i];
    const bool has_master = !master.empty() && master[i].defined();
    auto ok = [&](const Tensor& t, bool f32) {
      return t.defined() && t.device() == device && t.is_contiguous() && t.numel() == p.numel() &&
             (!f32 || t.dtype() == DType::f32);
    };
    TESSERA_CHECK(device.is_cuda() && ok(p, !has_master) && ok(grads[i], false) &&
                      is_floating(grads[i].dtype()) && ok(exp_avg[i], true) &&
                      ok(exp_avg_sq[i], true) && (!has_master || ok(master[i], true)),
                  "multi_tensor_adamw: tensor ", i, " (param ", shape_str(p.shape()), " ",
                  dtype_name(p.dtype()), " on ", p.device().str(),
                  "): grads/moments/master must be contiguous, same size, on the same CUDA "
                  "device, moments and master float32, param float32 unless a master is given");
    if (p.numel() == 0) continue;
    slots.push_back({p.raw_data(), grads[i].raw_data(), exp_avg[i].data<float>(),
                     exp_avg_sq[i].data<float>(), has_master ? master[i].data<float>() : nullptr,
                     p.numel(), decay[i], p.dtype(), grads[i].dtype()});
    append_chunks(chunks, static_cast<int32_t>(slots.size() - 1), p.numel());
  }
  if (chunks.empty()) return;
  KernelContext ctx(params[0]);
  const TensorSlot* dslots;
  const ChunkRef* dchunks;
  Tensor tables = upload_tables(slots, chunks, device, &dslots, &dchunks);
  const AdamWCoefficients<float> coeffs = rounded_to<float>(
      adamw_coefficients(cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.step));
  adamw_kernel<<<static_cast<unsigned>(chunks.size()), kMultiThreads, 0, ctx.stream>>>(
      dslots, dchunks, coeffs, cfg.grad_scale, cfg.replay_scalars, cfg.clip_norm, cfg.clip_max_norm);
  TESSERA_KERNEL_CHECK("adamw_kernel");
}

namespace {
// One launch of scale_kernel over every tensor, by a factor from `source` (device_value: one
// f32 on the tensors' device, for the device sources).
void scale_tensors(const std::vector<Tensor>& tensors, double factor, FactorSource source,
                   const Tensor& device_value = Tensor(), double max_norm = 0.0) {
  std::vector<NormSlot> slots;
  std::vector<ChunkRef> chunks;
  Tensor first;
  for (const Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    if (!first.defined()) first = t;
    const Device device = first.device();
    TESSERA_CHECK(t.device().is_cuda() && t.device() == device && is_floating(t.dtype()) &&
                      t.is_contiguous(),
                  "multi_tensor_scale_: every tensor must be a contiguous floating tensor on one CUDA "
                  "device, got ", dtype_name(t.dtype()), " ", shape_str(t.shape()), " on ",
                  t.device().str(), t.is_contiguous() ? "" : " (not contiguous)");
    slots.push_back({t.raw_data(), t.numel(), t.dtype()});
    append_chunks(chunks, static_cast<int32_t>(slots.size() - 1), t.numel());
    t.impl().version++;
  }
  if (chunks.empty()) return;
  KernelContext ctx(first);
  const NormSlot* dslots;
  const ChunkRef* dchunks;
  Tensor tables = upload_tables(slots, chunks, first.device(), &dslots, &dchunks);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  const int64_t blocks = std::min<int64_t>(n_chunks, 4 * int64_t(multiprocessor_count()));
  scale_kernel<<<static_cast<unsigned>(blocks), kMultiThreads, 0, ctx.stream>>>(
      dslots, dchunks, n_chunks, static_cast<float>(factor), source,
      device_value.defined() ? device_value.data<float>() : nullptr, max_norm);
  TESSERA_KERNEL_CHECK("scale_kernel");
}
}  // namespace

void multi_tensor_scale_(const std::vector<Tensor>& tensors, double factor) {
  scale_tensors(tensors, factor, FactorSource::host);
}

void scale_by_device_scalar_(const Tensor& t, const Tensor& scalar) {
  TESSERA_CHECK(scalar.defined() && scalar.numel() == 1 && is_floating(scalar.dtype()) &&
                    scalar.device() == t.device(),
                "scale_by_device_scalar_: the scalar must be one floating value on ",
                t.device().str(), ", got ", scalar.defined() ? shape_str(scalar.shape()) : "none",
                scalar.defined() ? " on " + scalar.device().str() : "");
  scale_tensors({t}, 1.0, FactorSource::value_unless_one,
                raw::contiguous(raw::to(scalar, t.device(), DType::f32)));
}

void multi_tensor_clip_(const std::vector<Tensor>& tensors, const Tensor& norm, double max_norm) {
  TESSERA_CHECK(norm.defined() && norm.numel() == 1 && norm.dtype() == DType::f32 &&
                    norm.device().is_cuda(),
                "multi_tensor_clip_: norm must be one float32 value on a CUDA device");
  TESSERA_CHECK(max_norm > 0, "multi_tensor_clip_: max_norm must be > 0, got ", max_norm);
  scale_tensors(tensors, 1.0, FactorSource::clip_of_norm, norm, max_norm);
}

Tensor global_grad_norm(const std::vector<Tensor>& grads) {
  TESSERA_CHECK(!grads.empty(), "global_grad_norm: no tensors");
  const Device device = grads[0].device();
  TESSERA_CHECK(device.is_cuda(), "global_grad_norm: tensors must be on a CUDA device, got ",
                device.str());
  std::vector<NormSlot> slots;
  std::vector<ChunkRef> chunks;
  std::vector<Tensor> keep;  // contiguous copies of strided gradients live until the launch
  for (const Tensor& g0 : grads) {
    if (!g0.defined() || g0.numel() == 0) continue;
    TESSERA_CHECK(g0.device() == device && is_floating(g0.dtype()),
                  "global_grad_norm: every tensor must be floating and on ", device.str(),
                  ", got ", dtype_name(g0.dtype()), " on ", g0.device().str());
    Tensor g = raw::contiguous(g0);
    keep.push_back(g);
    slots.push_back({g.raw_data(), g.numel(), g.dtype()});
    append_chunks(chunks, static_cast<int32_t>(slots.size() - 1), g.numel());
  }
  Tensor out = zeros({}, {.dtype = DType::f32, .device = device});
  if (chunks.empty()) return out;
  KernelContext ctx(out);
  const NormSlot* dslots;
  const ChunkRef* dchunks;
  Tensor tables = upload_tables(slots, chunks, device, &dslots, &dchunks);
  Tensor partial = empty({static_cast<int64_t>(chunks.size())}, {.dtype = DType::f32, .device = device});
  sum_squares_kernel<<<static_cast<unsigned>(chunks.size()), kMultiThreads, 0, ctx.stream>>>(
      dslots, dchunks, partial.data<float>());
  TESSERA_KERNEL_CHECK("sum_squares_kernel");
  norm_finish_kernel<<<1, 1024, 0, ctx.stream>>>(partial.data<float>(), partial.numel(),
                                                 out.data<float>());
  TESSERA_KERNEL_CHECK("norm_finish_kernel");
  return out;
}

}  // namespace tessera::cuda
