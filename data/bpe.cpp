// Byte-level BPE encoding and decoding (training is in bpe_train.cpp, the file formats in
// tokenizer_files.cpp).
#include <algorithm>
#include <exception>
#include <functional>
#include <queue>
#include <thread>

#include "tessera/core/error.h"
#include "tessera/data/pretokenizer.h"
#include "tessera/data/tokenizer.h"

namespace tessera::data {

namespace {
constexpr uint64_t kNone = ~uint64_t{0};
// Pieces up to this many bytes merge with a linear scan per merge (tiktoken's method,
// O(n^2) but with O(n) table lookups); longer ones (whitespace runs, long words) use a heap.
constexpr size_t kShortPieceBytes = 128;
constexpr size_t kMaxCachedPieceBytes = 256;
constexpr size_t kMaxCacheBytes = size_t{64} << 20;

uint64_t pair_key(uint32_t left, uint32_t right) { return (uint64_t{left} << 32) | right; }
size_t pair_slot(uint64_t key, uint64_t mask) {
  const uint64_t h = key * 0x9E3779B97F4A7C15ull;
  return static_cast<size_t>((h ^ (h >> 29)) & mask);
}
}  // namespace

// ---- construction ----

BpeTokenizer::BpeTokenizer(std::vector<std::string> tokens, const std::vector<Merge>& merges,
                           std::vector<uint32_t> special, Options options)
    : tokens_(std::move(tokens)), merges_(merges), special_(std::move(special)), options_(options) {
  std::sort(special_.begin(), special_.end());
  for (uint32_t id : special_)
    TESSERA_CHECK(id < tokens_.size(), "BpeTokenizer: special token id ", id,
                  " is outside the vocabulary of ", tokens_.size());
  index();
  merge_results_.reserve(merges_.size());
  for (size_t i = 0; i < merges_.size(); ++i) {
    const auto [left, right] = merges_[i];
    TESSERA_CHECK(left < tokens_.size() && right < tokens_.size(), "BpeTokenizer: merge ", i, " (",
                  left, ", ", right, ") refers to an id outside the vocabulary of ",
                  tokens_.size());
    const int64_t result = token_id(tokens_[left] + tokens_[right]);
    TESSERA_CHECK(result >= 0, "BpeTokenizer: merge ", i, " (", left, ", ", right,
                  ") makes bytes that are no token of the vocabulary");
    merge_results_.push_back(static_cast<uint32_t>(result));
  }
  index();
}

BpeTokenizer::BpeTokenizer(const std::vector<Merge>& merges) : merges_(merges) {
  tokens_.reserve(256 + merges_.size());
  for (int b = 0; b < 256; ++b) tokens_.emplace_back(1, static_cast<char>(b));
  for (size_t i = 0; i < merges_.size(); ++i) {
    const auto [left, right] = merges_[i];
    const uint32_t id = static_cast<uint32_t>(256 + i);
    TESSERA_CHECK(left < id && right < id, "BpeTokenizer: merge ", i, " (", left, ", ", right,
                  ") refers to an id not defined before id ", id);
    tokens_.push_back(tokens_[left] + tokens_[right]);
    merge_results_.push_back(id);
  }
  index();
}

void BpeTokenizer::index() {
  id_of_bytes_.clear();
  for (size_t id = 0; id < tokens_.size(); ++id)
    if (!std::binary_search(special_.begin(), special_.end(), id))
      id_of_bytes_.emplace(tokens_[id], static_cast<uint32_t>(id));  // the first id wins
  for (int b = 0; b < 256; ++b) {
    auto it = id_of_bytes_.find(std::string(1, static_cast<char>(b)));
    TESSERA_CHECK(it != id_of_bytes_.end(), "BpeTokenizer: the vocabulary has no token for byte 0x",
                  "0123456789abcdef"[b >> 4], "0123456789abcdef"[b & 15],
                  "; byte-level BPE needs all 256");
    byte_token_[b] = it->second;
  }
  for (uint32_t id : special_) id_of_bytes_.emplace(tokens_[id], id);
  if (merge_results_.size() != merges_.size()) return;  // merges resolved after this call

  uint64_t capacity = 16;
  while (capacity < 2 * merges_.size() + 16) capacity *= 2;
  pair_table_.assign(capacity, {kNone, kNone});
  pair_mask_ = capacity - 1;
  for (size_t i = 0; i < merges_.size(); ++i) {
    const uint64_t key = pair_key(merges_[i].first, merges_[i].second);
    size_t slot = pair_slot(key, pair_mask_);
    while (pair_table_[slot].first != kNone) {
      TESSERA_CHECK(pair_table_[slot].first != key, "BpeTokenizer: merge ", i, " (",
                    merges_[i].first, ", ", merges_[i].second, ") repeats an earlier merge");
      slot = (slot + 1) & pair_mask_;
    }
    pair_table_[slot] = {key, (uint64_t{i} << 32) | merge_results_[i]};
  }
}

int64_t BpeTokenizer::token_id(std::string_view bytes) const {
  auto it = id_of_bytes_.find(std::string(bytes));
  return it == id_of_bytes_.end() ? -1 : static_cast<int64_t>(it->second);
}

// ---- encoding one piece ----

class BpeTokenizer::PieceEncoder {
 public:
  explicit PieceEncoder(const BpeTokenizer& tok) : tok_(tok) { slots_.resize(1 << 12); }

