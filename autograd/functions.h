// The differentiable functions users call (namespace tessera).
//
// Each computes its result with the tape-free ops:: (kernels/ops.h) and, when a
// gradient is needed, records a node whose backward sits next to the forward in
// the same function and captures only what it needs. Element-wise binaries
// broadcast (their gradients are summed back with ops::sum_to); a gradient
// always takes its input's dtype. The view/copy members of Tensor (view, reshape,
// transpose, narrow, expand, to, copy_, fill_, ...) are differentiable too
// (autograd/tensor_methods.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "tessera/autograd/autograd.h"
#include "tessera/core/random.h"
#include "tessera/core/tensor.h"
#include "tessera/kernels/fused_table.h"
#include "tessera/kernels/ops.h"

namespace tessera {

// How cross_entropy reduces per-target losses. Its own type (not ops::Reduction) so a
// call naming it cannot resolve, through argument-dependent lookup, to the tape-free
// ops::cross_entropy.
enum class Reduction { Mean, Sum, None };

// ---- arithmetic (broadcasting) ----
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);
Tensor operator-(const Tensor& x);
Tensor neg(const Tensor& x);
Tensor pow(const Tensor& base, const Tensor& exponent);
Tensor pow(const Tensor& base, double exponent);
// Element-wise max/min; on ties the gradient is split evenly between a and b.
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);

// ---- element-wise functions (functions_elementwise.cpp; gelu: functions_activation.cpp) ----
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor gelu(const Tensor& x);  // tanh approximation (GPT-2)
// The exact GELU, x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)): PyTorch's gelu(approximate='none'),
// Hugging Face's "gelu" (BERT, DistilBERT).
Tensor gelu_erf(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor square(const Tensor& x);

// ---- reductions (empty dims = all dimensions) ----
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// The gradient goes to the positions holding the extreme value, split evenly on ties.
Tensor amax(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);

// ---- softmax (functions_reduce.cpp), layer_norm (functions_norm.cpp), dropout ----
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
// Normalises over the last dimension; weight and bias may be undefined.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// Zeroes each element with probability p and scales the rest by 1/(1-p) when training;
// identity otherwise. gen = nullptr draws from the default generator.
Tensor dropout(const Tensor& x, double p, bool training, Generator* gen = nullptr);

// ---- linear algebra (autograd/functions_linalg.cpp; mlp_gelu: functions_activation.cpp) ----
// PyTorch matmul semantics (1-D operands, broadcast batch dimensions).
Tensor matmul(const Tensor& a, const Tensor& b);
// y = x·W + b with W stored [in, out] (GPT-2's Conv1D layout); bias may be undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// GPT-2's MLP without its dropout: linear(gelu(linear(x, w_fc, b_fc)), w_proj, b_proj), GELU
// the tanh form, biases optional. Where the device has the fused GEMMs
// (FusedKernelTable::linear_gelu_forward / linear_input_grad_dgelu) it is one tape node: the
// GELU rides in the first GEMM's epilogue forward, and backward the second GEMM's input
// gradient comes out already through gelu' with db_fc beside it. Elsewhere (the CPU, f64,
// mixed dtypes) it is exactly that composition. Autocast casts as linear does.
Tensor mlp_gelu(const Tensor& x, const Tensor& w_fc, const Tensor& b_fc, const Tensor& w_proj,
                const Tensor& b_proj);

// ---- embedding (autograd/functions_embedding.cpp) and losses (functions_loss.cpp) ----
// weight [V, C], indices (i32/i64) of any shape -> indices.shape + [C].
Tensor embedding(const Tensor& weight, const Tensor& indices);

// Takes the gradient of an embedding lookup as (indices, dY) instead of the dense scatter
// into the weight's gradient. DDP installs one on the embeddings it synchronises sparsely
// (dist/sparse_embedding.h): the lookup then adds no edge into the weight, so the weight's
// gradient (from its other uses, a tied output head) is final before the lookup's backward
// runs, and its bucket can be sent while backward still runs.
class EmbeddingGradSink {
 public:
  virtual ~EmbeddingGradSink() = default;
  // Asked when the lookup is recorded: true = its gradient goes to take() in backward and
  // the weight gets nothing from it through the graph; false = the ordinary dense backward.
  virtual bool accepts(const Tensor& weight, const Tensor& indices) = 0;
  // In backward, once per accepted lookup: indices [N] and dY [N, C] (contiguous). Must
  // account for them (a sink that can no longer synchronise adds them into weight.grad).
  virtual void take(const Tensor& indices, const Tensor& grad) = 0;
};
// embedding(weight, indices) whose weight gradient goes to `sink` when it accepts (a null
// sink: the plain embedding). The sink is kept alive by the recorded graph.
Tensor embedding(const Tensor& weight, const Tensor& indices,
                 const std::shared_ptr<EmbeddingGradSink>& sink);
// logits [..., V], targets [...] (i32/i64); Mean is over targets != ignore_index.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::Mean);

// ---- joining, splitting, selecting ----
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);
// cond ? a : b (broadcasting); cond is bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// x with `value` where mask (bool, broadcast to x) is true.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);

