// Byte-level BPE files: Hugging Face's tokenizer.json (+ vocab.json, merges.txt,
// tokenizer_config.json), OpenAI's encoder.json + vocab.bpe (the same two files GPT-2
// ships) and Tessera's first {"type": "bpe", "merges": [[a, b], ...]} layout.
#include <array>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/pretokenizer.h"
#include "tessera/data/tokenizer.h"

namespace tessera::data {

namespace {

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand
// for themselves, every other byte for U+0100 + n, n counting those bytes in order.
struct Alphabet {
  std::array<char32_t, 256> char_of_byte{};
  std::array<int16_t, 0x144> byte_of_char{};  // -1: not in the alphabet
  Alphabet() {
    byte_of_char.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      char_of_byte[b] = printable ? static_cast<char32_t>(b) : next++;
      byte_of_char[char_of_byte[b]] = static_cast<int16_t>(b);
    }
  }
};
const Alphabet& alphabet() {
  static const Alphabet a;
  return a;
}

// "a b" or ["a", "b"]: one merge of a vocab.bpe/merges.txt line or a tokenizer.json entry.
std::pair<std::string, std::string> split_merge(const nlohmann::json& m, const std::string& where) {
  if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) return {m[0], m[1]};
  TESSERA_CHECK(m.is_string(), where, " is neither \"left right\" nor [\"left\", \"right\"]");
  const std::string s = m;
  const size_t space = s.find(' ');
  TESSERA_CHECK(space != std::string::npos && space > 0 && space + 1 < s.size() &&
                    s.find(' ', space + 1) == std::string::npos,
                where, " '", s, "' is not two tokens separated by one space");
  return {s.substr(0, space), s.substr(space + 1)};
}

// Builds the tokenizer from a vocabulary (alphabet string -> id) and merges in rank order.
// `added` holds the added/special tokens' ids and contents (stored as plain UTF-8).
BpeTokenizer build(const nlohmann::json& vocab, const nlohmann::json& merges,
                   const std::map<uint32_t, std::string>& added, BpeTokenizer::Options options,
                   const std::string& source) {
  TESSERA_CHECK(vocab.is_object(), "tokenizer '", source, "': the vocabulary is not a JSON object");
  TESSERA_CHECK(merges.is_array(), "tokenizer '", source, "': the merges are not a JSON array");
  std::vector<std::string> tokens;
  std::vector<bool> present;
  std::unordered_map<std::string, uint32_t> id_of_name;
  const auto put = [&](uint32_t id, std::string bytes) {
    if (id >= tokens.size()) tokens.resize(id + 1), present.resize(id + 1);
    TESSERA_CHECK(!present[id], "tokenizer '", source, "': id ", id, " is given to two tokens");
    tokens[id] = std::move(bytes);
    present[id] = true;
  };
  for (const auto& [name, id_json] : vocab.items()) {
    TESSERA_CHECK(id_json.is_number_unsigned() && id_json.get<uint64_t>() < (1u << 31),
                  "tokenizer '", source, "': vocabulary entry '", name, "' has id ", id_json.dump(),
                  ", not a token id");
    const uint32_t id = id_json.get<uint32_t>();
    id_of_name.emplace(name, id);
    auto is_added = added.find(id);
    if (is_added != added.end() && is_added->second == name) {
      put(id, name);  // added tokens are plain text, not alphabet strings
    } else {
      put(id, alphabet_to_bytes(name, "tokenizer '" + source + "': vocabulary entry"));
    }
  }
  std::vector<uint32_t> special;
  for (const auto& [id, content] : added) {
    if (id >= tokens.size() || !present[id]) put(id, content);
    special.push_back(id);
  }
  for (size_t id = 0; id < tokens.size(); ++id)
    TESSERA_CHECK(present[id], "tokenizer '", source, "': no token has id ", id,
                  " (ids must run 0..", tokens.size() - 1, " without gaps)");
  std::vector<BpeTokenizer::Merge> pairs;
  pairs.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string where = "tokenizer '" + source + "': merge " + std::to_string(i);
    const auto [left, right] = split_merge(merges[i], where);
    const auto l = id_of_name.find(left), r = id_of_name.find(right);
    TESSERA_CHECK(l != id_of_name.end() && r != id_of_name.end(), where, " '", left, " ", right,
                  "' names a token missing from the vocabulary");
    TESSERA_CHECK(id_of_name.count(left + right), where, " '", left, " ", right,
                  "': the merged token '", left + right, "' is missing from the vocabulary");
    pairs.emplace_back(l->second, r->second);
  }
  try {
    return BpeTokenizer(std::move(tokens), pairs, std::move(special), options);
  } catch (const Error& e) {
    TESSERA_FAIL("tokenizer '", source, "': ", e.what());
  }
}

bool is_null_or(const nlohmann::json& j, const char* key, const nlohmann::json& allowed) {
  return !j.contains(key) || j[key].is_null() || j[key] == allowed;
}

}  // namespace

std::string bytes_to_alphabet(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) append_utf8(out, alphabet().char_of_byte[b]);
  return out;
}

