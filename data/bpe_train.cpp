// Byte-level BPE training: pair counts kept up to date incrementally (only the words that
// hold the merged pair are revisited), a max-heap of counts with stale entries skipped.
#include <queue>

#include "tessera/core/error.h"
#include "tessera/data/pretokenizer.h"
#include "tessera/data/tokenizer.h"

namespace tessera::data {

namespace {

uint64_t pair_key(uint32_t left, uint32_t right) { return (uint64_t{left} << 32) | right; }

// The corpus as distinct GPT-2 pieces of byte ids, each with how often it occurs.
struct Words {
  std::vector<std::vector<uint32_t>> symbols;
  std::vector<int64_t> freq;
};

Words count_words(std::string_view corpus) {
  const std::string text = replace_invalid_utf8(corpus);
  std::unordered_map<std::string_view, int64_t> piece_counts;
  GptPieces pieces(text);
  for (std::string_view piece; pieces.next(piece);) ++piece_counts[piece];
  Words words;
  words.symbols.reserve(piece_counts.size());
  for (const auto& [piece, count] : piece_counts) {
    std::vector<uint32_t> symbols(piece.size());
    for (size_t i = 0; i < piece.size(); ++i) symbols[i] = static_cast<unsigned char>(piece[i]);
    words.symbols.push_back(std::move(symbols));
    words.freq.push_back(count);
  }
  return words;
}

// Replaces every (left, right) in `sym` by `merged_id`; false when there was none.
bool apply_merge(std::vector<uint32_t>& sym, uint32_t left, uint32_t right, uint32_t merged_id,
                 std::vector<uint32_t>& merged) {
  merged.clear();
  bool changed = false;
  for (size_t i = 0; i < sym.size(); ++i) {
    if (i + 1 < sym.size() && sym[i] == left && sym[i + 1] == right) {
      merged.push_back(merged_id);
      ++i;
      changed = true;
    } else {
      merged.push_back(sym[i]);
    }
  }
  return changed;
}

}  // namespace

BpeTokenizer BpeTokenizer::train(std::string_view corpus, int64_t vocab_size) {
  TESSERA_CHECK(vocab_size >= 256, "BpeTokenizer::train: vocab_size ", vocab_size,
                " is below the 256 byte tokens");
  Words words = count_words(corpus);
  std::vector<std::string> tokens;
  std::unordered_map<std::string, uint32_t> id_of_bytes;
  for (int b = 0; b < 256; ++b) {
    tokens.emplace_back(1, static_cast<char>(b));
    id_of_bytes.emplace(tokens.back(), static_cast<uint32_t>(b));
  }

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> words_with_pair;  // may hold stale entries
  for (uint32_t w = 0; w < words.symbols.size(); ++w) {
    const auto& sym = words.symbols[w];
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      const uint64_t key = pair_key(sym[i], sym[i + 1]);
      pair_count[key] += words.freq[w];
      auto& list = words_with_pair[key];
      if (list.empty() || list.back() != w) list.push_back(w);
    }
  }
  // Max-heap on count, ties to the smaller key; entries whose count is stale are skipped.
  struct Entry {
    int64_t count;
    uint64_t key;
  };
  auto lower_priority = [](const Entry& a, const Entry& b) {
    return a.count < b.count || (a.count == b.count && a.key > b.key);
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(lower_priority)> heap(lower_priority);
  for (const auto& [key, count] : pair_count) heap.push({count, key});

  std::vector<Merge> merges;
  std::vector<uint32_t> visited_in_merge(words.symbols.size(), UINT32_MAX);
  std::unordered_map<uint64_t, int64_t> delta;
  std::vector<uint32_t> merged;
  while (static_cast<int64_t>(tokens.size()) < vocab_size && !heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    auto found = pair_count.find(top.key);
    if (found == pair_count.end() || found->second != top.count) continue;  // stale entry
    if (top.count < 2) break;  // nothing repeats: more merges would not compress
    const uint32_t left = static_cast<uint32_t>(top.key >> 32),
                   right = static_cast<uint32_t>(top.key);
    const auto [it, fresh] =
        id_of_bytes.emplace(tokens[left] + tokens[right], static_cast<uint32_t>(tokens.size()));
    if (fresh) tokens.push_back(it->first);
    const uint32_t new_id = it->second;
    const uint32_t merge_index = static_cast<uint32_t>(merges.size());
    merges.emplace_back(left, right);

    delta.clear();
    std::vector<uint32_t> candidates = std::move(words_with_pair[top.key]);
    words_with_pair.erase(top.key);
    for (uint32_t w : candidates) {
      if (visited_in_merge[w] == merge_index) continue;
      visited_in_merge[w] = merge_index;
      std::vector<uint32_t>& sym = words.symbols[w];
      if (!apply_merge(sym, left, right, new_id, merged)) continue;
      const int64_t f = words.freq[w];
      for (size_t i = 0; i + 1 < sym.size(); ++i) delta[pair_key(sym[i], sym[i + 1])] -= f;
      for (size_t i = 0; i + 1 < merged.size(); ++i) {
        const uint64_t key = pair_key(merged[i], merged[i + 1]);
        delta[key] += f;
        if (merged[i] == new_id || merged[i + 1] == new_id) {
          auto& list = words_with_pair[key];
          if (list.empty() || list.back() != w) list.push_back(w);
        }
      }
      sym.swap(merged);
    }
    for (const auto& [key, d] : delta) {
      if (d == 0) continue;
      int64_t& count = pair_count[key];
      count += d;
      if (count <= 0) {
        pair_count.erase(key);
      } else {
        heap.push({count, key});
      }
    }
  }
  return BpeTokenizer(std::move(tokens), merges);
}

}  // namespace tessera::data
