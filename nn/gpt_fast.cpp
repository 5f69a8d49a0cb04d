#include "tessera/nn/gpt_fast.h"

#include <string>
#include <tuple>

#include "tessera/autograd/functions.h"
#include "tessera/core/settings.h"
#include "tessera/nn/gpt.h"

namespace tessera::nn {

bool GPTFastBlock::fused_projection_by_default() {
  return setting_enabled(Setting::FusedQkvProjection);
}

bool GPTFastBlock::fused_mlp_by_default() { return setting_enabled(Setting::FusedMlp); }

bool deferred_biases_by_default() {
  static const bool enabled = setting_enabled(Setting::DeferredBiases);
  return enabled;
}

Tensor GPTFastBlock::attention_heads(const Tensor& x) {
  CausalSelfAttention& attn = block_->attn;
  attn.check_input(x, 0);
  const double dropout_p = attn.attention_dropout_p();
  // The fused path reads q, k, v out of c_attn's output and writes y [B, T, C] in place:
  // no split, head transposes or merge copies in either direction. While training with
  // dropout > 0 the attention takes the flash kernels that drop probabilities (the mask the
  // composition would draw from the default generator) through causal_attention_qkv's
  // reference route. With c_attn and the attention as one node (no dropout), the attention
  // backward also sums c_attn's bias gradient (causal_attention_qkv_projection); c_attn's
  // hooks need its own call. The ops say which route they took (kernels/fused_table.h
  // decides); the counters count the fused ones.
  AttentionRoute route = AttentionRoute::Composed;
  Tensor y;
  if (use_fused_attention && use_fused_projection && dropout_p == 0 && !attn.c_attn.has_hooks())
    y = causal_attention_qkv_projection(x, attn.c_attn.weight, attn.c_attn.bias, attn.n_head,
                                        /*allow_fused=*/true, &route);
  else
    y = causal_attention_qkv(attn.c_attn(x), attn.n_head, dropout_p, nullptr, use_fused_attention,
                             &route);
  count_route(route);
  return y;
}

void GPTFastBlock::count_route(AttentionRoute route) {
  if (route != AttentionRoute::Composed) ++fused_attention_calls_;
  if (route == AttentionRoute::FusedProjection) ++fused_projection_calls_;
}

Tensor GPTFastBlock::attention(const Tensor& x, bool without_output_bias) {
  CausalSelfAttention& attn = block_->attn;
  // attn's own hooks see its call, as the reference's attn(x) would run them.
  if (!without_output_bias)
    return attn.call_with_hooks(x, [&] { return attn.resid_dropout(attn.c_proj(attention_heads(x))); });
  TESSERA_CHECK(!attn.resid_dropout.is_training() || attn.resid_dropout.p == 0,
                "CausalSelfAttention: the output bias cannot be deferred past an active dropout");
  return linear(attention_heads(x), attn.c_proj.weight, Tensor());
}

Tensor GPTFastBlock::attention_cached(const Tensor& x, KVCache::Layer& layer, int64_t past) {
  NoGradGuard no_grad;
  CausalSelfAttention& attn = block_->attn;
  attn.check_input(x, past);
  auto qkv = split(attn.c_attn(x), attn.n_embd, -1);
  const auto [k, v] = layer.append(attn.split_heads(qkv[1]), attn.split_heads(qkv[2]), past);
  const Tensor q = attn.split_heads(qkv[0]);
  const double dropout_p = attn.attention_dropout_p();
  AttentionRoute route = AttentionRoute::Composed;
  const Tensor y = scaled_dot_product_attention(q, k, v, /*causal=*/true, dropout_p, nullptr,
                                                use_fused_attention, &route);
  count_route(route);
  return attn.resid_dropout(attn.c_proj(attn.merge_heads(y)));
}

Tensor GPTFastBlock::mlp(const Tensor& x, bool without_output_bias) {
  MLP& mlp = block_->mlp;
  if (without_output_bias) {
    TESSERA_CHECK(!mlp.dropout.is_training() || mlp.dropout.p == 0,
                  "MLP: the output bias cannot be deferred past an active dropout");
    if (!use_fused_mlp) return linear(mlp.act(mlp.c_fc(x)), mlp.c_proj.weight, Tensor());
    ++fused_mlp_calls_;
    return mlp_gelu(x, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, Tensor());
  }
  return mlp.call_with_hooks(x, [&] {
    if (!use_fused_mlp || mlp.c_fc.has_hooks() || mlp.act.has_hooks() || mlp.c_proj.has_hooks())
      return mlp.forward(x);
    TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == mlp.c_fc.weight.size(0), "MLP: input shape ",
                  shape_str(x.shape()), " does not end in n_embd = ", mlp.c_fc.weight.size(0));
    ++fused_mlp_calls_;
    return mlp.dropout(mlp_gelu(x, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias));
  });
}

Tensor GPTFastBlock::forward(const Tensor& x) {
  const BlockOutput out = forward_deferred(x, Tensor());
  return out.residual + out.delta;
}

Tensor GPTFastBlock::call(const Tensor& x) {
  return block_->call_with_hooks(x, [&] { return forward(x); });
}

BlockOutput GPTFastBlock::call_deferred(const Tensor& residual, const Tensor& delta,
                                        const Tensor& delta_bias, bool defer_biases,
                                        CheckpointRegion recompute) {
  BlockOutput out;
  out.delta = block_->call_with_hooks(residual, [&] {
    out = forward_deferred(residual, delta, delta_bias, defer_biases, nullptr, 0, recompute);
    return out.delta;
  });
  return out;
}