std::string alphabet_to_bytes(std::string_view text, const std::string& what) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
    char32_t c = byte(i);
    size_t length = 1;
    if (c >= 0xC0 && c < 0xE0 && i + 1 < text.size())
      c = ((c & 0x1F) << 6) | (byte(i + 1) & 0x3F), length = 2;
    const bool known = (length == 2 || c < 0x80) && c < alphabet().byte_of_char.size() &&
                       alphabet().byte_of_char[c] >= 0;
    TESSERA_CHECK(known, what, " '", std::string(text), "' holds a character (at byte ", i,
                  ") outside GPT-2's byte-level alphabet");
    out += static_cast<char>(alphabet().byte_of_char[c]);
    i += length;
  }
  return out;
}

// ---- reading ----

std::unique_ptr<Tokenizer> bpe_from_hugging_face_json(const nlohmann::json& j,
                                                      const std::string& source) {
  const nlohmann::json& model = j["model"];
  TESSERA_CHECK(
      model.is_object() && is_null_or(model, "type", "BPE"), "tokenizer '", source,
      "': model type ", model.is_object() && model.contains("type") ? model["type"].dump() : "?",
      " is not supported; Tessera reads byte-level BPE (model type \"BPE\") and WordPiece "
      "tokenizers");
  TESSERA_CHECK(j.contains("pre_tokenizer") && j["pre_tokenizer"].is_object() &&
                    j["pre_tokenizer"].value("type", "") == "ByteLevel",
                "tokenizer '", source, "': pre_tokenizer ",
                j.contains("pre_tokenizer") ? j["pre_tokenizer"].dump().substr(0, 80) : "(missing)",
                " is not supported; Tessera reads BPE with the ByteLevel pre-tokenizer");
  const nlohmann::json& pre = j["pre_tokenizer"];
  TESSERA_CHECK(
      is_null_or(pre, "use_regex", true), "tokenizer '", source,
      "': ByteLevel with use_regex false is not supported (GPT-2's pattern is always used)");
  TESSERA_CHECK(is_null_or(j, "normalizer", nullptr), "tokenizer '", source, "': normalizer ",
                j["normalizer"].dump().substr(0, 80),
                " is not supported (byte-level BPE has none)");
  TESSERA_CHECK(
      is_null_or(model, "dropout", nullptr) && is_null_or(model, "continuing_subword_prefix", "") &&
          is_null_or(model, "end_of_word_suffix", "") && is_null_or(model, "byte_fallback", false),
      "tokenizer '", source,
      "': BPE with dropout, a continuing_subword_prefix, an "
      "end_of_word_suffix or byte_fallback is not byte-level BPE and is not supported");
  TESSERA_CHECK(model.contains("vocab") && model.contains("merges"), "tokenizer '", source,
                "': model needs keys \"vocab\" and \"merges\"");
  std::map<uint32_t, std::string> added;
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const auto& t : j["added_tokens"]) {
      TESSERA_CHECK(t.is_object() && t.contains("id") && t["id"].is_number_unsigned() &&
                        t.contains("content") && t["content"].is_string(),
                    "tokenizer '", source, "': added_tokens entry ", t.dump().substr(0, 80),
                    " needs \"id\" and \"content\"");
      added[t["id"].get<uint32_t>()] = t["content"].get<std::string>();
    }
  }
  BpeTokenizer::Options options;
  options.add_prefix_space = pre.value("add_prefix_space", false);
  options.ignore_merges = model.contains("ignore_merges") && model["ignore_merges"].is_boolean() &&
                          model["ignore_merges"].get<bool>();
  return std::make_unique<BpeTokenizer>(
      build(model["vocab"], model["merges"], added, options, source));
}

std::unique_ptr<Tokenizer> bpe_from_legacy_json(const nlohmann::json& j,
                                                const std::string& source) {
  TESSERA_CHECK(j.contains("merges") && j["merges"].is_array(), "tokenizer '", source,
                "': key \"merges\" must be an array of [left, right] pairs");
  std::vector<BpeTokenizer::Merge> merges;
  for (size_t i = 0; i < j["merges"].size(); ++i) {
    const auto& m = j["merges"][i];
    TESSERA_CHECK(
        m.is_array() && m.size() == 2 && m[0].is_number_unsigned() && m[1].is_number_unsigned(),
        "tokenizer '", source, "': \"merges\"[", i, "] is not a pair of ids");
    merges.emplace_back(m[0].get<uint32_t>(), m[1].get<uint32_t>());
  }
  std::unique_ptr<BpeTokenizer> tok;
  try {
    tok = std::make_unique<BpeTokenizer>(merges);
  } catch (const Error& e) {
    TESSERA_FAIL("tokenizer '", source, "': ", e.what());
  }
  if (j.contains("vocab_size")) {
    TESSERA_CHECK(
        j["vocab_size"].is_number_integer() && j["vocab_size"].get<int64_t>() == tok->vocab_size(),
        "tokenizer '", source, "': \"vocab_size\" ", j["vocab_size"].dump(),
        " disagrees with 256 + ", tok->merges().size(), " merges");
  }
  return tok;
}

