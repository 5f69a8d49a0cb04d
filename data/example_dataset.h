// Datasets of labelled examples: (text[, text_pair], label) rows of a JSON Lines, CSV or TSV
// file (data/text_table.h), tokenised once and kept in a cache file that is memory-mapped.
//
// The cache lives next to the source, `<file>.tessera-cache/<key hash>.bin`. Its key covers
// the source (size, modification time and a checksum of its bytes), the tokenizer (a
// checksum of every file it saves as) and every option that changes the examples, so a
// changed source, tokenizer or option builds a new cache. It is written atomically
// (temporary file, fsync, rename) and ends in a CRC-32 of all it holds; a cache that does not
// check out (truncated, damaged, another key) is rebuilt, never half-read.
//
// Every row is checked before any tokenising: the errors name the file, the line and the
// column (a missing column, a text that is not a string, an empty text, a label that is
// missing, outside num_labels or not in the label list).
//
// Labels (HF's `label` column): integers are class ids (0 <= id < num_labels); strings are
// class names mapped through `label_list` (id = position; by default the sorted distinct
// names, recorded in the cache and given by label_names()); floats are regression targets
// (num_labels = 1). With LabelType::Auto the column's values decide: all integers -> class
// ids, all numbers -> regression, otherwise names.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "tessera/data/text_table.h"
#include "tessera/data/tokenizer.h"
#include "tessera/data/wordpiece.h"

namespace tessera::data {

enum class LabelType { Auto, Integer, String, Float };
// "auto", "int", "str" (or "string"), "float"; anything else is an error naming the value.
LabelType parse_label_type(const std::string& name);
const char* label_type_name(LabelType type);

// What kind of labels a dataset holds: none, class ids (HF's single_label_classification)
// or regression targets.
enum class LabelKind { None, Class, Regression };

// One tokenised example, as a collator takes it. The spans point into the dataset's map (or
// into the caller's vectors). An empty token_type_ids or attention_mask means the example
// has none (a collator then gives no token_type_ids / an all-ones mask).
struct Example {
  std::span<const uint32_t> input_ids;
  std::span<const uint32_t> token_type_ids;
  std::span<const uint32_t> attention_mask;
  std::variant<std::monostate, int64_t, double> label;  // none, a class id, a regression target
};

// A dataset's examples as its cache file lays them out (data/example_cache.h reads and writes
// it); the pointers go into the file's map.
struct ExampleImage {
  int64_t count = 0;
  const uint64_t* offsets = nullptr;  // count + 1 token offsets
  const int64_t* lines = nullptr;     // the source line of each example
  const uint32_t* input_ids = nullptr;
  const uint32_t* token_type_ids = nullptr;  // null: the tokenizer gives none
  const int64_t* class_labels = nullptr;
  const double* regression_labels = nullptr;
  LabelKind label_kind = LabelKind::None;
  int64_t num_labels = 0;
  std::vector<std::string> label_names;
};

struct ExampleDatasetOptions {
  std::optional<TableFormat> format{};  // unset: from the file's extension
  std::string text_column = "text";
  std::string text_pair_column{};        // empty: single texts
  std::string label_column = "label";  // empty: no labels (a test set)
  LabelType label_type = LabelType::Auto;
  std::vector<std::string> label_list{};  // string labels: id = position (HF's label2id)
  int64_t num_labels = 0;               // 0: from the labels
  // How texts are tokenised (transformers' __call__ arguments); padding is the collator's
  // business and is refused here. max_length 0: the tokenizer's model_max_length.
  bool add_special_tokens = true;
  bool truncation = true;
  TruncationStrategy truncation_strategy = TruncationStrategy::LongestFirst;
  size_t max_length = 0;
  // An empty text (or only white space) is refused by default: it is almost always a broken
  // row, and it would train on [CLS] [SEP] alone. true keeps it.
  bool allow_empty_text = false;
  bool use_cache = true;
  std::filesystem::path cache_dir{};  // empty: <file>.tessera-cache next to the source
};

class ExampleDataset {
 public:
  // Reads, checks and tokenises `path` with `tokenizer`, or maps its valid cache. A text
  // pair needs a WordPiece tokenizer (the one with a pair template).
  static ExampleDataset load(const std::filesystem::path& path, const Tokenizer& tokenizer,
                             const ExampleDatasetOptions& options = {});

  int64_t size() const { return image_.count; }
  Example operator[](int64_t i) const;  // checked: error names i and size()
  int64_t length(int64_t i) const;      // tokens of example i
  std::vector<int64_t> lengths() const;
  // Line of the source where example i starts (for messages).
  int64_t source_line(int64_t i) const;

  LabelKind label_kind() const { return image_.label_kind; }
  int64_t num_labels() const { return image_.num_labels; }
  // Class names, id -> name (string labels only; empty otherwise), and their inverse.
  const std::vector<std::string>& label_names() const { return image_.label_names; }
  std::map<std::string, int64_t> label2id() const;

  // Whether this load mapped an existing cache, and how many examples it tokenised (0 when
  // it mapped a cache).
  bool loaded_from_cache() const { return loaded_from_cache_; }
  int64_t tokenized_examples() const { return tokenized_examples_; }
  // Why an existing cache file was not used ("" when none was there or it was used).
  const std::string& cache_rebuild_reason() const { return cache_rebuild_reason_; }
  const std::filesystem::path& cache_path() const { return cache_path_; }
  const std::filesystem::path& source() const { return source_; }

 private:
  ExampleDataset() = default;
  std::filesystem::path source_, cache_path_;
  std::shared_ptr<const void> bytes_;  // the mapping (or the image in memory), kept alive
  ExampleImage image_;
  bool loaded_from_cache_ = false;
  int64_t tokenized_examples_ = 0;
  std::string cache_rebuild_reason_;
};

}  // namespace tessera::data
