// The argument contract shared by every attention implementation on [B, H, T, D] views (the
// hand-written kernels of attention.cu / attention_backward.cu and cuDNN's in
// cudnn_attention.cpp): plain host code, so C++ and CUDA sources both include it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/settings.h"
#include "tessera/core/tensor.h"

namespace tessera::cuda::attention_detail {

// q is [B, H, T, D]; k and v are [B, Hkv, T, D] with Hkv dividing H (grouped-query
// attention: query head h reads key/value head h / group, Hugging Face's repeat_kv order).
struct AttnShape {
  int64_t B, H, T, D, Hkv;
  int64_t group() const { return H / Hkv; }
};

inline AttnShape check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              bool any_head_size) {
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4 && k.shape() == v.shape() && k.size(0) == q.size(0) &&
                    k.size(2) == q.size(2) && k.size(3) == q.size(3),
                op, ": q must be [B, H, T, D] and k, v both [B, Hkv, T, D], got ",
                shape_str(q.shape()), ", ", shape_str(k.shape()), ", ", shape_str(v.shape()));
  TESSERA_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": the ", q.size(1),
                " query heads are not a multiple of the ", k.size(1), " key/value heads (q ",
                shape_str(q.shape()), ", k ", shape_str(k.shape()), ")");
  TESSERA_CHECK((q.dtype() == DType::bf16 || q.dtype() == DType::f16) && k.dtype() == q.dtype() &&
                    v.dtype() == q.dtype(),
                op, ": q, k, v must be bfloat16 or float16 alike, got ", dtype_name(q.dtype()),
                ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  TESSERA_CHECK(q.device().is_cuda() && k.device() == q.device() && v.device() == q.device(), op,
                ": q, k, v must be on one CUDA device");
  TESSERA_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, op,
                ": the head dimension must be contiguous (stride 1)");
  const int64_t D = q.size(3);
  TESSERA_CHECK(any_head_size || D == 64 || D == 128, op, ": head size must be 64 or 128, got ", D);
  return {q.size(0), q.size(1), q.size(2), D, k.size(1)};
}

// The [B, H, T, D] tensors besides q, k, v (out, dout, dq; dk and dv are [B, Hkv, T, D])
// may be views, e.g. the
// heads of a [B, T, C] output or of a fused [B, T, 3C] gradient, so no layout copy is needed
// around the kernels: they must match q (dk, dv: k) in shape, dtype and device and have the head dim
// contiguous. With `vector_rows` their rows must also start on 16-byte boundaries (the
// tensor-core kernels move 16-byte packs). A tensor the kernels write must not overlap itself
// (different blocks write its elements, each once).
inline bool rows_on_16_bytes(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
         t.stride(2) % 8 == 0;
}

// True when no two indices of t address one element: sorted by stride, every dimension
// steps over the whole extent of the smaller ones.
inline bool non_overlapping(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements spanned by the dims already seen
  for (auto [stride, size] : dims) {
    if (stride < extent) return false;
    extent = stride * (size - 1) + extent;
  }
  return true;
}

inline void check_head_view(const char* op, const char* name, const Tensor& t, const Tensor& like,
                            bool vector_rows, bool written) {
  TESSERA_CHECK(t.defined() && t.shape() == like.shape() && t.dtype() == like.dtype() &&
                    t.device() == like.device(),
                op, ": ", name, " must be a ", shape_str(like.shape()), " ", dtype_name(like.dtype()),
                " tensor on ", like.device().str(), ", got ",
                t.defined() ? shape_str(t.shape()) + " " + dtype_name(t.dtype()) + " on " +
                                  t.device().str()
                            : std::string("an undefined tensor"));
  TESSERA_CHECK(t.stride(3) == 1, op, ": ", name, " must have a contiguous head dimension, got strides ",
                shape_str(t.strides()));
  TESSERA_CHECK(!vector_rows || rows_on_16_bytes(t), op, ": ", name,
                " rows must start on 16-byte boundaries (16-byte aligned data, strides multiples of 8 "
                "elements), got strides ",
                shape_str(t.strides()), " at address offset ",
                reinterpret_cast<uintptr_t>(t.raw_data()) % 16, " mod 16");
  TESSERA_CHECK(!written || non_overlapping(t), op, ": ", name,
                " is written and must not overlap itself, got shape ", shape_str(t.shape()),
                " strides ", shape_str(t.strides()));
}

// q, k, v as the tensor-core kernels read them (16-byte packs along rows).
inline void check_vector_rows(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_head_view(op, "q", q, q, /*vector_rows=*/true, /*written=*/false);
  check_head_view(op, "k", k, k, /*vector_rows=*/true, /*written=*/false);
  check_head_view(op, "v", v, k, /*vector_rows=*/true, /*written=*/false);
}

inline void check_lse(const char* op, const Tensor& lse, const AttnShape& s, Device device) {
  TESSERA_CHECK(lse.dtype() == DType::f32 && lse.is_contiguous() && lse.numel() == s.B * s.H * s.T &&
                    lse.device() == device,
                op, ": lse must be a contiguous float32 [B, H, T] = [", s.B, ", ", s.H, ", ", s.T,
                "] tensor on ", device.str());
}

// kv_lengths as the masked entries (hand-written and cuDNN's) take it: key j of batch row b is
// real iff j < kv_lengths[b].
inline void check_kv_lengths(const char* op, const Tensor& kv_lengths, const AttnShape& s,
                             Device device) {
  TESSERA_CHECK(kv_lengths.dtype() == DType::i32 && kv_lengths.dim() == 1 &&
                    kv_lengths.size(0) == s.B && kv_lengths.is_contiguous() &&
                    kv_lengths.device() == device,
                op, ": kv_lengths must be a contiguous int32 [B] = [", s.B, "] tensor on ",
                device.str(), ", got ", shape_str(kv_lengths.shape()), " ",
                dtype_name(kv_lengths.dtype()), " on ", kv_lengths.device().str());
}

// The switch `name` (TESSERA_ATTENTION_SM90, TESSERA_ATTENTION_SM90_BWD): "0" keeps the dispatch
// on the mma.sync kernels on Hopper too (to compare, or to rule the Hopper kernels out); "1" or
// unset lets it take them; anything else is an error naming the variable.
inline bool sm90_switched_off(const char* name) {
  const SettingInfo* setting = find_setting(name);
  TESSERA_CHECK(setting != nullptr, "sm90_switched_off: ", name, " is not a setting");
  return !setting_enabled(setting->id);
}

}  // namespace tessera::cuda::attention_detail
