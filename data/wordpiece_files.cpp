// WordPiece files: Hugging Face's tokenizer.json (model "WordPiece"), BERT's vocab.txt and
// transformers' tokenizer_config.json, both ways.
#include <limits>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/wordpiece.h"

namespace tessera::data {

namespace {

// The roles transformers' BertTokenizer gives tokens, with BERT's names for them.
const std::pair<const char*, const char*> kBertRoles[] = {{"pad_token", "[PAD]"},
                                                          {"unk_token", "[UNK]"},
                                                          {"cls_token", "[CLS]"},
                                                          {"sep_token", "[SEP]"},
                                                          {"mask_token", "[MASK]"}};

// Reads `json[key]` of one JSON type, naming `where` and the key when it has another.
class Reader {
 public:
  Reader(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {}
  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const nlohmann::json& at(const char* key) const {
    TESSERA_CHECK(has(key), where_, key, " is missing");
    return j_[key];
  }
  template <typename T>
  T get(const char* key, T fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j_[key];
    bool ok = false;
    if constexpr (std::is_same_v<T, bool>)
      ok = v.is_boolean();
    else if constexpr (std::is_same_v<T, std::string>)
      ok = v.is_string();
    else
      ok = v.is_number_unsigned() && v.get<uint64_t>() <= std::numeric_limits<T>::max();
    TESSERA_CHECK(ok, where_, key, " is ", v.dump().substr(0, 60), ", not a ",
                  std::is_same_v<T, bool>          ? "boolean"
                  : std::is_same_v<T, std::string> ? "string"
                                                   : "count");
    return v.get<T>();
  }
  std::string type() const { return has("type") && j_["type"].is_string() ? j_["type"] : "?"; }

 private:
  const nlohmann::json& j_;
  std::string where_;
};

std::vector<std::string> read_vocab_object(const nlohmann::json& vocab, const std::string& where) {
  TESSERA_CHECK(vocab.is_object(), where, "model.vocab is not a JSON object");
  std::vector<std::string> tokens(vocab.size());
  std::vector<bool> present(vocab.size(), false);
  for (const auto& [token, id] : vocab.items()) {
    TESSERA_CHECK(id.is_number_unsigned() && id.get<uint64_t>() < vocab.size(), where,
                  "model.vocab entry '", token, "' has id ", id.dump(), "; ids must run 0..",
                  vocab.size() - 1, " without gaps");
    TESSERA_CHECK(!present[id.get<size_t>()], where, "model.vocab gives id ", id.dump(),
                  " to two tokens");
    tokens[id.get<size_t>()] = token;
    present[id.get<size_t>()] = true;
  }
  return tokens;
}

std::optional<BertNormalizerOptions> read_normalizer(const nlohmann::json& j,
                                                     const std::string& where) {
  if (!j.contains("normalizer") || j["normalizer"].is_null()) return std::nullopt;
  const Reader n(j["normalizer"], where + "normalizer.");
  TESSERA_CHECK(n.type() == "BertNormalizer", where, "normalizer type '", n.type(),
                "' is not supported; Tessera's WordPiece reads BertNormalizer (or none)");
  BertNormalizerOptions options;
  options.clean_text = n.get("clean_text", true);
  options.handle_chinese_chars = n.get("handle_chinese_chars", true);
  if (n.has("strip_accents")) options.strip_accents = n.get("strip_accents", false);
  options.lowercase = n.get("lowercase", true);
  return options;
}

std::vector<TemplatePiece> read_template(const nlohmann::json& pieces, const std::string& where) {
  TESSERA_CHECK(pieces.is_array(), where, " is not an array");
  std::vector<TemplatePiece> out;
  for (const nlohmann::json& p : pieces) {
    const bool special = p.is_object() && p.contains("SpecialToken");
    TESSERA_CHECK(special || (p.is_object() && p.contains("Sequence")), where, " entry ",
                  p.dump().substr(0, 60), " is neither {\"Sequence\"} nor {\"SpecialToken\"}");
    const Reader r(p[special ? "SpecialToken" : "Sequence"], where + " entry: ");
    TemplatePiece piece;
    piece.type_id = r.get<uint32_t>("type_id", 0);
    const std::string id = r.get<std::string>("id", "");
    if (special) {
      piece.kind = TemplatePiece::SpecialToken;
      piece.special = id;
    } else {
      TESSERA_CHECK(id == "A" || id == "B", where, " names sequence '", id, "' (not A or B)");
      piece.kind = id == "A" ? TemplatePiece::SequenceA : TemplatePiece::SequenceB;
    }
    out.push_back(piece);
  }
  return out;
}

// BERT's template around special tokens named `cls` and `sep`.
PostProcessorTemplate bert_template(const std::string& cls, const std::string& sep) {
  using P = TemplatePiece;
  PostProcessorTemplate t;
  t.single = {{P::SpecialToken, cls, 0}, {P::SequenceA, "", 0}, {P::SpecialToken, sep, 0}};
  t.pair = t.single;
  t.pair.insert(t.pair.end(), {{P::SequenceB, "", 1}, {P::SpecialToken, sep, 1}});
  t.special_tokens = {{cls, {cls}}, {sep, {sep}}};
  return t;
}

PostProcessorTemplate read_post_processor(const nlohmann::json& j, const std::string& where,
                                          std::map<std::string, std::string>& roles) {
  if (!j.contains("post_processor") || j["post_processor"].is_null()) return {};
  const nlohmann::json& pp = j["post_processor"];
  const Reader r(pp, where + "post_processor.");
  if (r.type() == "BertProcessing") {
    std::string names[2];
    for (int k = 0; k < 2; ++k) {
      const nlohmann::json& entry = r.at(k == 0 ? "cls" : "sep");
      TESSERA_CHECK(entry.is_array() && entry.size() == 2 && entry[0].is_string(), where,
                    "post_processor.", k == 0 ? "cls" : "sep", " is not [token, id]");
      names[k] = entry[0];
    }
    roles["cls_token"] = names[0];
    roles["sep_token"] = names[1];
    return bert_template(names[0], names[1]);
  }
  TESSERA_CHECK(
      r.type() == "TemplateProcessing", where, "post_processor type '", r.type(),
      "' is not supported; Tessera's WordPiece reads TemplateProcessing or BertProcessing");
  PostProcessorTemplate t;
  t.single = read_template(r.at("single"), where + "post_processor.single");
  t.pair = read_template(r.at("pair"), where + "post_processor.pair");
  const nlohmann::json& specials = r.at("special_tokens");
  TESSERA_CHECK(specials.is_object(), where, "post_processor.special_tokens is not an object");
  for (const auto& [name, entry] : specials.items()) {
    const std::string key = where + "post_processor.special_tokens '" + name + "': ";
    TESSERA_CHECK(entry.is_object() && entry.contains("tokens") && entry["tokens"].is_array(), key,
                  "needs \"tokens\"");
    for (const nlohmann::json& token : entry["tokens"]) {
      TESSERA_CHECK(token.is_string(), key, "tokens holds ", token.dump(), ", not a string");
      t.special_tokens[name].push_back(token);
    }
  }
  return t;
}

std::vector<AddedToken> read_added_tokens(const nlohmann::json& j, const std::string& where) {
  std::vector<AddedToken> out;
  if (!j.contains("added_tokens") || j["added_tokens"].is_null()) return out;
  TESSERA_CHECK(j["added_tokens"].is_array(), where, "added_tokens is not an array");
  for (const nlohmann::json& entry : j["added_tokens"]) {
    TESSERA_CHECK(entry.is_object(), where, "added_tokens holds ", entry.dump().substr(0, 60));
    const Reader r(entry, where + "added_tokens entry " + entry.dump().substr(0, 60) + ": ");
    AddedToken t;
    r.at("id");
    r.at("content");
    t.id = r.get<uint32_t>("id", 0);
    t.content = r.get<std::string>("content", "");
    t.special = r.get("special", false);
    t.normalized = r.get("normalized", !t.special);
    t.lstrip = r.get("lstrip", false);
    t.rstrip = r.get("rstrip", false);
    TESSERA_CHECK(!r.get("single_word", false), where, "added_tokens entry '", t.content,
                  "': single_word is not supported");
    out.push_back(t);
  }
  return out;
}

// transformers' tokenizer_config.json: the *_token names (strings or AddedToken objects)
// and model_max_length (its "no limit" value, 1e30, is left out).
void apply_tokenizer_config(const nlohmann::json& c, const std::string& source,
                            WordPieceConfig& config) {
  TESSERA_CHECK(c.is_object(), "tokenizer config '", source, "': expected a JSON object");
  for (const auto& [role, name] : kBertRoles) {
    (void)name;
    if (!c.contains(role) || c[role].is_null()) continue;
    const nlohmann::json& v = c[role];
    const bool ok =
        v.is_string() || (v.is_object() && v.contains("content") && v["content"].is_string());
    TESSERA_CHECK(ok, "tokenizer config '", source, "': ", role, " is ", v.dump().substr(0, 60),
                  ", not a token");
    config.roles[role] = v.is_string() ? v.get<std::string>() : v["content"].get<std::string>();
  }
  if (c.contains("model_max_length") && c["model_max_length"].is_number_unsigned())
    config.model_max_length = c["model_max_length"].get<size_t>();
}

// BertTokenizer's do_lower_case (default true), strip_accents and tokenize_chinese_chars,
// which BertTokenizerFast imposes on tokenizer.json's normalizer as well.
void apply_bert_switches(const nlohmann::json& c, const std::string& source,
                         BertNormalizerOptions& normalizer) {
  const Reader r(c, "tokenizer config '" + source + "': ");
  normalizer.lowercase = r.get("do_lower_case", true);
  normalizer.strip_accents.reset();
  if (r.has("strip_accents")) normalizer.strip_accents = r.get("strip_accents", false);
  normalizer.handle_chinese_chars = r.get("tokenize_chinese_chars", true);
}

bool is_bert_class(const nlohmann::json& c) {
  if (!c.contains("tokenizer_class") || !c["tokenizer_class"].is_string()) return false;
  const std::string name = c["tokenizer_class"];
  return name == "BertTokenizer" || name == "BertTokenizerFast" || name == "DistilBertTokenizer" ||
         name == "DistilBertTokenizerFast";
}

nlohmann::json parse_json_file(const std::filesystem::path& path) {
  try {
    return nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::parse_error& e) {
    TESSERA_FAIL("tokenizer config '", path.string(), "': not valid JSON at byte ", e.byte);
  }
}

// BERT's layout: the roles present in the vocabulary are special added tokens.
WordPieceConfig bert_layout(std::vector<std::string> vocab,
                            const std::map<std::string, std::string>& role_names,
                            std::optional<BertNormalizerOptions> normalizer, std::string source) {
  WordPieceConfig c;
  c.source = std::move(source);
  c.normalizer = normalizer;
  c.roles = role_names;
  c.unk_token = role_names.at("unk_token");
  c.post_processor = bert_template(role_names.at("cls_token"), role_names.at("sep_token"));
  std::map<uint32_t, std::string> present;
  for (uint32_t id = 0; id < vocab.size(); ++id)
    for (const auto& [role, token] : role_names)
      if (vocab[id] == token) present[id] = token;
  for (const auto& [id, token] : present) c.added_tokens.push_back({token, id, true, false});
  c.vocab = std::move(vocab);
  return c;
}

std::map<std::string, std::string> bert_role_names() {
  std::map<std::string, std::string> names;
  for (const auto& [role, name] : kBertRoles) names[role] = name;
  return names;
}

}  // namespace

std::unique_ptr<Tokenizer> wordpiece_from_hugging_face_json(
    const nlohmann::json& j, const std::string& source, const nlohmann::json* tokenizer_config) {
  const std::string where = "tokenizer '" + source + "': ";
  const Reader model(j["model"], where + "model.");
  WordPieceConfig c;
  c.source = source;
  c.vocab = read_vocab_object(model.at("vocab"), where);
  model.at("unk_token");
  c.unk_token = model.get<std::string>("unk_token", "");
  c.continuing_subword_prefix = model.get<std::string>("continuing_subword_prefix", "##");
  c.max_input_chars_per_word = model.get<size_t>("max_input_chars_per_word", 100);
  c.normalizer = read_normalizer(j, where);
  TESSERA_CHECK(j.contains("pre_tokenizer") && j["pre_tokenizer"].is_object() &&
                    Reader(j["pre_tokenizer"], "").type() == "BertPreTokenizer",
                where, "pre_tokenizer ",
                j.contains("pre_tokenizer") ? j["pre_tokenizer"].dump().substr(0, 80) : "(missing)",
                " is not supported; Tessera's WordPiece reads BertPreTokenizer");
  c.added_tokens = read_added_tokens(j, where);
  c.post_processor = read_post_processor(j, where, c.roles);
  c.decoder_prefix.reset();
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    const Reader d(j["decoder"], where + "decoder.");
    TESSERA_CHECK(d.type() == "WordPiece", where, "decoder type '", d.type(),
                  "' is not supported; Tessera's WordPiece reads the WordPiece decoder (or none)");
    c.decoder_prefix = d.get<std::string>("prefix", "##");
    c.decoder_cleanup = d.get("cleanup", true);
  }
  c.roles["unk_token"] = c.unk_token;
  // Without a tokenizer_config.json transformers knows BERT's names when the vocabulary has them.
  for (const auto& [role, name] : kBertRoles)
    if (!c.roles.count(role) && std::find(c.vocab.begin(), c.vocab.end(), name) != c.vocab.end())
      c.roles[role] = name;
  if (tokenizer_config) {
    apply_tokenizer_config(*tokenizer_config, source, c);
    // As AutoTokenizer loads the folder: BertTokenizerFast's switches win over tokenizer.json's.
    if (c.normalizer && is_bert_class(*tokenizer_config))
      apply_bert_switches(*tokenizer_config, source, *c.normalizer);
  }
  return std::make_unique<WordPieceTokenizer>(std::move(c));
}

WordPieceConfig WordPieceTokenizer::bert_config(std::vector<std::string> vocab, bool lowercase) {
  BertNormalizerOptions normalizer;
  normalizer.lowercase = lowercase;
  return bert_layout(std::move(vocab), bert_role_names(), normalizer, "<bert vocabulary>");
}

WordPieceTokenizer WordPieceTokenizer::from_vocab_file(
    const std::filesystem::path& vocab_txt,
    const std::optional<std::filesystem::path>& tokenizer_config_json) {
  // Python's universal newlines, as transformers reads vocab.txt: \n, \r\n and \r end a line.
  const std::string text = read_file(vocab_txt);
  std::vector<std::string> vocab;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find_first_of("\r\n", start);
    if (end == std::string::npos) end = text.size();
    vocab.push_back(text.substr(start, end - start));
    start = end + (text.compare(end, 2, "\r\n") == 0 ? 2 : 1);
  }
  WordPieceConfig base;
  base.roles = bert_role_names();
  BertNormalizerOptions normalizer;
  if (tokenizer_config_json) {
    const nlohmann::json c = parse_json_file(*tokenizer_config_json);
    const std::string source = tokenizer_config_json->string();
    apply_tokenizer_config(c, source, base);
    apply_bert_switches(c, source, normalizer);
  }
  for (const char* role : {"unk_token", "cls_token", "sep_token"})
    TESSERA_CHECK(std::find(vocab.begin(), vocab.end(), base.roles[role]) != vocab.end(),
                  "tokenizer '", vocab_txt.string(), "': ", role, " '", base.roles[role],
                  "' is not in the vocabulary");
  WordPieceConfig c = bert_layout(std::move(vocab), base.roles, normalizer, vocab_txt.string());
  c.model_max_length = base.model_max_length;
  return WordPieceTokenizer(std::move(c));
}

