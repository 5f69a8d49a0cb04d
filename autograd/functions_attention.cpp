// Differentiable attention: scaled_dot_product_attention on [B, H, T, D] heads, and
// causal_attention_qkv (GPT-2) and rotary_causal_attention_qkv (Llama) straight from a fused
// projection. They run the fused CUDA kernels (hand-written flash or cuDNN, chosen at run
// time) where they apply and the composition of differentiable functions (the reference)
// everywhere else.
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/kernels/fused_table.h"

namespace tessera {

namespace {

void check_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  const char* op = "scaled_dot_product_attention";
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
                ": q, k, v must be [B, H, T, D], got ", autograd::describe(q), "; ",
                autograd::describe(k), "; ", autograd::describe(v));
  TESSERA_CHECK(k.shape() == v.shape() && q.size(0) == k.size(0) && q.size(3) == k.size(3), op,
                ": q ", shape_str(q.shape()), ", k ", shape_str(k.shape()), " and v ",
                shape_str(v.shape()), " disagree on B or D");
  // Grouped-query attention: each of k's heads serves H / H_kv consecutive query heads.
  TESSERA_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": the ", q.size(1),
                " query heads of q ", shape_str(q.shape()), " are not a multiple of the ",
                k.size(1), " key/value heads of k ", shape_str(k.shape()));
  TESSERA_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() && q.device() == k.device() &&
                    q.device() == v.device(),
                op, ": q, k, v must share dtype and device, got ", autograd::describe(q), "; ",
                autograd::describe(k), "; ", autograd::describe(v));
}

void check_dropout(const char* op, double dropout_p) {
  TESSERA_CHECK(dropout_p >= 0 && dropout_p < 1, op, ": dropout_p must lie in [0, 1), got ",
                dropout_p);
}

void check_qkv_input(const Tensor& qkv, int64_t n_head) {
  const char* op = "causal_attention_qkv";
  TESSERA_CHECK(qkv.dim() == 3 && qkv.size(2) % 3 == 0, op,
                ": qkv must be [B, T, 3C] (q | k | v along the last dim), got ",
                autograd::describe(qkv));
  const int64_t C = qkv.size(2) / 3;
  TESSERA_CHECK(n_head > 0 && C % n_head == 0, op, ": n_head (", n_head,
                ") must be positive and divide the width C = ", C, " of q, k and v (qkv ",
                shape_str(qkv.shape()), ")");
  TESSERA_CHECK(is_floating(qkv.dtype()), op, ": qkv must be floating point, got ",
                autograd::describe(qkv));
}

// [Tq, Tk] bool, true where key j lies in query i's future. Queries are the last Tq of the
// Tk positions (a KV cache holds the earlier ones), so query i sits at position Tk - Tq + i.
Tensor causal_mask(int64_t Tq, int64_t Tk, Device device) {
  const TensorOptions opts{.dtype = DType::i64, .device = device};
  const Tensor query_pos = ops::reshape(arange(double(Tk - Tq), double(Tk), 1.0, opts), {Tq, 1});
  const Tensor key_pos = ops::reshape(arange(0.0, double(Tk), 1.0, opts), {1, Tk});
  return ops::binary(BinaryOp::Gt, key_pos, query_pos);
}

// k or v [B, H_kv, T, D] with each head repeated for its `groups` query heads (head h of
// the result is head h / groups of kv, as Hugging Face's repeat_kv); the gradient sums back
// over each group through expand's backward.
Tensor repeat_kv_heads(const Tensor& kv, int64_t groups) {
  if (groups == 1) return kv;
  const int64_t B = kv.size(0), H_kv = kv.size(1), T = kv.size(2), D = kv.size(3);
  return kv.unsqueeze(2).expand({B, H_kv, groups, T, D}).reshape({B, H_kv * groups, T, D});
}

