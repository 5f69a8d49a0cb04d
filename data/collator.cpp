#include "tessera/data/collator.h"

#include <algorithm>

#include "tessera/core/error.h"

namespace tessera::data {
namespace {

constexpr int64_t kIgnoreIndex = -100;  // what the cross-entropy loss skips (PyTorch's)

uint32_t checked_pad_id(const Tokenizer& tokenizer, const char* who) {
  const std::optional<uint32_t> id = pad_token_id_of(tokenizer);
  TESSERA_CHECK(id.has_value(), who, ": the ", tokenizer.type(),
                " tokenizer has no pad token; pass pad_token_id in the padding options");
  return *id;
}

// Rows of one field, each padded to `length` with `pad` on options.padding_side.
std::vector<int64_t> padded_rows(std::span<const Example> examples, size_t length,
                                 const PaddingOptions& options,
                                 std::span<const uint32_t> Example::*field, int64_t pad,
                                 int64_t absent) {
  std::vector<int64_t> out(examples.size() * length, pad);
  for (size_t b = 0; b < examples.size(); ++b) {
    const std::span<const uint32_t> values = examples[b].*field;
    const size_t n = examples[b].input_ids.size();
    const size_t start = options.padding_side == Side::Right ? 0 : length - n;
    int64_t* row = out.data() + b * length + start;
    for (size_t t = 0; t < n; ++t) row[t] = values.empty() ? absent : values[t];
  }
  return out;
}

Tensor matrix(const std::vector<int64_t>& values, size_t rows, size_t columns) {
  return from_vector(values, {static_cast<int64_t>(rows), static_cast<int64_t>(columns)},
                     {.dtype = DType::i64});
}

Tensor label_tensor(std::span<const Example> examples) {
  const size_t kind = examples[0].label.index();
  for (size_t b = 0; b < examples.size(); ++b)
    TESSERA_CHECK(examples[b].label.index() == kind, "DataCollatorWithPadding: example ", b,
                  (examples[b].label.index() == 0 ? " has no label" : " has another kind of label"),
                  " than example 0 of the batch");
  const auto rows = static_cast<int64_t>(examples.size());
  if (kind == 1) {
    std::vector<int64_t> ids;
    for (const Example& e : examples) ids.push_back(std::get<int64_t>(e.label));
    return from_vector(ids, {rows}, {.dtype = DType::i64});
  }
  if (kind == 2) {
    std::vector<double> targets;
    for (const Example& e : examples) targets.push_back(std::get<double>(e.label));
    return from_vector(targets, {rows}, {.dtype = DType::f32});
  }
  return Tensor();
}

void check_examples(std::span<const Example> examples) {
  TESSERA_CHECK(!examples.empty(), "DataCollatorWithPadding: an empty batch");
  const bool types = !examples[0].token_type_ids.empty();
  for (size_t b = 0; b < examples.size(); ++b) {
    const Example& e = examples[b];
    const size_t n = e.input_ids.size();
    TESSERA_CHECK(e.token_type_ids.empty() == !types || n == 0, "DataCollatorWithPadding: example ",
                  b, types ? " has no token_type_ids" : " has token_type_ids",
                  " and example 0 of the batch ", types ? "has" : "has not");
    TESSERA_CHECK(e.token_type_ids.empty() || e.token_type_ids.size() == n,
                  "DataCollatorWithPadding: example ", b, " has ", e.token_type_ids.size(),
                  " token_type_ids for ", n, " input_ids");
    TESSERA_CHECK(e.attention_mask.empty() || e.attention_mask.size() == n,
                  "DataCollatorWithPadding: example ", b, " has ", e.attention_mask.size(),
                  " attention_mask values for ", n, " input_ids");
  }
}

}  // namespace

std::optional<uint32_t> pad_token_id_of(const Tokenizer& tokenizer) {
  if (const auto* wordpiece = dynamic_cast<const WordPieceTokenizer*>(&tokenizer))
    return wordpiece->role_id("pad_token");
  return std::nullopt;
}

DataCollatorWithPadding::DataCollatorWithPadding(PaddingOptions options) : options_(options) {
  TESSERA_CHECK(options_.padding != PaddingStrategy::MaxLength || options_.max_length > 0,
                "DataCollatorWithPadding: padding 'max_length' needs max_length");
}

DataCollatorWithPadding::DataCollatorWithPadding(const Tokenizer& tokenizer, PaddingOptions options)
    : DataCollatorWithPadding([&] {
        options.pad_token_id = checked_pad_id(tokenizer, "DataCollatorWithPadding");
        if (options.padding == PaddingStrategy::MaxLength && options.max_length == 0)
          if (const auto* wp = dynamic_cast<const WordPieceTokenizer*>(&tokenizer))
            options.max_length = wp->config().model_max_length;
        return options;
      }()) {}

size_t DataCollatorWithPadding::padded_length(std::span<const Example> examples) const {
  size_t longest = 0, shortest = SIZE_MAX;
  for (const Example& e : examples) {
    longest = std::max(longest, e.input_ids.size());
    shortest = std::min(shortest, e.input_ids.size());
  }
  size_t length = longest;
  if (options_.padding == PaddingStrategy::DoNotPad) {
    TESSERA_CHECK(longest == shortest, "DataCollatorWithPadding: without padding the examples ",
                  "must have one length; this batch has ", shortest, " to ", longest, " tokens");
    return length;
  }
  if (options_.padding == PaddingStrategy::MaxLength) {
    TESSERA_CHECK(longest <= options_.max_length, "DataCollatorWithPadding: an example of ",
                  longest, " tokens is longer than max_length ", options_.max_length,
                  " (truncate when tokenising)");
    length = options_.max_length;
  }
  const size_t m = options_.pad_to_multiple_of;
  if (m > 0 && length % m != 0) length = (length / m + 1) * m;
  return length;
}

ExampleBatch DataCollatorWithPadding::padded(std::span<const Example> examples,
                                             std::vector<int64_t>& ids) const {
  check_examples(examples);
  const size_t length = padded_length(examples), rows = examples.size();
  ids = padded_rows(examples, length, options_, &Example::input_ids, options_.pad_token_id, 0);
  ExampleBatch batch;
  batch.input_ids = matrix(ids, rows, length);
  batch.attention_mask =
      matrix(padded_rows(examples, length, options_, &Example::attention_mask, 0, 1), rows, length);
  if (!examples[0].token_type_ids.empty())
    batch.token_type_ids = matrix(padded_rows(examples, length, options_, &Example::token_type_ids,
                                              options_.pad_token_type_id, 0),
                                  rows, length);
  batch.real_examples = static_cast<int64_t>(rows);
  return batch;
}

ExampleBatch DataCollatorWithPadding::operator()(std::span<const Example> examples) const {
  std::vector<int64_t> ids;
  ExampleBatch batch = padded(examples, ids);
  batch.labels = label_tensor(examples);
  return batch;
}

DataCollatorForLanguageModeling::DataCollatorForLanguageModeling(PaddingOptions options, bool mlm)
    : DataCollatorWithPadding(options) {
  TESSERA_CHECK(!mlm, "DataCollatorForLanguageModeling: mlm=True (masked language modelling) ",
                "is not supported; use mlm=False for causal language models");
}

DataCollatorForLanguageModeling::DataCollatorForLanguageModeling(const Tokenizer& tokenizer,
                                                                 PaddingOptions options, bool mlm)
    : DataCollatorForLanguageModeling(
          [&] {
            options.pad_token_id = checked_pad_id(tokenizer, "DataCollatorForLanguageModeling");
            return options;
          }(),
          mlm) {}

ExampleBatch DataCollatorForLanguageModeling::operator()(std::span<const Example> examples) const {
  std::vector<int64_t> ids;
  ExampleBatch batch = padded(examples, ids);
  for (int64_t& id : ids)
    if (id == static_cast<int64_t>(options_.pad_token_id)) id = kIgnoreIndex;
  batch.labels = matrix(ids, examples.size(), ids.size() / examples.size());
  return batch;
}

}  // namespace tessera::data