BlockOutput GPTFastBlock::forward_deferred(const Tensor& residual, const Tensor& delta,
                                           const Tensor& delta_bias, bool defer_biases,
                                           KVCache::Layer* cache, int64_t past,
                                           CheckpointRegion recompute) {
  TESSERA_CHECK(delta.defined() || !delta_bias.defined(),
                "Block: a delta bias needs the delta it belongs to");
  TESSERA_CHECK(!(defer_biases && cache), "Block: biases are not deferred with a KV cache");
  TESSERA_CHECK(!(defer_biases || cache) || recompute == CheckpointRegion::none,
                "Block: a sub-layer is recomputed only in training without deferred biases");
  Block& b = *block_;
  // x = residual + delta (+ delta_bias); h = x + attn(ln_1(x)); the output h + mlp(ln_2(h))
  // stays two (or three) terms.
  const auto [x, x_normed] = delta.defined() ? b.ln_1.forward_residual(residual, delta, delta_bias)
                                             : std::pair{residual, b.ln_1(residual)};
  if (defer_biases) {
    const auto [h, h_normed] =
        b.ln_2.forward_residual(x, attention(x_normed, true), b.attn.c_proj.bias);
    return {h, mlp(h_normed, true), b.mlp.c_proj.bias};
  }
  // A recomputed sub-layer keeps only its input (the norm's output) for backward.
  const Tensor attn_out =
      cache ? attention_cached(x_normed, *cache, past)
            : checkpointed(recompute == CheckpointRegion::attention,
                           [this](const Tensor& t) { return attention(t, false); }, x_normed);
  const auto [h, h_normed] = b.ln_2.forward_residual(x, attn_out);
  return {h,
          checkpointed(recompute == CheckpointRegion::mlp,
                       [this](const Tensor& t) { return mlp(t, false); }, h_normed),
          Tensor()};
}

bool output_biases_deferrable(const GPT& model) {
  const GPTConfig& cfg = model.config();
  if (!deferred_biases_by_default() || !cfg.bias || model.any_hooks()) return false;
  // A recomputed block keeps its input as one summed tensor, and a recomputed sub-layer's output
  // must be whole: checkpointing anywhere keeps the biases in their GEMMs.
  for (int64_t i = 0; i < cfg.n_layer; ++i)
    if (model.checkpoint_region(i, model.transformer) != CheckpointRegion::none) return false;
  for (const Block* block : model.transformer.blocks)
    for (const Dropout* d : {&block->attn.resid_dropout, &block->mlp.dropout})
      if (d->is_training() && d->p > 0) return false;
  return true;
}

namespace {
// Block `index` as block.call_deferred(in..., defer_biases), with what the checkpointing policy
// recomputes; a whole block recomputed gives {block(residual + delta), undefined, undefined}.
BlockOutput run_block(const GPT& model, size_t index, GPTFastBlock& block, const BlockOutput& in,
                      bool defer_biases) {
  const Tensor &residual = in.residual, &delta = in.delta;
  // The mode of the transformer (a classification model registers only it: nn/classification.h).
  const CheckpointRegion region = model.checkpoint_region(static_cast<int64_t>(index), model.transformer);
  if (region != CheckpointRegion::block)
    return block.call_deferred(residual, delta, in.delta_bias, defer_biases, region);
  TESSERA_CHECK(!in.delta_bias.defined() && !defer_biases,
                "GPT: biases are not deferred under gradient checkpointing");
  // Checkpointed, the graph keeps each block's input for the recompute: one tensor, the
  // stream summed (two terms would keep twice the memory that checkpointing exists to save),
  // so the add between blocks stays a separate op here; ln_2's add is still fused inside.
  // The recompute replays the default generator and the autocast policy of this run, so
  // the block's dropout masks and dtypes are the same twice. The block's forward hooks run
  // in both passes, so a hook that gathers the block's parameters does so for the recompute.
  const Tensor x = delta.defined() ? residual + delta : residual;
  return {checkpointed(true, [&block](const Tensor& t) { return block.call(t); }, x), Tensor(),
          Tensor()};
}
}  // namespace

Tensor gpt_fast_hidden_states(GPT& model, const Tensor& embedded, int64_t past, KVCache* cache) {
  // The residual stream is carried as residual + delta, each block's last add left to the
  // next layer norm (fused there: the next block's ln_1, then ln_f). Where nothing needs to see
  // a projection's complete output (output_biases_deferrable), the output projections' biases
  // are added inside the norms after them as well.
  BlockOutput out{embedded, {}, {}};
  const bool defer_biases = !cache && output_biases_deferrable(model);
  for (size_t i = 0; i < model.fast_blocks.size(); ++i) {
    GPTFastBlock& block = model.fast_blocks[i];
    out = cache ? block.forward_deferred(out.residual, out.delta, out.delta_bias, false,
                                         &cache->layers[i], past)
                : run_block(model, i, block, out, defer_biases);
  }
  LayerNorm& ln_f = model.transformer.ln_f;
  return out.delta.defined() ? ln_f.forward_residual(out.residual, out.delta, out.delta_bias).second
                             : ln_f(out.residual);
}

}  // namespace tessera::nn
