// Fused CUDA kernels with a raw, host-callable API on Tensors (namespace
// tessera::cuda). They do in one pass what a chain of ops would do in several
// and are what the CUDA training path calls directly; each has a plain
// composition of ops/kernels it is tested against. No autograd here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/kernels/fused_table.h"

namespace tessera::cuda {

// residual_out = (x + x_bias) + residual (x_bias [C] may be undefined); out =
// layer_norm(residual_out) over the last dim.
// mean/rstd: f32 [rows]. weight/bias may be undefined. out, residual_out contiguous.
void fused_residual_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& x_bias,
                               const Tensor& weight, const Tensor& bias, double eps,
                               const Tensor& residual_out, const Tensor& out, const Tensor& mean,
                               const Tensor& rstd);

// The backward of GELU after a GEMM with a bias, in one pass: d [rows, H] holds dL/d act and
// becomes dL/d pre = d * gelu'(pre) (the same values as binary(GeluBackward)), and dbias [H]
// is overwritten with its column sums (the bias gradient), summed in a fixed order. False
// (nothing done) unless pre and d are contiguous f32/f16/bf16 alike, 16-byte aligned, H a
// multiple of 8, and dbias a contiguous [H] of their dtype.
bool gelu_backward_with_bias_grad(const Tensor& pre, const Tensor& d, const Tensor& dbias);

// sums [H] = the column sums of g [rows, H] (a Linear's bias gradient), overwritten, by the same
// pass without the GELU: a thread per 8 columns down a chunk of rows, partials summed in a
// fixed order. False (nothing done) under gelu_backward_with_bias_grad's conditions on d.
bool column_sums(const Tensor& g, const Tensor& sums);

// out = (a + b) * scale in f32, rounded once into out's dtype: the sum (scale 1) or the average
// (scale 1/2) of two ranks' halves of a bucket (dist/cuda/peer_all_reduce.h). The same bits as
// an add and then a multiply by a power of two, in one pass instead of two. a, b and out:
// contiguous f32/f16/bf16 tensors of one dtype and size on one CUDA device (out may be a).
void sum_scaled(const Tensor& a, const Tensor& b, double scale, const Tensor& out);

// The classifier head in one pass per row: reads logits [N, V] (f32/f16/bf16, contiguous),
// writes each row's loss (f32 [N], 0 for ignored rows) and overwrites the logits with
//   dlogits = dloss_scale * (softmax(logits) - onehot(target))   (0 for ignored rows)
// without ever storing probabilities for the whole vocabulary. A target outside [0, V) that
// is not ignore_index raises. The mean loss is sum(row_losses) / (number of counted rows);
// pass dloss_scale = 1 / that count for its gradient. When device_scale (one f32 value on the
// device) is given, the scale is read from it when the kernel runs instead, so the count need
// not be read on the host (and a CUDA graph replays it with the value of the replay). Inside
// a graph capture the bad-target check is skipped (reading its flag would synchronise).
void fused_classifier(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                      double dloss_scale, const Tensor& row_losses,
                      const Tensor& device_scale = Tensor());

// AdamW over many tensors in one launch; the formula and the config are
// MultiTensorAdamWConfig's (kernels/fused_table.h, the fused-kernel table this fills).
// exp_avg/exp_avg_sq are f32; params are f32, or f16/bf16 with an f32 master copy in
// `master` (then the master is updated and the param is its rounded copy). All contiguous,
// on one device.
using AdamWConfig = MultiTensorAdamWConfig;
void multi_tensor_adamw(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                        const std::vector<Tensor>& master, const std::vector<bool>& decay,
                        const AdamWConfig& config);

// sqrt(sum over tensors of sum(g^2)) as a 0-d f32 CUDA tensor (no host sync), summed in a
// fixed order. Tensors may have any float dtype; all on one device.
Tensor global_grad_norm(const std::vector<Tensor>& grads);

