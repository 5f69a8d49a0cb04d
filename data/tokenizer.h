// Tokenizers: byte-level (ids 0..255 are the bytes) and byte-level BPE trained on
// a corpus. Both map every byte string to ids and back exactly, valid UTF-8 or
// not, because every id stands for a fixed byte string.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tessera::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string type() const = 0;  // "byte" or "bpe"
  virtual int64_t vocab_size() const = 0;
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  // Error naming the id when an id is outside the vocabulary.
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
  // The bytes one id stands for.
  virtual std::string token_bytes(uint32_t id) const = 0;
  // JSON text: {"type": "byte"} or {"type": "bpe", "vocab_size": N, "merges": [[a, b], ...]}.
  virtual std::string to_json() const = 0;
  void save(const std::filesystem::path& path) const;  // atomic write
};

// Reads a tokenizer saved by Tokenizer::save; errors name the file and the key.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& path);
std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& json_text,
                                               const std::string& source_name = "<json>");

class ByteTokenizer final : public Tokenizer {
 public:
  std::string type() const override { return "byte"; }
  int64_t vocab_size() const override { return 256; }
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  std::string token_bytes(uint32_t id) const override;
  std::string to_json() const override;
};

// Byte-level BPE: ids 0..255 are bytes, id 256+i is merges[i] (the concatenation of
// its two parts). Text is first cut into short pieces (a run of letters/digits/other
// punctuation with at most one leading space, or a run of whitespace, at most 64 bytes)
// and merges never cross a piece boundary, which keeps training and encoding fast.
class BpeTokenizer final : public Tokenizer {
 public:
  using Merge = std::pair<uint32_t, uint32_t>;
  explicit BpeTokenizer(std::vector<Merge> merges);

  // Learns up to vocab_size - 256 merges from `corpus` (fewer when no pair occurs twice).
  // Ties between equally frequent pairs go to the smaller (left, right) ids, so training
  // is deterministic.
  static BpeTokenizer train(std::string_view corpus, int64_t vocab_size);

  std::string type() const override { return "bpe"; }
  int64_t vocab_size() const override { return 256 + static_cast<int64_t>(merges_.size()); }
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  std::string token_bytes(uint32_t id) const override;
  std::string to_json() const override;
  const std::vector<Merge>& merges() const { return merges_; }

 private:
  void encode_piece(std::string_view piece, std::vector<uint32_t>& out) const;

  std::vector<Merge> merges_;
  std::vector<std::string> bytes_of_id_;
  std::unordered_map<uint64_t, uint32_t> rank_of_pair_;  // (left << 32 | right) -> merge index
};

// The pre-tokenizer shared by BPE training and encoding (exposed for tests).
std::vector<std::string_view> split_into_pieces(std::string_view text);

}  // namespace tessera::data
