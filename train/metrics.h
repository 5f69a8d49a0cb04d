// Metrics of a classification evaluation, as Hugging Face's compute_metrics hook sees it:
// an EvalPrediction of the logits [N, num_labels] and the labels [N] of the whole evaluation
// set, gathered from every process in dataset order (gather_for_metrics: the padding rows of
// the last round are dropped, nothing is duplicated or lost).
//
//   train::Metrics my_metrics(const train::EvalPrediction& p) {
//     return {{"accuracy", train::accuracy(p)},
//             {"f1", train::f1_score(p.label_ids_vector(), p.predicted_labels(), p.num_labels(),
//                                    train::Average::Macro)}};
//   }
//   train::Trainer trainer(args, classifier, train_set, eval_set, collator, my_metrics);
//   train::Metrics m = trainer.evaluate();  // {"eval_loss", "eval_accuracy", "eval_f1", ...}
//
// compute_metrics returns names without a prefix ("accuracy"); the Trainer adds "eval_"
// (evaluate) or "test_" (predict), as transformers' metric_key_prefix does. The definitions
// are scikit-learn's (precision_recall_fscore_support with zero_division=0).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::train {

using Metrics = std::map<std::string, double>;

struct EvalPrediction {
  Tensor predictions;  // [N, num_labels] logits, f32 or f64, on the host
  Tensor label_ids;    // [N] i64 class ids (f32 regression targets for num_labels = 1)

  int64_t size() const;        // N
  int64_t num_labels() const;  // predictions' second dimension
  // argmax of each row of predictions (the first maximum, as numpy's argmax).
  std::vector<int64_t> predicted_labels() const;
  std::vector<int64_t> label_ids_vector() const;
  // The logits as float64, row after row.
  std::vector<double> predictions_f64() const;
};

// compute_metrics for a classification task (HF's signature).
using ComputePredictionMetrics = std::function<Metrics(const EvalPrediction&)>;

// sklearn's `average`: macro (unweighted mean over classes), micro (from the global counts;
// equals accuracy for single-label problems), weighted (mean weighted by each class's
// support, the number of its true labels).
enum class Average { Macro, Micro, Weighted };
// "macro", "micro", "weighted"; anything else is an error naming the value.
Average parse_average(const std::string& name);

// The share of predictions equal to the labels (0 for an empty set).
double accuracy(const EvalPrediction& p);
double accuracy_score(std::span<const int64_t> y_true, std::span<const int64_t> y_pred);

struct PrecisionRecallF1 {
  double precision = 0, recall = 0, f1 = 0;
};
// Over the classes 0 .. num_labels - 1 (labels outside are an error naming the row), with
// zero_division = 0: a class never predicted has precision 0, one never true recall 0, and
// F1 0 when both are. Macro and weighted average the per-class F1 (not the F1 of the mean
// precision and recall), as sklearn.
PrecisionRecallF1 precision_recall_f1(std::span<const int64_t> y_true, std::span<const int64_t> y_pred,
                                      int64_t num_labels, Average average);
double f1_score(std::span<const int64_t> y_true, std::span<const int64_t> y_pred, int64_t num_labels,
                Average average);

// The built-in classification metrics: accuracy, f1, precision and recall (macro averages),
// f1_micro and f1_weighted. The Trainer uses it when no compute_metrics is given.
Metrics classification_metrics(const EvalPrediction& p);
// The names classification_metrics returns (for checking metric_for_best_model up front).
std::vector<std::string> classification_metric_names();

// `metrics` with `prefix` ("eval_", "test_") before every name that does not have it.
Metrics with_prefix(const Metrics& metrics, const std::string& prefix);

}  // namespace tessera::train
