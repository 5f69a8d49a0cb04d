#include "tessera/train/metrics.h"

#include "tessera/core/error.h"

namespace tessera::train {

int64_t EvalPrediction::size() const { return predictions.defined() ? predictions.shape()[0] : 0; }

int64_t EvalPrediction::num_labels() const {
  return predictions.defined() && predictions.dim() == 2 ? predictions.shape()[1] : 0;
}

std::vector<double> EvalPrediction::predictions_f64() const {
  if (!predictions.defined()) return {};
  return predictions.to(Device::cpu()).to(DType::f64).contiguous().to_vector<double>();
}

std::vector<int64_t> EvalPrediction::predicted_labels() const {
  TESSERA_CHECK(!predictions.defined() || predictions.dim() == 2,
                "EvalPrediction: predictions must be logits [N, num_labels], got ", predictions.dim(),
                " dimensions");
  const std::vector<double> logits = predictions_f64();
  const int64_t n = size(), c = num_labels();
  std::vector<int64_t> predicted(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 1; j < c; ++j)
      if (logits[i * c + j] > logits[i * c + predicted[i]]) predicted[i] = j;
  return predicted;
}

std::vector<int64_t> EvalPrediction::label_ids_vector() const {
  if (!label_ids.defined()) return {};
  return label_ids.to(Device::cpu()).to(DType::i64).contiguous().to_vector<int64_t>();
}

Average parse_average(const std::string& name) {
  if (name == "macro") return Average::Macro;
  if (name == "micro") return Average::Micro;
  if (name == "weighted") return Average::Weighted;
  TESSERA_FAIL("average \"", name, "\" is not one of macro, micro, weighted");
}

double accuracy_score(std::span<const int64_t> y_true, std::span<const int64_t> y_pred) {
  TESSERA_CHECK(y_true.size() == y_pred.size(), "accuracy: ", y_true.size(), " labels but ",
                y_pred.size(), " predictions");
  if (y_true.empty()) return 0;
  size_t hits = 0;
  for (size_t i = 0; i < y_true.size(); ++i) hits += y_true[i] == y_pred[i];
  return static_cast<double>(hits) / static_cast<double>(y_true.size());
}

double accuracy(const EvalPrediction& p) {
  return accuracy_score(p.label_ids_vector(), p.predicted_labels());
}

namespace {

double ratio(double num, double den) { return den > 0 ? num / den : 0.0; }  // zero_division=0

double f1_of(double precision, double recall) {
  return ratio(2 * precision * recall, precision + recall);
}

}  // namespace

PrecisionRecallF1 precision_recall_f1(std::span<const int64_t> y_true, std::span<const int64_t> y_pred,
                                      int64_t num_labels, Average average) {
  TESSERA_CHECK(y_true.size() == y_pred.size(), "precision/recall/f1: ", y_true.size(),
                " labels but ", y_pred.size(), " predictions");
  TESSERA_CHECK(num_labels > 0, "precision/recall/f1: num_labels must be positive, got ", num_labels);
  // Per class: true positives, predicted count, true count (support).
  std::vector<double> tp(num_labels, 0), predicted(num_labels, 0), support(num_labels, 0);
  for (size_t i = 0; i < y_true.size(); ++i) {
    for (const int64_t v : {y_true[i], y_pred[i]})
      TESSERA_CHECK(v >= 0 && v < num_labels, "precision/recall/f1: row ", i, " holds class ", v,
                    ", outside [0, ", num_labels, ")");
    support[y_true[i]] += 1;
    predicted[y_pred[i]] += 1;
    tp[y_true[i]] += y_true[i] == y_pred[i];
  }
  PrecisionRecallF1 out;
  if (average == Average::Micro) {
    double all_tp = 0;
    for (const double t : tp) all_tp += t;
    const double n = static_cast<double>(y_true.size());
    out.precision = ratio(all_tp, n);
    out.recall = ratio(all_tp, n);
    out.f1 = f1_of(out.precision, out.recall);
    return out;
  }
  double total_support = 0;
  for (const double s : support) total_support += s;
  for (int64_t c = 0; c < num_labels; ++c) {
    const double precision = ratio(tp[c], predicted[c]), recall = ratio(tp[c], support[c]);
    const double weight = average == Average::Macro ? 1.0 / static_cast<double>(num_labels)
                                                    : ratio(support[c], total_support);
    out.precision += weight * precision;
    out.recall += weight * recall;
    out.f1 += weight * f1_of(precision, recall);
  }
  return out;
}

double f1_score(std::span<const int64_t> y_true, std::span<const int64_t> y_pred, int64_t num_labels,
                Average average) {
  return precision_recall_f1(y_true, y_pred, num_labels, average).f1;
}

Metrics classification_metrics(const EvalPrediction& p) {
  const std::vector<int64_t> y_true = p.label_ids_vector(), y_pred = p.predicted_labels();
  const int64_t classes = p.num_labels();
  const PrecisionRecallF1 macro = precision_recall_f1(y_true, y_pred, classes, Average::Macro);
  return {{"accuracy", accuracy_score(y_true, y_pred)},
          {"f1", macro.f1},
          {"precision", macro.precision},
          {"recall", macro.recall},
          {"f1_micro", f1_score(y_true, y_pred, classes, Average::Micro)},
          {"f1_weighted", f1_score(y_true, y_pred, classes, Average::Weighted)}};
}

std::vector<std::string> classification_metric_names() {
  return {"accuracy", "f1", "precision", "recall", "f1_micro", "f1_weighted"};
}

Metrics with_prefix(const Metrics& metrics, const std::string& prefix) {
  Metrics out;
  for (const auto& [name, value] : metrics)
    out[name.rfind(prefix, 0) == 0 ? name : prefix + name] = value;
  return out;
}

}  // namespace tessera::train
