// WordPiece tokenizers (BERT, DistilBERT) as Hugging Face `tokenizers` defines them: the
// BertNormalizer and BertPreTokenizer (data/bert_normalizer.h), the WordPiece model (greedy
// longest-match-first, continuation pieces prefixed "##", a word of more than
// max_input_chars_per_word characters or with no spelling in pieces is the unknown token),
// a TemplateProcessing/BertProcessing post-processor ([CLS] A [SEP], [CLS] A [SEP] B [SEP]
// with token_type_ids 0/1) and the WordPiece decoder. Read from a Hugging Face
// tokenizer.json or from BERT's vocab.txt (+ tokenizer_config.json); written as both, so
// transformers.BertTokenizerFast.from_pretrained(folder) loads what Tessera saves.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tessera/data/bert_normalizer.h"
#include "tessera/data/tokenizer.h"

namespace tessera::data {

// Hugging Face's truncation strategies (transformers' `truncation=` names).
enum class TruncationStrategy { LongestFirst, OnlyFirst, OnlySecond };
// transformers' `padding=`: False, "longest" (True), "max_length".
enum class PaddingStrategy { DoNotPad, Longest, MaxLength };
enum class Side { Right, Left };

TruncationStrategy parse_truncation_strategy(const std::string& name);  // "longest_first", ...
PaddingStrategy parse_padding_strategy(const std::string& name);    // "do_not_pad", "longest", ...
Side parse_side(const std::string& name, const std::string& what);  // "right" / "left"

// How a text (or a pair) becomes an Encoding; transformers' __call__ arguments.
struct EncodeOptions {
  bool add_special_tokens = true;
  bool truncation = false;
  TruncationStrategy truncation_strategy = TruncationStrategy::LongestFirst;
  // With truncation or padding to max_length: the length with the special tokens. 0: the
  // tokenizer's model_max_length (none: no truncation; padding to max_length is an error).
  size_t max_length = 0;
  PaddingStrategy padding = PaddingStrategy::DoNotPad;
  size_t pad_to_multiple_of = 0;  // 0: no rounding
  Side truncation_side = Side::Right;
  Side padding_side = Side::Right;
};

// What a collator needs of one encoded text or pair; all vectors have one entry per token.
struct Encoding {
  std::vector<uint32_t> input_ids;
  std::vector<uint32_t> token_type_ids;
  std::vector<uint32_t> attention_mask;       // 0 for padding
  std::vector<uint32_t> special_tokens_mask;  // 1 for tokens the post-processor or padding added
};

// A token matched in the text before normalization or pre-tokenization (the special tokens;
// Hugging Face's "added_tokens").
struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool special = true;
  bool normalized = false;  // matched in the normalized text rather than the raw text
  bool lstrip = false;      // the match takes the white space on its left
  bool rstrip = false;      // ... and on its right
};

// TemplateProcessing: what goes around the sequences. A piece is $A, $B or a special token.
struct TemplatePiece {
  enum Kind { SequenceA, SequenceB, SpecialToken } kind = SequenceA;
  std::string special;  // the special token's name (a key of special_tokens)
  uint32_t type_id = 0;
};
struct PostProcessorTemplate {
  std::vector<TemplatePiece> single, pair;
  // A special token's name -> the tokens it stands for (their ids come from the vocabulary).
  std::map<std::string, std::vector<std::string>> special_tokens;
  bool empty() const { return single.empty() && pair.empty(); }  // none: "$A" / "$A $B:1"
};

// Everything that defines a WordPiece tokenizer (what tokenizer.json holds).
struct WordPieceConfig {
  std::vector<std::string> vocab;  // the model's vocabulary, id -> token
  std::string unk_token = "[UNK]";
  std::string continuing_subword_prefix = "##";
  size_t max_input_chars_per_word = 100;
  std::optional<BertNormalizerOptions> normalizer = BertNormalizerOptions{};  // unset: none
  PostProcessorTemplate post_processor;
  std::vector<AddedToken> added_tokens;  // ids beyond the vocabulary extend it
  // The WordPiece decoder's prefix (unset: no decoder, tokens are joined by spaces) and cleanup.
  std::optional<std::string> decoder_prefix = "##";
  bool decoder_cleanup = true;
  // The roles transformers gives tokens (tokenizer_config.json's cls_token, ...): role -> token.
  std::map<std::string, std::string> roles;
  size_t model_max_length = 0;      // 0: none
  std::string source = "<config>";  // named in errors
};

