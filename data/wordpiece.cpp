// The WordPiece model, the post-processor, truncation, padding and the decoder, each as
// Hugging Face `tokenizers` 0.20.3 does it (tokenizer.json reading and writing:
// wordpiece_files.cpp).
#include "tessera/data/wordpiece.h"

#include <algorithm>

#include "tessera/core/error.h"
#include "tessera/data/pretokenizer.h"

namespace tessera::data {

namespace {

bool is_continuation_byte(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

size_t count_chars(std::string_view s) {
  return static_cast<size_t>(
      std::count_if(s.begin(), s.end(), [](char c) { return !is_continuation_byte(c); }));
}

void keep_first(std::vector<uint32_t>& ids, size_t n, Side side) {
  if (ids.size() <= n) return;
  if (side == Side::Right)
    ids.resize(n);
  else
    ids.erase(ids.begin(), ids.end() - static_cast<ptrdiff_t>(n));
}

// tokenizers' truncate_encodings: `max_length` is what the sequences may keep, the special
// tokens already taken off.
void truncate(std::vector<uint32_t>& a, std::vector<uint32_t>* b, size_t max_length,
              const EncodeOptions& options) {
  const Side side = options.truncation_side;
  if (max_length == 0) {
    a.clear();
    if (b) b->clear();
    return;
  }
  const size_t total = a.size() + (b ? b->size() : 0);
  if (total <= max_length) return;
  const size_t to_remove = total - max_length;
  if (options.truncation_strategy == TruncationStrategy::LongestFirst) {
    if (!b) return keep_first(a, max_length, side);
    // The shorter keeps all it can; when both are too long they share max_length.
    size_t n1 = a.size(), n2 = b->size();
    const bool swapped = n1 > n2;
    if (swapped) std::swap(n1, n2);
    n2 = n1 > max_length ? n1 : std::max(n1, max_length - n1);
    if (n1 + n2 > max_length) {
      n1 = max_length / 2;
      n2 = n1 + max_length % 2;
    }
    if (swapped) std::swap(n1, n2);
    keep_first(a, n1, side);
    keep_first(*b, n2, side);
    return;
  }
  const bool first = options.truncation_strategy == TruncationStrategy::OnlyFirst;
  std::vector<uint32_t>* target = first ? &a : b;
  TESSERA_CHECK(target != nullptr, "truncation 'only_second' needs a second text (text_pair)");
  TESSERA_CHECK(target->size() > to_remove, "truncation '", first ? "only_first" : "only_second",
                "': the ", first ? "first" : "second", " text has ", target->size(),
                " tokens, too few to remove the ", to_remove, " that max_length asks for");
  keep_first(*target, target->size() - to_remove, side);
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
}

// The WordPiece decoder's cleanup, applied to each token as `tokenizers` applies it.
void clean_up(std::string& token) {
  static const std::pair<std::string_view, std::string_view> kReplacements[] = {
      {" .", "."},   {" ?", "?"},     {" !", "!"},     {" ,", ","},
      {" ' ", "'"},  {" n't", "n't"}, {" 'm", "'m"},   {" do not", " don't"},
      {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"},
  };
  for (const auto& [from, to] : kReplacements) replace_all(token, from, to);
}

// The code point that ends just before byte `end` of valid UTF-8, and where it starts.
char32_t code_point_before(std::string_view text, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && is_continuation_byte(text[start])) --start;
  size_t length = 0;
  return decode_utf8_at(text, start, length);
}

template <typename Choice>
Choice parse_choice(const std::string& name,
                    std::initializer_list<std::pair<const char*, Choice>> choices,
                    const std::string& what) {
  std::string expected;
  for (const auto& [spelling, choice] : choices) {
    if (name == spelling) return choice;
    expected += (expected.empty() ? "\"" : ", \"") + std::string(spelling) + "\"";
  }
  TESSERA_FAIL(what, " '", name, "' is not one of ", expected);
}

}  // namespace

TruncationStrategy parse_truncation_strategy(const std::string& name) {
  return parse_choice<TruncationStrategy>(name,
                                          {{"longest_first", TruncationStrategy::LongestFirst},
                                           {"only_first", TruncationStrategy::OnlyFirst},
                                           {"only_second", TruncationStrategy::OnlySecond}},
                                          "truncation");
}

PaddingStrategy parse_padding_strategy(const std::string& name) {
  return parse_choice<PaddingStrategy>(name,
                                       {{"do_not_pad", PaddingStrategy::DoNotPad},
                                        {"longest", PaddingStrategy::Longest},
                                        {"max_length", PaddingStrategy::MaxLength}},
                                       "padding");
}

Side parse_side(const std::string& name, const std::string& what) {
  return parse_choice<Side>(name, {{"right", Side::Right}, {"left", Side::Left}}, what);
}

WordPieceTokenizer::WordPieceTokenizer(WordPieceConfig config) : config_(std::move(config)) {
  const std::string where = "tokenizer '" + config_.source + "': ";
  tokens_ = config_.vocab;
  for (uint32_t id = 0; id < tokens_.size(); ++id) {
    const auto [seen, fresh] = vocab_ids_.emplace(tokens_[id], id);
    TESSERA_CHECK(fresh, where, "model.vocab gives '", tokens_[id], "' two ids, ", seen->second,
                  " and ", id);
  }
  const auto unk = vocab_ids_.find(config_.unk_token);
  TESSERA_CHECK(unk != vocab_ids_.end(), where, "model.unk_token '", config_.unk_token,
                "' is not in model.vocab");
  unk_id_ = unk->second;
  std::vector<const AddedToken*> beyond;  // added tokens that extend the vocabulary
  for (const AddedToken& t : config_.added_tokens) {
    TESSERA_CHECK(!t.content.empty(), where, "added_tokens entry with id ", t.id, " is empty");
    if (t.id < tokens_.size())
      TESSERA_CHECK(tokens_[t.id] == t.content, where, "added_tokens entry '", t.content,
                    "' has id ", t.id, ", which model.vocab gives to '", tokens_[t.id], "'");
    else
      beyond.push_back(&t);
  }
  std::sort(beyond.begin(), beyond.end(), [](auto* x, auto* y) { return x->id < y->id; });
  for (const AddedToken* t : beyond) {
    TESSERA_CHECK(t->id == tokens_.size(), where, "added_tokens entry '", t->content, "' has id ",
                  t->id, "; ids must continue the vocabulary (next is ", tokens_.size(), ")");
    tokens_.push_back(t->content);
  }
  special_.assign(tokens_.size(), false);
  for (size_t i = 0; i < config_.added_tokens.size(); ++i) {
    const AddedToken& t = config_.added_tokens[i];
    special_[t.id] = t.special;
    (t.normalized ? normalized_added_ : raw_added_).push_back(i);
  }
  for (auto* list : {&raw_added_, &normalized_added_})
    std::stable_sort(list->begin(), list->end(), [&](size_t x, size_t y) {
      return config_.added_tokens[x].content.size() > config_.added_tokens[y].content.size();
    });
  for (const auto& [name, tokens] : config_.post_processor.special_tokens) {
    special_ids_[name];  // defined even when it stands for no token
    for (const std::string& token : tokens) {
      const std::optional<uint32_t> id = token_to_id(token);
      TESSERA_CHECK(id.has_value(), where, "post_processor.special_tokens '", name,
                    "': the template needs '", token, "', which is not in model.vocab");
      special_ids_[name].push_back(*id);
    }
  }
  for (const auto* pieces : {&config_.post_processor.single, &config_.post_processor.pair})
    for (const TemplatePiece& piece : *pieces)
      TESSERA_CHECK(piece.kind != TemplatePiece::SpecialToken || special_ids_.count(piece.special),
                    where, "post_processor: the template names '", piece.special,
                    "', which post_processor.special_tokens does not define");
}

std::optional<uint32_t> WordPieceTokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& t : config_.added_tokens)
    if (t.content == token) return t.id;
  const auto it = vocab_ids_.find(std::string(token));
  if (it == vocab_ids_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> WordPieceTokenizer::role_token(const std::string& role) const {
  const auto it = config_.roles.find(role);
  if (it == config_.roles.end()) return std::nullopt;
  return it->second;
}

std::optional<uint32_t> WordPieceTokenizer::role_id(const std::string& role) const {
  const std::optional<std::string> token = role_token(role);
  return token ? token_to_id(*token) : std::nullopt;
}

size_t WordPieceTokenizer::num_special_tokens_to_add(bool pair) const {
  size_t n = 0;
  for (const TemplatePiece& piece :
       pair ? config_.post_processor.pair : config_.post_processor.single)
    if (piece.kind == TemplatePiece::SpecialToken) n += special_ids_.at(piece.special).size();
  return n;
}

// Leftmost-longest matches of the added tokens (those matched in raw or in normalized
// text), as `tokenizers`' AddedVocabulary splits text before normalizing it.
std::vector<WordPieceTokenizer::Segment> WordPieceTokenizer::split_on_added_tokens(
    std::string_view text, bool normalized) const {
  const std::vector<size_t>& candidates = normalized ? normalized_added_ : raw_added_;
  if (candidates.empty()) return {{text}};
  std::vector<Segment> segments;
  size_t done = 0;  // text before this is in segments
  for (size_t i = 0; i < text.size(); ++i) {
    const AddedToken* match = nullptr;
    for (size_t k : candidates)
      if (text.substr(i).starts_with(config_.added_tokens[k].content)) {
        match = &config_.added_tokens[k];
        break;
      }
    if (!match) continue;
    size_t start = i, end = i + match->content.size(), before = 0;
    while (match->lstrip && start > done &&
           is_bert_whitespace(code_point_before(text, start, before)))
      start = before;
    for (size_t length = 0; match->rstrip && end < text.size() &&
                            is_bert_whitespace(decode_utf8_at(text, end, length));)
      end += length;
    if (start > done) segments.push_back({text.substr(done, start - done)});
    segments.push_back({text.substr(start, end - start), match->id});
    done = end;
    i = end - 1;
  }
  if (done < text.size()) segments.push_back({text.substr(done)});
  return segments;
}

void WordPieceTokenizer::encode_word(std::string_view word, std::vector<uint32_t>& ids,
                                     std::string& piece) const {
  const size_t first = ids.size();
  if (count_chars(word) <= config_.max_input_chars_per_word) {
    for (size_t start = 0; start < word.size();) {
      size_t end = word.size();
      bool found = false;
      for (; start < end && !found;) {  // the longest piece in the vocabulary wins
        piece.assign(start > 0 ? config_.continuing_subword_prefix : "");
        piece.append(word.substr(start, end - start));
        const auto it = vocab_ids_.find(piece);
        if (it != vocab_ids_.end()) {
          ids.push_back(it->second);
          found = true;
        } else {
          do --end;
          while (end > start && is_continuation_byte(word[end]));
        }
      }
      if (!found) break;
      start = end;
      if (start == word.size()) return;
    }
  }
  ids.resize(first);  // too long, or some part has no piece: the whole word is unknown
  ids.push_back(unk_id_);
}

void WordPieceTokenizer::encode_normalized(std::string_view normalized,
                                           std::vector<uint32_t>& ids) const {
  std::vector<std::string_view> words;
  std::string piece;
  for (const Segment& segment : split_on_added_tokens(normalized, true)) {
    if (segment.added_id >= 0) {
      ids.push_back(static_cast<uint32_t>(segment.added_id));
      continue;
    }
    words.clear();
    bert_pre_tokenize(segment.text, words);
    for (std::string_view word : words) encode_word(word, ids, piece);
  }
}

void WordPieceTokenizer::encode_sequence(std::string_view text, std::vector<uint32_t>& ids) const {
  std::string repaired;
  if (find_invalid_utf8(text) != std::string_view::npos) {
    repaired = replace_invalid_utf8(text);
    text = repaired;
  }
  for (const Segment& segment : split_on_added_tokens(text, false)) {
    if (segment.added_id >= 0)
      ids.push_back(static_cast<uint32_t>(segment.added_id));
    else if (config_.normalizer)
      encode_normalized(bert_normalize(segment.text, *config_.normalizer), ids);
    else
      encode_normalized(segment.text, ids);
  }
}

std::vector<uint32_t> WordPieceTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  encode_sequence(text, ids);
  return ids;
}

size_t WordPieceTokenizer::resolved_max_length(const EncodeOptions& options,
                                               bool for_padding) const {
  const size_t max_length = options.max_length ? options.max_length : config_.model_max_length;
  TESSERA_CHECK(!for_padding || max_length > 0,
                "padding 'max_length' needs max_length (tokenizer '", config_.source,
                "' has no model_max_length)");
  return max_length;
}

Encoding WordPieceTokenizer::post_process(std::vector<uint32_t> a,
                                          std::optional<std::vector<uint32_t>> b,
                                          const EncodeOptions& options) const {
  const bool pair = b.has_value();
  if (options.truncation) {
    if (const size_t max_length = resolved_max_length(options, false); max_length > 0) {
      const size_t added = options.add_special_tokens ? num_special_tokens_to_add(pair) : 0;
      TESSERA_CHECK(max_length >= added, "max_length ", max_length, " leaves no room for the ",
                    added, " special tokens of tokenizer '", config_.source, "'");
      truncate(a, pair ? &*b : nullptr, max_length - added, options);
    }
  }
  static const std::vector<TemplatePiece> kSingle = {{TemplatePiece::SequenceA, "", 0}},
                                          kPair = {{TemplatePiece::SequenceA, "", 0},
                                                   {TemplatePiece::SequenceB, "", 1}};
  const PostProcessorTemplate& tpl = config_.post_processor;
  const std::vector<TemplatePiece>& pieces =
      tpl.empty() ? (pair ? kPair : kSingle) : (pair ? tpl.pair : tpl.single);
  Encoding e;
  const auto append = [&](const std::vector<uint32_t>& ids, uint32_t type_id, uint32_t special) {
    e.input_ids.insert(e.input_ids.end(), ids.begin(), ids.end());
    e.token_type_ids.insert(e.token_type_ids.end(), ids.size(), type_id);
    e.attention_mask.insert(e.attention_mask.end(), ids.size(), 1);
    e.special_tokens_mask.insert(e.special_tokens_mask.end(), ids.size(), special);
  };
  for (const TemplatePiece& piece : pieces) {
    if (piece.kind == TemplatePiece::SpecialToken) {
      if (options.add_special_tokens) append(special_ids_.at(piece.special), piece.type_id, 1);
    } else if (piece.kind == TemplatePiece::SequenceA || pair) {
      append(piece.kind == TemplatePiece::SequenceA ? a : *b, piece.type_id, 0);
    }
  }
  if (options.padding == PaddingStrategy::MaxLength)
    pad(e, resolved_max_length(options, true), options);
  else if (options.padding == PaddingStrategy::Longest)
    pad(e, e.input_ids.size(), options);
  return e;
}

void WordPieceTokenizer::pad(Encoding& e, size_t length, const EncodeOptions& options) const {
  if (const size_t m = options.pad_to_multiple_of; m > 0 && length % m != 0)
    length += m - length % m;
  if (e.input_ids.size() >= length) return;
  const std::optional<uint32_t> pad_id = role_id("pad_token");
  TESSERA_CHECK(pad_id.has_value(), "padding: tokenizer '", config_.source,
                "' has no pad_token in its vocabulary");
  const size_t n = length - e.input_ids.size();
  const auto extend = [&](std::vector<uint32_t>& v, uint32_t value) {
    v.insert(options.padding_side == Side::Right ? v.end() : v.begin(), n, value);
  };
  extend(e.input_ids, *pad_id);
  extend(e.token_type_ids, 0);
  extend(e.attention_mask, 0);
  extend(e.special_tokens_mask, 1);
}

// transformers refuses a truncation length that padding would round up past.
void WordPieceTokenizer::check_options(const EncodeOptions& options) const {
  const size_t max_length = resolved_max_length(options, false),
               multiple = options.pad_to_multiple_of;
  TESSERA_CHECK(!options.truncation || options.padding == PaddingStrategy::DoNotPad ||
                    multiple == 0 || max_length == 0 || max_length % multiple == 0,
                "truncation and padding: max_length ", max_length,
                " is not a multiple of pad_to_multiple_of ", multiple);
}

Encoding WordPieceTokenizer::encode_one(std::string_view text, const std::string_view* pair,
                                        const EncodeOptions& options) const {
  check_options(options);
  std::vector<uint32_t> a;
  encode_sequence(text, a);
  if (!pair) return post_process(std::move(a), std::nullopt, options);
  std::vector<uint32_t> b;
  encode_sequence(*pair, b);
  return post_process(std::move(a), std::move(b), options);
}

Encoding WordPieceTokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  return encode_one(text, nullptr, options);
}