BpeTokenizer BpeTokenizer::from_gpt2_files(const std::filesystem::path& encoder_json,
                                           const std::filesystem::path& vocab_bpe) {
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_file(encoder_json));
  } catch (const nlohmann::json::parse_error& e) {
    TESSERA_FAIL("GPT-2 vocabulary '", encoder_json.string(), "': not valid JSON at byte ", e.byte);
  }
  // vocab.bpe: a "#version" line, then one "left right" merge per line.
  const std::string text = read_file(vocab_bpe);
  nlohmann::json merges = nlohmann::json::array();
  size_t line_start = 0;
  for (size_t line = 1; line_start < text.size(); ++line) {
    size_t line_end = text.find('\n', line_start);
    if (line_end == std::string::npos) line_end = text.size();
    std::string_view row(text.data() + line_start, line_end - line_start);
    if (!row.empty() && row.back() == '\r') row.remove_suffix(1);
    if (!row.empty() && !(line == 1 && row.starts_with("#version")))
      merges.push_back(std::string(row));
    line_start = line_end + 1;
  }
  std::map<uint32_t, std::string> added;
  for (const char* special : {"<|endoftext|>", "<|startoftext|>"})
    if (vocab.is_object() && vocab.contains(special) && vocab[special].is_number_unsigned())
      added[vocab[special].get<uint32_t>()] = special;
  return build(vocab, merges, added, {}, encoder_json.string() + " + " + vocab_bpe.string());
}

// ---- writing ----

// Plain (key-sorted) JSON objects: Hugging Face reads ids from the values, not the order,
// and nlohmann's insertion-ordered objects search keys linearly (too slow for 50k tokens).
std::string BpeTokenizer::to_json() const {
  nlohmann::json vocab = nlohmann::json::object();
  std::unordered_map<std::string, size_t> id_of_name;
  for (size_t id = 0; id < tokens_.size(); ++id) {
    const bool special = std::binary_search(special_.begin(), special_.end(), id);
    const std::string name = special ? tokens_[id] : bytes_to_alphabet(tokens_[id]);
    const auto [seen, fresh] = id_of_name.emplace(name, id);
    TESSERA_CHECK(fresh, "tokenizer: ids ", seen->second, " and ", id, " are both the token '",
                  name, "'; Hugging Face's vocab.json cannot hold both");
    vocab[name] = id;
  }
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [left, right] : merges_)
    merges.push_back(bytes_to_alphabet(tokens_[left]) + " " + bytes_to_alphabet(tokens_[right]));
  nlohmann::json added = nlohmann::json::array();
  for (uint32_t id : special_)
    added.push_back({{"id", id},
                     {"content", tokens_[id]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", true},
                     {"special", true}});
  const auto byte_level = [](bool add_prefix_space, bool trim_offsets) {
    return nlohmann::json{{"type", "ByteLevel"},
                          {"add_prefix_space", add_prefix_space},
                          {"trim_offsets", trim_offsets},
                          {"use_regex", true}};
  };
  nlohmann::json model = {{"type", "BPE"},
                          {"dropout", nullptr},
                          {"unk_token", nullptr},
                          {"continuing_subword_prefix", nullptr},
                          {"end_of_word_suffix", nullptr},
                          {"fuse_unk", false},
                          {"byte_fallback", false},
                          {"ignore_merges", options_.ignore_merges},
                          {"vocab", vocab},
                          {"merges", merges}};
  nlohmann::json j = {{"version", "1.0"},
                      {"truncation", nullptr},
                      {"padding", nullptr},
                      {"added_tokens", added},
                      {"normalizer", nullptr},
                      {"pre_tokenizer", byte_level(options_.add_prefix_space, true)},
                      {"post_processor", byte_level(true, false)},
                      {"decoder", byte_level(true, true)},
                      {"model", model}};
  return j.dump();
}

std::map<std::string, std::string> BpeTokenizer::files() const {
  const nlohmann::json tokenizer = nlohmann::json::parse(to_json());
  std::string merges_txt = "#version: 0.2\n";
  for (const auto& m : tokenizer["model"]["merges"]) merges_txt += m.get<std::string>() + "\n";
  // tokenizer_config.json lets AutoTokenizer load a folder that has no model config.json.
  nlohmann::json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                           {"add_prefix_space", options_.add_prefix_space},
                           {"clean_up_tokenization_spaces", false}};
  const int64_t end_of_text = token_id("<|endoftext|>");
  if (end_of_text >= 0 && std::binary_search(special_.begin(), special_.end(), end_of_text))
    for (const char* role : {"bos_token", "eos_token", "unk_token"}) config[role] = "<|endoftext|>";
  return {{"tokenizer.json", tokenizer.dump()},
          {"vocab.json", tokenizer["model"]["vocab"].dump()},
          {"merges.txt", merges_txt},
          {"tokenizer_config.json", config.dump(2)}};
}

}  // namespace tessera::data
