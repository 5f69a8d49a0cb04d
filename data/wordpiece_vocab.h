// A WordPiece vocabulary from text, for models trained from scratch. Tessera has no WordPiece
// trainer of Hugging Face's kind (which merges pieces by a likelihood score); this is a plain
// frequency count, honest about being simpler:
//   [PAD] [UNK] [CLS] [SEP] [MASK], then every character seen (as a word start and as a
//   "##" continuation, so any word of known characters has a spelling), then whole words by
//   descending frequency (ties in byte order) until vocab_size entries.
// Words are what BertTokenizer's pipeline makes of the text (BertNormalizer with lowercase,
// BertPreTokenizer), so the vocabulary fits WordPieceTokenizer::bert_config(vocab, true).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::data {

struct WordPieceVocabOptions {
  int64_t vocab_size = 4000;
  int64_t min_frequency = 2;  // words seen fewer times are left to their characters
  bool lowercase = true;
};

// The vocabulary (id -> token) of `texts` (valid UTF-8). Fewer entries than vocab_size when
// the text has fewer distinct words of min_frequency; a vocab_size below the special tokens
// and the characters is an error naming both counts.
std::vector<std::string> build_wordpiece_vocab(const std::vector<std::string>& texts,
                                               const WordPieceVocabOptions& options = {});

}  // namespace tessera::data
