// WordPiece without Python: BERT's normalizer and pre-tokenizer against outputs of Hugging
// Face `tokenizers` 0.20.3 written down here, the greedy longest-match model, truncation
// and padding as `tokenizers` defines them, the decoder, the files, and the refusals.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/data/bert_normalizer.h"
#include "tessera/data/wordpiece.h"
#include "tests/data/tokenizer_test_util.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::test;

namespace {

// ids 0..4 are BERT's special tokens.
WordPieceTokenizer small_bert(bool lowercase = true) {
  return WordPieceTokenizer(WordPieceTokenizer::bert_config(
      {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un",   "##aff", "##able", "a",  "##b",
       "b",     ",",     ".",     "'",     "s",      "cafe", "caf",   "##é",    "中", "文",
       "x",     "y",     "z",     "##z",   "do",     "n",    "##'",   "t"},
      lowercase));
}

std::vector<uint32_t> ids(const WordPieceTokenizer& tok, const std::string& text) {
  return tok.encode(text);
}

std::string with_long_word(size_t letters) { return "a " + std::string(letters, 'z') + " a"; }

template <typename F>
void expect_error(F&& f, const std::vector<std::string>& fragments) {
  try {
    f();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    for (const std::string& fragment : fragments)
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "'" << fragment << "' missing from: " << e.what();
  }
}

}  // namespace

// The expected values in these tests are what `tokenizers` 0.20.3 gave for the same
// vocabulary and input. The expected strings here are what
// tokenizers.normalizers.BertNormalizer(...).normalize_str returned for the same input.
TEST(WordPiece, NormalizesAsBertNormalizerDoes) {
  const std::string text =
      "H\u00e9llo\tWORLD\x01\u200b \u4e2d\u6587!\ufb01 \u0130stanbul \u01c5 e\u0301\u0323 "
      "\ud55c\uad6d \ufffd" +
      std::string(1, '\0') + "x\u3000y";
  BertNormalizerOptions uncased;
  EXPECT_EQ(bert_normalize(text, uncased),
            "hello world  \u4e2d  \u6587 !\ufb01 istanbul \u01c6 e "
            "\u1112\u1161\u11ab\u1100\u116e\u11a8 x y");
  BertNormalizerOptions cased;
  cased.lowercase = false;
  EXPECT_EQ(bert_normalize(text, cased),
            "H\u00e9llo WORLD  \u4e2d  \u6587 !\ufb01 \u0130stanbul \u01c5 e\u0301\u0323 "
            "\ud55c\uad6d x y");
  cased.strip_accents = true;
  EXPECT_EQ(bert_normalize(text, cased),
            "Hello WORLD  \u4e2d  \u6587 !\ufb01 Istanbul \u01c5 e "
            "\u1112\u1161\u11ab\u1100\u116e\u11a8 x y");
}

TEST(WordPiece, PreTokenizesAtWhiteSpaceAndAroundPunctuation) {
  std::vector<std::string_view> words;
  bert_pre_tokenize("a,b  c\u00bfd\u2026e$f\u00a0g's", words);
  EXPECT_EQ(words, (std::vector<std::string_view>{"a", ",", "b", "c", "\u00bf", "d", "\u2026", "e",
                                                  "$", "f", "g", "'", "s"}));
}

TEST(WordPiece, TakesTheLongestPieceFirstAndAWholeWordAsUnknown) {
  const WordPieceTokenizer tok = small_bert();
  EXPECT_EQ(ids(tok, "UnAffable ab"), (std::vector<uint32_t>{5, 6, 7, 8, 9}));
  EXPECT_EQ(ids(tok, "unaffablex b"), (std::vector<uint32_t>{1, 10}))
      << "a word with a part that has no piece is one [UNK]";
  EXPECT_EQ(ids(tok, "Caf\u00e9"), (std::vector<uint32_t>{15})) << "uncased strips accents";
  EXPECT_EQ(ids(small_bert(false), "caf\u00e9"), (std::vector<uint32_t>{16, 17}));
  EXPECT_EQ(ids(tok, "x\u4e2d\u6587y"), (std::vector<uint32_t>{20, 18, 19, 21}));
  std::vector<uint32_t> hundred = {8, 22};
  hundred.insert(hundred.end(), 99, 23);
  hundred.push_back(8);
  EXPECT_EQ(ids(tok, with_long_word(100)), hundred);
  EXPECT_EQ(ids(tok, with_long_word(101)), (std::vector<uint32_t>{8, 1, 8}))
      << "more than max_input_chars_per_word (100) characters is [UNK]";
  EXPECT_EQ(ids(tok, "a [MASK] a[MASK]"), (std::vector<uint32_t>{8, 4, 8, 4}))
      << "special tokens are found in the raw text";
  EXPECT_EQ(ids(tok, "[mask]"), (std::vector<uint32_t>{1, 1, 1})) << "but only as written";
}