// ---- more element-wise maths (functions_math.cpp; silu, swiglu: functions_activation.cpp) ----
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor log1p(const Tensor& x);
Tensor expm1(const Tensor& x);
Tensor erf(const Tensor& x);
Tensor reciprocal(const Tensor& x);
// min(max(x, min), max) with either bound optional; the gradient passes where
// min <= x <= max.
Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max = std::nullopt);
Tensor silu(const Tensor& x);                          // x * sigmoid(x)
Tensor swiglu(const Tensor& gate, const Tensor& up);   // silu(gate) * up (Llama's MLP)

// ---- comparisons: bool tensors, no gradient (broadcasting) ----
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double b);
Tensor ne(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor le(const Tensor& a, double b);
Tensor gt(const Tensor& a, double b);
Tensor ge(const Tensor& a, double b);
inline Tensor operator==(const Tensor& a, const Tensor& b) { return eq(a, b); }
inline Tensor operator!=(const Tensor& a, const Tensor& b) { return ne(a, b); }
inline Tensor operator<(const Tensor& a, const Tensor& b) { return lt(a, b); }
inline Tensor operator<=(const Tensor& a, const Tensor& b) { return le(a, b); }
inline Tensor operator>(const Tensor& a, const Tensor& b) { return gt(a, b); }
inline Tensor operator>=(const Tensor& a, const Tensor& b) { return ge(a, b); }
inline Tensor operator==(const Tensor& a, double b) { return eq(a, b); }
inline Tensor operator!=(const Tensor& a, double b) { return ne(a, b); }
inline Tensor operator<(const Tensor& a, double b) { return lt(a, b); }
inline Tensor operator<=(const Tensor& a, double b) { return le(a, b); }
inline Tensor operator>(const Tensor& a, double b) { return gt(a, b); }
inline Tensor operator>=(const Tensor& a, double b) { return ge(a, b); }

// cond ? a : b with a scalar on one side (the scalar takes the tensor's dtype).
Tensor where(const Tensor& cond, const Tensor& a, double b);
Tensor where(const Tensor& cond, double a, const Tensor& b);

// ---- more reductions (autograd/functions_reduce.cpp; cumsum: functions_select.cpp) ----
// Variance over dims (empty = all) divided by N - correction (1: unbiased, 0: population).
Tensor var(const Tensor& x, const std::vector<int64_t>& dims = {}, double correction = 1.0,
           bool keepdim = false);
// sqrt(var(...)). (Not named `std`: inside namespace tessera that would hide namespace std.)
Tensor std_dev(const Tensor& x, const std::vector<int64_t>& dims = {}, double correction = 1.0,
               bool keepdim = false);
Tensor logsumexp(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// The gradient is the product of the other elements (exact with zeros in the lane).
Tensor prod(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor cumsum(const Tensor& x, int64_t dim);

// ---- selection with gradients (autograd/functions_select.cpp) ----
struct ValuesIndices {
  Tensor values, indices;  // indices i64, no gradient
};
// Values and positions of the max (min) along dim; the gradient goes to that position.
ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim = false);
ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim = false);
ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true);
// See ops::gather / scatter / scatter_add; gradients flow to x and src.
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
using ops::multinomial;
using ops::sample_logits;

// ---- in-place arithmetic under autograd (autograd/functions_inplace.cpp) ----
// self = self op other (other broadcast to self). Bumps self's version: a backward that saved
// the old value raises. Refused on a leaf that requires grad (under grad mode) and on a
// self-overlapping destination; a view of a graph tensor rewrites its base's history.
Tensor& add_(Tensor& self, const Tensor& other);
Tensor& sub_(Tensor& self, const Tensor& other);
Tensor& mul_(Tensor& self, const Tensor& other);
Tensor& div_(Tensor& self, const Tensor& other);
Tensor& add_(Tensor& self, double other);
Tensor& sub_(Tensor& self, double other);
Tensor& mul_(Tensor& self, double other);
Tensor& div_(Tensor& self, double other);