// attn_mask against q [B, H, Tq, D] and k [B, H_kv, Tk, D]: bool or q's float dtype, on q's
// device, broadcastable to [B, H, Tq, Tk]; raises naming the problem otherwise.
void check_attention_mask(const Tensor& mask, const Tensor& q, const Tensor& k) {
  const char* op = "scaled_dot_product_attention";
  const Shape scores{q.size(0), q.size(1), q.size(2), k.size(2)};
  TESSERA_CHECK(mask.dtype() == DType::boolean || mask.dtype() == q.dtype(), op,
                ": attn_mask must be bool (true = attend) or q's dtype ", dtype_name(q.dtype()),
                " (added to the scores), got ", autograd::describe(mask));
  TESSERA_CHECK(mask.device() == q.device(), op, ": attn_mask is on ", mask.device().str(),
                " but q on ", q.device().str());
  bool broadcastable = mask.dim() <= 4;
  for (int64_t d = 1; broadcastable && d <= mask.dim(); ++d) {
    const int64_t m = mask.size(mask.dim() - d), s = scores[4 - d];
    broadcastable = m == 1 || m == s;
  }
  TESSERA_CHECK(broadcastable, op, ": attn_mask ", shape_str(mask.shape()),
                " does not broadcast to the scores' [B, H, Tq, Tk] = ", shape_str(scores));
}

// softmax over the last dim where a row whose scores are all -inf (no key left to attend to)
// gives 0 instead of NaN, and no gradient (PyTorch's _safe_softmax). Such rows are set to 0
// before the softmax, so its backward never sees -inf - -inf either.
Tensor softmax_without_empty_rows(const Tensor& scores) {
  const Tensor row_max = ops::amax(scores.detach(), {-1}, /*keepdim=*/true);
  const Tensor empty_rows =
      ops::binary(BinaryOp::Eq, row_max, -std::numeric_limits<double>::infinity());
  return masked_fill(softmax(masked_fill(scores, empty_rows, 0.0), -1), empty_rows, 0.0);
}

// softmax(q·kᵀ·scale [+ causal mask] [+ attn_mask]) v from the differentiable functions. q is
// scaled rather than the scores: [.., T, D] is cheaper than [.., T, T].
Tensor composed_attention(const Tensor& q, const Tensor& k_in, const Tensor& v_in, bool causal,
                          double scale, double dropout_p, Generator* gen,
                          const Tensor& attn_mask = Tensor()) {
  const int64_t groups = q.size(1) / k_in.size(1);
  const Tensor k = repeat_kv_heads(k_in, groups), v = repeat_kv_heads(v_in, groups);
  constexpr double kMasked = -std::numeric_limits<double>::infinity();
  Tensor att = matmul(q * scale, k.transpose(-2, -1));
  if (causal) att = masked_fill(att, causal_mask(q.size(2), k.size(2), q.device()), kMasked);
  if (!attn_mask.defined()) {
    att = softmax(att, -1);
  } else {
    att = attn_mask.dtype() == DType::boolean
              ? masked_fill(att, ops::unary(UnaryOp::LogicalNot, attn_mask), kMasked)
              : att + attn_mask;
    att = softmax_without_empty_rows(att);
  }
  if (dropout_p > 0) att = dropout(att, dropout_p, true, gen);
  return matmul(att, v);
}

// ---- the fused kernels of q's device (kernels/fused_table.h), through the chosen backend ----

const FusedKernelTable& fused_for(const Tensor& q) { return fused_kernel_table(q.device().type); }

void require_backend(AttentionBackend backend, const Tensor& q) {
  if (backend != AttentionBackend::Cudnn) return;
  const FusedKernelTable& fused = fused_for(q);
  std::string why = "no cuDNN attention kernels for " + q.device().str();
  const bool available =
      fused.cudnn_attention_available != nullptr && fused.cudnn_attention_forward != nullptr &&
      fused.cudnn_attention_backward != nullptr && fused.cudnn_attention_available(&why);
  TESSERA_CHECK(available,
                "attention: the cudnn backend was chosen (TESSERA_ATTENTION or "
                "set_attention_backend) but cuDNN attention is not available: ",
                why, "; choose the flash backend instead");
}

void attention_forward_on(AttentionBackend backend, const Tensor& q, const Tensor& k,
                          const Tensor& v, double scale, const Tensor& out, const Tensor& lse) {
  require_backend(backend, q);
  const FusedKernelTable& fused = fused_for(q);
  if (backend == AttentionBackend::Cudnn)
    fused.cudnn_attention_forward(q, k, v, scale, out, lse);
  else
    fused.flash_attention_forward(q, k, v, scale, out, lse);
}

