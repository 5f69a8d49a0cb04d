// cuDNN's fused (flash) attention through the cuDNN frontend graph API: the run-time
// alternative to the hand-written kernels of attention.cu / attention_backward.cu, with the
// same contract, so either can run the forward or the backward of the other:
//   q, out, dout, dq: [B, H, T, D]; k, v, dk, dv: [B, Hkv, T, D] with Hkv dividing H
//     (grouped-query attention; cuDNN sums dk, dv over each group); bf16 or f16 views whose head dim is
//     contiguous and whose rows start on 16-byte boundaries (views of a fused [B, T, 3C]
//     projection and of a [B, T, C] output work as they are); causal; D = 64 or 128.
//   lse: f32 [B, H, T] contiguous, the natural-log log-sum-exp of each query's scaled scores.
// Built only when the frontend headers are found (scripts/setup.sh fetches them); without
// them cudnn_attention_available() is false and the two functions raise.
// A graph and its plan are built on the first call for each (dtype, B, H, T, D, strides of
// every operand, scale, device) and cached per thread; later calls only execute. Work runs on
// the current stream with a workspace from the caching allocator. With
// set_deterministic(true) the backward uses cuDNN's deterministic (bitwise repeatable) variant.
#pragma once
#include <string>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// True when this build has the frontend and the loaded cuDNN can run causal SDPA on the
// current device; otherwise false, and reason (if given) says why.
bool cudnn_attention_available(std::string* reason = nullptr);

void cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse);
void cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse,
                              double scale, const Tensor& dq, const Tensor& dk, const Tensor& dv);

// The same beyond causal self-attention: `causal` or not, and keys padded on the right when
// kv_lengths is defined (i32 [B], contiguous on q's device, each in [1, T]): key j of batch row
// b is attended iff j < kv_lengths[b] (and, causal, j <= i). Every query row is computed (a
// padded query attends to row b's real keys, as a key-padding attn_mask makes it), so the
// outputs equal the masked composition on every row. cuDNN's padding mask takes the lengths.
bool cudnn_masked_attention_available(std::string* reason = nullptr);
void cudnn_masked_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                    bool causal, const Tensor& kv_lengths, const Tensor& out,
                                    const Tensor& lse);
void cudnn_masked_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& dout, const Tensor& lse,
                                     double scale, bool causal, const Tensor& kv_lengths,
                                     const Tensor& dq, const Tensor& dk, const Tensor& dv);

}  // namespace tessera::cuda
