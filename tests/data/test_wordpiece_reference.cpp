// WordPiece against transformers.BertTokenizerFast (tests/data/wordpiece_reference.py):
// vocabularies trained by `tokenizers`' WordPieceTrainer, uncased and cased, loaded here
// from tokenizer.json and from vocab.txt, encode a megabyte of mixed text (accents, CJK,
// punctuation, words over 100 characters, control characters, emoji, mixed scripts, every
// kind of white space, code points from every plane) to the same input_ids, token_type_ids
// and attention masks, single and paired, truncated and padded; and what Tessera saves
// loads in transformers and encodes the same.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tessera/data/wordpiece.h"
#include "tests/data/tokenizer_test_util.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::test;

namespace {

bool run_wordpiece_reference(const std::string& args) {
  const std::string cmd = python_interpreter() + " " + TESSERA_SOURCE_DIR +
                          "/tests/data/wordpiece_reference.py " + args;
  return std::system(cmd.c_str()) == 0;
}

// generated_corpus plus what BERT's normalizer treats specially: combining marks, Hangul,
// controls, zero-width and format characters, special tokens written in the text.
std::string bert_corpus(uint32_t seed, size_t bytes) {
  const std::vector<std::string> extras = {"e\u0301\u0323",
                                           "\u1e9b\u0323",
                                           "\u0130",
                                           "\u01c5",
                                           "\ud55c\uad6d\uc5b4",
                                           "\u00c5ngstr\u00f6m",
                                           "\x01\x7f",
                                           "\u0085\u009f",
                                           "\u200b",
                                           "\u200d",
                                           "\ufeff",
                                           "\ufffd",
                                           std::string(1, '\0'),
                                           "[MASK]",
                                           "[CLS]",
                                           "[mask]",
                                           "\u3002\u300c\u300d",
                                           "\u00bfQu\u00e9?",
                                           "\u2014\u2026",
                                           "\U0002B820",
                                           "\U0002B920",
                                           "\u0f73",
                                           "\u1734",
                                           "\u2e43"};
  std::mt19937 rng(seed);
  const std::string base = generated_corpus(seed, bytes, false);
  std::string out;
  for (size_t start = 0; start < base.size();) {  // an extra after every 64 bytes or so
    size_t end = std::min(base.size(), start + 64);
    while (end < base.size() && (static_cast<unsigned char>(base[end]) & 0xC0) == 0x80) ++end;
    out.append(base, start, end - start);
    out += extras[rng() % extras.size()];
    start = end;
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& text, size_t longest) {
  std::vector<std::string> lines;
  for (size_t start = 0; start < text.size();) {
    size_t end = std::min(text.find('\n', start), text.size());
    if (end - start > longest) {  // a cut at a character boundary
      end = start + longest;
      while ((static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
    }
    lines.push_back(text.substr(start, end - start));
    start = end + (end < text.size() && text[end] == '\n');
  }
  return lines;
}

nlohmann::json to_json(const std::vector<Encoding>& batch) {
  nlohmann::json j = {{"input_ids", nlohmann::json::array()},
                      {"token_type_ids", nlohmann::json::array()},
                      {"attention_mask", nlohmann::json::array()}};
  for (const Encoding& e : batch) {
    j["input_ids"].push_back(e.input_ids);
    j["token_type_ids"].push_back(e.token_type_ids);
    j["attention_mask"].push_back(e.attention_mask);
  }
  return j;
}

struct Case {
  std::vector<std::string> texts, pairs;
  EncodeOptions options;
  nlohmann::json kwargs;  // the same options, as transformers' __call__ takes them
};

// Runs every case through BertTokenizerFast.from_pretrained(dir) and through `tok`;
// reports the first text of each case whose encoding differs.
void expect_same_as_transformers(const WordPieceTokenizer& tok, const fs::path& dir,
                                 const std::vector<Case>& cases, const std::string& what) {
  nlohmann::json requests = nlohmann::json::array();
  for (const Case& c : cases) {
    nlohmann::json r = {{"texts", c.texts}, {"kwargs", c.kwargs}, {"pairs", nullptr}};
    if (!c.pairs.empty()) r["pairs"] = c.pairs;
    if (c.options.truncation_side == Side::Left) r["sides"]["truncation_side"] = "left";
    if (c.options.padding_side == Side::Left) r["sides"]["padding_side"] = "left";
    requests.push_back(r);
  }
  const fs::path in = scratch_dir() / "wp_cases.json", out = scratch_dir() / "wp_out.json";
  write_bytes(in, requests.dump());
  fs::remove(out);
  ASSERT_TRUE(
      run_wordpiece_reference("cases " + quoted(dir) + " " + quoted(in) + " " + quoted(out)));
  const nlohmann::json expected = nlohmann::json::parse(read_bytes(out));
  for (size_t k = 0; k < cases.size(); ++k) {
    const nlohmann::json ours =
        to_json(tok.encode_batch(cases[k].texts, cases[k].pairs, cases[k].options));
    for (const char* key : {"input_ids", "token_type_ids", "attention_mask"})
      for (size_t i = 0; i < cases[k].texts.size(); ++i)
        if (ours[key][i] != expected[k][key][i]) {
          ADD_FAILURE() << what << ", case " << k << " " << cases[k].kwargs.dump() << ", " << key
                        << " of text " << i << " " << nlohmann::json(cases[k].texts[i]).dump()
                        << (cases[k].pairs.empty()
                                ? ""
                                : " + " + nlohmann::json(cases[k].pairs[i]).dump())
                        << "\n ours:   " << ours[key][i].dump()
                        << "\n theirs: " << expected[k][key][i].dump();
          break;
        }
  }
}

std::vector<Case> megabyte_cases(uint32_t seed) {
  const std::vector<std::string> lines = lines_of(bert_corpus(seed, 1 << 20), 400);
  std::vector<std::string> first(lines.begin(), lines.begin() + lines.size() / 2),
      second(lines.begin() + lines.size() / 2, lines.begin() + lines.size() / 2 * 2);
  const std::vector<std::string> few(lines.begin(), lines.begin() + 600),
      short_texts(600, "a short text, caf\u00e9!");
  std::vector<Case> cases;
  cases.push_back({lines, {}, {}, nlohmann::json::object()});  // the whole megabyte
  EncodeOptions o;
  o.truncation = true;
  o.max_length = 48;
  o.padding = PaddingStrategy::Longest;
  cases.push_back({first,
                   second,
                   o,
                   {{"truncation", "longest_first"}, {"max_length", 48}, {"padding", "longest"}}});
  o.truncation_strategy = TruncationStrategy::OnlySecond;
  o.max_length = 40;
  o.padding = PaddingStrategy::MaxLength;
  cases.push_back({short_texts,
                   few,
                   o,
                   {{"truncation", "only_second"}, {"max_length", 40}, {"padding", "max_length"}}});
  o = {};
  o.padding = PaddingStrategy::Longest;
  o.pad_to_multiple_of = 16;
  cases.push_back({few, {}, o, {{"padding", "longest"}, {"pad_to_multiple_of", 16}}});
  o = {};
  o.truncation = true;
  o.truncation_strategy = TruncationStrategy::OnlyFirst;
  o.max_length = 24;
  o.truncation_side = o.padding_side = Side::Left;
  o.padding = PaddingStrategy::Longest;
  cases.push_back(
      {few, short_texts, o, {{"truncation", "only_first"}, {"max_length", 24}, {"padding", true}}});
  o = {};
  o.add_special_tokens = false;
  o.truncation = true;
  o.max_length = 20;
  cases.push_back(
      {few, {}, o, {{"add_special_tokens", false}, {"truncation", true}, {"max_length", 20}}});
  return cases;
}

// A WordPiece trained by `tokenizers` into scratch/<name>; empty when it cannot run.
fs::path trained(const std::string& name, bool lowercase) {
  const fs::path dir = scratch_dir() / name, corpus = scratch_dir() / (name + ".txt");
  write_bytes(corpus, bert_corpus(lowercase ? 41 : 42, 400000));
  if (!run_wordpiece_reference("train " + quoted(corpus) + " 6000 " + (lowercase ? "1 " : "0 ") +
                               quoted(dir)))
    return {};
  return dir;
}

void skip_without_transformers() {
  if (!python_can_import("transformers, tokenizers"))
    GTEST_SKIP() << python_interpreter() << " cannot import transformers and tokenizers";
}

}  // namespace

TEST(WordPieceReference, EncodesAMegabyteAsBertTokenizerFastUncasedAndCased) {
  skip_without_transformers();
  for (const bool lowercase : {true, false}) {
    const std::string what = lowercase ? "uncased" : "cased";
    const fs::path dir = trained("wp_" + what, lowercase);
    ASSERT_FALSE(dir.empty()) << "training the reference vocabulary failed";
    const auto tok = load_tokenizer_from(dir);
    const auto* wordpiece = dynamic_cast<const WordPieceTokenizer*>(tok.get());
    ASSERT_NE(wordpiece, nullptr);
    EXPECT_EQ(wordpiece->config().normalizer->lowercase, lowercase);
    expect_same_as_transformers(*wordpiece, dir, megabyte_cases(lowercase ? 43 : 44), what);
  }
}

TEST(WordPieceReference, VocabTxtLoadsAsBertTokenizerFastReadsIt) {
  skip_without_transformers();
  const fs::path trained_dir = trained("wp_vocab_source", false),
                 dir = scratch_dir() / "wp_vocab_only";
  ASSERT_FALSE(trained_dir.empty());
  fs::create_directories(dir);
  fs::copy_file(trained_dir / "vocab.txt", dir / "vocab.txt", fs::copy_options::overwrite_existing);
  write_bytes(dir / "tokenizer_config.json",
              R"({"tokenizer_class": "BertTokenizer", "do_lower_case": false})");
  const WordPieceTokenizer tok =
      WordPieceTokenizer::from_vocab_file(dir / "vocab.txt", dir / "tokenizer_config.json");
  std::vector<Case> cases = megabyte_cases(45);
  cases.resize(2);
  cases[0].texts.resize(2000);
  expect_same_as_transformers(tok, dir, cases, "vocab.txt");
}

TEST(WordPieceReference, WhatTesseraSavesLoadsInTransformersWithTheSameIds) {
  skip_without_transformers();
  const fs::path trained_dir = trained("wp_resave", true), dir = scratch_dir() / "wp_saved";
  ASSERT_FALSE(trained_dir.empty());
  const auto loaded = load_tokenizer_from(trained_dir);
  fs::remove_all(dir);
  loaded->save_files(dir);
  for (const char* f :
       {"tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"})
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  const auto& tok = dynamic_cast<const WordPieceTokenizer&>(*loaded);
  std::vector<Case> cases = megabyte_cases(46);
  cases[0].texts.resize(3000);
  expect_same_as_transformers(tok, dir, cases, "saved by Tessera");
  // Decoding, with and without the special tokens, as transformers decodes.
  const std::vector<Encoding> encoded = tok.encode_batch(
      std::vector<std::string>(cases[0].texts.begin(), cases[0].texts.begin() + 300), {}, {});
  nlohmann::json requests = nlohmann::json::array();
  for (const bool skip : {false, true}) {
    nlohmann::json ids = nlohmann::json::array();
    for (const Encoding& e : encoded) ids.push_back(e.input_ids);
    requests.push_back({{"decode", ids}, {"skip_special_tokens", skip}});
  }
  const fs::path in = scratch_dir() / "wp_decode.json", out = scratch_dir() / "wp_decoded.json";
  write_bytes(in, requests.dump());
  ASSERT_TRUE(
      run_wordpiece_reference("cases " + quoted(dir) + " " + quoted(in) + " " + quoted(out)));
  const nlohmann::json expected = nlohmann::json::parse(read_bytes(out));
  for (size_t k = 0; k < 2; ++k)
    for (size_t i = 0; i < encoded.size(); ++i)
      EXPECT_EQ(tok.decode(encoded[i].input_ids, k == 1),
                expected[k]["texts"][i].get<std::string>())
          << "text " << i << " skip_special_tokens " << k;
}
