// The fused-op table: the one place where "which kernel runs" is decided.
//
// Fused kernels do in one kernel what a chain of ops does in several passes (a GEMM with its
// bias epilogue, the classifier's loss and gradient in one pass, flash attention, optimizer
// updates over many tensors in one launch). Only some devices have them, so they are reached
// like the plain kernels (core/dispatch.h): through a table per device type, filled by the
// backend that has them when it loads (kernels/cuda/register_fused.cpp). Every entry has a
// composed fallback (the same computation from ops) that its caller runs where the entry is
// null, so nothing above kernels/ asks how Tessera was built.
//
// Below the table, its answers to "can this device do it": each fused route's caller asks
// the `*_takes` function of its route (swiglu_takes, linear_gelu_takes, attention_takes, ...)
// and runs the fused entry where it says yes, the composition elsewhere. The answers read the
// table, the operands and the settings (core/settings.h: TESSERA_ATTENTION through
// attention_backend()), never the environment; the settings that switch whole routes off in
// the models (TESSERA_FUSED_MLP, ...) are read by the models' fast blocks from the same
// settings. A size-only dry run (core/size_only.h) silences the CPU row through the hook this
// file registers (register_size_only_table), so planning takes the same routes.
//
// The contracts (shapes, dtypes, alignment) are those of the CUDA functions each entry is
// filled with: kernels/cuda/linear.h, fused.h and cudnn_attention.h.
#pragma once
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/adamw_math.h"
#include "tessera/core/tensor.h"

namespace tessera {

// One AdamW step over many tensors (PyTorch semantics: decoupled weight decay,
// bias-corrected moments, eps after the square root). For tensor i, with g = grads[i] *
// grad_scale (f32), the update is core/adamw_math.h's adamw_update_element with the
// coefficients adamw_coefficients(lr, beta1, beta2, eps, wd_i, step) rounded to float, where
// wd_i = weight_decay when decay[i] is true and 0 otherwise: the same operations, in the same
// order, as the CPU's AdamW, so both give the same bits for the same inputs.
struct MultiTensorAdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;         // 1 on the first update
  float grad_scale = 1.0f;  // e.g. 1/loss_scale or a clipping factor
  // For a launch recorded in a CUDA graph (core/graph_capture.h): device memory of
  // kAdamWReplayScalars floats that outlives the graph, from which the kernel reads the
  // coefficients that change with lr and step (adamw_replay_scalars) when it runs. The owner
  // copies each replay's values there in stream order before the replay
  // (optim::AdamW::prepare_graph_replay), so the host never waits for the previous replay.
  const float* replay_scalars = nullptr;
  // Global-norm clipping folded into the update (optim::Optimizer::clip_grads_in_next_step):
  // when set, every gradient is read times clip_grad_norm_'s factor of the norm at clip_norm
  // (one f32 on the device), max_norm / (norm + 1e-6) when that is below 1, rounded to the
  // gradient's dtype as multi_tensor_clip would have stored it. The gradients are not written.
  const float* clip_norm = nullptr;
  double clip_max_norm = 0.0;
};

// What a replayed multi-tensor AdamW launch reads from replay_scalars: the decay factor of
// the tensors with decay[i] set, the step size and sqrt(1 - beta2^step), as floats.
constexpr int kAdamWReplayScalars = 3;
inline void adamw_replay_scalars(const MultiTensorAdamWConfig& config, float* out) {
  const AdamWCoefficients<float> c = rounded_to<float>(adamw_coefficients(
      config.lr, config.beta1, config.beta2, config.eps, config.weight_decay, config.step));
  out[0] = c.decay;
  out[1] = c.step_size;
  out[2] = c.bias_correction2_sqrt;
}

// A dropout mask drawn inside a kernel: element u (row-major index into the tensor dropped:
// the [B, H, T, T] attention probabilities, or any contiguous activation) is kept when
// core/philox.h's uniform number u of a draw starting at block `offset` under `seed`, rounded
// to f32, is >= p: the mask that dropout(x, p) draws with rand() from the same generator state
// (dropout_keep_from gives the kernels that test on the 32-bit word). The attention kernels
// scale a kept probability by 1 / (1 - p) in f32; the element-wise entries below by
// dropout_kept_scale.
struct DropoutDraw {
  double p = 0;  // in (0, 1)
  uint64_t seed = 0, offset = 0;
};