  void encode(std::string_view piece, std::vector<uint32_t>& out) {
    if (piece.size() == 1) {
      out.push_back(tok_.byte_token_[static_cast<unsigned char>(piece[0])]);
      return;
    }
    if (tok_.options_.ignore_merges) {
      const int64_t whole = tok_.token_id(piece);
      if (whole >= 0 && !std::binary_search(tok_.special_.begin(), tok_.special_.end(), whole)) {
        out.push_back(static_cast<uint32_t>(whole));
        return;
      }
    }
    if (piece.size() > kMaxCachedPieceBytes) {
      merge(piece);
      out.insert(out.end(), symbols_.begin(), symbols_.end());
      return;
    }
    const uint64_t hash = std::hash<std::string_view>{}(piece);
    size_t slot = hash & (slots_.size() - 1);
    for (; slots_[slot].key_size != 0; slot = (slot + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[slot];
      if (s.hash == hash && std::string_view(keys_).substr(s.key_offset, s.key_size) == piece) {
        out.insert(out.end(), ids_.begin() + s.ids_offset,
                   ids_.begin() + s.ids_offset + s.ids_size);
        return;
      }
    }
    merge(piece);
    out.insert(out.end(), symbols_.begin(), symbols_.end());
    remember(slot, hash, piece);
  }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_offset = 0, key_size = 0, ids_offset = 0, ids_size = 0;  // key_size 0: empty
  };

  uint64_t lookup(uint32_t left, uint32_t right) const {
    const uint64_t key = pair_key(left, right);
    for (size_t slot = pair_slot(key, tok_.pair_mask_);; slot = (slot + 1) & tok_.pair_mask_) {
      const auto& entry = tok_.pair_table_[slot];
      if (entry.first == key) return entry.second;
      if (entry.first == kNone) return kNone;
    }
  }

  void merge(std::string_view piece) {
    symbols_.resize(piece.size());
    for (size_t i = 0; i < piece.size(); ++i)
      symbols_[i] = tok_.byte_token_[static_cast<unsigned char>(piece[i])];
    if (tok_.merges_.empty()) return;
    if (piece.size() <= kShortPieceBytes)
      merge_by_scanning();
    else
      merge_with_heap();
  }

  // ranks_[k] holds the (rank << 32 | result) of the pair (symbols_[k], symbols_[k + 1]);
  // each step merges the first pair of the lowest rank and refreshes its two neighbours.
  void merge_by_scanning() {
    ranks_.resize(symbols_.size() - 1);
    for (size_t k = 0; k + 1 < symbols_.size(); ++k)
      ranks_[k] = lookup(symbols_[k], symbols_[k + 1]);
    while (!ranks_.empty()) {
      const size_t k =
          static_cast<size_t>(std::min_element(ranks_.begin(), ranks_.end()) - ranks_.begin());
      if (ranks_[k] == kNone) break;
      symbols_[k] = static_cast<uint32_t>(ranks_[k]);
      symbols_.erase(symbols_.begin() + static_cast<std::ptrdiff_t>(k) + 1);
      ranks_.erase(ranks_.begin() + static_cast<std::ptrdiff_t>(k));
      if (k + 1 < symbols_.size()) ranks_[k] = lookup(symbols_[k], symbols_[k + 1]);
      if (k > 0) ranks_[k - 1] = lookup(symbols_[k - 1], symbols_[k]);
    }
  }

