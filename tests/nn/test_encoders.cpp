// BERT, DistilBERT and the classification heads on what needs no reference: padding
// invariance of the encoders, Embedding's padding_idx, a head left fresh over a pretrained
// body, the dropout sites a config sets, HF's last-token rule, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "python_reference.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/nn.h"

using namespace tessera;

namespace {

using test::scratch_dir;

nn::BertConfig small_bert() {
  return {.vocab_size = 50,
          .hidden_size = 32,
          .num_hidden_layers = 2,
          .num_attention_heads = 4,
          .intermediate_size = 48,
          .max_position_embeddings = 16,
          .labels = {.num_labels = 3}};
}

nn::DistilBertConfig small_distilbert() {
  return {.vocab_size = 50,
          .max_position_embeddings = 16,
          .n_layers = 2,
          .n_heads = 4,
          .dim = 32,
          .hidden_dim = 48};
}

Tensor ids(std::vector<int64_t> values, int64_t rows) {
  const int64_t T = int64_t(values.size()) / rows;
  return from_vector(values, {rows, T}, {.dtype = DType::i64});
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

double max_abs(const Tensor& t) { return ops::amax(ops::unary(UnaryOp::Abs, t)).item(); }

// One sequence alone and with three pad tokens behind it (attention_mask 0 there) gives the
// same logits, and the same gradients for every parameter. The key projections' biases get
// none, by symmetry (a bias shifts all of a query's scores alike, which the softmax ignores):
// their gradients are rounding noise on both sides, so each gradient is compared relative to
// the largest gradient of the model where its own is below 1e-3 of that.
void check_padding_invariance(nn::SequenceClassifier& model, bool segments) {
  model.eval();
  const Tensor alone = ids({7, 3, 9, 4, 12}, 1), padded = ids({7, 3, 9, 4, 12, 0, 0, 0}, 1);
  const Tensor mask = ids({1, 1, 1, 1, 1, 0, 0, 0}, 1);
  const Tensor types = segments ? ids({0, 0, 1, 1, 1}, 1) : Tensor();
  const Tensor padded_types = segments ? ids({0, 0, 1, 1, 1, 0, 0, 0}, 1) : Tensor();
  const Tensor a = model.logits(alone, Tensor(), types);
  sum(a).backward();
  std::map<std::string, Tensor> grads;
  double largest = 0;
  for (auto& [name, p] : model.named_parameters()) {
    grads[name] = p.grad();
    largest = std::max(largest, max_abs(p.grad()));
  }
  model.zero_grad();
  const Tensor b = model.logits(padded, mask, padded_types);
  sum(b).backward();
  EXPECT_LT(ops::max_rel_error(b, a), 1e-6);
  for (auto& [name, p] : model.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    const double scale = std::max(max_abs(grads[name]), 1e-3 * largest);
    EXPECT_LT(max_abs(ops::sub(p.grad(), grads[name])), 1e-5 * scale) << name;
  }
}

}  // namespace

TEST(Encoders, BertPaddingChangesNothingForTheRealTokens) {
  Generator gen(1);
  nn::BertForSequenceClassification model(small_bert(), &gen);
  check_padding_invariance(model, true);
}

TEST(Encoders, DistilBertPaddingChangesNothingForTheRealTokens) {
  Generator gen(2);
  nn::DistilBertForSequenceClassification model(small_distilbert(), &gen);
  check_padding_invariance(model, false);
}

TEST(Encoders, EmbeddingPaddingIdxPassesNoGradient) {
  Generator gen(3);
  nn::Embedding table(6, 4, 1.0, &gen);
  table.set_padding_idx(2);
  EXPECT_EQ(ops::amax(ops::unary(UnaryOp::Abs, ops::select(table.weight, 0, 2))).item(), 0.0);
  normal_(table.weight, 0.0, 1.0, &gen);  // a pretrained padding row keeps its values
  const Tensor looked_up = table(ids({2, 5, 2, 1}, 1));
  EXPECT_EQ(ops::max_rel_error(ops::select(ops::select(looked_up, 0, 0), 0, 0),
                               ops::select(table.weight, 0, 2)),
            0.0);
  sum(looked_up).backward();
  const std::vector<float> g = table.weight.grad().to_vector<float>();
  const std::vector<float> want_rows{0, 1, 0, 0, 0, 1};  // row 2 twice, but it is the pad
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(g[r * 4 + c], want_rows[r]) << r << "," << c;
}

TEST(Encoders, AHeadOverAPretrainedBodyStartsFresh) {
  const auto dir = scratch_dir("bert_fresh_head");
  Generator gen(4);
  nn::BertForSequenceClassification trained(small_bert(), &gen);
  trained.save_pretrained((dir / "full").string());
  // The body alone, as a pretraining checkpoint holds it: no classifier, a cls.* head instead.
  auto file = load_safetensors((dir / "full" / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> body{{"cls.predictions.bias", zeros({50})}};
  for (const auto& [name, t] : file.tensors)
    if (name.rfind("classifier.", 0) != 0) body.emplace_back(name, t);
  std::filesystem::create_directories(dir / "body");
  save_safetensors((dir / "body" / "model.safetensors").string(), body);
  std::filesystem::copy_file(dir / "full" / "config.json", dir / "body" / "config.json");
  auto loaded = nn::BertForSequenceClassification::from_pretrained((dir / "body").string());
  EXPECT_EQ(loaded->newly_initialized_keys(),
            (std::vector<std::string>{"classifier.weight", "classifier.bias"}));
  for (const auto& [name, p] : loaded->named_parameters())
    if (name.rfind("bert.", 0) == 0)
      EXPECT_EQ(ops::max_rel_error(p, trained.parameter(name)), 0.0) << name;
  // A tensor the model does not know is still refused, naming it.
  body.emplace_back("bert.encoder.layer.9.output.dense.weight", zeros({2, 2}));
  save_safetensors((dir / "body" / "model.safetensors").string(), body);
  EXPECT_NE(error_of([&] {
              nn::BertForSequenceClassification::from_pretrained((dir / "body").string());
            }).find("unexpected: bert.encoder.layer.9.output.dense.weight"),
            std::string::npos);
}

TEST(Encoders, DropoutSitesFollowTheConfig) {
  const auto dir = scratch_dir("bert_dropout_config");
  nn::BertConfig cfg = small_bert();
  cfg.hidden_dropout_prob = 0.125;
  cfg.attention_probs_dropout_prob = 0.25;
  cfg.classifier_dropout = 0.375;
  nn::BertForSequenceClassification model(cfg);
  model.save_pretrained(dir.string());
  auto loaded = nn::BertForSequenceClassification::from_pretrained(dir.string());
  EXPECT_EQ(loaded->bert.embeddings.dropout.p, 0.125);
  EXPECT_EQ(loaded->bert.layers[1]->attention.self_attention.dropout.p, 0.25);
  EXPECT_EQ(loaded->bert.layers[1]->attention.output.dropout.p, 0.125);
  EXPECT_EQ(loaded->bert.layers[1]->output.dropout.p, 0.125);
  EXPECT_EQ(loaded->dropout.p, 0.375);
  nn::DistilBertConfig d = small_distilbert();
  d.dropout = 0.0625;
  d.attention_dropout = 0.125;
  d.seq_classif_dropout = 0.5;
  nn::DistilBertForSequenceClassification distil(d);
  distil.save_pretrained((dir / "distil").string());
  auto distil_loaded =
      nn::DistilBertForSequenceClassification::from_pretrained((dir / "distil").string());
  EXPECT_EQ(distil_loaded->distilbert.embeddings.dropout.p, 0.0625);
  EXPECT_EQ(distil_loaded->distilbert.blocks[0]->attention.dropout.p, 0.125);
  EXPECT_EQ(distil_loaded->distilbert.blocks[0]->ffn.dropout.p, 0.0625);
  EXPECT_EQ(distil_loaded->dropout.p, 0.5);
  // In training the dropout draws: two forwards differ; in eval they agree.
  distil_loaded->train();
  const Tensor x = ids({4, 8, 15, 16, 23, 42}, 2);
  EXPECT_GT(ops::max_rel_error(distil_loaded->logits(x), distil_loaded->logits(x)), 0.0);
  distil_loaded->eval();
  EXPECT_EQ(ops::max_rel_error(distil_loaded->logits(x), distil_loaded->logits(x)), 0.0);
}

TEST(Encoders, ConfigErrorsNameTheKey) {
  const auto dir = scratch_dir("bert_config_errors");
  auto write = [&](const std::string& json) { std::ofstream(dir / "config.json") << json; };
  auto error = [&] {
    return error_of([&] { nn::bert_config_from_json_file((dir / "config.json").string()); });
  };
  write(R"({"model_type": "bert", "hidden_size": "wide"})");
  EXPECT_NE(error().find("\"hidden_size\" = \"wide\" must be an integer"), std::string::npos)
      << error();
  write(R"({"model_type": "bert", "position_embedding_type": "relative_key"})");
  EXPECT_NE(error().find("position_embedding_type"), std::string::npos) << error();
  write(R"({"model_type": "bert", "hidden_act": "swish"})");
  EXPECT_NE(error().find("activation \"swish\" is not supported"), std::string::npos) << error();
  write(R"({"model_type": "bert", "id2label": {"0": "neg", "2": "pos"}})");
  EXPECT_NE(error().find("id2label"), std::string::npos) << error();
  write(R"({"model_type": "bert", "problem_type": "ranking"})");
  EXPECT_NE(error().find("problem_type \"ranking\""), std::string::npos) << error();
  write(R"({"model_type": "bert", "hidden_size": 30, "num_attention_heads": 4})");
  EXPECT_NE(error().find("multiple of num_attention_heads"), std::string::npos) << error();
  write(R"({"model_type": "distilbert"})");
  EXPECT_NE(error().find("expected \"bert\""), std::string::npos) << error();
  // Labels read back as written.
  write(
      R"({"model_type": "bert", "id2label": {"1": "pos", "0": "neg"}, "problem_type": "single_label_classification"})");
  const nn::BertConfig cfg = nn::bert_config_from_json_file((dir / "config.json").string());
  EXPECT_EQ(cfg.labels.num_labels, 2);
  EXPECT_EQ(cfg.labels.label_name(1), "pos");
  EXPECT_EQ(cfg.labels.problem_type, nn::ProblemType::SingleLabelClassification);
}

TEST(Encoders, LastTokenPositionsFollowHuggingFace) {
  const Tensor batch = ids({5, 6, 7, 0, 0,  //
                            5, 6, 7, 8, 9,  // no pad: the last position
                            0, 6, 7, 8, 9},
                           3);  // pad first: (0 - 1) mod 5, the last one too
  EXPECT_EQ(nn::last_token_positions(batch, Tensor(), 0, "test"), (std::vector<int64_t>{2, 4, 4}));
  EXPECT_EQ(nn::last_token_positions(ids({1, 2, 3}, 1), Tensor(), -1, "test"),
            (std::vector<int64_t>{2}));
  EXPECT_NE(error_of([&] {
              nn::last_token_positions(batch, Tensor(), -1, "test");
            }).find("needs pad_token_id"),
            std::string::npos);
  const Tensor left_padded = ids({0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 3);
  EXPECT_NE(error_of([&] {
              nn::last_token_positions(batch, left_padded, 0, "test");
            }).find("pad on the right"),
            std::string::npos);
}

TEST(Encoders, LossesRefuseLabelsOfTheWrongKind) {
  nn::SequenceClassificationConfig labels;
  labels.num_labels = 3;
  const Tensor logits = zeros({2, 3});
  EXPECT_NE(error_of([&] {
              nn::sequence_classification_loss(
                  logits, from_vector<int64_t>({0, 1, 2}, {3}, {.dtype = DType::i64}), labels);
            }).find("integer labels [B = 2]"),
            std::string::npos);
  labels.problem_type = nn::ProblemType::Regression;
  EXPECT_NE(error_of([&] {
              nn::sequence_classification_loss(logits, zeros({2}), labels);
            }).find("one target per logit"),
            std::string::npos);
  // Regression is the mean squared error; single-label the cross-entropy.
  EXPECT_NEAR(nn::sequence_classification_loss(ones({2, 3}), zeros({2, 3}), labels).item(), 1.0,
              1e-7);
  labels.problem_type = nn::ProblemType::Unspecified;
  EXPECT_NEAR(nn::sequence_classification_loss(
                  logits, from_vector<int64_t>({0, 2}, {2}, {.dtype = DType::i64}), labels)
                  .item(),
              std::log(3.0), 1e-6);
}
