#include "tessera/data/tokenizer.h"

#include <nlohmann/json.hpp>
#include <queue>

#include "tessera/core/error.h"
#include "tessera/data/file_io.h"

namespace tessera::data {

namespace {
constexpr size_t kMaxPieceBytes = 64;

uint64_t pair_key(uint32_t left, uint32_t right) {
  return (static_cast<uint64_t>(left) << 32) | right;
}

enum class ByteClass { Space, Letter, Digit, Other };
ByteClass classify(unsigned char c) {
  if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f') return ByteClass::Space;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80) return ByteClass::Letter;
  if (c >= '0' && c <= '9') return ByteClass::Digit;
  return ByteClass::Other;
}

void check_id(uint32_t id, int64_t vocab_size) {
  TESSERA_CHECK(static_cast<int64_t>(id) < vocab_size, "tokenizer decode: id ", id,
                " is outside the vocabulary of ", vocab_size);
}
}  // namespace

std::vector<std::string_view> split_into_pieces(std::string_view text) {
  std::vector<std::string_view> pieces;
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    size_t j = i;
    const auto at = [&](size_t k) { return classify(static_cast<unsigned char>(text[k])); };
    if (at(i) == ByteClass::Space) {
      if (text[i] == ' ' && i + 1 < n && at(i + 1) != ByteClass::Space) {
        // " word": one leading space joins the run after it (GPT-2 style).
        const ByteClass run = at(i + 1);
        j = i + 1;
        while (j < n && at(j) == run && j - i < kMaxPieceBytes) ++j;
      } else {
        while (j < n && at(j) == ByteClass::Space && j - i < kMaxPieceBytes) ++j;
        // Leave a final ' ' before a non-space for the next piece.
        if (j < n && j - i > 1 && text[j - 1] == ' ' && at(j) != ByteClass::Space) --j;
      }
    } else {
      const ByteClass run = at(i);
      while (j < n && at(j) == run && j - i < kMaxPieceBytes) ++j;
    }
    pieces.push_back(text.substr(i, j - i));
    i = j;
  }
  return pieces;
}

void Tokenizer::save(const std::filesystem::path& path) const { write_file_atomically(path, to_json()); }

// ---- byte-level ----

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    check_id(ids[i], 256);
    out[i] = static_cast<char>(ids[i]);
  }
  return out;
}

std::string ByteTokenizer::token_bytes(uint32_t id) const {
  check_id(id, 256);
  return std::string(1, static_cast<char>(id));
}

std::string ByteTokenizer::to_json() const { return nlohmann::json{{"type", "byte"}}.dump(); }

// ---- byte-level BPE ----

BpeTokenizer::BpeTokenizer(std::vector<Merge> merges) : merges_(std::move(merges)) {
  bytes_of_id_.reserve(256 + merges_.size());
  for (int b = 0; b < 256; ++b) bytes_of_id_.emplace_back(1, static_cast<char>(b));
  for (size_t i = 0; i < merges_.size(); ++i) {
    const auto [left, right] = merges_[i];
    const uint32_t id = static_cast<uint32_t>(256 + i);
    TESSERA_CHECK(left < id && right < id, "BpeTokenizer: merge ", i, " (", left, ", ", right,
                  ") refers to an id not defined before id ", id);
    const bool fresh = rank_of_pair_.emplace(pair_key(left, right), static_cast<uint32_t>(i)).second;
    TESSERA_CHECK(fresh, "BpeTokenizer: merge ", i, " (", left, ", ", right, ") repeats an earlier merge");
    bytes_of_id_.push_back(bytes_of_id_[left] + bytes_of_id_[right]);
  }
}