class WordPieceTokenizer final : public Tokenizer {
 public:
  // Checks the configuration (the unknown token and every special token of the template
  // must be in the vocabulary), naming config.source and the key.
  explicit WordPieceTokenizer(WordPieceConfig config);

  // BERT's layout over a vocabulary, as transformers' BertTokenizer builds it: [PAD] [UNK]
  // [CLS] [SEP] [MASK] (those present) are special, the template is "[CLS] $A [SEP]" /
  // "[CLS] $A [SEP] $B [SEP]", accents are stripped when lowercasing.
  static WordPieceConfig bert_config(std::vector<std::string> vocab, bool lowercase);
  // vocab.txt (one token a line, the line number is its id) and, when given, a
  // tokenizer_config.json (do_lower_case, strip_accents, tokenize_chinese_chars, the
  // *_token names, model_max_length). Without one, do_lower_case is true as in transformers.
  static WordPieceTokenizer from_vocab_file(
      const std::filesystem::path& vocab_txt,
      const std::optional<std::filesystem::path>& tokenizer_config_json = std::nullopt);

  std::string type() const override { return "wordpiece"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(tokens_.size()); }
  // The model's tokens without the post-processor's ([CLS] ... [SEP] are not added): what a
  // token file holds.
  std::vector<uint32_t> encode(std::string_view text) const override;
  Encoding encode(std::string_view text, const EncodeOptions& options) const;
  Encoding encode_pair(std::string_view text, std::string_view pair,
                       const EncodeOptions& options) const;
  // `pairs` empty, or one second text per text. Padding "longest" pads to the batch's longest.
  std::vector<Encoding> encode_batch(const std::vector<std::string>& texts,
                                     const std::vector<std::string>& pairs,
                                     const EncodeOptions& options) const;

  // The WordPiece decoder: "##" pieces join the token before them, other tokens are
  // separated by a space (and with `cleanup`, " ." becomes "." and so on, as Hugging Face's).
  std::string decode(const std::vector<uint32_t>& ids) const override { return decode(ids, false); }
  std::string decode(const std::vector<uint32_t>& ids, bool skip_special_tokens) const;
  std::string token_bytes(uint32_t id) const override;  // the token's text ("##ing")
  std::string to_json() const override;                 // Hugging Face tokenizer.json
  // tokenizer.json, vocab.txt, tokenizer_config.json, special_tokens_map.json.
  std::map<std::string, std::string> files() const override;

  const WordPieceConfig& config() const { return config_; }
  std::optional<uint32_t> token_to_id(std::string_view token) const;
  // The id of the token transformers knows by this role ("cls_token", "sep_token",
  // "pad_token", "unk_token", "mask_token"), if the tokenizer has one.
  std::optional<uint32_t> role_id(const std::string& role) const;
  std::optional<std::string> role_token(const std::string& role) const;
  // How many tokens the post-processor adds to one text (pair = false) or a pair.
  size_t num_special_tokens_to_add(bool pair) const;

 private:
  struct Segment {  // a stretch of text, or an added token found in it
    std::string_view text;
    int64_t added_id = -1;
  };
  void encode_sequence(std::string_view text, std::vector<uint32_t>& ids) const;
  void encode_normalized(std::string_view normalized, std::vector<uint32_t>& ids) const;
  void encode_word(std::string_view word, std::vector<uint32_t>& ids, std::string& scratch) const;
  std::vector<Segment> split_on_added_tokens(std::string_view text, bool normalized) const;
  Encoding post_process(std::vector<uint32_t> a, std::optional<std::vector<uint32_t>> b,
                        const EncodeOptions& options) const;
  Encoding encode_one(std::string_view text, const std::string_view* pair,
                      const EncodeOptions& options) const;
  size_t resolved_max_length(const EncodeOptions& options, bool for_padding) const;
  void check_options(const EncodeOptions& options) const;
  void pad(Encoding& e, size_t length, const EncodeOptions& options) const;

  WordPieceConfig config_;
  std::vector<std::string> tokens_;  // id -> token: the vocabulary, then added tokens beyond it
  std::unordered_map<std::string, uint32_t> vocab_ids_;  // the model's vocabulary only
  std::vector<bool> special_;                            // id -> an added special token
  uint32_t unk_id_ = 0;
  std::map<std::string, std::vector<uint32_t>> special_ids_;  // the template's, resolved
  // Indices into config_.added_tokens matched in the raw / normalized text, longest first.
  std::vector<size_t> raw_added_, normalized_added_;
};

}  // namespace tessera::data
