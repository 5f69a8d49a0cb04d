// The Unicode data of BERT's normalizer and pre-tokenizer (data/bert_normalizer.h), as
// Hugging Face `tokenizers` 0.20.3 classifies code points, generated into
// bert_unicode_tables.cpp by scripts/gen_bert_unicode_tables.py (its docstring says from what).
#pragma once
#include <cstddef>
#include <cstdint>

#include "tessera/data/unicode_tables.h"

namespace tessera::data::unicode {

// Code point `code_point` maps onto pool[offset, offset + length).
struct CodePointMapping {
  char32_t code_point;
  uint32_t offset;
  uint32_t length;
};
struct CombiningClass {
  char32_t code_point;
  uint8_t combining_class;
};

extern const char kBertUnicodeVersion[];
extern const CodePointRange kBertControlRanges[];  // removed by clean_text (Cc Cf Co but \t\n\r)
extern const size_t kBertControlRangeCount;
extern const CodePointRange kBertPunctuationRanges[];  // ASCII punctuation and P*
extern const size_t kBertPunctuationRangeCount;
extern const CodePointRange kNonspacingMarkRanges[];  // Mn
extern const size_t kNonspacingMarkRangeCount;
// Sorted by code point. Full canonical decompositions (Hangul syllables excepted).
extern const CodePointMapping kCanonicalDecompositions[];
extern const size_t kCanonicalDecompositionsCount;
extern const char32_t kCanonicalDecompositionsPool[];
extern const CombiningClass kCombiningClasses[];  // the non-zero ones
extern const size_t kCombiningClassCount;
extern const CodePointMapping kLowercaseMappings[];  // full lowercase mappings that change
extern const size_t kLowercaseMappingsCount;
extern const char32_t kLowercaseMappingsPool[];

}  // namespace tessera::data::unicode