// ---- row norms (autograd/functions_norm.cpp) and rotary embeddings (functions_rope.cpp) ----
// x * rsqrt(mean(x^2, -1) + eps) * weight (weight [C] may be undefined); fused kernels.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
// The residual add of a pre-norm block with the RMSNorm after it, in one fused kernel where
// the device has one: returns {x + residual, rms_norm(x + residual, weight, eps)}. Its backward
// adds the gradient of the sum and the norm's input gradient in the same pass.
std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& residual,
                                            const Tensor& weight, double eps = 1e-6);
// The same for LayerNorm (GPT-2's pre-norm blocks): {x + residual, layer_norm(x + residual,
// weight, bias, eps)}, weight and bias [C] or undefined, one fused kernel forward and one
// backward where the device has them. x and residual of two float dtypes add in the promoted
// one (as x + residual does). x_bias ([C] or undefined): the bias of the projection that
// produced x, added here ((x + x_bias) + residual) so that its gradient comes out of the
// norm's backward pass (ops::residual_layer_norm).
std::pair<Tensor, Tensor> residual_layer_norm(const Tensor& x, const Tensor& residual,
                                              const Tensor& weight, const Tensor& bias,
                                              double eps = 1e-5, const Tensor& x_bias = Tensor());
// Rotary embedding of x [B, T, H, D] (HF rotate_half pairing) with ops::rope_tables for its
// T positions.
Tensor rotary_embedding(const Tensor& x, const ops::RopeTables& tables);

// ---- convenience re-exports of the tape machinery ----
using autograd::NoGradGuard;

}  // namespace tessera

// ---- attention (autograd/functions_attention.cpp) ----
namespace tessera {

// softmax(q·kᵀ/√D [+ causal mask]) · v for q [B, H, Tq, D], k and v [B, H_kv, Tk, D], where
// H_kv divides H (grouped-query attention: kv head j serves query heads j·H/H_kv onwards; the
// fused kernels read the shared heads in place, no repeated copy, and sum dk, dv over each
// group). With
// causal, the queries are the last Tq of the Tk positions (Tq < Tk for a KV cache). Under
// an AutocastGuard q, k, v are cast to the compute dtype first. On a GPU, for bf16/f16,
// D of 64 or 128, causal and Tq == Tk, it runs the flash-attention kernels (O(T) memory)
// unless allow_flash is false (non-causal calls without dropout take the fused masked kernels
// that key_padded_attention describes); otherwise matmul, mask, softmax, dropout (p = dropout_p,
// from gen or the default generator) and matmul. With dropout the flash kernels drop the
// probabilities the composition would (the same Philox numbers, the generator advanced alike)
// and run the mma.sync kernels, whichever attention backend is chosen. Whether the fused
// kernels take a call is attention_takes' answer (kernels/fused_table.h); the route that ran
// is written to *route when route is given.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    double dropout_p = 0.0, Generator* gen = nullptr,
                                    bool allow_flash = true, AttentionRoute* route = nullptr);
// The same with PyTorch's attn_mask, broadcastable to [B, H, Tq, Tk] (a key-padding mask is
// [B, 1, 1, Tk]): bool, true = attend (false positions get -inf before the softmax), or an
// additive float mask of q's dtype (HF's (1 - mask) * finfo.min, or -inf). Combinable with
// causal (both apply). A query row left with no key to attend to (every score -inf) gives 0
// and passes no gradient, as PyTorch 2.5's _safe_softmax in SDPA's math path; torch 1.13 has no
// SDPA, and the explicit softmax there (as older SDPA) gives NaN for such rows. An undefined
// mask is the call above (where, on a GPU, non-causal calls of the flash kernels' shapes
// run the fused masked kernels; with dropout the hand-written ones). A masked call runs the composed path on every
// device: the fused kernels take no mask tensor (but see key_padded_attention).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, bool causal = false,
                                    double dropout_p = 0.0, Generator* gen = nullptr);
