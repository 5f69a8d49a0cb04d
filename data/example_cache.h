// The cache file of an ExampleDataset (data/example_dataset.h). Little-endian, every
// section starting on 8 bytes so the map can be read in place:
//   "TSRDSET1"; u64 key bytes, count, tokens, has_token_types, label kind, num_labels,
//   label-names bytes; the key text; the label names (a JSON array); u64 offsets[count + 1];
//   i64 lines[count]; the labels (i64 class ids or f64 targets)[count], unless none;
//   u32 input_ids[tokens]; u32 token_type_ids[tokens], if any; then u32 CRC-32 of all before
//   it and "TSR1".
// The key text is the whole description of what the cache was built from (not a hash), so
// a cache is used only for exactly that source, tokenizer and options.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/data/example_dataset.h"

namespace tessera::data {

// A dataset's columns while it is built.
struct ExampleColumns {
  std::vector<uint64_t> offsets{0};
  std::vector<int64_t> lines;
  std::vector<uint32_t> input_ids, token_type_ids;
  bool has_token_types = false;
  LabelKind label_kind = LabelKind::None;
  std::vector<int64_t> class_labels;
  std::vector<double> regression_labels;
  int64_t num_labels = 0;
  std::vector<std::string> label_names;
};

std::vector<std::byte> cache_image(const ExampleColumns& columns, const std::string& key);

// Checks an image of `size` bytes built for `key` and points `image` into it. Returns why
// it cannot be used ("" when it can): too short, another format or key, sizes that do not
// add up, a CRC-32 mismatch, offsets out of order.
std::string read_cache_image(const std::byte* data, size_t size, const std::string& key,
                             ExampleImage& image);

}  // namespace tessera::data