void attention_backward_on(AttentionBackend backend, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& out, const Tensor& dout,
                           const Tensor& lse, double scale, const Tensor& dq, const Tensor& dk,
                           const Tensor& dv) {
  require_backend(backend, q);
  const FusedKernelTable& fused = fused_for(q);
  if (backend == AttentionBackend::Cudnn)
    fused.cudnn_attention_backward(q, k, v, out, dout, lse, scale, dq, dk, dv);
  else
    fused.flash_attention_backward(q, k, v, out, dout, lse, scale, dq, dk, dv);
}

// The incoming gradient in the kernels' dtype, copied only when the kernels cannot read it
// as it is (an expanded or otherwise unaligned gradient).
Tensor readable_gradient(const Tensor& grad, DType dtype) {
  const Tensor g = grad.dtype() == dtype ? grad : ops::to(grad, grad.device(), dtype);
  return rows_readable_by_kernels(g) ? g : ops::contiguous(g);
}

// An uninitialised [B, H, T, D] tensor shaped like heads, laid out as [B, T, H, D] and
// returned as its [B, H, T, D] view: the layout of the projections the heads come from and go
// to, so the caller's transpose(1, 2) and reshape to [B, T, H * D] cost no copy (nor does
// rotating the result in place of a contiguous input).
Tensor empty_heads_like(const Tensor& heads) {
  const Tensor seq_major = empty({heads.size(0), heads.size(2), heads.size(1), heads.size(3)},
                                 {.dtype = heads.dtype(), .device = heads.device()});
  return ops::permute(seq_major, {0, 2, 1, 3});
}

Tensor lse_for(const Tensor& q) {
  return empty({q.size(0), q.size(1), q.size(2)}, {.dtype = DType::f32, .device = q.device()});
}

// What a fused call masks beyond causal self-attention: non-causal attention and keys padded
// on the right run the masked entries of `kernels` (hand-written flash or cuDNN's graphs).
struct FusedMasking {
  bool causal = true;
  Tensor kv_lengths;  // i32 [B]: key j of row b is attended iff j < kv_lengths[b]; or undefined
  MaskedAttentionKernels kernels = MaskedAttentionKernels::Flash;
  bool beyond_causal() const { return !causal || kv_lengths.defined(); }
};

// The masked forward and backward entries of masking.kernels (one contract, kernels/fused_table.h).
struct MaskedEntries {
  decltype(FusedKernelTable::flash_masked_attention_forward) forward;
  decltype(FusedKernelTable::flash_masked_attention_backward) backward;
};
MaskedEntries masked_entries(const Tensor& q, MaskedAttentionKernels kernels) {
  const FusedKernelTable& fused = fused_for(q);
  if (kernels == MaskedAttentionKernels::Cudnn)
    return {fused.cudnn_masked_attention_forward, fused.cudnn_masked_attention_backward};
  return {fused.flash_masked_attention_forward, fused.flash_masked_attention_backward};
}

// Raises, naming the reason, when the cudnn backend was chosen but its masked graphs cannot run.
void require_masked_kernels(const Tensor& q, MaskedAttentionKernels kernels) {
  if (kernels != MaskedAttentionKernels::Cudnn) return;
  const FusedKernelTable& fused = fused_for(q);
  std::string why = "no cuDNN masked attention for " + q.device().str();
  const bool available = fused.cudnn_masked_attention_available != nullptr &&
                         fused.cudnn_masked_attention_available(&why);
  TESSERA_CHECK(available,
                "attention: the cudnn backend was chosen (TESSERA_ATTENTION or "
                "set_attention_backend) but cuDNN's masked attention is not available: ",
                why, "; choose the flash backend instead");
}

