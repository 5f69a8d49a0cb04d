// Collators: a list of tokenised examples (data/example_dataset.h) -> one batch of
// [B, T] i64 tensors, as transformers' collators build them.
//
// DataCollatorWithPadding pads with tokenizer.pad's rules: to the longest example of the
// batch (or to max_length with PaddingStrategy::MaxLength; DoNotPad needs equal lengths),
// rounded up to pad_to_multiple_of, input_ids with the pad token, token_type_ids with 0
// (given only when the examples have them), attention_mask 1 on tokens and 0 on padding,
// on the right or the left. Labels become `labels`: i64 [B] class ids or f32 [B] regression
// targets (transformers' torch.long / torch.float).
//
// DataCollatorForLanguageModeling with mlm = false (causal language modelling): the same
// padding, and labels = input_ids with -100 wherever input_ids is the pad token. Like
// transformers, it compares ids, so with pad = eos (GPT-2's usual set-up) the real eos
// tokens are ignored by the loss as well.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/data/example_dataset.h"
#include "tessera/data/wordpiece.h"

namespace tessera::data {

// A collated batch. Tensors a collator does not give are left undefined (token_type_ids
// without types in the examples, labels without labels).
struct ExampleBatch {
  Tensor input_ids, attention_mask, token_type_ids, labels;
  // Set by the ExampleLoader: the dataset index of each row, and how many rows are real
  // (the rest are evaluation padding that gather_for_metrics drops).
  std::vector<int64_t> indices;
  int64_t real_examples = 0;
};

struct PaddingOptions {
  PaddingStrategy padding = PaddingStrategy::Longest;
  size_t max_length = 0;  // PaddingStrategy::MaxLength: required
  size_t pad_to_multiple_of = 0;
  Side padding_side = Side::Right;
  uint32_t pad_token_id = 0;
  uint32_t pad_token_type_id = 0;
};

// The pad token id of a tokenizer (a WordPiece tokenizer's pad_token), if it has one.
std::optional<uint32_t> pad_token_id_of(const Tokenizer& tokenizer);

class DataCollatorWithPadding {
 public:
  explicit DataCollatorWithPadding(PaddingOptions options);
  // The tokenizer's pad token fills options.pad_token_id; a tokenizer without one is an
  // error (pass the id in PaddingOptions instead).
  DataCollatorWithPadding(const Tokenizer& tokenizer, PaddingOptions options);
  // Errors name the example: a batch mixing examples with and without labels or token
  // types, an example longer than max_length, unequal lengths without padding.
  ExampleBatch operator()(std::span<const Example> examples) const;
  const PaddingOptions& options() const { return options_; }

 protected:
  // The padded length of this batch.
  size_t padded_length(std::span<const Example> examples) const;
  // The batch without labels; `ids` receives the padded input_ids, row after row.
  ExampleBatch padded(std::span<const Example> examples, std::vector<int64_t>& ids) const;
  PaddingOptions options_;
};

class DataCollatorForLanguageModeling : private DataCollatorWithPadding {
 public:
  // mlm = true (masked language modelling) is not supported and refused.
  DataCollatorForLanguageModeling(PaddingOptions options, bool mlm = false);
  DataCollatorForLanguageModeling(const Tokenizer& tokenizer, PaddingOptions options,
                                  bool mlm = false);
  ExampleBatch operator()(std::span<const Example> examples) const;
  using DataCollatorWithPadding::options;
};

}  // namespace tessera::data
