// Collators against transformers' DataCollatorWithPadding and
// DataCollatorForLanguageModeling(mlm=False) (tests/data/dataset_reference.py); samplers
// (torch's DistributedSampler semantics, gather_for_metrics evaluation at any world size,
// group_by_length) and the ExampleLoader over a dataset.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "tessera/core/error.h"
#include "tessera/data/collator.h"
#include "tessera/data/example_loader.h"
#include "tessera/data/sampler.h"
#include "tests/data/example_test_util.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::test;

namespace {

// Features as a test holds them (Example only points into them).
struct Feature {
  std::vector<uint32_t> input_ids, token_type_ids;
  std::variant<std::monostate, int64_t, double> label;
};

std::vector<Example> views(const std::vector<Feature>& features) {
  std::vector<Example> out;
  for (const Feature& f : features) out.push_back({f.input_ids, f.token_type_ids, {}, f.label});
  return out;
}

nlohmann::json feature_json(const Feature& f) {
  nlohmann::json j = {{"input_ids", f.input_ids}};
  if (!f.token_type_ids.empty()) j["token_type_ids"] = f.token_type_ids;
  if (f.label.index() == 1) j["label"] = std::get<int64_t>(f.label);
  if (f.label.index() == 2) j["label"] = std::get<double>(f.label);
  return j;
}

// Encoded texts of several lengths (BERT's [CLS] ... [SEP], one a pair).
std::vector<Feature> bert_features(const WordPieceTokenizer& tok, int label_kind) {
  const std::vector<std::string> texts = {"the cat sat on the mat", "a dog", "good film !",
                                          "the the the the the the the the the the bad"};
  std::vector<Feature> out;
  for (size_t i = 0; i < texts.size(); ++i) {
    const Encoding e = i == 1 ? tok.encode_pair(texts[i], "cats , dogs", {})
                              : tok.encode(texts[i], {});
    Feature f{e.input_ids, e.token_type_ids, {}};
    if (label_kind == 1) f.label = static_cast<int64_t>(i % 3);
    if (label_kind == 2) f.label = 0.5 * static_cast<double>(i) - 0.25;
    out.push_back(std::move(f));
  }
  return out;
}

struct CollatorCase {
  std::string collator;  // "padding" or "lm"
  std::vector<Feature> features;
  nlohmann::json kwargs;
  PaddingOptions options;
};

nlohmann::json tensor_json(const Tensor& t) {
  if (t.dtype() == DType::f32) return t.to_vector<float>();
  return t.to_vector<int64_t>();
}

void expect_same_as_transformers(const WordPieceTokenizer& tok, const std::vector<CollatorCase>& cases) {
  if (!python_can_import("transformers, numpy")) GTEST_SKIP() << "transformers is not installed";
  const fs::path dir = example_scratch("collate");
  tok.save_files(dir / "tokenizer");
  nlohmann::json requests = nlohmann::json::array();
  for (const CollatorCase& c : cases) {
    nlohmann::json features = nlohmann::json::array();
    for (const Feature& f : c.features) features.push_back(feature_json(f));
    requests.push_back({{"collator", c.collator},
                        {"features", features},
                        {"kwargs", c.kwargs},
                        {"padding_side", c.options.padding_side == Side::Left ? "left" : "right"}});
  }
  write_text(dir / "cases.json", requests.dump());
  ASSERT_TRUE(run_dataset_reference("collate " + shell_quoted((dir / "tokenizer").string()) + " " +
                                    shell_quoted((dir / "cases.json").string()) + " " +
                                    shell_quoted((dir / "out.json").string())));
  const nlohmann::json expected = nlohmann::json::parse(read_text(dir / "out.json"));
  for (size_t k = 0; k < cases.size(); ++k) {
    const CollatorCase& c = cases[k];
    const std::vector<Example> examples = views(c.features);
    const ExampleBatch batch =
        c.collator == "lm" ? DataCollatorForLanguageModeling(tok, c.options)(examples)
                           : DataCollatorWithPadding(tok, c.options)(examples);
    std::map<std::string, Tensor> ours = {{"input_ids", batch.input_ids},
                                          {"attention_mask", batch.attention_mask}};
    if (batch.token_type_ids.defined()) ours["token_type_ids"] = batch.token_type_ids;
    if (batch.labels.defined()) ours["labels"] = batch.labels;
    std::set<std::string> their_keys;
    for (const auto& item : expected[k].items()) their_keys.insert(item.key());
    std::set<std::string> our_keys;
    for (const auto& [key, _] : ours) our_keys.insert(key);
    EXPECT_EQ(our_keys, their_keys) << "case " << k << " " << c.kwargs.dump();
    for (const auto& [key, tensor] : ours) {
      if (!expected[k].contains(key)) continue;
      const nlohmann::json& theirs = expected[k][key];
      EXPECT_EQ(tensor.dim() == 2 ? tensor.size(1) : 0,
                theirs[0].is_array() ? static_cast<int64_t>(theirs[0].size()) : 0)
          << "case " << k << " " << key;
      nlohmann::json flat = nlohmann::json::array();
      for (const auto& row : theirs) {
        if (row.is_array())
          for (const auto& v : row) flat.push_back(v);
        else
          flat.push_back(row);
      }
      if (tensor.dtype() == DType::f32) {
        const std::vector<float> values = tensor.to_vector<float>();
        ASSERT_EQ(values.size(), flat.size());
        for (size_t i = 0; i < values.size(); ++i) EXPECT_FLOAT_EQ(values[i], flat[i].get<float>());
      } else {
        EXPECT_EQ(tensor_json(tensor), flat) << "case " << k << " " << c.kwargs.dump() << " " << key;
      }
    }
  }
}

}  // namespace

