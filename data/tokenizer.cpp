#include "tessera/data/tokenizer.h"

#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/wordpiece.h"

namespace tessera::data {

// Defined in tokenizer_files.cpp: a Hugging Face tokenizer.json, or Tessera's first BPE layout.
std::unique_ptr<Tokenizer> bpe_from_hugging_face_json(const nlohmann::json& j,
                                                      const std::string& source);
std::unique_ptr<Tokenizer> bpe_from_legacy_json(const nlohmann::json& j, const std::string& source);
// Defined in wordpiece_files.cpp; `tokenizer_config` (may be null) is transformers'
// tokenizer_config.json beside it, which names the special tokens' roles.
std::unique_ptr<Tokenizer> wordpiece_from_hugging_face_json(const nlohmann::json& j,
                                                            const std::string& source,
                                                            const nlohmann::json* tokenizer_config);

namespace {

std::unique_ptr<Tokenizer> from_json_text(const std::string& json_text,
                                          const std::string& source_name,
                                          const nlohmann::json* tokenizer_config) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& e) {
    TESSERA_FAIL("tokenizer '", source_name, "': not valid JSON at byte ", e.byte, ": ", e.what());
  }
  TESSERA_CHECK(j.is_object(), "tokenizer '", source_name, "': expected a JSON object");
  if (j.contains("model")) {
    const nlohmann::json& model = j["model"];
    if (model.is_object() && model.contains("type") && model["type"] == "WordPiece")
      return wordpiece_from_hugging_face_json(j, source_name, tokenizer_config);
    return bpe_from_hugging_face_json(j, source_name);
  }
  TESSERA_CHECK(j.contains("type") && j["type"].is_string(), "tokenizer '", source_name,
                "': neither a Hugging Face tokenizer.json (key \"model\") nor a Tessera one "
                "(string key \"type\", \"byte\" or \"bpe\")");
  const std::string type = j["type"];
  if (type == "byte") return std::make_unique<ByteTokenizer>();
  TESSERA_CHECK(type == "bpe", "tokenizer '", source_name, "': unknown \"type\" '", type,
                "' (expected \"byte\" or \"bpe\")");
  return bpe_from_legacy_json(j, source_name);
}

}  // namespace

void Tokenizer::save(const std::filesystem::path& path) const {
  write_file_atomically(path, to_json());
}

void Tokenizer::save_files(const std::filesystem::path& dir) const {
  for (const auto& [name, contents] : files()) write_file_atomically(dir / name, contents);
}

// ---- byte-level ----

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) out[i] = token_bytes(ids[i])[0];
  return out;
}

std::string ByteTokenizer::token_bytes(uint32_t id) const {
  TESSERA_CHECK(id < 256, "tokenizer decode: id ", id, " is outside the vocabulary of 256");
  return std::string(1, static_cast<char>(id));
}

std::string ByteTokenizer::to_json() const { return nlohmann::json{{"type", "byte"}}.dump(); }

// ---- loading ----

std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& json_text,
                                               const std::string& source_name) {
  return from_json_text(json_text, source_name, nullptr);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& path) {
  return tokenizer_from_json(read_file(path), path.string());
}

std::unique_ptr<Tokenizer> load_tokenizer_from(const std::filesystem::path& file_or_dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(file_or_dir)) return load_tokenizer(file_or_dir);
  const fs::path config_path = file_or_dir / "tokenizer_config.json";
  const bool has_config = fs::exists(config_path);
  if (fs::exists(file_or_dir / "tokenizer.json")) {
    nlohmann::json config;
    if (has_config) {
      try {
        config = nlohmann::json::parse(read_file(config_path));
      } catch (const nlohmann::json::parse_error& e) {
        TESSERA_FAIL("tokenizer config '", config_path.string(), "': not valid JSON at byte ",
                     e.byte);
      }
    }
    const fs::path path = file_or_dir / "tokenizer.json";
    return from_json_text(read_file(path), path.string(), has_config ? &config : nullptr);
  }
  for (const auto& [vocab, merges] :
       {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}})
    if (fs::exists(file_or_dir / vocab) && fs::exists(file_or_dir / merges))
      return std::make_unique<BpeTokenizer>(
          BpeTokenizer::from_gpt2_files(file_or_dir / vocab, file_or_dir / merges));
  if (fs::exists(file_or_dir / "vocab.txt"))
    return std::make_unique<WordPieceTokenizer>(WordPieceTokenizer::from_vocab_file(
        file_or_dir / "vocab.txt", has_config ? std::optional(config_path) : std::nullopt));
  return nullptr;
}

}  // namespace tessera::data
