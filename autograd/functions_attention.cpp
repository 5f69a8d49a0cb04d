// Differentiable scaled dot-product attention: the flash-attention CUDA kernels where they
// apply, the composition of differentiable functions (the reference) everywhere else.
#include <cmath>
#include <cstdint>
#include <limits>

#include "autograd/autocast.h"
#include "autograd/functions.h"
#if TESSERA_WITH_CUDA
#include "kernels/cuda/fused.h"
#endif

namespace tessera {

namespace {

void check_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  const char* op = "scaled_dot_product_attention";
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be [B, H, T, D], got ",
                autograd::describe(q), "; ", autograd::describe(k), "; ", autograd::describe(v));
  TESSERA_CHECK(k.shape() == v.shape() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                    q.size(3) == k.size(3),
                op, ": q ", shape_str(q.shape()), ", k ", shape_str(k.shape()), " and v ",
                shape_str(v.shape()), " disagree on B, H or D");
  TESSERA_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() && q.device() == k.device() &&
                    q.device() == v.device(),
                op, ": q, k, v must share dtype and device, got ", autograd::describe(q), "; ",
                autograd::describe(k), "; ", autograd::describe(v));
}

// [Tq, Tk] bool, true where key j lies in query i's future. Queries are the last Tq of the
// Tk positions (a KV cache holds the earlier ones), so query i sits at position Tk - Tq + i.
Tensor causal_mask(int64_t Tq, int64_t Tk, Device device) {
  const TensorOptions opts{.dtype = DType::i64, .device = device};
  const Tensor query_pos = raw::reshape(arange(double(Tk - Tq), double(Tk), 1.0, opts), {Tq, 1});
  const Tensor key_pos = raw::reshape(arange(0.0, double(Tk), 1.0, opts), {1, Tk});
  return ops::binary(BinaryOp::Gt, key_pos, query_pos);
}

// softmax(q·kᵀ·scale [+ causal mask]) v from the differentiable functions. q is scaled
// rather than the scores: [.., T, D] is cheaper than [.., T, T].
Tensor composed_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                          double scale, double dropout_p, Generator* gen) {
  Tensor att = matmul(q * scale, k.transpose(-2, -1));
  if (causal)
    att = masked_fill(att, causal_mask(q.size(2), k.size(2), q.device()),
                      -std::numeric_limits<double>::infinity());
  att = softmax(att, -1);
  if (dropout_p > 0) att = dropout(att, dropout_p, true, gen);
  return matmul(att, v);
}

#if TESSERA_WITH_CUDA
// The flash-attention kernels (O(T) memory); the backward recomputes the scores from
// q, k, v and the saved log-sum-exp.
Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  const TensorOptions like{.dtype = q.dtype(), .device = q.device()};
  Tensor out = empty(q.shape(), like);
  Tensor lse = empty({q.size(0), q.size(1), q.size(2)}, {.dtype = DType::f32, .device = q.device()});
  cuda::flash_attention_forward(q, k, v, scale, out, lse);
  using autograd::SavedTensor;
  autograd::record(
      "FlashAttentionBackward", {q, k, v}, {out},
      [sq = SavedTensor::input(q), sk = SavedTensor::input(k), sv = SavedTensor::input(v),
       so = SavedTensor::output(out), lse, scale](const autograd::BackwardArgs& args) {
        const char* op = "FlashAttentionBackward";
        const Tensor q = sq.unpack(op), k = sk.unpack(op), v = sv.unpack(op), o = so.unpack(op);
        const Tensor dout = raw::contiguous(
            args.grad().dtype() == q.dtype() ? args.grad() : raw::to(args.grad(), q.device(), q.dtype()));
        const TensorOptions like{.dtype = q.dtype(), .device = q.device()};
        Tensor dq = empty(q.shape(), like), dk = empty(q.shape(), like), dv = empty(q.shape(), like);
        cuda::flash_attention_backward(q, k, v, o, dout, lse, scale, dq, dk, dv);
        return std::vector<Tensor>{dq, dk, dv};
      });
  return out;
}
#endif

}  // namespace

bool flash_attention_applies(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  if (!TESSERA_WITH_CUDA || !causal || !q.device().is_cuda()) return false;
  if (q.dtype() != DType::bf16 && q.dtype() != DType::f16) return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (k.size(2) != q.size(2) || (q.size(3) != 64 && q.size(3) != 128)) return false;
  // The kernels read 16-byte vectors along D: last dim contiguous, rows 16-byte aligned.
  for (const Tensor* t : {&q, &k, &v}) {
    if (t->dtype() != q.dtype() || t->shape() != q.shape() || t->stride(3) != 1) return false;
    if (t->stride(0) % 8 || t->stride(1) % 8 || t->stride(2) % 8) return false;
    if (reinterpret_cast<uintptr_t>(t->raw_data()) % 16) return false;
  }
  return true;
}

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    bool causal, double dropout_p, Generator* gen, bool allow_flash) {
  check_attention_inputs(q_in, k_in, v_in);
  TESSERA_CHECK(!causal || q_in.size(2) <= k_in.size(2), "scaled_dot_product_attention: causal with ",
                q_in.size(2), " queries but only ", k_in.size(2), " keys");
  TESSERA_CHECK(dropout_p >= 0 && dropout_p < 1,
                "scaled_dot_product_attention: dropout_p must lie in [0, 1), got ", dropout_p);
  const Tensor q = autograd::autocast(q_in), k = autograd::autocast(k_in), v = autograd::autocast(v_in);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
#if TESSERA_WITH_CUDA
  if (allow_flash && dropout_p == 0 && flash_attention_applies(q, k, v, causal))
    return flash_attention(q, k, v, scale);
#else
  (void)allow_flash;
#endif
  return composed_attention(q, k, v, causal, scale, dropout_p, gen);
}

}  // namespace tessera