TEST(Collator, WithPaddingEqualsTransformers) {
  const WordPieceTokenizer tok = small_bert();
  std::vector<CollatorCase> cases;
  cases.push_back({"padding", bert_features(tok, 1), nlohmann::json::object(), {}});
  cases.push_back({"padding", bert_features(tok, 1), {{"pad_to_multiple_of", 8}},
                   {.pad_to_multiple_of = 8}});
  cases.push_back({"padding", bert_features(tok, 2), {{"padding", "max_length"}, {"max_length", 20}},
                   {.padding = PaddingStrategy::MaxLength, .max_length = 20}});
  cases.push_back({"padding", bert_features(tok, 0),
                   {{"padding", "max_length"}, {"max_length", 14}, {"pad_to_multiple_of", 4}},
                   {.padding = PaddingStrategy::MaxLength, .max_length = 14, .pad_to_multiple_of = 4}});
  cases.push_back({"padding", bert_features(tok, 1), {{"pad_to_multiple_of", 5}},
                   {.pad_to_multiple_of = 5, .padding_side = Side::Left}});
  std::vector<Feature> untyped = bert_features(tok, 1);
  for (Feature& f : untyped) f.token_type_ids.clear();
  cases.push_back({"padding", untyped, nlohmann::json::object(), {}});
  expect_same_as_transformers(tok, cases);
}

TEST(Collator, LanguageModellingLabelsEqualTransformers) {
  const WordPieceTokenizer tok = small_bert();
  // Documents of several lengths, one holding the pad id itself (ignored as transformers does).
  std::vector<Feature> docs = {{{5, 7, 9, 11, 12, 13, 14}, {}, {}},
                               {{6, 8}, {}, {}},
                               {{5, 0, 10, 11}, {}, {}},
                               {{19}, {}, {}}};
  std::vector<CollatorCase> cases;
  cases.push_back({"lm", docs, nlohmann::json::object(), {}});
  cases.push_back({"lm", docs, {{"pad_to_multiple_of", 4}}, {.pad_to_multiple_of = 4}});
  cases.push_back({"lm", docs, nlohmann::json::object(), {.padding_side = Side::Left}});
  expect_same_as_transformers(tok, cases);
}