TEST(WordPiece, AddsTheTemplateAndTruncatesAsTokenizersDoes) {
  const WordPieceTokenizer tok = small_bert();
  EncodeOptions o;
  Encoding e = tok.encode_pair("a b", "x y z", o);
  EXPECT_EQ(e.input_ids, (std::vector<uint32_t>{2, 8, 10, 3, 20, 21, 22, 3}));
  EXPECT_EQ(e.token_type_ids, (std::vector<uint32_t>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(e.special_tokens_mask, (std::vector<uint32_t>{1, 0, 0, 1, 0, 0, 0, 1}));
  EXPECT_EQ(tok.num_special_tokens_to_add(true), 3u);
  o.truncation = true;
  o.max_length = 7;  // 4 for the texts: the shorter keeps 2, the longer 2
  EXPECT_EQ(tok.encode_pair("a b", "x y z", o).input_ids,
            (std::vector<uint32_t>{2, 8, 10, 3, 20, 21, 3}));
  o.max_length = 6;  // 3: both too long for an even share, the longer gets the odd one
  EXPECT_EQ(tok.encode_pair("a a a a", "x y z", o).input_ids,
            (std::vector<uint32_t>{2, 8, 8, 3, 20, 3}));
  o.truncation_strategy = TruncationStrategy::OnlySecond;
  EXPECT_EQ(tok.encode_pair("a b", "x y z", o).input_ids,
            (std::vector<uint32_t>{2, 8, 10, 3, 20, 3}));
  o.truncation_side = Side::Left;
  EXPECT_EQ(tok.encode_pair("a b", "x y z", o).input_ids,
            (std::vector<uint32_t>{2, 8, 10, 3, 22, 3}));
  o.truncation_strategy = TruncationStrategy::OnlyFirst;
  expect_error([&] { tok.encode_pair("a b", "x y z", o); }, {"only_first", "2 tokens"});
  EXPECT_EQ(tok.encode("a b a b a b", o).input_ids, (std::vector<uint32_t>{2, 8, 10, 8, 10, 3}));
  o.truncation_strategy = TruncationStrategy::OnlySecond;
  expect_error([&] { tok.encode("a b a b a b", o); }, {"only_second", "text_pair"});
  o.add_special_tokens = false;
  o.truncation_strategy = TruncationStrategy::LongestFirst;
  e = tok.encode_pair("a b", "x y z", o);
  EXPECT_EQ(e.input_ids, (std::vector<uint32_t>{8, 10, 20, 21, 22}));
  EXPECT_EQ(e.token_type_ids, (std::vector<uint32_t>{0, 0, 1, 1, 1}));
}

TEST(WordPiece, PadsTheBatchToItsLongestOrToMaxLength) {
  const WordPieceTokenizer tok = small_bert();
  EncodeOptions o;
  o.padding = PaddingStrategy::Longest;
  std::vector<Encoding> batch = tok.encode_batch({"a", "a b a b"}, {}, o);
  EXPECT_EQ(batch[0].input_ids, (std::vector<uint32_t>{2, 8, 3, 0, 0, 0}));
  EXPECT_EQ(batch[0].attention_mask, (std::vector<uint32_t>{1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(batch[1].attention_mask, std::vector<uint32_t>(6, 1));
  o.padding = PaddingStrategy::MaxLength;
  o.max_length = 5;
  o.pad_to_multiple_of = 4;
  o.padding_side = Side::Left;
  const Encoding e = tok.encode("a", o);
  EXPECT_EQ(e.input_ids, (std::vector<uint32_t>{0, 0, 0, 0, 0, 2, 8, 3}));
  EXPECT_EQ(e.token_type_ids, std::vector<uint32_t>(8, 0));
  EXPECT_EQ(e.attention_mask, (std::vector<uint32_t>{0, 0, 0, 0, 0, 1, 1, 1}));
  o.truncation = true;  // transformers refuses a length that padding would round past
  expect_error([&] { tok.encode("a", o); }, {"max_length 5", "pad_to_multiple_of 4"});
  o.truncation = false;
  o.max_length = 0;
  expect_error([&] { tok.encode("a", o); }, {"max_length", "model_max_length"});
}

TEST(WordPiece, DecodesJoiningContinuationPieces) {
  const WordPieceTokenizer tok = small_bert();
  EXPECT_EQ(tok.decode({2, 5, 6, 7, 11, 8, 9, 12, 3}), "[CLS] unaffable, ab. [SEP]");
  EXPECT_EQ(tok.decode({2, 5, 6, 7, 11, 8, 9, 12, 3}, true), "unaffable, ab.");
  EXPECT_EQ(tok.decode({24, 25, 26, 27, 8, 13, 14}), "do n' t a ' s")
      << "the cleanup sees one token at a time";
  EXPECT_EQ(tok.decode({6, 8}), "##aff a") << "a first piece keeps its prefix";
  expect_error([&] { tok.decode({28}); }, {"id 28", "28"});
}

TEST(WordPiece, NamesItsSpecialTokens) {
  const WordPieceTokenizer tok = small_bert();
  EXPECT_EQ(tok.role_id("pad_token"), 0u);
  EXPECT_EQ(tok.role_id("unk_token"), 1u);
  EXPECT_EQ(tok.role_id("cls_token"), 2u);
  EXPECT_EQ(tok.role_id("sep_token"), 3u);
  EXPECT_EQ(tok.role_id("mask_token"), 4u);
  EXPECT_EQ(tok.token_to_id("##able"), 7u);
  EXPECT_FALSE(tok.token_to_id("able").has_value());
  EXPECT_EQ(tok.type(), "wordpiece");
  EXPECT_EQ(tok.vocab_size(), 28);
}

TEST(WordPiece, WritesFilesItReadsBack) {
  const WordPieceTokenizer tok = small_bert(false);
  const fs::path dir = scratch_dir() / "wordpiece_files";
  fs::remove_all(dir);
  tok.save_files(dir);
  const std::string text = "Caf\u00e9 unaffable, [MASK] \u4e2d!";
  const auto from_json = load_tokenizer(dir / "tokenizer.json");
  EXPECT_EQ(from_json->type(), "wordpiece");
  EXPECT_EQ(from_json->encode(text), tok.encode(text));
  // Loaded as a folder, as BertTokenizerFast loads it: tokenizer_config.json's do_lower_case
  // (true when left out) overrides tokenizer.json's normalizer.
  EXPECT_EQ(load_tokenizer_from(dir)->encode(text), tok.encode(text));
  const std::string config = read_bytes(dir / "tokenizer_config.json");
  write_bytes(dir / "tokenizer_config.json", R"({"tokenizer_class": "BertTokenizer"})");
  EXPECT_EQ(load_tokenizer_from(dir)->encode(text), small_bert(true).encode(text));
  write_bytes(dir / "tokenizer_config.json", config);
  fs::remove(dir / "tokenizer.json");  // vocab.txt + tokenizer_config.json (do_lower_case false)
  const auto from_vocab = load_tokenizer_from(dir);
  ASSERT_NE(from_vocab, nullptr);
  EXPECT_EQ(from_vocab->encode(text), tok.encode(text));
  EXPECT_EQ(from_vocab->to_json(), tok.to_json());
  fs::remove(dir / "tokenizer_config.json");  // transformers' default: do_lower_case true
  EXPECT_EQ(load_tokenizer_from(dir)->encode(text), small_bert(true).encode(text));
}

TEST(WordPiece, RefusesBadFilesNamingTheFileAndKey) {
  nlohmann::json good = nlohmann::json::parse(small_bert().to_json());
  EXPECT_NO_THROW(tokenizer_from_json(good.dump(), "bert.json"));
  const auto refused = [&](const std::function<void(nlohmann::json&)>& edit,
                           const std::vector<std::string>& fragments) {
    nlohmann::json j = good;
    edit(j);
    std::vector<std::string> all = fragments;
    all.push_back("bert.json");
    expect_error([&] { tokenizer_from_json(j.dump(), "bert.json"); }, all);
  };
  refused([](auto& j) { j["model"].erase("unk_token"); }, {"model.unk_token", "missing"});
  refused([](auto& j) { j["model"]["unk_token"] = "[NOPE]"; }, {"model.unk_token", "[NOPE]"});
  refused(
      [](auto& j) {  // [CLS]'s id goes to another token
        j["model"]["vocab"].erase("[CLS]");
        j["model"]["vocab"]["[KLS]"] = 2;
        j["added_tokens"].erase(2);
      },
      {"post_processor.special_tokens '[CLS]'", "model.vocab"});
  refused([](auto& j) { j["normalizer"] = {{"type", "NFC"}}; }, {"normalizer", "NFC"});
  refused(
      [](auto& j) {
        j["pre_tokenizer"] = {{"type", "Whitespace"}};
      },
      {"pre_tokenizer", "Whitespace"});
  refused([](auto& j) { j["model"]["vocab"]["zz"] = 900; }, {"model.vocab", "zz"});
  refused([](auto& j) { j["normalizer"]["lowercase"] = "yes"; }, {"normalizer.lowercase"});
  const fs::path dir = scratch_dir() / "wordpiece_no_cls";
  fs::create_directories(dir);
  write_bytes(dir / "vocab.txt", "[PAD]\n[UNK]\n[SEP]\na\n");
  expect_error([&] { load_tokenizer_from(dir); }, {"vocab.txt", "cls_token", "[CLS]"});
}
