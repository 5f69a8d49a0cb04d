// Code-point ranges of the Unicode classes GPT-2's pre-tokenizer uses (\p{L}, \p{N}, \s),
// generated into unicode_tables.cpp by scripts/gen_unicode_tables.py.
#pragma once
#include <cstddef>

namespace tessera::data::unicode {

struct CodePointRange {
  char32_t first, last;  // inclusive
};

extern const char kUnicodeVersion[];          // the Unicode version the tables come from
extern const CodePointRange kLetterRanges[];  // general category L*
extern const size_t kLetterRangeCount;
extern const CodePointRange kNumberRanges[];  // general category N*
extern const size_t kNumberRangeCount;
extern const CodePointRange kWhiteSpaceRanges[];  // the White_Space property
extern const size_t kWhiteSpaceRangeCount;

}  // namespace tessera::data::unicode
