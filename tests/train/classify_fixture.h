// Shared by the classification Trainer tests and their multi-process helper: a tiny
// vocabulary and BERT, and generated (text, label) JSON Lines files.
#pragma once
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/data/collator.h"
#include "tessera/data/example_dataset.h"
#include "tessera/data/example_loader.h"
#include "tessera/data/wordpiece.h"
#include "tessera/nn/bert.h"

namespace tessera::test {

namespace fs = std::filesystem;

inline const std::vector<std::string> kVocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad",
                                         "film",  "the",   "a",     "cat",   "dog",   "sat",   "on"};
inline constexpr int64_t kClasses = 3;

inline const data::WordPieceTokenizer& tokenizer() {
  static const data::WordPieceTokenizer tok(data::WordPieceTokenizer::bert_config(kVocab, true));
  return tok;
}

// Rows whose label is set by the first word (good 0, bad 1, film 2), then 1-5 filler words.
// `label_override` replaces the label of row `override_row` (for the bad-input tests).
inline fs::path write_rows(const fs::path& file, int rows, uint32_t seed, int override_row = -1,
                    int label_override = 0, int extra_words = 0) {
  std::mt19937 rng(seed);
  std::ofstream out(file);
  const char* lead[] = {"good", "bad", "film"};
  const char* filler[] = {"the", "a", "cat", "dog", "sat", "on"};
  for (int i = 0; i < rows; ++i) {
    const int label = static_cast<int>(rng() % kClasses);
    std::string text = lead[label];
    const int words = 1 + static_cast<int>(rng() % 5) + (i == override_row ? extra_words : 0);
    for (int w = 0; w < words; ++w) text += std::string(" ") + filler[rng() % 6];
    out << nlohmann::json{{"text", text}, {"label", i == override_row ? label_override : label}}.dump()
        << "\n";
  }
  return file;
}

inline data::ExampleDataset load(const fs::path& file, bool truncation = true) {
  data::ExampleDatasetOptions o;
  o.num_labels = kClasses;
  o.truncation = truncation;
  o.use_cache = false;
  return data::ExampleDataset::load(file, tokenizer(), o);
}

inline std::unique_ptr<nn::BertForSequenceClassification> tiny_bert(double dropout = 0.0) {
  nn::BertConfig c;
  c.vocab_size = static_cast<int64_t>(kVocab.size());
  c.hidden_size = 16, c.num_hidden_layers = 1, c.num_attention_heads = 2, c.intermediate_size = 32;
  c.max_position_embeddings = 16;
  c.hidden_dropout_prob = dropout, c.attention_probs_dropout_prob = dropout;
  c.labels.num_labels = kClasses;
  Generator gen(3);
  return std::make_unique<nn::BertForSequenceClassification>(c, &gen);
}

inline data::Collator padding_collator() {
  return data::DataCollatorWithPadding(tokenizer(), {});
}

}  // namespace tessera::test