// The fused kernels on [B, H, T, D] heads (O(T) memory); the backward recomputes the scores
// from q, k, v and the saved log-sum-exp. The backend is the one chosen at the forward. With
// `dropout`, the flash kernels that drop the probabilities (whatever the backend); the backward
// regenerates the mask from the draw's (seed, offset).
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                       const std::optional<DropoutDraw>& dropout = std::nullopt,
                       const FusedMasking& masking = {}) {
  const AttentionBackend backend = attention_backend();
  // The caller's usual y.transpose(1, 2).reshape({B, T, H * D}) costs no copy (nor does its
  // gradient).
  const Tensor out = empty_heads_like(q);
  Tensor lse = lse_for(q);
  if (masking.beyond_causal()) require_masked_kernels(q, masking.kernels);
  if (dropout && masking.beyond_causal())
    fused_for(q).flash_masked_attention_dropout_forward(q, k, v, scale, masking.causal,
                                                        masking.kv_lengths, *dropout, out, lse);
  else if (dropout)
    fused_for(q).flash_attention_dropout_forward(q, k, v, scale, *dropout, out, lse);
  else if (masking.beyond_causal())
    masked_entries(q, masking.kernels)
        .forward(q, k, v, scale, masking.causal, masking.kv_lengths, out, lse);
  else attention_forward_on(backend, q, k, v, scale, out, lse);
  const char* masked_name = masking.kernels == MaskedAttentionKernels::Cudnn
                                ? "CudnnMaskedAttentionBackward"
                                : "FlashMaskedAttentionBackward";
  const char* name = dropout && masking.beyond_causal() ? "FlashMaskedAttentionDropoutBackward"
                     : dropout                          ? "FlashAttentionDropoutBackward"
                     : masking.beyond_causal()          ? masked_name
                                                        : "FlashAttentionBackward";
  using autograd::SavedTensor;
  autograd::record(name, {q, k, v}, {out},
                   [sq = SavedTensor::input(q), sk = SavedTensor::input(k),
                    sv = SavedTensor::input(v), so = SavedTensor::output(out), lse, scale, backend,
                    dropout, masking, name](const autograd::BackwardArgs& args) {
                     const Tensor q = sq.unpack(name), k = sk.unpack(name), v = sv.unpack(name),
                                  o = so.unpack(name);
                     // dk, dv have k's Hkv heads: the kernels sum each group's query heads into
                     // them. In the projections' layout, the gradients flow back through the usual
                     // view/transpose of q, k, v (and rotary embeddings) without a layout copy.
                     Tensor dq = empty_heads_like(q), dk = empty_heads_like(k),
                            dv = empty_heads_like(v);
                     const Tensor dout = readable_gradient(args.grad(), q.dtype());
                     if (dropout && masking.beyond_causal())
                       fused_for(q).flash_masked_attention_dropout_backward(
                           q, k, v, o, dout, lse, scale, masking.causal, masking.kv_lengths,
                           *dropout, dq, dk, dv);
                     else if (dropout)
                       fused_for(q).flash_attention_dropout_backward(q, k, v, o, dout, lse, scale,
                                                                     *dropout, dq, dk, dv);
                     else if (masking.beyond_causal())
                       masked_entries(q, masking.kernels)
                           .backward(q, k, v, o, dout, lse, scale, masking.causal,
                                     masking.kv_lengths, dq, dk, dv);
                     else
                       attention_backward_on(backend, q, k, v, o, dout, lse, scale, dq, dk, dv);
                     return std::vector<Tensor>{dq, dk, dv};
                   });
  return out;
}

// The dropout on q k^T's probabilities that composed dropout would draw: the same Philox
// numbers, reserved from the generator in the same amount, so both routes drop the same
// probabilities and leave the generator in the same state.
DropoutDraw draw_attention_dropout(const Tensor& q, const Tensor& k, double dropout_p,
                                        Generator* gen) {
  Generator& g = gen ? *gen : default_generator();
  const uint64_t probabilities =
      static_cast<uint64_t>(q.size(0) * q.size(1) * q.size(2) * k.size(2));
  return {dropout_p, g.seed(), g.reserve((probabilities + 3) / 4)};
}

// draw_attention_dropout for dropout_p > 0; none for 0.
std::optional<DropoutDraw> maybe_draw_attention_dropout(const Tensor& q, const Tensor& k,
                                                             double dropout_p, Generator* gen) {
  if (dropout_p == 0) return std::nullopt;
  return draw_attention_dropout(q, k, dropout_p, gen);
}

// y [B, T, C] and the log-sum-exp of the attention over the heads of qkv [B, T, 3C], by
// `backend`'s kernels reading q, k, v and writing y through [B, H, T, D] views.
std::pair<Tensor, Tensor> attention_forward_qkv(AttentionBackend backend, const Tensor& qkv,
                                                int64_t n_head, double scale) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
  Tensor y = empty({B, T, C}, {.dtype = qkv.dtype(), .device = qkv.device()});
  const Tensor q = attention_heads_view(qkv, 0, C, n_head);
  Tensor lse = lse_for(q);
  attention_forward_on(backend, q, attention_heads_view(qkv, C, C, n_head),
                       attention_heads_view(qkv, 2 * C, C, n_head), scale,
                       attention_heads_view(y, 0, C, n_head), lse);
  return {y, lse};
}