TEST(Collator, LanguageModellingMasksPaddingWithMinus100) {
  const std::vector<Feature> docs = {{{4, 5, 6}, {}, {}}, {{7}, {}, {}}};
  const ExampleBatch b = DataCollatorForLanguageModeling(PaddingOptions{.pad_token_id = 1})(views(docs));
  EXPECT_EQ(b.input_ids.to_vector<int64_t>(), (std::vector<int64_t>{4, 5, 6, 7, 1, 1}));
  EXPECT_EQ(b.labels.to_vector<int64_t>(), (std::vector<int64_t>{4, 5, 6, 7, -100, -100}));
  EXPECT_EQ(b.attention_mask.to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(b.input_ids.shape(), (Shape{2, 3}));
  EXPECT_EQ(b.input_ids.dtype(), DType::i64);
}

TEST(Collator, RefusesWhatItCannotBatch) {
  const WordPieceTokenizer tok = small_bert();
  std::vector<Feature> mixed = bert_features(tok, 1);
  mixed[2].label = std::monostate();
  EXPECT_THROW(DataCollatorWithPadding(tok, {})(views(mixed)), Error);
  std::vector<Feature> uneven = bert_features(tok, 0);
  EXPECT_THROW(DataCollatorWithPadding(tok, {.padding = PaddingStrategy::DoNotPad})(views(uneven)),
               Error);
  EXPECT_THROW(DataCollatorWithPadding(tok, {.padding = PaddingStrategy::MaxLength, .max_length = 4})(
                   views(uneven)),
               Error);
  EXPECT_THROW(DataCollatorForLanguageModeling(PaddingOptions{}, /*mlm=*/true), Error);
  EXPECT_THROW(DataCollatorWithPadding(ByteTokenizer(), {}), Error);  // no pad token
}

// Evaluation keeps every example once: after each rank's padding rows are dropped, the
// gathered rounds (rank 0's batch, rank 1's, ...) are the dataset in order, at any world size.
TEST(Sampler, EvalGathersEveryExampleOnceInDatasetOrderAtAnyWorldSize) {
  for (const int64_t n : {1, 7, 10, 23}) {
    for (const int64_t batch : {1, 3, 4}) {
      for (const int world : {1, 2, 3}) {
        std::vector<EvalSampler> ranks;
        for (int r = 0; r < world; ++r) ranks.emplace_back(n, batch, r, world);
        std::vector<int64_t> gathered;
        for (int64_t k = 0; k < ranks[0].size(); ++k)
          for (int r = 0; r < world; ++r) {
            ASSERT_EQ(ranks[r].size(), ranks[0].size());  // even batches
            const EvalBatchIndices b = ranks[r].batch(k);
            ASSERT_EQ(static_cast<int64_t>(b.indices.size()), batch);  // full, padded by repeats
            gathered.insert(gathered.end(), b.indices.begin(), b.indices.begin() + b.real_examples);
          }
        std::vector<int64_t> dataset(n);
        std::iota(dataset.begin(), dataset.end(), int64_t{0});
        EXPECT_EQ(gathered, dataset) << "n " << n << " batch " << batch << " world " << world;
      }
    }
  }
}

TEST(Sampler, TrainingFollowsTorchDistributedSamplerSemantics) {
  const int64_t n = 10;
  for (const int world : {1, 2, 3, 4}) {
    for (const bool drop_last : {false, true}) {
      std::multiset<int64_t> seen;
      int64_t per_rank = -1;
      for (int r = 0; r < world; ++r) {
        DistributedSampler s(n, {.num_replicas = world, .rank = r, .seed = 42, .drop_last = drop_last});
        s.set_epoch(3);
        const std::vector<int64_t> mine = s.indices();
        EXPECT_EQ(static_cast<int64_t>(mine.size()), s.size());
        if (per_rank >= 0) {
          EXPECT_EQ(static_cast<int64_t>(mine.size()), per_rank);
        }
        per_rank = static_cast<int64_t>(mine.size());
        seen.insert(mine.begin(), mine.end());
        EXPECT_EQ(mine, s.indices()) << "deterministic";
      }
      // torch: ceil(n / W) per rank padded by repeats, or floor(n / W) with drop_last.
      EXPECT_EQ(per_rank, drop_last ? n / world : (n + world - 1) / world);
      std::set<int64_t> distinct(seen.begin(), seen.end());
      if (drop_last) {
        EXPECT_EQ(distinct.size(), seen.size());  // none twice
      } else {
        EXPECT_EQ(static_cast<int64_t>(distinct.size()), n);  // all covered
      }
      EXPECT_EQ(static_cast<int64_t>(seen.size()), per_rank * world);
    }
  }
}

TEST(Sampler, ShuffleDependsOnSeedAndEpochOnly) {
  const std::vector<int64_t> a = seeded_permutation(50, 7, 0), b = seeded_permutation(50, 7, 1);
  EXPECT_EQ(a, seeded_permutation(50, 7, 0));
  EXPECT_NE(a, b);
  EXPECT_NE(a, seeded_permutation(50, 8, 0));
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[i], i);
  // The global order (rank r takes positions r, r + W, ...) is the same at every world size.
  DistributedSampler one(50, {.seed = 7});
  one.set_epoch(1);
  EXPECT_EQ(one.indices(), b);
  for (int r = 0; r < 2; ++r) {
    DistributedSampler s(50, {.num_replicas = 2, .rank = r, .seed = 7});
    s.set_epoch(1);
    const std::vector<int64_t> mine = s.indices();
    for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(mine[i], b[2 * i + r]);
  }
  DistributedSampler unshuffled(5, {.shuffle = false});
  EXPECT_EQ(unshuffled.indices(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(Sampler, GroupByLengthSortsMegabatchesLongestFirst) {
  std::vector<int64_t> lengths(200);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = static_cast<int64_t>((i * 37) % 101);
  const std::vector<int64_t> perm = seeded_permutation(200, 3, 0);
  const std::vector<int64_t> grouped = length_grouped(perm, lengths, 4);  // megabatches of 48
  EXPECT_EQ(std::multiset<int64_t>(grouped.begin(), grouped.end()),
            std::multiset<int64_t>(perm.begin(), perm.end()));
  EXPECT_EQ(lengths[grouped[0]], 100);  // the longest of all leads
  for (size_t start = 0; start < grouped.size(); start += 48) {
    const size_t end = std::min(grouped.size(), start + 48);
    for (size_t i = start + 2; i < end; ++i)  // sorted within (the first may be swapped in)
      EXPECT_GE(lengths[grouped[i - 1]], lengths[grouped[i]]) << i;
  }
  DistributedSampler s(200, {.num_replicas = 2, .rank = 1, .seed = 3, .lengths = lengths,
                             .batch_size = 2});
  const std::vector<int64_t> mine = s.indices();
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(mine[i], grouped[2 * i + 1]);
}

TEST(Sampler, RefusesBadArguments) {
  EXPECT_THROW(DistributedSampler(0, {}), Error);
  EXPECT_THROW(DistributedSampler(5, {.num_replicas = 2, .rank = 2}), Error);
  EXPECT_THROW(DistributedSampler(5, {.lengths = {1, 2}}), Error);
  EXPECT_THROW(DistributedSampler(2, {.num_replicas = 3, .drop_last = true}), Error);
  EXPECT_THROW(EvalSampler(5, 0), Error);
}

TEST(ExampleLoader, BatchesAreReIterableAndCountedByLen) {
  const fs::path dir = example_scratch("loader");
  std::string rows = "text,label\n";
  for (int i = 0; i < 11; ++i) rows += std::string(i % 2 ? "the cat" : "a dog sat on the mat") + "," + std::to_string(i % 2) + "\n";
  write_text(dir / "d.csv", rows);
  const WordPieceTokenizer tok = small_bert();
  const ExampleDataset ds = ExampleDataset::load(dir / "d.csv", tok);
  const Collator collate = DataCollatorWithPadding(tok, {});
  ExampleLoader train(ds, collate, {.batch_size = 4, .shuffle = true, .seed = 1});
  EXPECT_EQ(train.size(), 3);
  std::vector<int64_t> first_pass, second_pass;
  for (const ExampleBatch& b : train) first_pass.insert(first_pass.end(), b.indices.begin(), b.indices.end());
  for (const ExampleBatch& b : train) second_pass.insert(second_pass.end(), b.indices.begin(), b.indices.end());
  EXPECT_EQ(first_pass, second_pass);
  EXPECT_EQ(std::set<int64_t>(first_pass.begin(), first_pass.end()).size(), 11u);
  train.set_epoch(1);
  EXPECT_NE(train.batch(0).indices, std::vector<int64_t>(first_pass.begin(), first_pass.begin() + 4));
  const ExampleBatch b0 = train.batch(0);
  EXPECT_EQ(b0.input_ids.size(0), 4);
  EXPECT_EQ(b0.labels.to_vector<int64_t>().size(), 4u);
  EXPECT_EQ(b0.labels.to_vector<int64_t>()[0], b0.indices[0] % 2);

  ExampleLoader dropping(ds, collate, {.batch_size = 4, .drop_last = true});
  EXPECT_EQ(dropping.size(), 2);
  ExampleLoader eval(ds, collate, {.batch_size = 4, .rank = 1, .world_size = 2, .evaluation = true});
  EXPECT_EQ(eval.size(), 2);  // rounds of 8: positions 4..7 and 12..15 (all padding)
  EXPECT_EQ(eval.batch(0).real_examples, 4);
  EXPECT_EQ(eval.batch(1).real_examples, 0);
  EXPECT_EQ(eval.batch(1).input_ids.size(0), 4);
  EXPECT_THROW(ExampleLoader(ds, collate, {.shuffle = true, .evaluation = true}), Error);
}
