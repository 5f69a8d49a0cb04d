#include "tessera/data/bert_normalizer.h"

#include <algorithm>
#include <cstdint>

#include "tessera/data/bert_unicode_tables.h"
#include "tessera/data/pretokenizer.h"
#include "tessera/data/unicode_tables.h"

namespace tessera::data {

namespace {

enum Flag : uint8_t {
  kControl = 1,
  kSpace = 2,
  kPunctuation = 4,
  kNonspacingMark = 8,
  kCjk = 16,
  kDecomposes = 32,
  kCombining = 64,
  kLowercases = 128,
};

// The "Chinese characters" of BERT's tokenizer, as `tokenizers` 0.20.3 spells them (its
// fourth extension range starts at U+2B920, not at U+2B820 as Google's BERT code has it).
constexpr unicode::CodePointRange kCjkRanges[] = {
    {0x4E00, 0x9FFF},   {0x3400, 0x4DBF},   {0x20000, 0x2A6DF}, {0x2A700, 0x2B73F},
    {0x2B740, 0x2B81F}, {0x2B920, 0x2CEAF}, {0xF900, 0xFAFF},   {0x2F800, 0x2FA1F},
};

// Hangul syllables decompose arithmetically (Unicode 3.12).
constexpr char32_t kHangulFirst = 0xAC00, kHangulLast = 0xD7A3, kLeadBase = 0x1100,
                   kVowelBase = 0x1161, kTrailBase = 0x11A7;
constexpr char32_t kVowelCount = 21, kTrailCount = 28;

// One byte of flags per code point (1.1 MB, built once): a lookup is one load.
const std::vector<uint8_t>& flag_table() {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(0x110000, 0);
    const auto mark = [&](const unicode::CodePointRange* ranges, size_t count, uint8_t flag) {
      for (size_t r = 0; r < count; ++r)
        for (char32_t c = ranges[r].first; c <= ranges[r].last; ++c) t[c] |= flag;
    };
    mark(unicode::kBertControlRanges, unicode::kBertControlRangeCount, kControl);
    mark(unicode::kWhiteSpaceRanges, unicode::kWhiteSpaceRangeCount, kSpace);
    mark(unicode::kBertPunctuationRanges, unicode::kBertPunctuationRangeCount, kPunctuation);
    mark(unicode::kNonspacingMarkRanges, unicode::kNonspacingMarkRangeCount, kNonspacingMark);
    mark(kCjkRanges, std::size(kCjkRanges), kCjk);
    for (size_t i = 0; i < unicode::kCanonicalDecompositionsCount; ++i)
      t[unicode::kCanonicalDecompositions[i].code_point] |= kDecomposes;
    for (size_t i = 0; i < unicode::kCombiningClassCount; ++i)
      t[unicode::kCombiningClasses[i].code_point] |= kCombining;
    for (size_t i = 0; i < unicode::kLowercaseMappingsCount; ++i)
      t[unicode::kLowercaseMappings[i].code_point] |= kLowercases;
    return t;
  }();
  return table;
}

uint8_t flags(char32_t c) { return c < 0x110000 ? flag_table()[c] : 0; }

// Appends what `c` maps onto in a generated mapping table (c must be in it).
void append_mapping(std::u32string& out, char32_t c, const unicode::CodePointMapping* table,
                    size_t count, const char32_t* pool) {
  const auto* m = std::lower_bound(
      table, table + count, c,
      [](const unicode::CodePointMapping& e, char32_t key) { return e.code_point < key; });
  out.append(pool + m->offset, m->length);
}

uint8_t combining_class(char32_t c) {
  if (!(flags(c) & kCombining)) return 0;
  const auto* end = unicode::kCombiningClasses + unicode::kCombiningClassCount;
  return std::lower_bound(
             unicode::kCombiningClasses, end, c,
             [](const unicode::CombiningClass& e, char32_t key) { return e.code_point < key; })
      ->combining_class;
}

void decompose(std::u32string& out, char32_t c) {
  if (c >= kHangulFirst && c <= kHangulLast) {
    const char32_t index = c - kHangulFirst, trail = index % kTrailCount;
    out += kLeadBase + index / (kVowelCount * kTrailCount);
    out += kVowelBase + (index % (kVowelCount * kTrailCount)) / kTrailCount;
    if (trail != 0) out += kTrailBase + trail;
  } else if (flags(c) & kDecomposes) {
    append_mapping(out, c, unicode::kCanonicalDecompositions,
                   unicode::kCanonicalDecompositionsCount, unicode::kCanonicalDecompositionsPool);
  } else {
    out += c;
  }
}

// NFD: full canonical decomposition, then each run of combining marks (class > 0) sorted
// stably by class (the canonical ordering algorithm).
std::u32string nfd(const std::u32string& text) {
  std::u32string out;
  out.reserve(text.size());
  for (char32_t c : text) decompose(out, c);
  for (size_t i = 0; i < out.size();) {
    if (combining_class(out[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < out.size() && combining_class(out[end]) != 0) ++end;
    std::stable_sort(out.begin() + i, out.begin() + end, [](char32_t a, char32_t b) {
      return combining_class(a) < combining_class(b);
    });
    i = end;
  }
  return out;
}

std::u32string clean_and_space(std::string_view text, const BertNormalizerOptions& options) {
  std::u32string out;
  out.reserve(text.size());
  for (size_t i = 0, length = 0; i < text.size(); i += length) {
    const char32_t c = decode_utf8_at(text, i, length);
    const uint8_t f = flags(c);
    if (options.clean_text) {
      if (c == 0 || c == 0xFFFD || (f & kControl)) continue;
      if (f & kSpace) {
        out += U' ';
        continue;
      }
    }
    if (options.handle_chinese_chars && (f & kCjk)) {
      out += U' ';
      out += c;
      out += U' ';
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

bool is_bert_whitespace(char32_t code_point) { return flags(code_point) & kSpace; }

std::string bert_normalize(std::string_view valid_utf8, const BertNormalizerOptions& options) {
  std::u32string text = clean_and_space(valid_utf8, options);
  if (options.strip_accents.value_or(options.lowercase)) {
    text = nfd(text);
    std::erase_if(text, [](char32_t c) { return flags(c) & kNonspacingMark; });
  }
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  std::u32string lowered;
  for (char32_t c : text) {
    if (options.lowercase && (flags(c) & kLowercases)) {
      lowered.clear();
      append_mapping(lowered, c, unicode::kLowercaseMappings, unicode::kLowercaseMappingsCount,
                     unicode::kLowercaseMappingsPool);
      for (char32_t l : lowered) append_utf8(out, l);
    } else {
      append_utf8(out, c);
    }
  }
  return out;
}

void bert_pre_tokenize(std::string_view text, std::vector<std::string_view>& words) {
  size_t word_start = 0;
  const auto end_word = [&](size_t end) {
    if (end > word_start) words.push_back(text.substr(word_start, end - word_start));
  };
  for (size_t i = 0, length = 0; i < text.size(); i += length) {
    const uint8_t f = flags(decode_utf8_at(text, i, length));
    if (f & kSpace) {
      end_word(i);
      word_start = i + length;
    } else if (f & kPunctuation) {
      end_word(i);
      words.push_back(text.substr(i, length));
      word_start = i + length;
    }
  }
  end_word(text.size());
}

}  // namespace tessera::data