struct FusedKernelTable {
  // ---- Linear: out[M, N] = x2d @ w (+ bias) with the bias in the GEMM's epilogue; and
  // dw = x2dᵀ @ g with dbias (when defined) = g's column sums from the same GEMM.
  void (*linear_forward)(const Tensor& x2d, const Tensor& w, const Tensor& bias,
                         const Tensor& out) = nullptr;
  void (*linear_weight_grad)(const Tensor& x2d, const Tensor& g, const Tensor& dw,
                             const Tensor& dbias) = nullptr;

  // ---- GPT-2's MLP: out = gelu_tanh(pre_activation) with pre_activation = x2d @ w (+ bias)
  // written too (kept for the backward), one GEMM; and dpre = (g @ wᵀ) * gelu_tanh'(pre_activation)
  // with dbias (when defined) = dpre's column sums from the same GEMM. Outputs contiguous.
  void (*linear_gelu_forward)(const Tensor& x2d, const Tensor& w, const Tensor& bias,
                              const Tensor& out, const Tensor& pre_activation) = nullptr;
  void (*linear_input_grad_dgelu)(const Tensor& g, const Tensor& w, const Tensor& pre_activation,
                                  const Tensor& dpre, const Tensor& dbias) = nullptr;

  // ---- the classifier head: per-row losses of logits [N, V], and the logits overwritten
  // with dloss_scale * (softmax - onehot(target)); with device_scale defined (one f32 on the
  // device) the scale is read from there when the kernel runs.
  void (*classifier)(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     double dloss_scale, const Tensor& row_losses,
                     const Tensor& device_scale) = nullptr;

  // ---- t *= scalar (one value on t's device, rounded to t's dtype by the caller), in
  // place; t is left untouched when the value is exactly 1, decided on the device (no host
  // read, so a CUDA graph can record it).
  void (*scale_by_device_scalar_)(const Tensor& t, const Tensor& scalar) = nullptr;

  // ---- SwiGLU: out = silu(gate) * up and its backward (dgate, dup), one pass each; all
  // operands contiguous, one shape and floating dtype.
  void (*swiglu_forward)(const Tensor& gate, const Tensor& up, const Tensor& out) = nullptr;
  void (*swiglu_backward)(const Tensor& dout, const Tensor& gate, const Tensor& up,
                          const Tensor& dgate, const Tensor& dup) = nullptr;

  // ---- dropout in one pass each way, out = x * mask and dx = dy * mask, where element i's
  // mask is dropout_kept_scale(p, dtype) when `draw` keeps it and 0 otherwise: the bits of
  // dropout's composition (rand, compare, scale, multiply) from the same generator state. The
  // backward draws the mask again instead of reading a saved one. x, out (dy, dx) contiguous,
  // of one shape and floating dtype; p in (0, 1].
  void (*dropout_forward)(const Tensor& x, const DropoutDraw& draw, const Tensor& out) = nullptr;
  void (*dropout_backward)(const Tensor& dy, const DropoutDraw& draw, const Tensor& dx) = nullptr;

  // ---- the exact GELU (core/activation_math.h), BERT's, one pass each way: out = gelu(x),
  // dx = dy * gelu'(x), in f32 for 16- and 32-bit dtypes (f64 for f64). Contiguous operands of
  // one shape and floating dtype.
  void (*gelu_erf_forward)(const Tensor& x, const Tensor& out) = nullptr;
  void (*gelu_erf_backward)(const Tensor& dy, const Tensor& x, const Tensor& dx) = nullptr;

  // ---- the residual add of a pre-norm block fused into RMSNorm (ops::residual_rms_norm):
  // residual_out = x + residual (rounded to the dtype) and out = rms_norm(residual_out, w) with
  // rstd as the plain kernel's (core/dispatch.h); residual_out, out, rstd contiguous.
  void (*residual_rms_norm)(const Tensor& x, const Tensor& residual, const Tensor& residual_out,
                            const Tensor& w, double eps, const Tensor& out,
                            const Tensor& rstd) = nullptr;
  // RMSNorm's backward with the residual stream's gradient added into dx in the same pass:
  // dx = rms_norm_backward(dy) + dresidual; dw accumulates (+=) when defined.
  void (*rms_norm_backward_residual)(const Tensor& dy, const Tensor& x, const Tensor& w,
                                     const Tensor& rstd, const Tensor& dresidual, const Tensor& dx,
                                     const Tensor& dw) = nullptr;