// The fused kernels straight on qkv [B, T, 3C]: q, k, v, y and d(qkv) are only ever seen
// through [B, H, T, D] views, so neither direction copies a layout.
Tensor fused_attention_qkv(const Tensor& qkv, int64_t n_head, double scale) {
  const AttentionBackend backend = attention_backend();
  auto [y, lse] = attention_forward_qkv(backend, qkv, n_head, scale);
  using autograd::SavedTensor;
  autograd::record(
      "CausalAttentionQkvBackward", {qkv}, {y},
      // lse by init-capture: clang 14 (the fuzz build) cannot capture a structured binding.
      [sqkv = SavedTensor::input(qkv), sy = SavedTensor::output(y), lse = lse, scale, n_head,
       backend](const autograd::BackwardArgs& args) {
        const char* op = "CausalAttentionQkvBackward";
        const Tensor qkv = sqkv.unpack(op), y = sy.unpack(op);
        const int64_t C = y.size(2);
        // [B, H, T, D] views of qkv's, y's, dy's and d(qkv)'s q (0), k (1) or v (2) part.
        auto heads = [&](const Tensor& x, int64_t which) {
          return attention_heads_view(x, which * C, C, n_head);
        };
        Tensor dqkv = empty(qkv.shape(), {.dtype = qkv.dtype(), .device = qkv.device()});
        attention_backward_on(backend, heads(qkv, 0), heads(qkv, 1), heads(qkv, 2), heads(y, 0),
                              readable_gradient(heads(args.grad(), 0), y.dtype()), lse, scale,
                              heads(dqkv, 0), heads(dqkv, 1), heads(dqkv, 2));
        return std::vector<Tensor>{dqkv};
      });
  return y;
}

// The backward of causal_attention_qkv_projection's one-node route: y = attention over the heads
// of qkv = x w + bias. The attention kernels write d(qkv) and sum bias's gradient (its column
// sums) as they store it; dW and dx are the Linear's two GEMMs on d(qkv). Inputs (x, w, bias).
struct ProjectionAttentionBackward {
  autograd::SavedTensor x, w, y;
  Tensor qkv, lse;  // qkv [B, T, 3C] private to this node
  double scale;
  int64_t n_head;

  std::vector<Tensor> operator()(const autograd::BackwardArgs& a) const {
    using autograd::util::overwrite_target;
    const char* op = "ProjectionAttentionQkvBackward";
    const Tensor y = this->y.unpack(op);
    const int64_t C = y.size(2), rows = qkv.size(0) * qkv.size(1);
    const DType t = qkv.dtype();
    const TensorOptions like{.dtype = t, .device = qkv.device()};
    auto heads = [&](const Tensor& u, int64_t which) {
      return attention_heads_view(u, which * C, C, n_head);
    };
    Tensor dqkv = empty(qkv.shape(), like);
    const Tensor dy = readable_gradient(heads(a.grad(), 0), t);
    const FusedKernelTable& fused = fused_for(qkv);
    std::vector<Tensor> grads(3);
    if (a.needs(2)) {
      grads[2] = overwrite_target(a, 2, {3 * C}, t);
      if (!grads[2].defined()) grads[2] = empty({3 * C}, like);
      fused.flash_attention_backward_with_bias_grad(heads(qkv, 0), heads(qkv, 1), heads(qkv, 2),
                                                    heads(y, 0), dy, lse, scale, heads(dqkv, 0),
                                                    heads(dqkv, 1), heads(dqkv, 2), grads[2]);
    } else {
      fused.flash_attention_backward(heads(qkv, 0), heads(qkv, 1), heads(qkv, 2), heads(y, 0), dy,
                                     lse, scale, heads(dqkv, 0), heads(dqkv, 1), heads(dqkv, 2));
    }
    const Tensor g = ops::reshape(dqkv, {rows, 3 * C});
    if (a.needs(1)) {
      const Tensor x = this->x.unpack(op);
      grads[1] = autograd::util::linear_weight_grad(ops::reshape(x, {rows, x.size(2)}), g,
                                                    overwrite_target(a, 1, {x.size(2), 3 * C}, t));
    }
    if (a.needs(0)) {
      const Tensor w = this->w.unpack(op);
      grads[0] = ops::reshape(ops::matmul(g, ops::transpose(w, 0, 1)),
                              {qkv.size(0), qkv.size(1), w.size(0)});
    }
    for (size_t i = 1; i < grads.size(); ++i)
      grads[i] = autograd::util::add_into_destination(a, i, grads[i]);
    return grads;
  }
};