// ---- writing ----

namespace {

nlohmann::json optional_json(const std::optional<bool>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

nlohmann::json normalizer_json(const std::optional<BertNormalizerOptions>& n) {
  if (!n) return nullptr;
  return {{"type", "BertNormalizer"},
          {"clean_text", n->clean_text},
          {"handle_chinese_chars", n->handle_chinese_chars},
          {"strip_accents", optional_json(n->strip_accents)},
          {"lowercase", n->lowercase}};
}

nlohmann::json template_json(const std::vector<TemplatePiece>& pieces) {
  nlohmann::json out = nlohmann::json::array();
  for (const TemplatePiece& p : pieces)
    out.push_back(
        p.kind == TemplatePiece::SpecialToken
            ? nlohmann::json{{"SpecialToken", {{"id", p.special}, {"type_id", p.type_id}}}}
            : nlohmann::json{{"Sequence",
                              {{"id", p.kind == TemplatePiece::SequenceA ? "A" : "B"},
                               {"type_id", p.type_id}}}});
  return out;
}

}  // namespace

std::string WordPieceTokenizer::to_json() const {
  const WordPieceConfig& c = config_;
  nlohmann::json vocab = nlohmann::json::object();
  for (uint32_t id = 0; id < c.vocab.size(); ++id) vocab[c.vocab[id]] = id;
  nlohmann::json added = nlohmann::json::array();
  std::vector<AddedToken> sorted = c.added_tokens;
  std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.id < b.id; });
  for (const AddedToken& t : sorted)
    added.push_back({{"id", t.id},
                     {"content", t.content},
                     {"single_word", false},
                     {"lstrip", t.lstrip},
                     {"rstrip", t.rstrip},
                     {"normalized", t.normalized},
                     {"special", t.special}});
  nlohmann::json post_processor = nullptr;
  if (!c.post_processor.empty()) {
    nlohmann::json specials = nlohmann::json::object();
    for (const auto& [name, tokens] : c.post_processor.special_tokens)
      specials[name] = {{"id", name}, {"ids", special_ids_.at(name)}, {"tokens", tokens}};
    post_processor = {{"type", "TemplateProcessing"},
                      {"single", template_json(c.post_processor.single)},
                      {"pair", template_json(c.post_processor.pair)},
                      {"special_tokens", specials}};
  }
  nlohmann::json decoder = nullptr;
  if (c.decoder_prefix)
    decoder = {
        {"type", "WordPiece"}, {"prefix", *c.decoder_prefix}, {"cleanup", c.decoder_cleanup}};
  const nlohmann::json j = {{"version", "1.0"},
                            {"truncation", nullptr},
                            {"padding", nullptr},
                            {"added_tokens", added},
                            {"normalizer", normalizer_json(c.normalizer)},
                            {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
                            {"post_processor", post_processor},
                            {"decoder", decoder},
                            {"model",
                             {{"type", "WordPiece"},
                              {"unk_token", c.unk_token},
                              {"continuing_subword_prefix", c.continuing_subword_prefix},
                              {"max_input_chars_per_word", c.max_input_chars_per_word},
                              {"vocab", vocab}}}};
  return j.dump();
}