// The masked call above where attn_mask is a key-padding mask of keys padded on the right and
// kv_lengths (int32 [B] on q's device, each in [0, Tk], or undefined) says the same as lengths:
// key j of row b is attended iff j < kv_lengths[b]. On a GPU, for the flash kernels' shapes,
// fused O(T)-memory kernels run with the lengths, causal or not: the hand-written flash kernels
// (kernels/cuda/fused.h, flash_masked_attention_*) where the flash backend is named
// (TESSERA_ATTENTION=flash, set_attention_backend) or cuDNN cannot run, else cuDNN's padding
// mask (the faster on Hopper; it takes lengths of at least 1); with dropout the hand-written
// kernels that drop what the composition would (flash_masked_attention_dropout_*), whatever the
// backend; everywhere else the composition with attn_mask.
// A row of length 0 gives 0 outputs and passes no gradient (flash and composition). The caller
// vouches that mask and lengths agree (nn::padding_of_attention_mask builds both from one
// attention_mask).
Tensor key_padded_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& attn_mask, const Tensor& kv_lengths, bool causal = false,
                            double dropout_p = 0.0, Generator* gen = nullptr);

// Causal self-attention straight from the fused projection: qkv [B, T, 3C] (q | k | v along
// the last dim, each C = n_head * D wide) -> y [B, T, C], the heads merged back. On a GPU,
// for bf16/f16, D of 64 or 128 and no dropout (and allow_fused), the attention kernels read
// q, k, v as strided views of qkv, write y through its [B, H, T, D] view, and the backward
// writes dq, dk, dv through views of one d(qkv) buffer: no layout copies. Otherwise it is
// split, heads, scaled_dot_product_attention (dropout_p from gen), merge: the reference.
// Under an AutocastGuard qkv is cast to the compute dtype first. The fused route is taken
// where attention_qkv_takes says so (kernels/fused_table.h); *route, when given, says which ran.
Tensor causal_attention_qkv(const Tensor& qkv, int64_t n_head, double dropout_p = 0.0,
                            Generator* gen = nullptr, bool allow_fused = true,
                            AttentionRoute* route = nullptr);

// causal_attention_qkv(linear(x, w, bias), n_head): a fused projection (GPT-2's c_attn, x
// [B, T, in], w [in, 3C], bias [3C]) and the attention over its output. Where the fused
// attention kernels apply with the flash backend (bf16/f16 in the compute dtype, D 64 or 128,
// a bias, allow_fused) both are one node: its backward's attention kernels sum the bias's
// gradient (the column sums of d(qkv)) as they write d(qkv), so no pass of its own reads that
// [B T, 3C] gradient again; the sums run in a fixed order (bitwise repeatable), a different one
// from the composition's. Elsewhere the composition itself. Autocast as linear's. The one-node
// route is attention_qkv_projection_takes' answer (kernels/fused_table.h, with autocast's
// compute dtype); *route, when given, says which route ran (FusedProjection for that one).
Tensor causal_attention_qkv_projection(const Tensor& x, const Tensor& w, const Tensor& bias,
                                       int64_t n_head, bool allow_fused = true,
                                       AttentionRoute* route = nullptr);

// Llama's attention straight from its fused projection: qkv [B, T, (H + 2 Hkv) D] (q | k | v
// along the last dim; Hkv key/value heads, Hkv dividing H) -> y [B, T, H D]. q and k are
// rotated with the tables of their T positions (ops::rope_tables, head dim D), then causal
// grouped-query attention. Where the fused attention kernels apply (as
// scaled_dot_product_attention's flash condition, and allow_fused) one RoPE launch rotates q
// and k together, the kernels read v in place and write y through a view, and the backward
// writes dv and the rotated-back dq, dk straight into one d(qkv) buffer: no layout copies and
// one gradient for the fused projection. Otherwise: split, rotary_embedding, heads,
// scaled_dot_product_attention, merge (the reference).
Tensor rotary_causal_attention_qkv(const Tensor& qkv, int64_t n_head, int64_t n_kv_head,
                                   const ops::RopeTables& rope, bool allow_fused = true,
                                   AttentionRoute* route = nullptr);

// The attention backend (AttentionBackend, set_attention_backend, attention_backend,
// AttentionBackendRestorer) is a decision of the fused-op table: kernels/fused_table.h.

}  // namespace tessera

namespace tessera {
// ---- the fused loss (autograd/functions_loss.cpp) ----
// cross_entropy for CUDA logits through the fused classifier kernel: the forward writes
// the per-row losses and the gradient of the logits in one pass and the backward only
// scales that gradient (no [N, V] probabilities kept or recomputed). Losses are f32
// whatever the logits' dtype. With consume_logits the kernel reuses the logits' memory for
// the gradient (saves an [N, V] buffer); the caller must not read the logits afterwards.
Tensor fused_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                           Reduction reduction = Reduction::Mean, bool consume_logits = false);

}  // namespace tessera
