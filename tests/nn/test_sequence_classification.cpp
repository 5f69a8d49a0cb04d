// Sequence classification (BERT, DistilBERT, and GPT-2 and Llama with a score head) against
// Hugging Face transformers (tests/nn/hf_classification_check.py): a model transformers saved
// loads here and gives the same logits and loss on a right-padded batch with odd lengths;
// after 20 AdamW steps every parameter matches transformers' own loop; what Tessera saves
// loads there with the same logits. Then what needs no reference: padding invariance,
// padding_idx, the head left fresh over a pretrained body, the config's dropout sites and
// the errors.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "tessera/autograd/functions.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"
#include "python_reference.h"

using namespace tessera;

namespace {

const std::string kScript = TESSERA_SOURCE_DIR "/tests/nn/hf_classification_check.py";
constexpr int kSteps = 20;
// transformers' TrainingArguments default. AdamW's normalised step turns last-bit differences
// of tiny gradients into differences of up to lr per step; the key projections' biases have
// no gradient at all by symmetry (a bias shifts all of a query's scores alike), only rounding
// noise on both sides. At 1e-4 GPT-2's c_attn (whose bias holds the keys') ended 1.6e-5 apart;
// at this rate the worst tensor is 2.7e-6 (BERT 1.9e-6 at 1e-4).
constexpr double kLr = 5e-5;

using test::scratch_dir;

// Runs the reference; false (the caller skips) when transformers is not usable.
bool run_reference(const std::string& args) { return test::run_reference_script(kScript, args); }

struct Batch {
  Tensor input_ids, attention_mask, token_type_ids, labels;
  std::string path;
};

// Rows of lengths 11, 7 and 4 right-padded to 11 with pad_id; real tokens never pad_id.
Batch make_batch(const std::filesystem::path& dir, int64_t vocab, int64_t pad_id, bool segments,
                 const Tensor& labels, uint64_t seed) {
  const std::vector<int64_t> lengths{11, 7, 4};
  const int64_t B = 3, T = 11;
  Generator gen(seed);
  const std::vector<int64_t> draws =
      randint(0, vocab - 1, {B, T}, {.dtype = DType::i64}, &gen).to_vector<int64_t>();
  std::vector<int64_t> ids(B * T), mask(B * T), types(B * T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const bool real = t < lengths[b];
      const int64_t token = draws[b * T + t] >= pad_id ? draws[b * T + t] + 1 : draws[b * T + t];
      ids[b * T + t] = real ? token : pad_id;
      mask[b * T + t] = real;
      types[b * T + t] = real && t >= lengths[b] / 2;  // two segments per row
    }
  Batch batch{from_vector(ids, {B, T}, {.dtype = DType::i64}),
              from_vector(mask, {B, T}, {.dtype = DType::i64}),
              segments ? from_vector(types, {B, T}, {.dtype = DType::i64}) : Tensor(), labels,
              (dir / "batch.safetensors").string()};
  std::vector<std::pair<std::string, Tensor>> tensors{
      {"input_ids", batch.input_ids}, {"attention_mask", batch.attention_mask}, {"labels", labels}};
  if (segments) tensors.emplace_back("token_type_ids", batch.token_type_ids);
  save_safetensors(batch.path, tensors);
  return batch;
}

struct ParityCase {
  std::string arch;
  std::string config;  // JSON for the reference's --make
  int64_t pad_id;
  Tensor labels;
};

// The whole round: transformers makes a model; Tessera loads it (through
// load_sequence_classifier), matches its logits and loss, trains 20 AdamW steps alongside it,
// saves, and transformers reads Tessera's directory back with the same logits.
void check_parity(const ParityCase& c) {
  const auto dir = scratch_dir("classification_" + c.arch);
  const std::string arch = " --arch " + c.arch;
  if (!run_reference("--make " + (dir / "hf").string() + arch + " --config '" + c.config + "'"))
    GTEST_SKIP() << test::python_interpreter() << " cannot use transformers";
  auto model = nn::load_sequence_classifier((dir / "hf").string());
  EXPECT_TRUE(model->newly_initialized_keys().empty());
  const Batch batch = make_batch(dir, 101, c.pad_id, c.arch == "bert", c.labels, 5);
  const std::string ref_path = (dir / "ref.safetensors").string();
  ASSERT_TRUE(run_reference("--model " + (dir / "hf").string() + arch + " --batch " + batch.path +
                            " --out " + ref_path + " --steps " + std::to_string(kSteps) +
                            " --lr " + std::to_string(kLr)));
  const SafetensorsContents ref = load_safetensors(ref_path);
  model->train();
  auto loss_of = [&] {
    const Tensor logits = model->logits(batch.input_ids, batch.attention_mask, batch.token_type_ids);
    return std::pair{logits, model->loss(logits, batch.labels)};
  };
  const auto [logits, loss] = loss_of();
  const double logits_err = ops::max_rel_error(logits, ref.at("logits"));
  EXPECT_LT(logits_err, 1e-5) << c.arch;
  EXPECT_LT(std::abs(loss.item() - ref.at("loss").item()), 1e-5 * std::abs(ref.at("loss").item()))
      << c.arch;
  optim::AdamW opt(model->parameters(), {.lr = kLr, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                         .weight_decay = 0.01});
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    loss_of().second.backward();
    opt.step();
  }
  double worst = 0;
  for (const auto& [name, p] : model->named_parameters()) {
    const double err = ops::max_rel_error(p, ref.at("param/" + name));
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-5) << c.arch << " " << name;
  }
  model->save_pretrained((dir / "tessera").string());
  ASSERT_TRUE(run_reference("--logits " + (dir / "tessera").string() + arch + " --batch " +
                            batch.path + " --out " + (dir / "saved.safetensors").string()));
  model->eval();
  NoGradGuard no_grad;
  const Tensor trained = model->logits(batch.input_ids, batch.attention_mask, batch.token_type_ids);
  const double saved_err = ops::max_rel_error(
      trained, load_safetensors((dir / "saved.safetensors").string()).at("logits"));
  EXPECT_LT(saved_err, 1e-5) << c.arch;
  std::printf("%s classification parity: logits %.2e, worst parameter after %d AdamW steps %.2e, "
              "Tessera-saved logits in transformers %.2e\n",
              c.arch.c_str(), logits_err, kSteps, worst, saved_err);
}