  // ---- the same for LayerNorm (ops::residual_layer_norm, GPT-2's pre-norm blocks):
  // residual_out = (x + x_bias) + residual (each add rounded to the dtype; x_bias [C], the
  // bias of the projection that produced x, may be undefined), out = layer_norm(residual_out,
  // w, b) with mean/rstd as the plain kernel's (core/dispatch.h); w, b may be undefined;
  // residual_out, out, mean, rstd contiguous.
  void (*residual_layer_norm)(const Tensor& x, const Tensor& residual, const Tensor& x_bias,
                              const Tensor& w, const Tensor& b, double eps,
                              const Tensor& residual_out, const Tensor& out, const Tensor& mean,
                              const Tensor& rstd) = nullptr;
  // LayerNorm's backward with the residual stream's gradient added into dx in the same pass:
  // dx = layer_norm_backward(dy) + dresidual; dw, db and dsum (the column sums of dx: x_bias's
  // gradient) are written (not accumulated: they need not be initialised) when defined and x
  // has rows.
  void (*layer_norm_backward_residual)(const Tensor& dy, const Tensor& x, const Tensor& w,
                                       const Tensor& mean, const Tensor& rstd,
                                       const Tensor& dresidual, const Tensor& dx, const Tensor& dw,
                                       const Tensor& db, const Tensor& dsum) = nullptr;

  // ---- causal attention on [B, H, T, D] heads, O(T) memory; lse [B, H, T] f32. Two
  // implementations with one contract: the hand-written flash kernels and cuDNN's.
  void (*flash_attention_forward)(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                  const Tensor& out, const Tensor& lse) = nullptr;
  void (*flash_attention_backward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& dout, const Tensor& lse,
                                   double scale, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv) = nullptr;
  // flash_attention_backward, and dbias [3 H D] = the column sums of dq | dk | dv over their
  // B T rows (H = Hkv; q's dtype; written): the bias gradient of the projection q | k | v come
  // from, summed by the kernels as they store the gradients.
  void (*flash_attention_backward_with_bias_grad)(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& out, const Tensor& dout,
                                                  const Tensor& lse, double scale, const Tensor& dq,
                                                  const Tensor& dk, const Tensor& dv,
                                                  const Tensor& dbias) = nullptr;
  // The same with dropout on the probabilities (the mask of `dropout`, above); the backward
  // regenerates it from the same (seed, offset).
  void (*flash_attention_dropout_forward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                          double scale, const DropoutDraw& dropout,
                                          const Tensor& out, const Tensor& lse) = nullptr;
  void (*flash_attention_dropout_backward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& out, const Tensor& dout, const Tensor& lse,
                                           double scale, const DropoutDraw& dropout,
                                           const Tensor& dq, const Tensor& dk,
                                           const Tensor& dv) = nullptr;
  // ---- attention beyond causal self-attention in the hand-written flash kernels: `causal` or
  // not, with keys padded on the right when kv_lengths (i32 [B]) is defined: key j of batch row
  // b is attended iff j < kv_lengths[b] (and, causal, j <= i). cuDNN's masked entries below have
  // the same contract, except that these also take a length of 0: such a row's outputs are 0,
  // its lse +inf, and it passes no gradient (kernels/cuda/fused.h).
  void (*flash_masked_attention_forward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                         double scale, bool causal, const Tensor& kv_lengths,
                                         const Tensor& out, const Tensor& lse) = nullptr;
  void (*flash_masked_attention_backward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& out, const Tensor& dout, const Tensor& lse,
                                          double scale, bool causal, const Tensor& kv_lengths,
                                          const Tensor& dq, const Tensor& dk,
                                          const Tensor& dv) = nullptr;
  // The same with dropout on the probabilities (the mask of `dropout`, as the causal dropout
  // entries above draw it); the backward regenerates it from the same (seed, offset).
  void (*flash_masked_attention_dropout_forward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 double scale, bool causal,
                                                 const Tensor& kv_lengths,
                                                 const DropoutDraw& dropout, const Tensor& out,
                                                 const Tensor& lse) = nullptr;
  void (*flash_masked_attention_dropout_backward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& out, const Tensor& dout,
                                                  const Tensor& lse, double scale, bool causal,
                                                  const Tensor& kv_lengths,
                                                  const DropoutDraw& dropout, const Tensor& dq,
                                                  const Tensor& dk, const Tensor& dv) = nullptr;
  // True when cuDNN attention can run here; otherwise false and *reason says why.
  bool (*cudnn_attention_available)(std::string* reason) = nullptr;
  void (*cudnn_attention_forward)(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                  const Tensor& out, const Tensor& lse) = nullptr;
  void (*cudnn_attention_backward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& dout, const Tensor& lse,
                                   double scale, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv) = nullptr;
  // cuDNN's attention causal or not, with keys padded on the right when kv_lengths (i32 [B])
  // is defined (kernels/cuda/cudnn_attention.h).
  bool (*cudnn_masked_attention_available)(std::string* reason) = nullptr;
  void (*cudnn_masked_attention_forward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                         double scale, bool causal, const Tensor& kv_lengths,
                                         const Tensor& out, const Tensor& lse) = nullptr;
  void (*cudnn_masked_attention_backward)(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& out, const Tensor& dout, const Tensor& lse,
                                          double scale, bool causal, const Tensor& kv_lengths,
                                          const Tensor& dq, const Tensor& dk,
                                          const Tensor& dv) = nullptr;

