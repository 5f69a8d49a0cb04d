// Tokenizers: exact round trips on random bytes (including invalid UTF-8), and BPE
// training checked merge-for-merge against a naive trainer written here that recounts
// every pair from scratch before each merge.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"

using namespace tessera;
using namespace tessera::data;

namespace {

std::string random_bytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  std::uniform_int_distribution<int> byte(0, 255);
  for (char& c : s) c = static_cast<char>(byte(rng));
  return s;
}

// Text with repeated words, punctuation, digits, multi-byte UTF-8 and newlines.
std::string sample_corpus(std::mt19937& rng, size_t words) {
  const std::vector<std::string> vocabulary = {
      "the", "cat", "sat", "on", "a", "mat", "and", "then", "dog", "ran", "far", "away",
      "héllo", "naïve", "日本", "42", "1999", ",", ".", "!", "\n", "  ", "\t", "ünïcödé"};
  std::uniform_int_distribution<size_t> pick(0, vocabulary.size() - 1);
  std::string out;
  for (size_t i = 0; i < words; ++i) {
    out += vocabulary[pick(rng)];
    if (i % 3 != 2) out += ' ';
  }
  return out;
}

// Reference BPE trainer: the same pieces and tie rule (most frequent pair, then smallest
// (left, right)), but every pair recounted over the whole corpus before each merge.
std::vector<BpeTokenizer::Merge> naive_bpe(const std::string& corpus, int64_t vocab_size) {
  std::vector<std::vector<uint32_t>> words;
  for (std::string_view piece : split_into_pieces(corpus)) {
    std::vector<uint32_t> w;
    for (unsigned char c : piece) w.push_back(c);
    words.push_back(w);
  }
  std::vector<BpeTokenizer::Merge> merges;
  while (256 + static_cast<int64_t>(merges.size()) < vocab_size) {
    std::map<std::pair<uint32_t, uint32_t>, int64_t> counts;
    for (const auto& w : words)
      for (size_t i = 0; i + 1 < w.size(); ++i) ++counts[{w[i], w[i + 1]}];
    std::pair<uint32_t, uint32_t> best{};
    int64_t best_count = 0;
    for (const auto& [pair, count] : counts)  // ascending pairs: first max wins ties
      if (count > best_count) best = pair, best_count = count;
    if (best_count < 2) break;
    const uint32_t id = 256 + static_cast<uint32_t>(merges.size());
    merges.push_back(best);
    for (auto& w : words) {
      std::vector<uint32_t> merged;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == best.first && w[i + 1] == best.second) {
          merged.push_back(id);
          ++i;
        } else {
          merged.push_back(w[i]);
        }
      }
      w = merged;
    }
  }
  return merges;
}

std::filesystem::path temp_path(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("tessera_test_tokenizer_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

// Removes this process's temporary folder when the tests are done.
class TempCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                ("tessera_test_tokenizer_" + std::to_string(::getpid())));
  }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempCleanup);

}  // namespace

TEST(Pieces, ConcatenateToTheInputAndStayShort) {
  std::mt19937 rng(1);
  for (size_t n : {0, 1, 7, 33, 257, 5000}) {
    for (const std::string& text : {random_bytes(rng, n), sample_corpus(rng, n)}) {
      std::string joined;
      for (std::string_view p : split_into_pieces(text)) {
        EXPECT_FALSE(p.empty());
        EXPECT_LE(p.size(), 64u);
        joined += p;
      }
      EXPECT_EQ(joined, text);
    }
  }
  auto pieces = split_into_pieces("Hello, world  42!");
  std::vector<std::string> expected = {"Hello", ",", " world", " ", " 42", "!"};
  ASSERT_EQ(pieces.size(), expected.size());
  for (size_t i = 0; i < pieces.size(); ++i) EXPECT_EQ(pieces[i], expected[i]);
}

TEST(ByteTokenizer, RoundTripsEveryByteString) {
  ByteTokenizer tok;
  std::mt19937 rng(2);
  for (size_t n : {0, 1, 7, 33, 257, 4096}) {
    const std::string s = random_bytes(rng, n);
    const auto ids = tok.encode(s);
    ASSERT_EQ(ids.size(), s.size());
    for (size_t i = 0; i < s.size(); ++i) EXPECT_EQ(ids[i], static_cast<unsigned char>(s[i]));
    EXPECT_EQ(tok.decode(ids), s);
  }
  EXPECT_THROW(tok.decode({256}), Error);
}

