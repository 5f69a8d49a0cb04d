// BERT's text pipeline ahead of WordPiece, as Hugging Face `tokenizers` defines it:
// the BertNormalizer (clean_text, handle_chinese_chars, strip_accents, lowercase) and the
// BertPreTokenizer (split on white space, isolate each punctuation character). The Unicode
// data it needs come from data/bert_unicode_tables.h.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::data {

struct BertNormalizerOptions {
  // Drop NUL, U+FFFD and control/format/private-use characters (\t \n \r excepted); every
  // other white-space character becomes ' '.
  bool clean_text = true;
  // Put a space either side of each CJK ideograph (the ranges BERT lists).
  bool handle_chinese_chars = true;
  // NFD, then drop the non-spacing marks (Mn). Unset: follow `lowercase`.
  std::optional<bool> strip_accents;
  bool lowercase = true;
};

// `valid_utf8` normalized; the steps run in the order above, as `tokenizers` runs them.
std::string bert_normalize(std::string_view valid_utf8, const BertNormalizerOptions& options);

// BertPreTokenizer: the words of `valid_utf8` (views into it), split at White_Space (which
// is dropped) and around every punctuation character (ASCII punctuation or category P*),
// which is a word of its own.
void bert_pre_tokenize(std::string_view valid_utf8, std::vector<std::string_view>& words);

// Rust's char::is_whitespace (Unicode's White_Space), which `tokenizers` splits words at.
bool is_bert_whitespace(char32_t code_point);

}  // namespace tessera::data