  // ---- optimizers and clipping, one launch for many contiguous tensors on one device ----
  // exp_avg/exp_avg_sq f32; params f32, or f16/bf16 with an f32 master (updated, then rounded
  // into the param); masters[i] undefined when there is none.
  void (*multi_tensor_adamw)(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const std::vector<Tensor>& exp_avg,
                             const std::vector<Tensor>& exp_avg_sq,
                             const std::vector<Tensor>& masters, const std::vector<bool>& decay,
                             const MultiTensorAdamWConfig& config) = nullptr;
  // sqrt(sum of squares of every element) as a 0-d f32 tensor on the device (no host sync).
  Tensor (*global_grad_norm)(const std::vector<Tensor>& grads) = nullptr;
  // Every tensor *= factor in place.
  void (*multi_tensor_scale)(const std::vector<Tensor>& tensors, double factor) = nullptr;
  // Gradient clipping without a host read: with n = norm (0-d f32 on the device, from
  // global_grad_norm) and coef = max_norm / (n + 1e-6) in f64, every tensor *= min(coef, 1)
  // when coef < 1 or n is not finite (optim::clip_grad_norm_'s rule, decided on the device).
  void (*multi_tensor_clip)(const std::vector<Tensor>& tensors, const Tensor& norm,
                            double max_norm) = nullptr;
};

// The row for a device type; entries are null where the device has no such fused kernel.
FusedKernelTable& fused_kernel_table(DeviceType type);

// ---- "can this device do it": the table's answers, one per fused route ----

// True when the Linear GEMM entries can take x2d [rows, in], w [in, out] and bias ([out] or
// undefined) as they are: one device, one 16/32-bit float dtype (the bias in it or in f32, as
// under autocast); with allow_f64 also float64, which the kernels take through their plain
// fallback. Says nothing about whether the device has the entries (the caller looks).
bool fused_linear_operands(const Tensor& x2d, const Tensor& w, const Tensor& bias,
                           bool allow_f64 = false);

// swiglu(gate, up) in one kernel each way: the device has both entries and gate, up are
// contiguous, of one shape, floating dtype and device.
bool swiglu_takes(const Tensor& gate, const Tensor& up);

// dropout(x, p) and the exact GELU in one kernel each way: the device has both entries of the
// route and x is contiguous with a floating dtype.
bool dropout_takes(const Tensor& x);
bool gelu_erf_takes(const Tensor& x);
// What a kept element of dropout(x, p) is multiplied by: 1 / (1 - p) rounded to `dtype` as
// ops::binary rounds a scalar operand, so that the fused entries multiply by what the
// composition's mask holds (1 for p = 1, where nothing is kept); exact in double.
double dropout_kept_scale(double p, DType dtype);
// What every backend's dropout_* / gelu_erf_* entry checks first, naming the operands: a and b
// defined, contiguous, floating, of one shape and dtype, on one device of `type`; and a draw's
// p in (0, 1].
void check_elementwise_entry_operands(const char* op, DeviceType type, const Tensor& a,
                                      const char* a_name, const Tensor& b, const char* b_name);
void check_dropout_draw(const char* op, const DropoutDraw& draw);

// GPT-2's MLP gelu(x2d @ w_fc + b_fc) @ w_proj + b_proj with the GELU in the GEMMs'
// epilogues: the device has the entries and both GEMMs take their operands (f64 included:
// one node either way, so the fused route can be checked in float64).
bool linear_gelu_takes(const Tensor& x2d, const Tensor& w_fc, const Tensor& b_fc,
                       const Tensor& w_proj, const Tensor& b_proj);

// Which implementation the fused attention routes run: the hand-written flash kernels
// (default) or cuDNN's fused attention (kernels/cuda/cudnn_attention.h). Choosing Cudnn where
// cuDNN attention is unavailable makes those routes raise, saying why; they never fall back
// silently. The composed route is unaffected. Until set_attention_backend is called, the
// choice is the setting TESSERA_ATTENTION (flash | cudnn), read at the first use.
enum class AttentionBackend { Flash, Cudnn };
void set_attention_backend(AttentionBackend backend);
AttentionBackend attention_backend();
// "flash" or "cudnn" (any case) -> the backend; anything else raises naming `source`
// (where the name came from, e.g. the variable) and the accepted names.
AttentionBackend parse_attention_backend(const std::string& name,
                                         const char* source = "attention backend");