TEST(BpeTokenizer, TrainingMatchesNaiveReference) {
  std::mt19937 rng(3);
  const std::string corpus = sample_corpus(rng, 3000) + random_bytes(rng, 300);
  for (int64_t vocab : {256, 257, 300, 400}) {
    const BpeTokenizer tok = BpeTokenizer::train(corpus, vocab);
    const auto reference = naive_bpe(corpus, vocab);
    ASSERT_EQ(tok.merges().size(), reference.size()) << "vocab " << vocab;
    for (size_t i = 0; i < reference.size(); ++i) EXPECT_EQ(tok.merges()[i], reference[i]) << "merge " << i;
    EXPECT_EQ(tok.vocab_size(), 256 + static_cast<int64_t>(reference.size()));
  }
}

TEST(BpeTokenizer, StopsWhenNothingRepeats) {
  const BpeTokenizer tok = BpeTokenizer::train("abcdefg", 1000);
  EXPECT_EQ(tok.vocab_size(), 256);  // no pair occurs twice
  const BpeTokenizer two = BpeTokenizer::train("abab abab", 1000);
  EXPECT_GT(two.vocab_size(), 256);
  EXPECT_THROW(BpeTokenizer::train("abc", 100), Error);
}

TEST(BpeTokenizer, RoundTripsRandomBytesAndCompressesText) {
  std::mt19937 rng(4);
  const std::string corpus = sample_corpus(rng, 5000);
  const BpeTokenizer tok = BpeTokenizer::train(corpus, 512);
  const auto ids = tok.encode(corpus);
  EXPECT_LT(ids.size() * 2, corpus.size()) << "BPE should compress its own corpus";
  EXPECT_EQ(tok.decode(ids), corpus);
  for (uint32_t id : ids) EXPECT_LT(id, static_cast<uint32_t>(tok.vocab_size()));
  for (size_t n : {0, 1, 7, 33, 257, 2000}) {
    // Invalid UTF-8 (lone continuation bytes, truncated sequences) and mixes with text.
    std::string s = random_bytes(rng, n);
    EXPECT_EQ(tok.decode(tok.encode(s)), s);
    std::string mixed = sample_corpus(rng, n) + "\xC3" + s + "\x80\xFF" + sample_corpus(rng, 5);
    EXPECT_EQ(tok.decode(tok.encode(mixed)), mixed);
  }
  // Every id decodes to the concatenation of its merge parts.
  for (size_t i = 0; i < tok.merges().size(); ++i) {
    const auto [l, r] = tok.merges()[i];
    EXPECT_EQ(tok.token_bytes(256 + i), tok.token_bytes(l) + tok.token_bytes(r));
  }
  EXPECT_THROW(tok.decode({static_cast<uint32_t>(tok.vocab_size())}), Error);
}

TEST(BpeTokenizer, SavesAndLoadsAsJson) {
  std::mt19937 rng(5);
  const std::string corpus = sample_corpus(rng, 2000);
  const BpeTokenizer tok = BpeTokenizer::train(corpus, 350);
  const auto path = temp_path("bpe.json");
  tok.save(path);
  const auto loaded = load_tokenizer(path);
  EXPECT_EQ(loaded->type(), "bpe");
  EXPECT_EQ(loaded->vocab_size(), tok.vocab_size());
  const std::string text = sample_corpus(rng, 500) + random_bytes(rng, 100);
  EXPECT_EQ(loaded->encode(text), tok.encode(text));

  ByteTokenizer bytes;
  bytes.save(temp_path("byte.json"));
  EXPECT_EQ(load_tokenizer(temp_path("byte.json"))->type(), "byte");
}

TEST(BpeTokenizer, RejectsBadJsonNamingTheProblem) {
  auto expect_error = [](const std::string& json, const std::string& fragment) {
    try {
      tokenizer_from_json(json, "tok.json");
      ADD_FAILURE() << "accepted " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("tok.json"), std::string::npos) << e.what();
    }
  };
  expect_error("{", "not valid JSON");
  expect_error(R"({"kind": "bpe"})", "type");
  expect_error(R"({"type": "wordpiece"})", "wordpiece");
  expect_error(R"({"type": "bpe", "merges": [[1]]})", "merges");
  expect_error(R"({"type": "bpe", "merges": [[300, 1]]})", "merge 0");
  expect_error(R"({"type": "bpe", "vocab_size": 999, "merges": [[97, 98]]})", "vocab_size");
  EXPECT_THROW(load_tokenizer(temp_path("does_not_exist.json")), Error);
}
