#include "tessera/data/wordpiece_vocab.h"

#include <algorithm>
#include <map>
#include <set>
#include <string_view>
#include <unordered_map>

#include "tessera/core/error.h"
#include "tessera/data/bert_normalizer.h"

namespace tessera::data {

namespace {

// The UTF-8 characters of `word`, each as its own string.
std::vector<std::string> characters_of(std::string_view word) {
  std::vector<std::string> chars;
  for (size_t i = 0; i < word.size();) {
    const auto lead = static_cast<unsigned char>(word[i]);
    const size_t length = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    chars.emplace_back(word.substr(i, length));
    i += length;
  }
  return chars;
}

}  // namespace

std::vector<std::string> build_wordpiece_vocab(const std::vector<std::string>& texts,
                                               const WordPieceVocabOptions& options) {
  BertNormalizerOptions normalizer;
  normalizer.lowercase = options.lowercase;
  std::unordered_map<std::string, int64_t> word_counts;
  std::set<std::string> alphabet;
  std::vector<std::string_view> words;
  for (const std::string& text : texts) {
    const std::string normalized = bert_normalize(text, normalizer);
    words.clear();
    bert_pre_tokenize(normalized, words);
    for (std::string_view w : words) {
      ++word_counts[std::string(w)];
      for (std::string& c : characters_of(w)) alphabet.insert(std::move(c));
    }
  }
  std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  std::set<std::string> taken(vocab.begin(), vocab.end());
  for (const std::string& c : alphabet)
    if (taken.insert(c).second) vocab.push_back(c);
  for (const std::string& c : alphabet)
    if (taken.insert("##" + c).second) vocab.push_back("##" + c);
  TESSERA_CHECK(static_cast<int64_t>(vocab.size()) <= options.vocab_size, "WordPiece vocabulary: vocab_size ",
                options.vocab_size, " cannot hold the 5 special tokens and the ", alphabet.size(),
                " characters of the text (", vocab.size(), " entries with their ## continuations)");
  std::vector<std::pair<std::string, int64_t>> frequent;
  for (const auto& [word, count] : word_counts)
    if (count >= options.min_frequency && !taken.count(word)) frequent.emplace_back(word, count);
  std::sort(frequent.begin(), frequent.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  for (const auto& [word, count] : frequent) {
    if (static_cast<int64_t>(vocab.size()) >= options.vocab_size) break;
    vocab.push_back(word);
  }
  return vocab;
}

}  // namespace tessera::data