const char* attention_backend_name(AttentionBackend backend);
// The backend TESSERA_ATTENTION names now (Flash when unset or empty); raises on an unknown
// name. attention_backend() calls it once, at its first use.
AttentionBackend attention_backend_from_environment();
// Saves the attention backend and where its choice came from, and restores both when it goes
// out of scope: a choice left to the default or the environment is theirs again (masked
// attention tells a backend named by set_attention_backend from the default, see
// masked_attention_kernels). For tests and tools that switch backends for a while.
class AttentionBackendRestorer {
 public:
  AttentionBackendRestorer();
  ~AttentionBackendRestorer();
  AttentionBackendRestorer(const AttentionBackendRestorer&) = delete;
  AttentionBackendRestorer& operator=(const AttentionBackendRestorer&) = delete;

 private:
  AttentionBackend saved_;
  bool was_option_;
};

// The route an attention op took, as it reports it (autograd/functions.h's attention ops take
// an optional AttentionRoute*): the composition of differentiable ops, the fused attention
// kernels, or the fused kernels in one node with the projection before them.
enum class AttentionRoute { Composed, Fused, FusedProjection };
const char* attention_route_name(AttentionRoute route);

// True when the fused kernels can read t as it is: last dim contiguous, every row starting on
// a 16-byte boundary (they move 16-byte vectors along it).
bool rows_readable_by_kernels(const Tensor& t);
// The [B, H, T, D] heads of channels [first, first + C) of x [B, T, *] as a view (no copy):
// the shape the attention kernels take. Needs x's last dim contiguous.
Tensor attention_heads_view(const Tensor& x, int64_t first, int64_t C, int64_t n_head);
// The shapes and layouts every fused attention kernel takes: bf16/f16 [B, H, T, D]
// self-attention views with D of 64 or 128, grouped-query heads (k, v [B, Hkv, T, D], Hkv | H),
// rows the kernels can read.
bool attention_shapes_fit(const Tensor& q, const Tensor& k, const Tensor& v);

// The kernels that run attention beyond causal self-attention (not causal, or keys padded on
// the right): the hand-written flash kernels' masked entries or cuDNN's masked graphs.
enum class MaskedAttentionKernels { Flash, Cudnn };
// Who runs such attention on q's device: cuDNN's masked graphs where the cudnn backend is
// chosen (TESSERA_ATTENTION, set_attention_backend; the call raises when cuDNN cannot run);
// the hand-written flash kernels where the flash backend is chosen in so many words (the
// environment or set_attention_backend) or cuDNN cannot run; by default, cuDNN where it runs:
// the hand-written masked kernels are the portable mma.sync ones (the Hopper kernels take no
// mask), 2-2.6x slower than cuDNN's graphs on an H200 (benchmarks/cuda/NOTES.md). With dropout
// the hand-written kernels whatever the backend (cuDNN draws no dropout of Tessera's
// generator). Nothing (the caller composes) for shapes no fused kernel takes, or on a device
// without such kernels.
std::optional<MaskedAttentionKernels> masked_attention_kernels(const Tensor& q, const Tensor& k,
                                                               const Tensor& v, double dropout_p);

// scaled_dot_product_attention(q, k, v, causal, dropout_p) in the fused kernels (flash, or
// cuDNN's under the cudnn backend; non-causal: masked_attention_kernels has an answer).
bool attention_takes(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                     double dropout_p = 0.0);
// causal_attention_qkv(qkv, n_head, dropout_p) in the fused kernels (with dropout: through the
// reference's scaled_dot_product_attention): the heads of qkv [B, T, 3C] as views take them.
bool attention_qkv_takes(const Tensor& qkv, int64_t n_head, double dropout_p = 0.0);
// causal_attention_qkv_projection(x, w, bias, n_head) as one node: x [B, T, in], w [in, 3C],
// bias [3C], both computing in bf16/f16 (x's and w's dtypes, or `cast_to` (autocast's compute
// dtype) where it casts them: floating, not f64), D 64 or 128, the flash backend and the
// entry that sums the bias's gradient in the attention backward.
bool attention_qkv_projection_takes(const Tensor& x, const Tensor& w, const Tensor& bias,
                                    int64_t n_head, std::optional<DType> cast_to = std::nullopt);

}  // namespace tessera
