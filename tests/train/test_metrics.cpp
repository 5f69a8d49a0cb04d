// Classification metrics (train/metrics.h) against scikit-learn's documented values and a
// float64 confusion-matrix reference on random labels (odd sizes, a class never predicted
// and one never true: zero_division = 0).
#include <gtest/gtest.h>

#include <random>

#include "tessera/core/error.h"
#include "tessera/train/metrics.h"

using namespace tessera;

namespace {

// sklearn.metrics.precision_recall_fscore_support from the confusion matrix C[true][pred].
struct Reference {
  double precision, recall, f1;
};

Reference reference(const std::vector<int64_t>& y_true, const std::vector<int64_t>& y_pred, int64_t k,
                    const std::string& average) {
  std::vector<std::vector<double>> confusion(k, std::vector<double>(k, 0.0));
  for (size_t i = 0; i < y_true.size(); ++i) confusion[y_true[i]][y_pred[i]] += 1;
  auto safe = [](double a, double b) { return b == 0 ? 0.0 : a / b; };
  if (average == "micro") {
    double trace = 0, total = 0;
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < k; ++j) (i == j ? trace : total) += confusion[i][j];
    total += trace;
    const double p = safe(trace, total);
    return {p, p, safe(2 * p * p, 2 * p)};
  }
  Reference out{0, 0, 0};
  for (int64_t c = 0; c < k; ++c) {
    double column = 0, row = 0;
    for (int64_t j = 0; j < k; ++j) column += confusion[j][c], row += confusion[c][j];
    const double p = safe(confusion[c][c], column), r = safe(confusion[c][c], row);
    const double w = average == "macro" ? 1.0 / double(k) : row / double(y_true.size());
    out.precision += w * p, out.recall += w * r, out.f1 += w * safe(2 * p * r, p + r);
  }
  return out;
}

train::EvalPrediction prediction_of(const std::vector<int64_t>& y_pred, const std::vector<int64_t>& y_true,
                                    int64_t k, std::mt19937& rng) {
  // Logits whose argmax is y_pred, the rest random below it.
  std::uniform_real_distribution<float> u(-3.0f, 0.9f);
  std::vector<float> logits(y_pred.size() * k);
  for (size_t i = 0; i < y_pred.size(); ++i)
    for (int64_t c = 0; c < k; ++c) logits[i * k + c] = c == y_pred[i] ? 1.0f : u(rng);
  return {from_vector(logits, {static_cast<int64_t>(y_pred.size()), k}),
          from_vector(y_true, {static_cast<int64_t>(y_true.size())}, {.dtype = DType::i64})};
}

}  // namespace

// The example of sklearn's f1_score documentation.
TEST(ClassificationMetrics, MatchScikitLearnsDocumentedExample) {
  const std::vector<int64_t> y_true = {0, 1, 2, 0, 1, 2}, y_pred = {0, 2, 1, 0, 0, 1};
  EXPECT_NEAR(train::f1_score(y_true, y_pred, 3, train::Average::Macro), 0.26666666666666666, 1e-15);
  EXPECT_NEAR(train::f1_score(y_true, y_pred, 3, train::Average::Micro), 0.3333333333333333, 1e-15);
  EXPECT_NEAR(train::f1_score(y_true, y_pred, 3, train::Average::Weighted), 0.26666666666666666, 1e-15);
  const auto macro = train::precision_recall_f1(y_true, y_pred, 3, train::Average::Macro);
  EXPECT_NEAR(macro.precision, 0.2222222222222222, 1e-15);
  EXPECT_NEAR(macro.recall, 0.3333333333333333, 1e-15);
  EXPECT_NEAR(train::accuracy_score(y_true, y_pred), 2.0 / 6.0, 1e-15);
}

TEST(ClassificationMetrics, EqualAFloat64ConfusionMatrixOnRandomLabels) {
  std::mt19937 rng(17);
  for (const auto& [n, k] : {std::pair<int64_t, int64_t>{37, 5}, {101, 2}, {13, 7}, {1, 3}}) {
    std::vector<int64_t> y_true(n), y_pred(n);
    // Class k - 1 is never predicted and class 0 never true in the first case: zero_division.
    for (int64_t i = 0; i < n; ++i) {
      y_true[i] = n == 37 ? 1 + int64_t(rng() % (k - 1)) : int64_t(rng() % k);
      y_pred[i] = n == 37 ? int64_t(rng() % (k - 1)) : int64_t(rng() % k);
    }
    const train::EvalPrediction p = prediction_of(y_pred, y_true, k, rng);
    EXPECT_EQ(p.predicted_labels(), y_pred);
    const train::Metrics m = train::classification_metrics(p);
    EXPECT_EQ(m.size(), train::classification_metric_names().size());
    for (const std::string& name : train::classification_metric_names()) EXPECT_TRUE(m.count(name)) << name;
    double hits = 0;
    for (int64_t i = 0; i < n; ++i) hits += y_true[i] == y_pred[i];
    EXPECT_NEAR(m.at("accuracy"), hits / double(n), 1e-15);
    const Reference macro = reference(y_true, y_pred, k, "macro");
    EXPECT_NEAR(m.at("f1"), macro.f1, 1e-14) << n;
    EXPECT_NEAR(m.at("precision"), macro.precision, 1e-14) << n;
    EXPECT_NEAR(m.at("recall"), macro.recall, 1e-14) << n;
    EXPECT_NEAR(m.at("f1_micro"), reference(y_true, y_pred, k, "micro").f1, 1e-14) << n;
    EXPECT_NEAR(m.at("f1_weighted"), reference(y_true, y_pred, k, "weighted").f1, 1e-14) << n;
    const Reference weighted = reference(y_true, y_pred, k, "weighted");
    const auto got = train::precision_recall_f1(y_true, y_pred, k, train::Average::Weighted);
    EXPECT_NEAR(got.precision, weighted.precision, 1e-14);
    EXPECT_NEAR(got.recall, weighted.recall, 1e-14);
  }
}

TEST(ClassificationMetrics, ALabelOutsideTheClassesAndAnUnknownAverageAreRefusedNamingThem) {
  const std::vector<int64_t> y_true = {0, 3}, y_pred = {0, 1};
  try {
    train::f1_score(y_true, y_pred, 3, train::Average::Macro);
    FAIL() << "class 3 of 3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1 holds class 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(train::parse_average("samples"), Error);
  EXPECT_EQ(train::parse_average("weighted"), train::Average::Weighted);
}

TEST(ClassificationMetrics, WithPrefixAddsItOnlyWhereMissing) {
  const train::Metrics m = train::with_prefix({{"loss", 1.0}, {"eval_f1", 0.5}}, "eval_");
  EXPECT_EQ(m, (train::Metrics{{"eval_loss", 1.0}, {"eval_f1", 0.5}}));
}