Tensor fused_projection_attention_qkv(const Tensor& x, const Tensor& w, const Tensor& bias,
                                      int64_t n_head) {
  const int64_t B = x.size(0), T = x.size(1), C = w.size(1) / 3, D = C / n_head;
  const Tensor qkv = ops::reshape(
      autograd::util::linear_rows(ops::reshape(x, {B * T, x.size(2)}), w, bias), {B, T, 3 * C});
  if (!attention_qkv_takes(qkv, n_head))  // not expected: see attention_qkv_projection_takes
    return causal_attention_qkv(linear(x, w, bias), n_head);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto [y, lse] = attention_forward_qkv(AttentionBackend::Flash, qkv, n_head, scale);
  if (!autograd::any_requires_grad({x, w, bias})) return y;
  using autograd::SavedTensor;
  ProjectionAttentionBackward backward{
      .x = w.requires_grad() ? SavedTensor::input(x) : SavedTensor(),
      .w = x.requires_grad() ? SavedTensor::input(w) : SavedTensor(),
      .y = SavedTensor::output(y),
      .qkv = qkv,
      .lse = lse,
      .scale = scale,
      .n_head = n_head};
  autograd::record("ProjectionAttentionQkvBackward", {x, w, bias}, {y}, std::move(backward));
  return y;
}

// Channels [0, (H + Hkv) D) of qkv [B, T, *] (q | k) as [B, T, H + Hkv, D] heads.
Tensor rotary_part(const Tensor& qkv, int64_t heads, int64_t D) {
  return ops::view(ops::narrow(qkv, 2, 0, heads * D), {qkv.size(0), qkv.size(1), heads, D});
}

// Heads [first, first + count) of x [B, T, heads, D] as a [B, count, T, D] view.
Tensor heads_of(const Tensor& x, int64_t first, int64_t count) {
  return ops::permute(ops::narrow(x, 2, first, count), {0, 2, 1, 3});
}

// The fused path of rotary_causal_attention_qkv: q | k rotated into one [B, T, H + Hkv, D]
// buffer (kept for the backward), v read in place from qkv.
Tensor fused_rotary_attention_qkv(const Tensor& qkv, int64_t H, int64_t Hkv,
                                  const ops::RopeTables& rope) {
  const AttentionBackend backend = attention_backend();
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / (H + 2 * Hkv);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const TensorOptions like{.dtype = qkv.dtype(), .device = qkv.device()};
  Tensor qk = empty({B, T, H + Hkv, D}, like);
  ops::rope_into(rotary_part(qkv, H + Hkv, D), rope, /*inverse=*/false, qk);
  Tensor y = empty({B, T, H * D}, like);
  const Tensor q = heads_of(qk, 0, H);
  Tensor lse = lse_for(q);
  attention_forward_on(backend, q, heads_of(qk, H, Hkv),
                       attention_heads_view(qkv, (H + Hkv) * D, Hkv * D, Hkv), scale,
                       attention_heads_view(y, 0, H * D, H), lse);
  using autograd::SavedTensor;
  autograd::record(
      "RotaryAttentionQkvBackward", {qkv}, {y},
      [sqkv = SavedTensor::input(qkv), sy = SavedTensor::output(y), qk, lse, scale, H, Hkv, D, rope,
       backend](const autograd::BackwardArgs& args) {
        const char* op = "RotaryAttentionQkvBackward";
        const Tensor qkv = sqkv.unpack(op), y = sy.unpack(op);
        Tensor dqkv = empty(qkv.shape(), {.dtype = qkv.dtype(), .device = qkv.device()});
        Tensor dqk = empty(qk.shape(), {.dtype = qk.dtype(), .device = qk.device()});
        const int64_t v_at = (H + Hkv) * D;
        attention_backward_on(
            backend, heads_of(qk, 0, H), heads_of(qk, H, Hkv),
            attention_heads_view(qkv, v_at, Hkv * D, Hkv), attention_heads_view(y, 0, H * D, H),
            readable_gradient(attention_heads_view(args.grad(), 0, H * D, H), y.dtype()), lse,
            scale, heads_of(dqk, 0, H), heads_of(dqk, H, Hkv),
            attention_heads_view(dqkv, v_at, Hkv * D, Hkv));
        // A rotation's gradient is the opposite rotation, written where q | k's gradient goes.
        ops::rope_into(dqk, rope, /*inverse=*/true, rotary_part(dqkv, H + Hkv, D));
        return std::vector<Tensor>{dqkv};
      });
  return y;
}

}  // namespace