// Multiplies every tensor in place by factor (f32 math, stored in each tensor's dtype), one
// launch for all (gradient clipping). Contiguous floating tensors on one CUDA device.
void multi_tensor_scale_(const std::vector<Tensor>& tensors, double factor);
// Clipping by a global norm that stays on the device (FusedKernelTable::multi_tensor_clip):
// every tensor *= min(max_norm / (norm + 1e-6), 1) when that is below 1 or norm is not finite.
void multi_tensor_clip_(const std::vector<Tensor>& tensors, const Tensor& norm, double max_norm);
// t *= scalar (one floating value on t's device, taken as f32), in place; blocks leave t
// alone when it is exactly 1 (FusedKernelTable::scale_by_device_scalar_).
void scale_by_device_scalar_(const Tensor& t, const Tensor& scalar);

// ---- SwiGLU (kernels/cuda/swiglu.cu): out = silu(gate) * up, and its backward
// dgate = dout * up * silu'(gate), dup = dout * silu(gate), each one pass. All operands
// contiguous floating tensors of one shape and dtype on one CUDA device.
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out);
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup);

// ---- dropout and the exact GELU, one pass each way (kernels/cuda/fused_elementwise.cu):
// FusedKernelTable's dropout_* and gelu_erf_* contracts (kernels/fused_table.h). Contiguous
// floating tensors of one shape and dtype on one CUDA device.
void dropout_forward(const Tensor& x, const DropoutDraw& draw, const Tensor& out);
void dropout_backward(const Tensor& dy, const DropoutDraw& draw, const Tensor& dx);
void gelu_erf_forward(const Tensor& x, const Tensor& out);
void gelu_erf_backward(const Tensor& dy, const Tensor& x, const Tensor& dx);

// ---- causal attention, flash-attention style (O(T) memory) ----
// q, out (and dout, dq of the backward): [B, H, T, D]; k, v (and dk, dv): [B, Hkv, T, D]
// with Hkv dividing H (grouped-query attention: query head h reads key/value head
// h / (H / Hkv), and dk, dv are summed over each group; Hkv = H is plain attention); bf16
// or f16 of one dtype, D = 64 or 128, as VIEWS: any strides with the head dim contiguous and
// every row starting on a 16-byte boundary (data 16-byte aligned, other strides multiples
// of 8 elements). So q, k, v can be the heads of a fused [B, T, 3C] projection, out the heads
// of a [B, T, C] output and dq | dk | dv the heads of one [B, T, 3C] gradient: no layout
// copies. Written tensors (out, dq, dk, dv) must not overlap themselves. lse: f32 [B, H, T],
// contiguous, the log-sum-exp of each query's scaled scores (kept for the backward). scale
// is usually 1/sqrt(D). cudnn_attention.h offers cuDNN's kernels under the same contract.
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse);
// On an H100/H200 (sm_90 device, library built with sm_90a code) the forward runs a
// warp-specialised wgmma + TMA kernel (attention_sm90.cu); elsewhere, and for views the TMA unit
// cannot describe, the mma.sync kernel. These entry points pick one explicitly (tests, benchmarks):
// flash_attention_forward_sm90 raises, saying why, where the Hopper kernel cannot run.
void flash_attention_forward_sm90(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                  const Tensor& out, const Tensor& lse);
void flash_attention_forward_mma_sync(const Tensor& q, const Tensor& k, const Tensor& v,
                                      double scale, const Tensor& out, const Tensor& lse);
// Whether flash_attention_forward takes the Hopper kernel for these inputs and scale (out and
// lse as the contract above; it needs scale > 0; TESSERA_ATTENTION_SM90=0 in the environment
// keeps the mma.sync kernel); when not and why_not is given, the reason.
bool flash_attention_forward_uses_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                       double scale, std::string* why_not = nullptr);
// dq, dk, dv in the input dtype; out and lse from the forward.
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse,
                              double scale, const Tensor& dq, const Tensor& dk, const Tensor& dv);
// The same, and dbias [3 H D] (q's dtype, written) = the column sums of dq | dk | dv over their
// B T rows: the bias gradient of the projection q, k and v come out of (H = Hkv). The Hopper
// kernels sum each block's rows as they store them (a fixed order: bitwise repeatable); the
// mma.sync route sums the three gradients afterwards.
void flash_attention_backward_with_bias_grad(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& out, const Tensor& dout,
                                             const Tensor& lse, double scale, const Tensor& dq,
                                             const Tensor& dk, const Tensor& dv,
                                             const Tensor& dbias);
