// GPT-2's tokenizer against tiktoken (`gpt2`, encode_ordinary) and transformers'
// GPT2Tokenizer, both built offline from the same encoder.json + vocab.bpe; the
// pre-tokenizer and the invalid-UTF-8 rule checked against hand-worked cases and Python.
#include <gtest/gtest.h>

#include "tessera/core/error.h"
#include "tessera/data/pretokenizer.h"
#include "tessera/data/tokenizer.h"
#include "tests/data/tokenizer_test_util.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::test;

namespace {

std::vector<std::string> pieces_of(const std::string& text) {
  std::vector<std::string> out;
  for (std::string_view p : gpt2_pieces(text)) out.emplace_back(p);
  return out;
}

// Ids from tokenizer_reference.py `command` on `text`; empty optional when it failed.
std::vector<uint32_t> reference_ids(const std::string& command, const std::string& text,
                                    const std::string& name) {
  const fs::path dir = gpt2_dir(), in = scratch_dir() / (name + ".txt"),
                 out = scratch_dir() / (name + ".ids");
  write_bytes(in, text);
  EXPECT_TRUE(run_reference(command + " " + quoted(dir / "encoder.json") + " " +
                            quoted(dir / "vocab.bpe") + " " + quoted(in) + " " + quoted(out)));
  return read_ids(out);
}

// The first position where two id sequences differ, with the text around it, for messages.
std::string first_difference(const BpeTokenizer& tok, const std::vector<uint32_t>& a,
                             const std::vector<uint32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  if (i == a.size() && i == b.size()) return "none";
  const auto show = [&](const std::vector<uint32_t>& ids) {
    std::string s;
    for (size_t k = i >= 3 ? i - 3 : 0; k < std::min(ids.size(), i + 6); ++k)
      s += std::to_string(ids[k]) + "'" + tok.token_bytes(ids[k]) + "' ";
    return s;
  };
  return "at token " + std::to_string(i) + ": " + show(a) + " vs " + show(b);
}

class Gpt2Tokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!gpt2_dir().empty())
      tok_ = new BpeTokenizer(
          BpeTokenizer::from_gpt2_files(gpt2_dir() / "encoder.json", gpt2_dir() / "vocab.bpe"));
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
    fs::remove_all(scratch_dir());
  }
  void SetUp() override {
    if (!tok_)
      GTEST_SKIP() << "GPT-2's encoder.json/vocab.bpe not found (scripts/setup.sh fetches them "
                      "into .deps/gpt2)";
  }
  static void skip_without(const std::string& modules) {
    if (!python_can_import(modules))
      GTEST_SKIP() << python_interpreter() << " cannot import " << modules;
  }
  static BpeTokenizer* tok_;
};
BpeTokenizer* Gpt2Tokenizer::tok_ = nullptr;

}  // namespace