std::map<std::string, std::string> WordPieceTokenizer::files() const {
  std::string vocab_txt;
  for (const std::string& token : config_.vocab) {
    TESSERA_CHECK(token.find_first_of("\r\n") == std::string::npos, "tokenizer '", config_.source,
                  "': the token '", token, "' holds a line break; vocab.txt cannot");
    vocab_txt += token + "\n";
  }
  // BertTokenizerFast takes do_lower_case & co. from here and rebuilds the normalizer when
  // they disagree with tokenizer.json's, so they must say the same.
  const bool bert = config_.normalizer.has_value();
  nlohmann::json config = {{"tokenizer_class", bert ? "BertTokenizer" : "PreTrainedTokenizerFast"},
                           {"clean_up_tokenization_spaces", false}};
  if (bert) {
    config["do_lower_case"] = config_.normalizer->lowercase;
    config["tokenize_chinese_chars"] = config_.normalizer->handle_chinese_chars;
    config["strip_accents"] = optional_json(config_.normalizer->strip_accents);
  }
  if (config_.model_max_length > 0) config["model_max_length"] = config_.model_max_length;
  nlohmann::json special_map = nlohmann::json::object();
  for (const auto& [role, token] : config_.roles)
    if (token_to_id(token)) config[role] = special_map[role] = token;
  return {{"tokenizer.json", to_json()},
          {"vocab.txt", vocab_txt},
          {"tokenizer_config.json", config.dump(2)},
          {"special_tokens_map.json", special_map.dump(2)}};
}

}  // namespace tessera::data