  // The same merge order (lowest rank, then leftmost) for long pieces: a linked list of
  // symbols and a min-heap of candidate pairs; a pair's entry is stale once the version of
  // its left symbol changed (its id or its right neighbour changed, or it was merged away).
  void merge_with_heap() {
    const uint32_t n = static_cast<uint32_t>(symbols_.size()), end = n;
    next_.resize(n);
    prev_.resize(n);
    version_.assign(n, 0);
    struct Candidate {
      uint64_t rank_and_position;
      uint32_t version;
      bool operator>(const Candidate& o) const { return rank_and_position > o.rank_and_position; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    const auto consider = [&](uint32_t i) {
      const uint64_t found = lookup(symbols_[i], symbols_[next_[i]]);
      if (found != kNone) heap.push({(found >> 32) << 32 | i, version_[i]});
    };
    for (uint32_t i = 0; i < n; ++i) next_[i] = i + 1, prev_[i] = i == 0 ? end : i - 1;
    for (uint32_t i = 0; i + 1 < n; ++i) consider(i);
    while (!heap.empty()) {
      const Candidate top = heap.top();
      heap.pop();
      const uint32_t i = static_cast<uint32_t>(top.rank_and_position);
      if (top.version != version_[i]) continue;
      const uint32_t j = next_[i];
      symbols_[i] = static_cast<uint32_t>(lookup(symbols_[i], symbols_[j]));
      next_[i] = next_[j];
      if (next_[j] != end) prev_[next_[j]] = i;
      ++version_[j];
      ++version_[i];
      if (next_[i] != end) consider(i);
      if (prev_[i] != end) {
        ++version_[prev_[i]];
        consider(prev_[i]);
      }
    }
    size_t write = 0;
    for (uint32_t i = 0; i != end; i = next_[i]) symbols_[write++] = symbols_[i];
    symbols_.resize(write);
  }

  void remember(size_t slot, uint64_t hash, std::string_view piece) {
    if (keys_.size() + piece.size() > kMaxCacheBytes) {  // bound memory on huge inputs
      std::fill(slots_.begin(), slots_.end(), Slot{});
      keys_.clear();
      ids_.clear();
      used_ = 0;
      slot = hash & (slots_.size() - 1);
    }
    slots_[slot] = {hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(piece.size()),
                    static_cast<uint32_t>(ids_.size()), static_cast<uint32_t>(symbols_.size())};
    keys_.append(piece);
    ids_.insert(ids_.end(), symbols_.begin(), symbols_.end());
    if (++used_ * 2 > slots_.size()) grow();
  }

  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.key_size == 0) continue;
      size_t slot = s.hash & (slots_.size() - 1);
      while (slots_[slot].key_size != 0) slot = (slot + 1) & (slots_.size() - 1);
      slots_[slot] = s;
    }
  }

  const BpeTokenizer& tok_;
  std::vector<uint32_t> symbols_, next_, prev_, version_;
  std::vector<uint64_t> ranks_;
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<uint32_t> ids_;
  size_t used_ = 0;
};

// ---- encoding text ----

void BpeTokenizer::encode_chunk(std::string_view text, bool first_chunk,
                                std::vector<uint32_t>& out) const {
  std::string fixed;
  if (find_invalid_utf8(text) != std::string_view::npos) {
    fixed = replace_invalid_utf8(text);
    text = fixed;
  }
  if (first_chunk && options_.add_prefix_space && !text.empty() && text[0] != ' ') {
    std::string prefixed(1, ' ');
    prefixed.append(text);  // `text` may view `fixed`, so build apart and then move
    fixed = std::move(prefixed);
    text = fixed;
  }
  PieceEncoder encoder(*this);
  GptPieces pieces(text);
  for (std::string_view piece; pieces.next(piece);) encoder.encode(piece, out);
}

std::vector<uint32_t> BpeTokenizer::encode(std::string_view text) const { return encode(text, 0); }

std::vector<uint32_t> BpeTokenizer::encode(std::string_view text, int threads) const {
  if (threads <= 0)
    threads = text.size() >= (size_t{1} << 20)
                  ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))
                  : 1;
  std::vector<size_t> bounds = safe_cut_points(text, static_cast<size_t>(threads));
  bounds.insert(bounds.begin(), 0);
  bounds.push_back(text.size());
  const size_t chunks = bounds.size() - 1;
  std::vector<uint32_t> ids;
  if (chunks == 1) {
    ids.reserve(text.size() / 3);
    encode_chunk(text, true, ids);
    return ids;
  }
  std::vector<std::vector<uint32_t>> parts(chunks);
  std::vector<std::exception_ptr> errors(chunks);
  std::vector<std::thread> workers;
  for (size_t c = 0; c < chunks; ++c) {
    workers.emplace_back([&, c] {
      try {
        const std::string_view chunk = text.substr(bounds[c], bounds[c + 1] - bounds[c]);
        parts[c].reserve(chunk.size() / 3);
        encode_chunk(chunk, c == 0, parts[c]);
      } catch (...) {
        errors[c] = std::current_exception();
      }
    });
  }
  for (auto& w : workers) w.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  ids.reserve(total);
  for (const auto& p : parts) ids.insert(ids.end(), p.begin(), p.end());
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (uint32_t id : ids) {
    TESSERA_CHECK(id < tokens_.size(), "tokenizer decode: id ", id,
                  " is outside the vocabulary of ", tokens_.size());
    out += tokens_[id];
  }
  return out;
}

std::string BpeTokenizer::token_bytes(uint32_t id) const {
  TESSERA_CHECK(id < tokens_.size(), "tokenizer decode: id ", id, " is outside the vocabulary of ",
                tokens_.size());
  return tokens_[id];
}

}  // namespace tessera::data
