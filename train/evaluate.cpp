#include "tessera/train/evaluate.h"

#include <cmath>

#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/error.h"
#include "tessera/data/dataloader.h"
#include "tessera/kernels/ops.h"

namespace tessera::train {

std::map<std::string, double> language_model_metrics(const EvalTotals& t) {
  return {{"loss", t.loss()},
          {"perplexity", std::exp(t.loss())},
          {"accuracy",
           t.tokens > 0 ? static_cast<double>(t.correct) / static_cast<double>(t.tokens) : 0.0}};
}

namespace {

// Loss sum, correct predictions and token count of one micro-batch, as doubles.
std::vector<double> score_batch(nn::CausalLM& model, const data::Batch& b) {
  const Tensor logits = model(b.x);
  const double mean_loss = tessera::cross_entropy(logits, b.y).item();
  const std::vector<int64_t> predicted =
      ops::argmax(logits, -1).to(DType::i64).to_vector<int64_t>();
  const std::vector<int64_t> targets = b.y.to(DType::i64).to_vector<int64_t>();
  int64_t correct = 0;
  for (size_t i = 0; i < targets.size(); ++i) correct += predicted[i] == targets[i];
  const double tokens = static_cast<double>(targets.size());
  return {mean_loss * tokens, static_cast<double>(correct), tokens};
}

}  // namespace

EvalTotals evaluate_tokens(nn::CausalLM& model, const data::TokenFile& file, int64_t batch, int64_t seq,
                           int64_t batches, Device device, dist::Accelerator* acc) {
  TESSERA_CHECK(batch > 0 && seq > 0 && batches > 0,
                "evaluate: batch, seq and batches must be positive (got ", batch, ", ", seq, ", ",
                batches, ")");
  TESSERA_CHECK(seq <= model.context_length(), "evaluate: seq ", seq,
                " is longer than the model context ", model.context_length());
  autograd::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  // The batches as one process reads them; each process takes its share.
  const data::DataLoader loader(file, {.batch = batch, .seq = seq, .device = device});
  std::vector<int64_t> all(static_cast<size_t>(batches));
  for (int64_t k = 0; k < batches; ++k) all[static_cast<size_t>(k)] = k;
  const std::vector<int64_t> mine =
      acc ? acc->split_between_processes(all, /*apply_padding=*/true) : all;
  std::vector<double> rows;
  for (int64_t k : mine) {
    const std::vector<double> r = score_batch(model, loader.batch_at(static_cast<uint64_t>(k)));
    rows.insert(rows.end(), r.begin(), r.end());
  }
  model.train(was_training);
  Tensor local = from_vector(rows, {static_cast<int64_t>(mine.size()), 3}, {.dtype = DType::f64});
  const Tensor gathered = acc ? acc->gather_for_metrics(local, batches) : local;
  const std::vector<double> values = gathered.to_vector<double>();
  EvalTotals totals;
  for (size_t i = 0; i + 2 < values.size(); i += 3) {  // in batch order, on every process
    totals.loss_sum += values[i];
    totals.correct += static_cast<int64_t>(values[i + 1]);
    totals.tokens += static_cast<int64_t>(values[i + 2]);
  }
  return totals;
}

}  // namespace tessera::train