TEST(Utf8, ReplacesIllFormedSubsequencesAsPythonDoes) {
  EXPECT_EQ(replace_invalid_utf8("plain ascii"), "plain ascii");
  EXPECT_EQ(replace_invalid_utf8("h\xC3\xA9llo \xF0\x9F\x98\x80"), "h\xC3\xA9llo \xF0\x9F\x98\x80");
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(replace_invalid_utf8("a\xE2\x82"), "a" + fffd);                        // truncated: one
  EXPECT_EQ(replace_invalid_utf8("\xE2\x82z"), fffd + "z");                        // cut short: one
  EXPECT_EQ(replace_invalid_utf8("\xED\xA0\x80"), fffd + fffd + fffd);             // a surrogate
  EXPECT_EQ(replace_invalid_utf8("\xC0\xAF"), fffd + fffd);                        // overlong
  EXPECT_EQ(replace_invalid_utf8("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // > U+10FFFF
  EXPECT_EQ(replace_invalid_utf8("\xF0\x9F\x98"), fffd);
  EXPECT_EQ(replace_invalid_utf8("\xFF\x80"), fffd + fffd);
  EXPECT_EQ(find_invalid_utf8("ok\xC3"), 2u);
  EXPECT_EQ(find_invalid_utf8("ok"), std::string_view::npos);
}

TEST(Utf8, MatchesPythonOnRandomBytes) {
  if (!python_can_import("sys")) GTEST_SKIP() << "no Python";
  std::mt19937 rng(7);
  std::string bytes;
  for (int i = 0; i < 200000; ++i)
    bytes += static_cast<char>(rng() % 3 ? 0x80 + rng() % 128 : rng() % 256);
  bytes += generated_corpus(8, 100000, true);
  const fs::path in = scratch_dir() / "random.bin", out = scratch_dir() / "random.replaced";
  write_bytes(in, bytes);
  ASSERT_TRUE(run_reference("replace " + quoted(in) + " " + quoted(out)));
  EXPECT_EQ(replace_invalid_utf8(bytes), read_bytes(out));
  fs::remove_all(scratch_dir());
}

TEST(Pretokenizer, CutsLikeGpt2sPattern) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces_of("Hello world's 123 cats!"),
            (V{"Hello", " world", "'s", " 123", " cats", "!"}));
  EXPECT_EQ(pieces_of("I'm we'll they've 'S 'x"),
            (V{"I", "'m", " we", "'ll", " they", "'ve", " '", "S", " '", "x"}));
  // \s+(?!\S): a run leaves its last space to the word after it; at the end it stays whole.
  EXPECT_EQ(pieces_of("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(pieces_of("a\n\n b  "), (V{"a", "\n\n", " b", "  "}));
  EXPECT_EQ(pieces_of("a\n\nb"), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces_of("x\t y"), (V{"x", "\t", " y"}));
  // Letters, numbers and the rest are separate runs; one plain space joins any of them.
  EXPECT_EQ(pieces_of("abc123?!x ١٢ ½ 日本語 😀😀"),
            (V{"abc", "123", "?!", "x", " ١٢", " ½", " 日本語", " 😀😀"}));
  // U+00A0 and U+3000 are whitespace but never the joining space; U+200B is not whitespace.
  EXPECT_EQ(pieces_of("a\xC2\xA0"
                      "b"),
            (V{"a", "\xC2\xA0", "b"}));
  EXPECT_EQ(pieces_of("a\xE2\x80\x8B"
                      "b"),
            (V{"a", "\xE2\x80\x8B", "b"}));
  EXPECT_EQ(char_class(U'é'), CharClass::Letter);
  EXPECT_EQ(char_class(U'Ⅻ'), CharClass::Number);
  EXPECT_EQ(char_class(0x3000), CharClass::Space);
  EXPECT_EQ(char_class(0x1C), CharClass::Other);  // isspace() in Python, not White_Space
  EXPECT_EQ(char_class(0x1F600), CharClass::Other);
}

TEST(Pretokenizer, CutPointsSplitNowhereAPieceRuns) {
  const std::string text = generated_corpus(3, 300000, false);
  const auto cuts = safe_cut_points(text, 16);
  ASSERT_GT(cuts.size(), 8u);
  std::vector<size_t> boundaries;
  size_t at = 0;
  for (std::string_view p : gpt2_pieces(text)) boundaries.push_back(at), at += p.size();
  for (size_t cut : cuts)
    EXPECT_TRUE(std::binary_search(boundaries.begin(), boundaries.end(), cut)) << cut;
}

TEST_F(Gpt2Tokenizer, KnowsItsVocabulary) {
  EXPECT_EQ(tok_->vocab_size(), 50257);
  EXPECT_EQ(tok_->token_id("<|endoftext|>"), 50256);
  EXPECT_EQ(tok_->special_ids(), std::vector<uint32_t>{50256});
  EXPECT_EQ(tok_->merges().size(), 50000u);
  // Hand-checked against GPT-2: "Hello world" -> [15496, 995], " Hello" -> 18435.
  EXPECT_EQ(tok_->encode("Hello world"), (std::vector<uint32_t>{15496, 995}));
  EXPECT_EQ(tok_->encode(" Hello world"), (std::vector<uint32_t>{18435, 995}));
  // Special tokens are never made from text (encode_ordinary).
  EXPECT_NE(tok_->encode("<|endoftext|>"), std::vector<uint32_t>{50256});
  EXPECT_EQ(tok_->decode({50256}), "<|endoftext|>");
  EXPECT_THROW(tok_->decode({50257}), Error);
}

TEST_F(Gpt2Tokenizer, MatchesTiktokenOnAGeneratedCorpus) {
  skip_without("tiktoken, tiktoken_ext.openai_public");
  const std::string text = generated_corpus(11, 1 << 21, true);
  const std::vector<uint32_t> ids = tok_->encode(text, 1);
  const std::vector<uint32_t> expected = reference_ids("tiktoken", text, "generated");
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(ids.size(), expected.size());
  EXPECT_TRUE(ids == expected) << first_difference(*tok_, ids, expected);
  // Every core gives the same ids; decoding gives the text back (after the U+FFFD rule).
  for (int threads : {2, 3, 8})
    EXPECT_TRUE(tok_->encode(text, threads) == ids) << threads << " threads";
  EXPECT_TRUE(tok_->decode(ids) == replace_invalid_utf8(text));
}

TEST_F(Gpt2Tokenizer, MatchesTransformersGpt2Tokenizer) {
  skip_without("transformers");
  const std::string text = generated_corpus(12, 1 << 20, false);
  const std::vector<uint32_t> ids = tok_->encode(text);
  const std::vector<uint32_t> expected = reference_ids("gpt2", text, "generated_hf");
  ASSERT_FALSE(expected.empty());
  EXPECT_TRUE(ids == expected) << first_difference(*tok_, ids, expected);
  EXPECT_TRUE(tok_->decode(ids) == text);
}

TEST_F(Gpt2Tokenizer, MatchesTiktokenOnEveryCodePoint) {
  skip_without("tiktoken, tiktoken_ext.openai_public");
  // Each code point after neighbours of every class and before "'s", which is one token
  // (338) unless the code point is in a [^\s\p{L}\p{N}] run that swallows the apostrophe.
  const char* neighbours[] = {"a", "1", " ", "!", "\n", "'"};
  std::string text;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    text += neighbours[c % 6];
    append_utf8(text, c);
    text += "'s";
  }
  const std::vector<uint32_t> ids = tok_->encode(text);
  const std::vector<uint32_t> expected = reference_ids("tiktoken", text, "code_points");
  EXPECT_TRUE(ids == expected) << first_difference(*tok_, ids, expected);
}

TEST_F(Gpt2Tokenizer, MatchesTiktokenOnTheDefaultCorpus) {
  skip_without("tiktoken, tiktoken_ext.openai_public");
  // The corpus scripts/main.sh trains on: Debian's fortunes, when installed.
  const fs::path fortunes = "/usr/share/games/fortunes";
  if (!fs::is_directory(fortunes))
    GTEST_SKIP() << fortunes << " is missing (Debian package fortunes)";
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(fortunes))
    if (e.is_regular_file() && e.path().extension() != ".dat" && e.path().extension() != ".u8")
      files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) text += read_bytes(f);
  ASSERT_GT(text.size(), 1000000u);
  const std::vector<uint32_t> ids = tok_->encode(text);
  const std::vector<uint32_t> expected = reference_ids("tiktoken", text, "fortunes");
  EXPECT_TRUE(ids == expected) << first_difference(*tok_, ids, expected);
  EXPECT_TRUE(tok_->decode(ids) == replace_invalid_utf8(text));
}