namespace {
struct Heads {
  Tensor q, k, v;
};
// scaled_dot_product_attention's q, k, v checked and cast by autocast.
Heads checked_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                               double dropout_p) {
  check_attention_inputs(q, k, v);
  TESSERA_CHECK(!causal || q.size(2) <= k.size(2), "scaled_dot_product_attention: causal with ",
                q.size(2), " queries but only ", k.size(2), " keys");
  check_dropout("scaled_dot_product_attention", dropout_p);
  return {autograd::autocast(q), autograd::autocast(k), autograd::autocast(v)};
}
}  // namespace

namespace {
// y, with `taken` written to *route where the caller asked which route ran.
Tensor reporting(AttentionRoute* route, AttentionRoute taken, Tensor y) {
  if (route != nullptr) *route = taken;
  return y;
}
}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    bool causal, double dropout_p, Generator* gen, bool allow_flash,
                                    AttentionRoute* route) {
  const auto [q, k, v] = checked_attention_inputs(q_in, k_in, v_in, causal, dropout_p);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  if (allow_flash && causal && attention_takes(q, k, v, causal, dropout_p))
    return reporting(
        route, AttentionRoute::Fused,
        fused_attention(q, k, v, scale, maybe_draw_attention_dropout(q, k, dropout_p, gen)));
  if (allow_flash && !causal)
    if (const std::optional<MaskedAttentionKernels> kernels =
            masked_attention_kernels(q, k, v, dropout_p))
      return reporting(
          route, AttentionRoute::Fused,
          fused_attention(q, k, v, scale, maybe_draw_attention_dropout(q, k, dropout_p, gen),
                          {.causal = false, .kv_lengths = Tensor(), .kernels = *kernels}));
  return reporting(route, AttentionRoute::Composed,
                   composed_attention(q, k, v, causal, scale, dropout_p, gen));
}

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    const Tensor& attn_mask, bool causal, double dropout_p,
                                    Generator* gen) {
  return key_padded_attention(q_in, k_in, v_in, attn_mask, Tensor(), causal, dropout_p, gen);
}

Tensor key_padded_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                            const Tensor& attn_mask, const Tensor& kv_lengths, bool causal,
                            double dropout_p, Generator* gen) {
  if (!attn_mask.defined())
    return scaled_dot_product_attention(q_in, k_in, v_in, causal, dropout_p, gen);
  const auto [q, k, v] = checked_attention_inputs(q_in, k_in, v_in, causal, dropout_p);
  // An additive mask follows the scores' dtype under autocast, as the scores it is added to.
  const Tensor mask = attn_mask.dtype() == DType::boolean || attn_mask.dtype() == q.dtype()
                          ? attn_mask
                          : autograd::autocast(attn_mask);
  check_attention_mask(mask, q, k);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  // Keys padded on the right, as the lengths say: the fused kernels' padding where they run
  // (masked_attention_kernels, kernels/fused_table.h). Any other mask is the composition on every
  // device (the fused kernels take no mask tensor).
  if (kv_lengths.defined()) {
    TESSERA_CHECK(kv_lengths.dtype() == DType::i32 && kv_lengths.dim() == 1 &&
                      kv_lengths.size(0) == q.size(0) && kv_lengths.device() == q.device(),
                  "key_padded_attention: kv_lengths must be int32 [B] = [", q.size(0), "] on ",
                  q.device().str(), ", got ", autograd::describe(kv_lengths));
    if (const std::optional<MaskedAttentionKernels> kernels =
            masked_attention_kernels(q, k, v, dropout_p))
      return fused_attention(
          q, k, v, scale, maybe_draw_attention_dropout(q, k, dropout_p, gen),
          {.causal = causal, .kv_lengths = ops::contiguous(kv_lengths), .kernels = *kernels});
  }
  return composed_attention(q, k, v, causal, scale, dropout_p, gen, mask);
}

