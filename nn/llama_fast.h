// The fast Llama decoder layer: the reference LlamaDecoderLayer (nn/llama.h) computed with
// fewer kernels, on the same parameters. What differs from the reference:
// - the residual stream travels as residual + delta: each add is left to the RMSNorm that
//   reads the sum next, which does it in the same kernel (residual_rms_norm) and its gradient
//   in the norm's backward;
// - training and full forwards run one GEMM for q | k | v (the three weights stacked) and the
//   rotary attention straight from that projection (rotary_causal_attention_qkv: one gradient
//   flows back into it). With a KV cache the attention is the reference's.
// tests/nn/test_reference_and_fast_blocks.cpp holds the two to the same outputs and gradients.
#pragma once
#include <utility>

#include "tessera/kernels/ops.h"
#include "tessera/nn/causal_lm.h"

namespace tessera::nn {

class Llama;
class LlamaAttention;
class LlamaDecoderLayer;

// The attention's output for input_layernorm's output x (positions [past, past + T)).
Tensor llama_fast_attention(LlamaAttention& attn, const Tensor& x, const ops::RopeTables& rope,
                            int64_t past, KVCache::Layer* cache);
// The layer on a residual stream whose last add is still pending: its input is residual +
// delta (delta undefined: residual alone), and it returns {h, mlp_out}, its output being
// h + mlp_out. `recompute` attention or mlp (training, no cache: CausalLM::checkpoint_region)
// runs that sub-layer under activation checkpointing; a whole layer's is the caller's.
std::pair<Tensor, Tensor> llama_fast_layer(LlamaDecoderLayer& layer, const Tensor& residual,
                                           const Tensor& delta, const ops::RopeTables& rope,
                                           int64_t past, KVCache::Layer* cache,
                                           CheckpointRegion recompute = CheckpointRegion::none);
// Llama's fast stack: the embeddings' output x [B, T, C] through every decoder layer to the
// final norm's output; with a cache, positions [past, past + T).
Tensor llama_fast_hidden_states(Llama& model, const Tensor& x, const ops::RopeTables& rope,
                                int64_t past, KVCache* cache);

}  // namespace tessera::nn