Tensor class_labels(std::vector<int64_t> ids) {
  return from_vector(ids, {int64_t(ids.size())}, {.dtype = DType::i64});
}

}  // namespace

TEST(SequenceClassificationParity, BertSingleLabel) {
  check_parity({"bert",
                R"({"vocab_size": 101, "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "intermediate_size": 96,
                    "max_position_embeddings": 24, "hidden_dropout_prob": 0.0,
                    "attention_probs_dropout_prob": 0.0, "pad_token_id": 0, "num_labels": 3})",
                0, class_labels({2, 0, 1})});
}

TEST(SequenceClassificationParity, DistilBertRegression) {
  check_parity({"distilbert",
                R"({"vocab_size": 101, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 96,
                    "max_position_embeddings": 24, "dropout": 0.0, "attention_dropout": 0.0,
                    "seq_classif_dropout": 0.0, "pad_token_id": 0, "num_labels": 1})",
                0, from_vector<float>({0.5f, -1.25f, 2.0f}, {3})});
}

TEST(SequenceClassificationParity, GPT2MultiLabel) {
  check_parity({"gpt2",
                R"({"vocab_size": 101, "n_positions": 24, "n_embd": 64, "n_layer": 2,
                    "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                    "pad_token_id": 100, "num_labels": 4,
                    "problem_type": "multi_label_classification"})",
                100, from_vector<float>({1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0}, {3, 4})});
}

TEST(SequenceClassificationParity, LlamaSingleLabel) {
  check_parity({"llama",
                R"({"vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "max_position_embeddings": 24, "rope_theta": 500.0, "pad_token_id": 0,
                    "num_labels": 3, "attention_dropout": 0.0})",
                0, class_labels({1, 2, 0})});
}
