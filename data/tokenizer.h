// Tokenizers: byte-level (ids 0..255 are the bytes), byte-level BPE, the family of
// GPT-2, tiktoken's `gpt2` and Hugging Face's ByteLevel BPE, and WordPiece (BERT's;
// data/wordpiece.h). A BPE tokenizer is trained
// here, read from OpenAI's encoder.json + vocab.bpe, or read from a Hugging Face
// tokenizer.json, and it writes Hugging Face's files (tokenizer.json, vocab.json,
// merges.txt, tokenizer_config.json) so `transformers` and `tokenizers` load it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
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
  virtual std::string type() const = 0;  // "byte", "bpe" or "wordpiece"
  virtual int64_t vocab_size() const = 0;
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  // Error naming the id when an id is outside the vocabulary.
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
  // The bytes one id stands for.
  virtual std::string token_bytes(uint32_t id) const = 0;
  // The text of tokenizer.json.
  virtual std::string to_json() const = 0;
  // Every file this tokenizer is saved as (name -> contents), tokenizer.json included.
  virtual std::map<std::string, std::string> files() const {
    return {{"tokenizer.json", to_json()}};
  }
  void save(const std::filesystem::path& path) const;       // tokenizer.json alone, atomic
  void save_files(const std::filesystem::path& dir) const;  // every file of files()
};

// Reads tokenizer.json: Tessera's byte tokenizer ({"type": "byte"}), a Hugging Face BPE
// tokenizer with a ByteLevel pre-tokenizer, a Hugging Face WordPiece tokenizer (BERT's), or
// Tessera's older {"type": "bpe", "merges"}.
// Errors name the file and the key.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& path);
std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& json_text,
                                               const std::string& source_name = "<json>");
// A tokenizer file, or a folder holding tokenizer.json, vocab.json + merges.txt (Hugging
// Face), encoder.json + vocab.bpe (OpenAI) or BERT's vocab.txt; nullptr when the folder has
// none of them. A tokenizer_config.json beside them names a WordPiece tokenizer's special
// tokens and model_max_length and, for a BertTokenizer (or vocab.txt alone), its
// do_lower_case, strip_accents and tokenize_chinese_chars, as transformers reads it.
std::unique_ptr<Tokenizer> load_tokenizer_from(const std::filesystem::path& file_or_dir);

class ByteTokenizer final : public Tokenizer {
 public:
  std::string type() const override { return "byte"; }
  int64_t vocab_size() const override { return 256; }
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  std::string token_bytes(uint32_t id) const override;
  std::string to_json() const override;
};

// Hugging Face's ByteLevel/BPE switches that change encoding.
struct BpeOptions {
  bool add_prefix_space = false;  // a space is put before text that does not start with one
  bool ignore_merges = false;     // a piece that is a whole token is taken as it is
};

// Byte-level BPE. Text is cut into GPT-2's pieces (data/pretokenizer.h); each piece starts
// as its bytes' tokens and merges apply in rank order (the lowest-ranked adjacent pair
// first, leftmost on ties, as Hugging Face `tokenizers` and tiktoken do) without crossing
// pieces. Invalid UTF-8 is first replaced as Python's decode(errors="replace") does (each
// ill-formed subsequence becomes U+FFFD), because tiktoken and `tokenizers` only ever see
// such decoded text; valid UTF-8 round-trips exactly.
class BpeTokenizer final : public Tokenizer {
 public:
  using Merge = std::pair<uint32_t, uint32_t>;  // (left id, right id); rank = position in the list
  using Options = BpeOptions;

  // `tokens[id]` is the bytes of token id; every single byte must be a token. A merge's
  // result is the token spelling its two parts' bytes. `special` ids (e.g. <|endoftext|>)
  // only come from ids, never from text.
  BpeTokenizer(std::vector<std::string> tokens, const std::vector<Merge>& merges,
               std::vector<uint32_t> special = {}, Options options = {});
  // Tessera's first layout: ids 0..255 are the bytes and 256 + i is merges[i].
  explicit BpeTokenizer(const std::vector<Merge>& merges);

  // Learns merges from `corpus` until the vocabulary has vocab_size tokens (fewer when no
  // pair occurs twice). Ties between equally frequent pairs go to the smaller (left,
  // right) ids, so training is deterministic. A merge whose bytes already are a token
  // reuses that token's id, as Hugging Face's trainer does.
  static BpeTokenizer train(std::string_view corpus, int64_t vocab_size);
  // OpenAI's GPT-2 files (Hugging Face: vocab.json, merges.txt): <|endoftext|> is special.
  static BpeTokenizer from_gpt2_files(const std::filesystem::path& encoder_json,
                                      const std::filesystem::path& vocab_bpe);

  std::string type() const override { return "bpe"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(tokens_.size()); }
  // Large inputs are cut at safe points and encoded on every core (see encode(text, threads)).
  std::vector<uint32_t> encode(std::string_view text) const override;
  // threads = 0: every core for inputs of 1 MiB or more, one thread otherwise. The ids
  // do not depend on the thread count.
  std::vector<uint32_t> encode(std::string_view text, int threads) const;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  std::string token_bytes(uint32_t id) const override;
  std::string to_json() const override;  // Hugging Face tokenizer.json
  std::map<std::string, std::string> files() const override;

  const std::vector<Merge>& merges() const { return merges_; }
  const std::vector<uint32_t>& special_ids() const { return special_; }
  const Options& options() const { return options_; }
  // The id of the token with these bytes (special tokens included), or -1.
  int64_t token_id(std::string_view bytes) const;

  class PieceEncoder;  // per-thread state: merge scratch space and a cache of pieces

 private:
  BpeTokenizer() = default;
  void index();  // fills the lookup tables from tokens_, merges_ and special_
  void encode_chunk(std::string_view text, bool first_chunk, std::vector<uint32_t>& out) const;

  std::vector<std::string> tokens_;
  std::vector<Merge> merges_;
  std::vector<uint32_t> merge_results_;
  std::vector<uint32_t> special_;
  Options options_;
  uint32_t byte_token_[256] = {};
  std::unordered_map<std::string, uint32_t> id_of_bytes_;
  // (left << 32 | right) -> (rank << 32 | result), open addressing, empty key = ~0.
  std::vector<std::pair<uint64_t, uint64_t>> pair_table_;
  uint64_t pair_mask_ = 0;

  friend class PieceEncoder;
};

// GPT-2's byte-level alphabet: byte b <-> the character that stands for it in
// encoder.json/vocab.json/merges.txt (printable bytes stand for themselves, the rest for
// U+0100 onwards in byte order).
std::string bytes_to_alphabet(std::string_view bytes);  // UTF-8 of the alphabet characters
// Error naming `what` when a character is not in the alphabet.
std::string alphabet_to_bytes(std::string_view text, const std::string& what);

}  // namespace tessera::data