// On an H100/H200 the backward runs the wgmma + TMA kernels of attention_sm90_backward.cu (a
// dk/dv kernel and a dq kernel, no atomics, bitwise repeatable like the mma.sync ones); elsewhere,
// for views the TMA unit cannot describe, or with TESSERA_ATTENTION_SM90_BWD=0 in the environment,
// the mma.sync kernels. These pick one explicitly (tests, benchmarks):
// flash_attention_backward_sm90 raises, saying why, where the Hopper kernels cannot run.
void flash_attention_backward_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& dout, const Tensor& lse,
                                   double scale, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv);
void flash_attention_backward_mma_sync(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& dout, const Tensor& lse,
                                       double scale, const Tensor& dq, const Tensor& dk,
                                       const Tensor& dv);
// Whether flash_attention_backward takes the Hopper kernels for these inputs (dout as the
// contract above); when not and why_not is given, the reason.
bool flash_attention_backward_uses_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& dout, std::string* why_not = nullptr);
// Flash attention with dropout on the probabilities (kernels/fused_table.h's DropoutDraw:
// the mask dropout(softmax(...), p) draws from the same generator state), forward and backward,
// on the mma.sync kernels on every GPU (the Hopper and cuDNN kernels draw no dropout). The
// contract of flash_attention_forward / flash_attention_backward; the backward takes the
// forward's `dropout` and regenerates its mask.
void flash_attention_dropout_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     double scale, const DropoutDraw& dropout,
                                     const Tensor& out, const Tensor& lse);
void flash_attention_dropout_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& out, const Tensor& dout, const Tensor& lse,
                                      double scale, const DropoutDraw& dropout,
                                      const Tensor& dq, const Tensor& dk, const Tensor& dv);
// Attention beyond causal self-attention on the mma.sync kernels (every GPU): `causal` or not
// (bidirectional), and keys padded on the right when kv_lengths is defined (i32 [B], contiguous,
// on q's device): key j of batch row b is attended iff j < kv_lengths[b] (and, causal, j <= i).
// The contract of flash_attention_forward / flash_attention_backward otherwise. Every query row
// is computed, padded ones too: a query past its row's length attends to the row's real keys
// (as a key-padding attn_mask makes it), so the outputs and gradients equal the masked
// composition's on every row, and keys at j >= kv_lengths[b] get exactly zero dk, dv. What the
// padded keys and values hold is never read (NaN there changes nothing). A length of 0 leaves a
// row no key: its outputs are 0, its lse +inf (FlashAttention's convention; the composition's
// safe softmax gives the same 0) and it passes no gradient. Lengths are clamped to [0, T] on the
// device (reading them on the host would wait for the GPU). Causal without kv_lengths is
// flash_attention_forward / flash_attention_backward (the Hopper kernels where they run).
void flash_masked_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                    bool causal, const Tensor& kv_lengths, const Tensor& out,
                                    const Tensor& lse);
void flash_masked_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& dout, const Tensor& lse,
                                     double scale, bool causal, const Tensor& kv_lengths,
                                     const Tensor& dq, const Tensor& dk, const Tensor& dv);
// Both at once: the masking above with dropout on the probabilities (the mask of
// flash_attention_dropout_forward: the one the composition dropout(softmax(masked scores), p)
// draws from the same generator state; masked probabilities are 0 and stay 0). Every case,
// plain causal included, runs the mma.sync kernels.
void flash_masked_attention_dropout_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            double scale, bool causal, const Tensor& kv_lengths,
                                            const DropoutDraw& dropout, const Tensor& out,
                                            const Tensor& lse);
void flash_masked_attention_dropout_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& out, const Tensor& dout, const Tensor& lse,
                                             double scale, bool causal, const Tensor& kv_lengths,
                                             const DropoutDraw& dropout, const Tensor& dq,
                                             const Tensor& dk, const Tensor& dv);
// The readable reference: materialises the [T, T] scores per (b, h) in f32. Any head size;
// out any non-overlapping view with the head dim contiguous.
void naive_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse);

// ---- hand-written tensor-core GEMM (teaching / benchmark; cuBLAS is the default) ----
// c[M, N] = a[M, K] @ b[K, N], bf16 or f16 in, f32 accumulation, out in the input dtype.
// All row-major contiguous.
void tensor_core_gemm(const Tensor& a, const Tensor& b, const Tensor& c);

}  // namespace tessera::cuda