Tensor causal_attention_qkv(const Tensor& qkv_in, int64_t n_head, double dropout_p, Generator* gen,
                            bool allow_fused, AttentionRoute* route) {
  check_qkv_input(qkv_in, n_head);
  check_dropout("causal_attention_qkv", dropout_p);
  const Tensor qkv = autograd::autocast(qkv_in);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / n_head;
  if (allow_fused && dropout_p == 0 && attention_qkv_takes(qkv, n_head))
    return reporting(route, AttentionRoute::Fused,
                     fused_attention_qkv(qkv, n_head, 1.0 / std::sqrt(static_cast<double>(D))));
  // The reference: the same computation from differentiable pieces (copies included), whose
  // attention takes the flash kernels with dropout where they apply (the heads are views).
  const std::vector<Tensor> parts = split(qkv, C, -1);
  auto heads = [&](const Tensor& t) { return t.reshape({B, T, n_head, D}).transpose(1, 2); };
  const Tensor y =
      scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]),
                                   /*causal=*/true, dropout_p, gen, allow_fused, route);
  return y.transpose(1, 2).reshape({B, T, C});
}

Tensor causal_attention_qkv_projection(const Tensor& x_in, const Tensor& w_in, const Tensor& bias,
                                       int64_t n_head, bool allow_fused, AttentionRoute* route) {
  if (!allow_fused ||
      !attention_qkv_projection_takes(x_in, w_in, bias, n_head, autograd::autocast_dtype()))
    return causal_attention_qkv(linear(x_in, w_in, bias), n_head, 0.0, nullptr, allow_fused, route);
  return reporting(route, AttentionRoute::FusedProjection,
                   fused_projection_attention_qkv(autograd::autocast(x_in),
                                                  autograd::autocast(w_in), bias, n_head));
}

Tensor rotary_causal_attention_qkv(const Tensor& qkv_in, int64_t n_head, int64_t n_kv_head,
                                   const ops::RopeTables& rope, bool allow_fused,
                                   AttentionRoute* route) {
  const char* op = "rotary_causal_attention_qkv";
  TESSERA_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op, ": n_kv_head (",
                n_kv_head, ") must be positive and divide n_head (", n_head, ")");
  const int64_t heads = n_head + 2 * n_kv_head;
  TESSERA_CHECK(
      qkv_in.dim() == 3 && qkv_in.size(2) % heads == 0 && (qkv_in.size(2) / heads) % 2 == 0 &&
          is_floating(qkv_in.dtype()),
      op, ": qkv must be a float [B, T, (n_head + 2 n_kv_head) D] tensor with an even D, got ",
      autograd::describe(qkv_in), " for ", n_head, " + 2 x ", n_kv_head, " heads");
  const Tensor qkv = autograd::autocast(qkv_in);
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / heads;
  const int64_t q_width = n_head * D, kv_width = n_kv_head * D;
  if (allow_fused && qkv.stride(2) == 1 && rope.cos.dim() == 2 && rope.cos.size(0) == T &&
      rope.cos.size(1) == D / 2 &&
      attention_takes(attention_heads_view(qkv, 0, q_width, n_head),
                      attention_heads_view(qkv, q_width, kv_width, n_kv_head),
                      attention_heads_view(qkv, q_width + kv_width, kv_width, n_kv_head), true))
    return reporting(route, AttentionRoute::Fused,
                     fused_rotary_attention_qkv(qkv, n_head, n_kv_head, rope));
  // The reference: the same computation from differentiable pieces.
  const std::vector<Tensor> parts =
      split(qkv, std::vector<int64_t>{q_width, kv_width, kv_width}, -1);
  auto heads_of_part = [&](const Tensor& t, int64_t n) { return t.reshape({B, T, n, D}); };
  const Tensor q = rotary_embedding(heads_of_part(parts[0], n_head), rope).transpose(1, 2);
  const Tensor k = rotary_embedding(heads_of_part(parts[1], n_kv_head), rope).transpose(1, 2);
  const Tensor v = heads_of_part(parts[2], n_kv_head).transpose(1, 2);
  const Tensor y =
      scaled_dot_product_attention(q, k, v, /*causal=*/true, 0.0, nullptr, allow_fused, route);
  return y.transpose(1, 2).reshape({B, T, q_width});
}

}  // namespace tessera