BpeTokenizer BpeTokenizer::train(std::string_view corpus, int64_t vocab_size) {
  TESSERA_CHECK(vocab_size >= 256, "BpeTokenizer::train: vocab_size ", vocab_size,
                " is below the 256 byte tokens");
  // Distinct pieces with their frequencies: merges are counted once per distinct piece.
  std::unordered_map<std::string_view, int64_t> piece_counts;
  for (std::string_view piece : split_into_pieces(corpus)) ++piece_counts[piece];
  std::vector<std::vector<uint32_t>> words;
  std::vector<int64_t> word_freq;
  words.reserve(piece_counts.size());
  for (const auto& [piece, count] : piece_counts) {
    std::vector<uint32_t> symbols(piece.size());
    for (size_t i = 0; i < piece.size(); ++i) symbols[i] = static_cast<unsigned char>(piece[i]);
    words.push_back(std::move(symbols));
    word_freq.push_back(count);
  }

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> words_with_pair;  // may hold stale entries
  for (uint32_t w = 0; w < words.size(); ++w) {
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t key = pair_key(words[w][i], words[w][i + 1]);
      pair_count[key] += word_freq[w];
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
  std::vector<uint32_t> visited_in_merge(words.size(), UINT32_MAX);
  std::unordered_map<uint64_t, int64_t> delta;
  while (static_cast<int64_t>(256 + merges.size()) < vocab_size && !heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    auto found = pair_count.find(top.key);
    if (found == pair_count.end() || found->second != top.count) continue;  // stale entry
    if (top.count < 2) break;  // nothing repeats: more merges would not compress
    const uint32_t left = static_cast<uint32_t>(top.key >> 32), right = static_cast<uint32_t>(top.key);
    const uint32_t new_id = static_cast<uint32_t>(256 + merges.size());
    const uint32_t merge_index = static_cast<uint32_t>(merges.size());
    merges.emplace_back(left, right);

    delta.clear();
    std::vector<uint32_t> candidates = std::move(words_with_pair[top.key]);
    words_with_pair.erase(top.key);
    for (uint32_t w : candidates) {
      if (visited_in_merge[w] == merge_index) continue;
      visited_in_merge[w] = merge_index;
      std::vector<uint32_t>& sym = words[w];
      std::vector<uint32_t> merged;
      merged.reserve(sym.size());
      bool changed = false;
      for (size_t i = 0; i < sym.size(); ++i) {
        if (i + 1 < sym.size() && sym[i] == left && sym[i + 1] == right) {
          merged.push_back(new_id);
          ++i;
          changed = true;
        } else {
          merged.push_back(sym[i]);
        }
      }
      if (!changed) continue;
      const int64_t f = word_freq[w];
      for (size_t i = 0; i + 1 < sym.size(); ++i) delta[pair_key(sym[i], sym[i + 1])] -= f;
      for (size_t i = 0; i + 1 < merged.size(); ++i) {
        const uint64_t key = pair_key(merged[i], merged[i + 1]);
        delta[key] += f;
        if (merged[i] == new_id || merged[i + 1] == new_id) {
          auto& list = words_with_pair[key];
          if (list.empty() || list.back() != w) list.push_back(w);
        }
      }
      sym = std::move(merged);
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
  return BpeTokenizer(std::move(merges));
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>& out) const {
  std::vector<uint32_t> sym(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) sym[i] = static_cast<unsigned char>(piece[i]);
  // Apply merges in the order they were learned: always the lowest-ranked pair present.
  while (sym.size() > 1) {
    uint32_t best_rank = UINT32_MAX;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = rank_of_pair_.find(pair_key(sym[i], sym[i + 1]));
      if (it != rank_of_pair_.end() && it->second < best_rank) best_rank = it->second;
    }
    if (best_rank == UINT32_MAX) break;
    const auto [left, right] = merges_[best_rank];
    const uint32_t new_id = 256 + best_rank;
    size_t write = 0;
    for (size_t i = 0; i < sym.size(); ++i) {
      if (i + 1 < sym.size() && sym[i] == left && sym[i + 1] == right) {
        sym[write++] = new_id;
        ++i;
      } else {
        sym[write++] = sym[i];
      }
    }
    sym.resize(write);
  }
  out.insert(out.end(), sym.begin(), sym.end());
}

std::vector<uint32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 2);
  std::unordered_map<std::string_view, std::vector<uint32_t>> cache;  // pieces repeat a lot
  for (std::string_view piece : split_into_pieces(text)) {
    auto it = cache.find(piece);
    if (it == cache.end()) {
      std::vector<uint32_t> encoded;
      encode_piece(piece, encoded);
      it = cache.emplace(piece, std::move(encoded)).first;
    }
    ids.insert(ids.end(), it->second.begin(), it->second.end());
  }
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (uint32_t id : ids) {
    check_id(id, vocab_size());
    out += bytes_of_id_[id];
  }
  return out;
}

std::string BpeTokenizer::token_bytes(uint32_t id) const {
  check_id(id, vocab_size());
  return bytes_of_id_[id];
}

std::string BpeTokenizer::to_json() const {
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [left, right] : merges_) merges.push_back({left, right});
  return nlohmann::json{{"type", "bpe"}, {"vocab_size", vocab_size()}, {"merges", merges}}.dump();
}

// ---- loading ----

std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& json_text,
                                               const std::string& source_name) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& e) {
    TESSERA_FAIL("tokenizer '", source_name, "': not valid JSON at byte ", e.byte, ": ", e.what());
  }
  TESSERA_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), "tokenizer '",
                source_name, "': missing string key \"type\" (\"byte\" or \"bpe\")");
  const std::string type = j["type"];
  if (type == "byte") return std::make_unique<ByteTokenizer>();
  TESSERA_CHECK(type == "bpe", "tokenizer '", source_name, "': unknown \"type\" '", type,
                "' (expected \"byte\" or \"bpe\")");
  TESSERA_CHECK(j.contains("merges") && j["merges"].is_array(), "tokenizer '", source_name,
                "': key \"merges\" must be an array of [left, right] pairs");
  std::vector<BpeTokenizer::Merge> merges;
  for (size_t i = 0; i < j["merges"].size(); ++i) {
    const auto& m = j["merges"][i];
    TESSERA_CHECK(m.is_array() && m.size() == 2 && m[0].is_number_unsigned() && m[1].is_number_unsigned(),
                  "tokenizer '", source_name, "': \"merges\"[", i, "] is not a pair of ids");
    merges.emplace_back(m[0].get<uint32_t>(), m[1].get<uint32_t>());
  }
  std::unique_ptr<BpeTokenizer> tok;
  try {
    tok = std::make_unique<BpeTokenizer>(std::move(merges));
  } catch (const Error& e) {
    TESSERA_FAIL("tokenizer '", source_name, "': ", e.what());
  }
  if (j.contains("vocab_size")) {
    TESSERA_CHECK(j["vocab_size"].is_number_integer() && j["vocab_size"].get<int64_t>() == tok->vocab_size(),
                  "tokenizer '", source_name, "': \"vocab_size\" ", j["vocab_size"].dump(),
                  " disagrees with 256 + ", tok->merges().size(), " merges");
  }
  return tok;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& path) {
  return tokenizer_from_json(read_file(path), path.string());
}

}  // namespace tessera::data
