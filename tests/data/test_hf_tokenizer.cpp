// Hugging Face tokenizer files both ways: what Tessera writes loads in `tokenizers` and
// transformers.AutoTokenizer and encodes the same ids there; what `tokenizers` trains
// (ByteLevel BPE) and GPT-2's files load in Tessera and encode the same ids here.
// (WordPiece files: test_wordpiece.cpp and test_wordpiece_reference.cpp.)
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/data/pretokenizer.h"
#include "tessera/data/tokenizer.h"
#include "tests/data/tokenizer_test_util.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::test;

namespace {

void skip_without(const std::string& modules) {
  if (!python_can_import(modules))
    GTEST_SKIP() << python_interpreter() << " cannot import " << modules;
}

// Ids of `text` from tokenizer_reference.py `command` (file or auto) on `target`.
std::vector<uint32_t> reference_ids(const std::string& command, const fs::path& target,
                                    const std::string& text) {
  const fs::path in = scratch_dir() / "hf_text.txt", out = scratch_dir() / "hf_text.ids";
  write_bytes(in, text);
  fs::remove(out);
  EXPECT_TRUE(run_reference(command + " " + quoted(target) + " " + quoted(in) + " " + quoted(out)));
  return read_ids(out);
}

class Scratch : public ::testing::Environment {
 public:
  void TearDown() override { fs::remove_all(scratch_dir()); }
};
const auto* const kScratch = ::testing::AddGlobalTestEnvironment(new Scratch);

}  // namespace