Encoding WordPieceTokenizer::encode_pair(std::string_view text, std::string_view pair,
                                         const EncodeOptions& options) const {
  return encode_one(text, &pair, options);
}

std::vector<Encoding> WordPieceTokenizer::encode_batch(const std::vector<std::string>& texts,
                                                       const std::vector<std::string>& pairs,
                                                       const EncodeOptions& options) const {
  TESSERA_CHECK(pairs.empty() || pairs.size() == texts.size(), "encode_batch: ", texts.size(),
                " texts but ", pairs.size(), " second texts (text_pair)");
  EncodeOptions each = options;
  if (options.padding == PaddingStrategy::Longest) each.padding = PaddingStrategy::DoNotPad;
  std::vector<Encoding> out(texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string_view pair = pairs.empty() ? std::string_view() : pairs[i];
    out[i] = encode_one(texts[i], pairs.empty() ? nullptr : &pair, each);
  }
  if (options.padding == PaddingStrategy::Longest) {
    size_t longest = 0;
    for (const Encoding& e : out) longest = std::max(longest, e.input_ids.size());
    for (Encoding& e : out) pad(e, longest, options);
  }
  return out;
}

std::string WordPieceTokenizer::token_bytes(uint32_t id) const {
  TESSERA_CHECK(id < tokens_.size(), "tokenizer decode: id ", id, " is outside the vocabulary of ",
                tokens_.size());
  return tokens_[id];
}

std::string WordPieceTokenizer::decode(const std::vector<uint32_t>& ids,
                                       bool skip_special_tokens) const {
  std::string out, token;
  bool first = true;
  for (uint32_t id : ids) {
    token = token_bytes(id);
    if (skip_special_tokens && special_[id]) continue;
    if (!config_.decoder_prefix) {  // no decoder: tokens joined by spaces
      out += (first ? "" : " ") + token;
    } else {
      const std::string& prefix = *config_.decoder_prefix;
      if (!first && token.starts_with(prefix))
        token.erase(0, prefix.size());
      else if (!first)
        token.insert(0, " ");
      if (config_.decoder_cleanup) clean_up(token);
      out += token;
    }
    first = false;
  }
  return out;
}

}  // namespace tessera::data
