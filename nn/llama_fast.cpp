#include "tessera/nn/llama_fast.h"

#include <tuple>

#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/nn/llama.h"

namespace tessera::nn {

Tensor llama_fast_attention(LlamaAttention& attn, const Tensor& x, const ops::RopeTables& rope,
                            int64_t past, KVCache::Layer* cache) {
  if (cache) return attn.forward(x, rope, past, cache);
  const Tensor w_qkv = cat({attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight}, 0);
  return attn.o_proj(
      rotary_causal_attention_qkv(linear(x, w_qkv.t()), attn.n_head, attn.n_kv_head, rope));
}

std::pair<Tensor, Tensor> llama_fast_layer(LlamaDecoderLayer& layer, const Tensor& residual,
                                           const Tensor& delta, const ops::RopeTables& rope,
                                           int64_t past, KVCache::Layer* cache,
                                           CheckpointRegion recompute) {
  TESSERA_CHECK(!cache || recompute == CheckpointRegion::none,
                "LlamaDecoderLayer: a sub-layer is recomputed only in training, without a cache");
  // x = residual + delta; h = x + attn(input_layernorm(x)); out = h + mlp(post_norm(h)).
  const RMSNorm &norm_1 = layer.input_layernorm, &norm_2 = layer.post_attention_layernorm;
  const auto [x, x_normed] = delta.defined()
                                 ? residual_rms_norm(residual, delta, norm_1.weight, norm_1.eps)
                                 : std::pair{residual, layer.input_layernorm(residual)};
  // A recomputed sub-layer keeps only its input (the norm's output) for backward; the rotary
  // tables are constants of this forward, captured as they are.
  LlamaAttention& attn = layer.self_attn;
  const Tensor attn_out = checkpointed(
      recompute == CheckpointRegion::attention,
      [&attn, rope, past, cache](const Tensor& t) { return llama_fast_attention(attn, t, rope, past, cache); },
      x_normed);
  const auto [h, h_normed] = residual_rms_norm(x, attn_out, norm_2.weight, norm_2.eps);
  LlamaMLP& mlp = layer.mlp;
  return {h, checkpointed(recompute == CheckpointRegion::mlp,
                          [&mlp](const Tensor& t) { return mlp(t); }, h_normed)};
}

namespace {
// llama_fast_layer between the layer's hooks (ZeRO-3 gathers its parameters there, and
// arms its backward pre-hook on the output's second term, which backward reaches first),
// as GPT's fast blocks call theirs.
std::pair<Tensor, Tensor> call_layer(LlamaDecoderLayer& layer, const Tensor& residual, const Tensor& delta,
                                     const ops::RopeTables& rope,
                                     CheckpointRegion recompute = CheckpointRegion::none) {
  std::pair<Tensor, Tensor> out;
  out.second = layer.call_with_hooks(residual, [&] {
    out = llama_fast_layer(layer, residual, delta, rope, 0, nullptr, recompute);
    return out.second;
  });
  return out;
}

std::pair<Tensor, Tensor> run_layer(const Llama& model, size_t index, const Tensor& residual,
                                    const Tensor& delta, const ops::RopeTables& rope) {
  LlamaDecoderLayer& layer = *model.model.decoder_layers[index];
  // The mode of the body (a classification model registers only it: nn/classification.h).
  const CheckpointRegion region = model.checkpoint_region(static_cast<int64_t>(index), model.model);
  if (region != CheckpointRegion::block) return call_layer(layer, residual, delta, rope, region);
  // The recompute replays the autocast policy; the layer has no randomness to replay. The
  // rotary tables are constants of this forward, captured as they are.
  std::vector<Tensor> inputs{residual};
  if (delta.defined()) inputs.push_back(delta);
  const std::vector<Tensor> out = autograd::checkpoint(
      [&layer, rope](const std::vector<Tensor>& in) {
        const auto [h, mlp_out] = call_layer(layer, in[0], in.size() > 1 ? in[1] : Tensor(), rope);
        return std::vector<Tensor>{h, mlp_out};
      },
      inputs);
  return {out[0], out[1]};
}
}  // namespace

Tensor llama_fast_hidden_states(Llama& model, const Tensor& embedded, const ops::RopeTables& rope,
                                int64_t past, KVCache* cache) {
  // The residual stream as residual + delta, the add left to the next RMSNorm (fused there).
  Tensor residual = embedded, delta;
  const std::vector<LlamaDecoderLayer*>& layers = model.model.decoder_layers;
  for (size_t i = 0; i < layers.size(); ++i) {
    std::tie(residual, delta) =
        cache ? llama_fast_layer(*layers[i], residual, delta, rope, past, &cache->layers[i])
              : run_layer(model, i, residual, delta, rope);
  }
  const RMSNorm& norm = model.model.norm;
  return delta.defined() ? residual_rms_norm(residual, delta, norm.weight, norm.eps).second
                         : model.model.norm(residual);
}

}  // namespace tessera::nn