TEST(HfTokenizer, TesseraBpeLoadsInTransformersAndEncodesTheSame) {
  skip_without("transformers, tokenizers");
  const std::string corpus = generated_corpus(21, 400000, false);
  const BpeTokenizer tok = BpeTokenizer::train(corpus, 1200);
  const fs::path dir = scratch_dir() / "tessera_bpe";
  tok.save_files(dir);
  for (const char* f : {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  const std::string text = generated_corpus(22, 200000, false);
  const std::vector<uint32_t> ids = tok.encode(text);
  EXPECT_LT(ids.size() * 2, text.size()) << "the trained merges should compress similar text";
  EXPECT_TRUE(reference_ids("file", dir / "tokenizer.json", text) == ids)
      << "tokenizers.Tokenizer.from_file";
  EXPECT_TRUE(reference_ids("auto", dir, text) == ids) << "transformers.AutoTokenizer";
  // And Tessera reads its own files back: tokenizer.json, and vocab.json + merges.txt.
  EXPECT_TRUE(load_tokenizer(dir / "tokenizer.json")->encode(text) == ids);
  fs::remove(dir / "tokenizer.json");
  EXPECT_TRUE(load_tokenizer_from(dir)->encode(text) == ids);
}

TEST(HfTokenizer, ReadsWhatTokenizersTrains) {
  skip_without("tokenizers");
  const std::string corpus = generated_corpus(23, 300000, false);
  const fs::path in = scratch_dir() / "train.txt", json = scratch_dir() / "hf_trained.json";
  write_bytes(in, corpus);
  ASSERT_TRUE(run_reference("train " + quoted(in) + " 900 " + quoted(json)));
  const auto tok = load_tokenizer(json);
  EXPECT_EQ(tok->vocab_size(), 900);
  const std::string text = generated_corpus(24, 200000, true);
  const std::vector<uint32_t> ids = tok->encode(text);
  EXPECT_TRUE(reference_ids("file", json, text) == ids);
  EXPECT_EQ(tok->decode(ids), replace_invalid_utf8(text));
}

TEST(HfTokenizer, Gpt2AsTokenizerJsonEncodesLikeTokenizers) {
  skip_without("tokenizers");
  if (gpt2_dir().empty()) GTEST_SKIP() << "GPT-2's files not found (scripts/setup.sh)";
  const BpeTokenizer gpt2 =
      BpeTokenizer::from_gpt2_files(gpt2_dir() / "encoder.json", gpt2_dir() / "vocab.bpe");
  const fs::path dir = scratch_dir() / "gpt2_hf";
  gpt2.save_files(dir);
  const auto reloaded = load_tokenizer(dir / "tokenizer.json");
  EXPECT_EQ(reloaded->vocab_size(), 50257);
  const std::string text = generated_corpus(25, 300000, false);
  const std::vector<uint32_t> ids = gpt2.encode(text);
  EXPECT_TRUE(reloaded->encode(text) == ids);
  EXPECT_TRUE(reference_ids("file", dir / "tokenizer.json", text) == ids);
}

TEST(HfTokenizer, RefusesWhatItCannotEncodeNamingTheKey) {
  const auto expect_error = [](const std::string& json, const std::string& fragment) {
    try {
      tokenizer_from_json(json, "hf.json");
      ADD_FAILURE() << "accepted " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("hf.json"), std::string::npos) << e.what();
    }
  };
  // Every byte token, then "ab" = merge of a and b.
  std::string vocab = "{";
  for (int b = 0; b < 256; ++b)  // JSON-escaped: the alphabet holds '"' and '\\'
    vocab += nlohmann::json(bytes_to_alphabet(std::string(1, static_cast<char>(b)))).dump() + ": " +
             std::to_string(b) + ",";
  const std::string bytes_only = vocab.substr(0, vocab.size() - 1) + "}";
  const std::string ok_vocab = vocab + "\"ab\": 256}";
  const std::string byte_level =
      R"("pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
  const auto file = [&](const std::string& model, const std::string& extra = "") {
    return "{" + byte_level + ", " + extra + "\"model\": " + model + "}";
  };
  EXPECT_NO_THROW(tokenizer_from_json(
      file(R"({"type": "BPE", "vocab": )" + ok_vocab + R"(, "merges": ["a b"]})")));
  expect_error(file(R"({"type": "Unigram", "vocab": []})"), "Unigram");
  // WordPiece (BERT's, data/wordpiece.h) is read; without its unknown token it is refused.
  const std::string bert_pieces = R"("normalizer": {"type": "BertNormalizer", "lowercase": true}, )"
                                  R"("pre_tokenizer": {"type": "BertPreTokenizer"}, )";
  const std::string vocab_pieces = R"("vocab": {"[UNK]": 0, "hello": 1, "##s": 2})";
  EXPECT_EQ(tokenizer_from_json("{" + bert_pieces + R"("model": {"type": "WordPiece", )" +
                                R"("unk_token": "[UNK]", )" + vocab_pieces + "}}")
                ->encode("Hellos, hello"),
            (std::vector<uint32_t>{1, 2, 0, 1}));
  expect_error("{" + bert_pieces + R"("model": {"type": "WordPiece", )" + vocab_pieces + "}}",
               "model.unk_token");
  expect_error(file(R"({"type": "WordPiece", "unk_token": "[UNK]", )" + vocab_pieces + "}"),
               "pre_tokenizer");
  expect_error(
      R"({"pre_tokenizer": {"type": "Whitespace"}, "model": {"type": "BPE", "vocab": {}, "merges": []}})",
      "Whitespace");
  expect_error(file(R"({"type": "BPE", "vocab": )" + ok_vocab + R"(, "merges": ["a b"]})",
                    R"("normalizer": {"type": "NFC"}, )"),
               "normalizer");
  expect_error(file(R"({"type": "BPE", "vocab": )" + bytes_only + R"(, "merges": ["a b"]})"),
               "merge 0");
  expect_error(file(R"({"type": "BPE", "vocab": )" + vocab + R"("ab": 300}, "merges": []})"),
               "no token has id 256");
  expect_error(file(R"({"type": "BPE", "vocab": )" + vocab + R"("a€": 256}, "merges": []})"),
               "alphabet");
  expect_error(file(R"({"type": "BPE", "vocab": {"a": 0}, "merges": []})"), "byte 0x00");
  expect_error(file(R"({"type": "BPE", "vocab": )" + ok_vocab + R"(, "merges": ["ab"]})"),
               "merge 0");
}
