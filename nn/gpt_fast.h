// The fast GPT-2 block: the reference Block (nn/attention.h) computed with fewer kernels, on
// the same parameters. What differs from the reference, each where it applies:
// - the residual stream travels as residual + delta (+ delta_bias): each block's last add is
//   left to the layer norm that reads the sum next (the next block's ln_1, then ln_f), which
//   does it in its own kernel (LayerNorm::forward_residual) and its gradient in its backward;
// - deferred biases: where nothing needs to see a projection's complete output
//   (output_biases_deferrable), attn.c_proj's and mlp.c_proj's biases stay out of their GEMMs
//   and are added inside the norms after them, their gradients coming out of those norms'
//   backward passes (TESSERA_DEFERRED_BIASES=0 turns it off);
// - attention straight on c_attn's output (causal_attention_qkv: no split, head transposes or
//   merge copies), and c_attn and the attention as one node on a GPU
//   (causal_attention_qkv_projection; TESSERA_FUSED_QKV_PROJECTION=0 turns it off);
// - the MLP as one mlp_gelu node (TESSERA_FUSED_MLP=0 turns it off).
// The reference is what GPT runs with set_block_implementation(BlockImplementation::reference);
// tests/nn/test_reference_and_fast_blocks.cpp holds the two to the same outputs and gradients.
#pragma once
#include <vector>

#include "tessera/kernels/fused_table.h"
#include "tessera/nn/attention.h"

namespace tessera::nn {

class GPT;

// A block's output as three terms, its sum residual + delta + delta_bias: the last add of the
// block (and the bias of its MLP's output projection, delta_bias, when that is deferred too;
// else undefined) left to the next layer norm.
struct BlockOutput {
  Tensor residual, delta, delta_bias;
};

// The fast implementation of one Block (which it reads, and must outlive it), with the
// switches of its fused routes and how often each ran (to check a route is really taken).
class GPTFastBlock {
 public:
  explicit GPTFastBlock(Block& block) : block_(&block) {}

  // Block::forward(x) computed as forward_deferred(x, {}) and summed; call runs it between the
  // block's hooks, as the block's operator() runs forward.
  Tensor forward(const Tensor& x);
  Tensor call(const Tensor& x);
  // The block with its residual adds fused into the layer norms after them: the input is
  // residual + delta + delta_bias (delta undefined: residual alone; delta_bias undefined: no
  // bias term), added inside ln_1, and the output is the terms of BlockOutput, its last add
  // left to the next layer norm. With defer_biases (only where output_biases_deferrable) the
  // output projections' biases stay out of their GEMMs too: attn.c_proj's is added inside
  // ln_2, mlp.c_proj's is returned as delta_bias. With a cache, attention appends to it at
  // positions [past, past + T) (tape-free decoding). `recompute` attention or mlp (training,
  // without deferred biases: CausalLM::checkpoint_region) runs that sub-layer under activation
  // checkpointing; a whole block's checkpoint is the caller's.
  BlockOutput forward_deferred(const Tensor& residual, const Tensor& delta,
                               const Tensor& delta_bias = Tensor(), bool defer_biases = false,
                               KVCache::Layer* cache = nullptr, int64_t past = 0,
                               CheckpointRegion recompute = CheckpointRegion::none);
  // forward_deferred between the block's hooks, as the block's operator() runs forward: they
  // see residual as the input and the delta term as the output, so the backward pre-hooks fire
  // when its gradient arrives, before any of the block's own ops run backward (ZeRO-3 gathers
  // the block's parameters there).
  BlockOutput call_deferred(const Tensor& residual, const Tensor& delta, const Tensor& delta_bias,
                            bool defer_biases,
                            CheckpointRegion recompute = CheckpointRegion::none);
  // The attention's output for ln_1's output x; without_output_bias leaves c_proj's bias out
  // (resid_dropout must then be inactive).
  Tensor attention(const Tensor& x, bool without_output_bias);
  // The attention with a cache (tape-free).
  Tensor attention_cached(const Tensor& x, KVCache::Layer& layer, int64_t past);
  // The MLP's output for ln_2's output x, as attention.
  Tensor mlp(const Tensor& x, bool without_output_bias);

  Block& block() { return *block_; }

  // Use the fused CUDA attention kernels (flash or cuDNN: see set_attention_backend) where
  // they apply (bf16/f16 on a GPU, head size 64 or 128; with attention dropout the flash
  // kernels that draw it): attention runs them straight on c_attn's output
  // (causal_attention_qkv), attention_cached on the cache's heads; otherwise the scores are
  // materialised.
  bool use_fused_attention = true;
  // Run c_attn and the fused attention as one node where it applies
  // (causal_attention_qkv_projection: the attention backward also sums c_attn's bias gradient)
  // unless c_attn has hooks.
  bool use_fused_projection = fused_projection_by_default();
  // Run c_fc -> act -> c_proj as one mlp_gelu node (on a GPU: the GELU's backward and c_fc's
  // bias gradient in one pass, kernels/cuda/linear.h) unless one of the three carries hooks,
  // which must see their module's own call; the MLP's own hooks run either way.
  bool use_fused_mlp = fused_mlp_by_default();
  // TESSERA_FUSED_QKV_PROJECTION / TESSERA_FUSED_MLP: on unless "0".
  static bool fused_projection_by_default();
  static bool fused_mlp_by_default();

  // How many attention calls took the fused kernels, how many of them the one-node
  // projection route (as the attention ops report their AttentionRoute), and how many MLP
  // calls went through mlp_gelu.
  int64_t fused_attention_calls() const { return fused_attention_calls_; }
  int64_t fused_projection_calls() const { return fused_projection_calls_; }
  int64_t fused_mlp_calls() const { return fused_mlp_calls_; }

 private:
  Tensor attention_heads(const Tensor& x);
  void count_route(AttentionRoute route);
  Block* block_;
  int64_t fused_attention_calls_ = 0;
  int64_t fused_projection_calls_ = 0;
  int64_t fused_mlp_calls_ = 0;
};

// GPT's fast stack: the blocks of model.transformer through model.fast_blocks from the
// embeddings' output x [B, T, C] to ln_f's output; with a cache, positions [past, past + T).
Tensor gpt_fast_hidden_states(GPT& model, const Tensor& x, int64_t past, KVCache* cache);
// Whether the fast stack leaves the output projections' biases to the norms after them
// (GPTFastBlock::forward_deferred's defer_biases): the model has biases, no module has hooks
// (they would see outputs without them; ZeRO-3 gathers parameters per block from its hooks), no
// dropout after a projection is active, no block recomputes anything under the gradient
// checkpointing policy (CausalLM::checkpoint_region), and TESSERA_DEFERRED_BIASES is not 0.
bool output_biases_deferrable(const GPT& model);
// TESSERA_DEFERRED_BIASES: on unless "0" (read once).
bool deferred_biases_by_default();

}  // namespace tessera::nn
