// Evaluation of a language model (GPT, Llama) on a token file: the first `batches` sequential micro-batches
// [batch, seq] (the data-order contract with one process), in eval mode without
// gradients. Distributed, every process scores its contiguous share of the batches and
// the per-batch sums are gathered in batch order, so every process gets exactly what one
// process scoring all of them gets.
#pragma once
#include <functional>
#include <map>
#include <string>

#include "tessera/data/token_file.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/causal_lm.h"

namespace tessera::train {

struct EvalTotals {
  double loss_sum = 0;  // cross-entropy summed over target tokens
  int64_t tokens = 0;   // target tokens scored
  int64_t correct = 0;  // targets that were the model's most likely token
  double loss() const { return tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0; }
};

// The metrics of a language model's evaluation from its totals (its compute_metrics hook),
// named without a prefix; the Trainer adds "eval_" (and eval_loss when it is missing).
using ComputeMetrics = std::function<std::map<std::string, double>(const EvalTotals&)>;
// As transformers' run_clm reports them: loss (mean cross-entropy per token), perplexity =
// exp(loss) and accuracy (share of targets predicted by argmax).
std::map<std::string, double> language_model_metrics(const EvalTotals& totals);

// `acc` null: this process scores every batch.
EvalTotals evaluate_tokens(nn::CausalLM& model, const data::TokenFile& file, int64_t batch, int64_t seq,
                           int64_t batches, Device device, dist::Accelerator* acc = nullptr);

}  // namespace tessera::train
