// Datasets of labelled examples: the JSON Lines / CSV / TSV readers against Python's json and
// csv modules (tests/data/dataset_reference.py), the tokenised cache (used the second time,
// rebuilt when the source, the tokenizer or the options change or the file is damaged), the
// labels, and the refusals of bad input, each naming the file, the line and the column.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/data/example_dataset.h"
#include "tessera/data/text_table.h"
#include "tests/data/example_test_util.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::test;

namespace {

const std::string kBom = "\xEF\xBB\xBF";

// Quoting that trips readers: "" escapes, delimiters and every line break inside quotes,
// text after a closing quote, a quote inside an unquoted field, empty fields, blank lines,
// records ended by \n, \r\n and a lone \r, unicode, a BOM and no final line break.
std::string tricky_delimited(char d) {
  const std::string s(1, d);
  return kBom + "text" + s + "label" + s + "text_pair\r\n" +
         "\"Hello" + s + " \"\"world\"\"\"" + s + "pos" + s + "plain\n" +
         "\"multi\nline\r\nwith crlf and \rcr\"" + s + "neg" + s + "\"a\"\"b\"\r\n" +
         "caf\u00e9 \u2615 \u65e5\u672c\u8a9e \U0001F600" + s + "pos" + s + "\"x\"y\r" +
         "unquoted \"quote\" inside" + s + "neg" + s + "\n" +
         "\r\n\n" +
         "\"\"" + s + "neg" + s + "\"\"\"\"\n" +
         "  spaced  " + s + "\"pos\"" + s + "\"" + s + "\"\n" +
         "last" + s + "pos" + s + "no newline at end";
}

std::string tricky_jsonl() {
  return kBom + R"({"text": "Hello \"world\"", "label": 1, "extra": [1, {"a": 2}]})" "\n" +
         R"({"label": 0, "text": "caf\u00e9 \ud83d\ude00 )" + "\u65e5\u672c\u8a9e\"}\r\n" +
         "   \n" +
         R"({"text": "tab\tand\\n escape, \/ slash", "label": 2.5, "text": "second wins"})" "\n" +
         R"({"text":"", "label": -7})" "\n" +
         R"(  {"text": "no final newline", "label": 1e3})";
}

nlohmann::json cell_json(const Cell& c) {
  switch (c.kind) {
    case Cell::Kind::Text: return c.text;
    case Cell::Kind::Integer: return c.integer;
    case Cell::Kind::Float: return c.number;
    case Cell::Kind::Boolean: return c.integer != 0;
    case Cell::Kind::Null: return nullptr;
  }
  return nullptr;
}

void expect_same_as_python(const std::string& bytes, const std::string& format,
                           const std::vector<std::string>& columns) {
  if (!python_can_import("json, csv")) GTEST_SKIP() << "no Python";
  const fs::path dir = example_scratch("python_" + format);
  const fs::path file = dir / ("table." + format), out = dir / "out.json";
  write_text(file, bytes);
  ASSERT_TRUE(run_dataset_reference("read " + format + " " + shell_quoted(file.string()) + " " +
                                    shell_quoted(nlohmann::json(columns).dump()) + " " +
                                    shell_quoted(out.string())));
  const nlohmann::json expected = nlohmann::json::parse(read_text(out));
  const Table table = read_table(file, parse_table_format(format), columns);
  ASSERT_EQ(table.rows.size(), expected.size());
  for (size_t r = 0; r < table.rows.size(); ++r)
    for (size_t c = 0; c < columns.size(); ++c)
      EXPECT_EQ(cell_json(table.rows[r].cells[c]), expected[r][columns[c]])
          << format << " row " << r << " column " << columns[c];
}

// Expects an Error whose message holds every one of `parts`.
template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << nlohmann::json(parts).dump();
  } catch (const Error& e) {
    for (const std::string& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' not in: " << e.what();
  }
}

std::vector<uint32_t> ids_of(const Example& e) { return {e.input_ids.begin(), e.input_ids.end()}; }

}  // namespace

TEST(TextTable, CsvReadsWhatPythonsCsvModuleReads) {
  expect_same_as_python(tricky_delimited(','), "csv", {"text", "label", "text_pair"});
}

TEST(TextTable, TsvReadsWhatPythonsCsvModuleReads) {
  expect_same_as_python(tricky_delimited('\t'), "tsv", {"text_pair", "text"});
}

TEST(TextTable, JsonLinesReadWhatPythonsJsonModuleReads) {
  expect_same_as_python(tricky_jsonl(), "jsonl", {"text", "label"});
}

TEST(TextTable, RowsKnowTheLineTheyStartOn) {
  const Table t = parse_table("a,b\n\"x\ny\",1\r\n\r\nz,2\rw,3", "mem", TableFormat::Csv, {"b"});
  ASSERT_EQ(t.rows.size(), 3u);
  EXPECT_EQ(t.rows[0].line, 2);
  EXPECT_EQ(t.rows[1].line, 5);
  EXPECT_EQ(t.rows[2].line, 6);
}

TEST(TextTable, BadInputNamesFileLineAndColumn) {
  const auto csv = [](const std::string& bytes, std::vector<std::string> columns) {
    return [=] { parse_table(bytes, "f.csv", TableFormat::Csv, columns); };
  };
  const auto jsonl = [](const std::string& bytes) {
    return [=] { parse_table(bytes, "f.jsonl", TableFormat::JsonLines, {"text", "label"}); };
  };
  expect_error(csv("text,lab\nx,1\n", {"text", "label"}), {"f.csv:1", "'label'", "'lab'"});
  expect_error(csv("text,label\nx,1\ny\n", {"text", "label"}), {"f.csv:3", "'label'"});
  expect_error(csv("text,label\nx,1,2\n", {"text"}), {"f.csv:2", "3 fields"});
  expect_error(csv("text,label\n\"open,1\nmore\n", {"text"}), {"f.csv:2", "never closed"});
  expect_error(csv("text,label\nok,1\nbad \xC3\x28,1\n", {"text"}), {"f.csv:3", "UTF-8"});
  expect_error(csv("text,text\nx,y\n", {"text"}), {"appears twice"});
  expect_error(csv("", {"text"}), {"f.csv", "empty file"});
  expect_error(jsonl("{\"text\": \"a\", \"label\": 1}\n{\"text\": \"b\"}\n"), {"f.jsonl:2", "'label'"});
  expect_error(jsonl("{\"text\": \"a\", \"label\": 1}\n\n{\"text\": \"b\", }\n"),
               {"f.jsonl:3", "invalid JSON"});
  expect_error(jsonl("[1, 2]\n"), {"f.jsonl:1", "not an object"});
  // A number past double's range (Python's json reads it as inf) is refused, not thrown
  // bare by the JSON library (a fuzzing finding).
  expect_error(jsonl("{\"text\": \"a\", \"label\": 2e313}\n"), {"f.jsonl:1", "invalid JSON"});
  expect_error(jsonl("{\"text\": [\"a\"], \"label\": 1}\n"), {"f.jsonl:1", "'text'", "array"});
  expect_error(jsonl("{\"text\": \"\xFF\", \"label\": 1}\n"), {"f.jsonl:1", "UTF-8"});
  expect_error([] { read_table("/nonexistent/x.csv", TableFormat::Csv, {"text"}); },
               {"/nonexistent/x.csv"});
  expect_error([] { table_format_of("data.parquet"); }, {"data.parquet", "'.parquet'"});
}

TEST(ExampleDataset, TokenisesTextsPairsAndLabels) {
  const fs::path dir = example_scratch("tokenises");
  write_text(dir / "d.csv", "sentence,other,label\nthe cat sat,on the mat,good\na dog!,cats,bad\n");
  const WordPieceTokenizer tok = small_bert();
  ExampleDatasetOptions o;
  o.text_column = "sentence";
  o.text_pair_column = "other";
  const ExampleDataset ds = ExampleDataset::load(dir / "d.csv", tok, o);
  ASSERT_EQ(ds.size(), 2);
  for (int64_t i = 0; i < ds.size(); ++i) {
    const Encoding expected = tok.encode_pair(i == 0 ? "the cat sat" : "a dog!",
                                              i == 0 ? "on the mat" : "cats", {.truncation = true});
    EXPECT_EQ(ids_of(ds[i]), expected.input_ids);
    EXPECT_EQ(std::vector<uint32_t>(ds[i].token_type_ids.begin(), ds[i].token_type_ids.end()),
              expected.token_type_ids);
    EXPECT_EQ(ds.length(i), static_cast<int64_t>(expected.input_ids.size()));
  }
  // String labels: the sorted distinct names, recorded.
  EXPECT_EQ(ds.label_kind(), LabelKind::Class);
  EXPECT_EQ(ds.label_names(), (std::vector<std::string>{"bad", "good"}));
  EXPECT_EQ(std::get<int64_t>(ds[0].label), 1);
  EXPECT_EQ(std::get<int64_t>(ds[1].label), 0);
  EXPECT_EQ(ds.num_labels(), 2);
  EXPECT_EQ(ds.source_line(1), 3);
}

TEST(ExampleDataset, LabelKindsFollowTheValuesOrTheOptions) {
  const fs::path dir = example_scratch("labels");
  const WordPieceTokenizer tok = small_bert();
  write_text(dir / "ints.jsonl", "{\"text\": \"a\", \"label\": 2}\n{\"text\": \"b\", \"label\": 0}\n");
  const ExampleDataset ints = ExampleDataset::load(dir / "ints.jsonl", tok);
  EXPECT_EQ(ints.label_kind(), LabelKind::Class);
  EXPECT_EQ(ints.num_labels(), 3);
  EXPECT_EQ(std::get<int64_t>(ints[0].label), 2);

  write_text(dir / "floats.tsv", "text\tlabel\na\t0.25\nb\t3\n");
  const ExampleDataset floats = ExampleDataset::load(dir / "floats.tsv", tok);
  EXPECT_EQ(floats.label_kind(), LabelKind::Regression);
  EXPECT_EQ(floats.num_labels(), 1);
  EXPECT_DOUBLE_EQ(std::get<double>(floats[0].label), 0.25);
  EXPECT_DOUBLE_EQ(std::get<double>(floats[1].label), 3.0);

  write_text(dir / "names.csv", "text,label\na,neutral\nb,positive\nc,negative\n");
  ExampleDatasetOptions o;
  o.label_list = {"negative", "neutral", "positive"};
  const ExampleDataset named = ExampleDataset::load(dir / "names.csv", tok, o);
  EXPECT_EQ(std::get<int64_t>(named[0].label), 1);
  EXPECT_EQ(std::get<int64_t>(named[1].label), 2);
  EXPECT_EQ(std::get<int64_t>(named[2].label), 0);
  EXPECT_EQ(named.label2id().at("positive"), 2);

  o = {};
  o.label_column = "";  // a test set without labels
  const ExampleDataset unlabelled = ExampleDataset::load(dir / "names.csv", tok, o);
  EXPECT_EQ(unlabelled.label_kind(), LabelKind::None);
  EXPECT_EQ(unlabelled[0].label.index(), 0u);
}

TEST(ExampleDataset, TruncatesToMaxLength) {
  const fs::path dir = example_scratch("truncates");
  write_text(dir / "d.jsonl", "{\"text\": \"the cat sat on the mat the dog sat\", \"label\": 0}\n");
  const WordPieceTokenizer tok = small_bert();
  ExampleDatasetOptions o;
  o.max_length = 5;
  const ExampleDataset ds = ExampleDataset::load(dir / "d.jsonl", tok, o);
  EXPECT_EQ(ids_of(ds[0]), tok.encode("the cat sat on the mat the dog sat",
                                      {.truncation = true, .max_length = 5})
                               .input_ids);
  EXPECT_EQ(ds.length(0), 5);
  EXPECT_EQ(ds[0].input_ids.back(), *tok.token_to_id("[SEP]"));
}

TEST(ExampleDataset, SecondLoadMapsTheCacheWithoutTokenising) {
  const fs::path dir = example_scratch("cache_hit");
  write_text(dir / "d.csv", "text,label\nthe cat,1\na dog,0\n");
  const WordPieceTokenizer tok = small_bert();
  const ExampleDataset first = ExampleDataset::load(dir / "d.csv", tok);
  EXPECT_FALSE(first.loaded_from_cache());
  EXPECT_EQ(first.tokenized_examples(), 2);
  EXPECT_TRUE(fs::exists(first.cache_path()));
  EXPECT_EQ(first.cache_path().parent_path(), fs::path(dir / "d.csv.tessera-cache"));
  const ExampleDataset second = ExampleDataset::load(dir / "d.csv", tok);
  EXPECT_TRUE(second.loaded_from_cache());
  EXPECT_EQ(second.tokenized_examples(), 0);
  EXPECT_EQ(second.cache_path(), first.cache_path());
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ids_of(second[i]), ids_of(first[i]));
    EXPECT_EQ(second[i].label, first[i].label);
  }
}

TEST(ExampleDataset, ChangedSourceTokenizerOrOptionsRebuildTheCache) {
  const fs::path dir = example_scratch("cache_key");
  const fs::path file = dir / "d.csv";
  write_text(file, "text,label\nthe cat,1\n");
  const WordPieceTokenizer tok = small_bert();
  (void)ExampleDataset::load(file, tok);
  ASSERT_TRUE(ExampleDataset::load(file, tok).loaded_from_cache());
  // Same size, other bytes (the modification time may not have moved).
  write_text(file, "text,label\nthe dog,1\n");
  const ExampleDataset changed = ExampleDataset::load(file, tok);
  EXPECT_FALSE(changed.loaded_from_cache());
  EXPECT_EQ(ids_of(changed[0]), tok.encode("the dog", {}).input_ids);
  // A tokenizer with one more word encodes "bird" differently.
  write_text(file, "text,label\nthe bird,1\n");
  (void)ExampleDataset::load(file, tok);
  const WordPieceTokenizer bigger = small_bert({"bird"});
  const ExampleDataset retokenised = ExampleDataset::load(file, bigger);
  EXPECT_FALSE(retokenised.loaded_from_cache());
  EXPECT_EQ(ids_of(retokenised[0]), bigger.encode("the bird", {}).input_ids);
  EXPECT_NE(ids_of(retokenised[0]), tok.encode("the bird", {}).input_ids);
  ExampleDatasetOptions o;
  o.max_length = 3;
  EXPECT_FALSE(ExampleDataset::load(file, bigger, o).loaded_from_cache());
  EXPECT_TRUE(ExampleDataset::load(file, bigger, o).loaded_from_cache());
}

TEST(ExampleDataset, DamagedCacheIsRebuiltNotRead) {
  const fs::path dir = example_scratch("cache_damaged");
  write_text(dir / "d.jsonl", "{\"text\": \"the cat sat\", \"label\": 1}\n{\"text\": \"a dog\", \"label\": 0}\n");
  const WordPieceTokenizer tok = small_bert();
  const fs::path cache = ExampleDataset::load(dir / "d.jsonl", tok).cache_path();
  const std::string good = read_text(cache);
  const auto expect_rebuilt = [&](const std::string& damaged, const std::string& reason) {
    write_text(cache, damaged);
    const ExampleDataset ds = ExampleDataset::load(dir / "d.jsonl", tok);
    EXPECT_FALSE(ds.loaded_from_cache()) << reason;
    EXPECT_NE(ds.cache_rebuild_reason().find(reason), std::string::npos) << ds.cache_rebuild_reason();
    EXPECT_EQ(ids_of(ds[0]), tok.encode("the cat sat", {}).input_ids);
    EXPECT_EQ(read_text(cache), good);  // rewritten whole
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x5A;
  expect_rebuilt(flipped, "CRC-32");
  expect_rebuilt(good.substr(0, good.size() - 3), "truncated");
  expect_rebuilt(good.substr(0, 20), "shorter");
  expect_rebuilt("", "empty");
}

TEST(ExampleDataset, BadRowsAreRefusedBeforeAnyTokenising) {
  const fs::path dir = example_scratch("bad_rows");
  const WordPieceTokenizer tok = small_bert();
  const auto load = [&](const std::string& name, const std::string& bytes,
                        ExampleDatasetOptions o = {}) {
    write_text(dir / name, bytes);
    return [=, &tok] { ExampleDataset::load(dir / name, tok, o); };
  };
  const std::string jsonl = (dir / "a.jsonl").string();
  expect_error(load("a.jsonl", "{\"text\": \"a\", \"label\": 1}\n{\"text\": \"b\", \"label\": 5}\n",
                    {.num_labels = 2}),
               {jsonl + ":2", "label 5", "'label'", "[0, 2)"});
  expect_error(load("a.jsonl", "{\"text\": \"a\", \"label\": -1}\n"), {jsonl + ":1", "label -1"});
  expect_error(load("a.jsonl", "{\"text\": \" \", \"label\": 1}\n"), {jsonl + ":1", "'text'", "empty"});
  expect_error(load("a.jsonl", "{\"text\": 12, \"label\": 1}\n"), {jsonl + ":1", "'text'", "integer"});
  expect_error(load("a.jsonl", "{\"text\": \"a\", \"label\": null}\n"), {jsonl + ":1", "'label'", "empty"});
  expect_error(load("a.jsonl", "{\"text\": \"a\", \"label\": 1}\n{\"txt\": \"b\", \"label\": 1}\n"),
               {jsonl + ":2", "'text'"});
  expect_error(load("a.jsonl", "{\"text\": \"a\", \"label\": 1}\n{\"text\": \"b\" \"label\": 1}\n"),
               {jsonl + ":2", "invalid JSON"});
  const std::string csv = (dir / "b.csv").string();
  expect_error(load("b.csv", "text,label\na,pos\nb,meh\n", {.label_list = {"neg", "pos"}}),
               {csv + ":3", "'meh'", "label_list"});
  expect_error(load("b.csv", "text,label\na,1\n,0\n"), {csv + ":3", "'text'", "empty"});
  expect_error(load("b.csv", "text,label\na,x\nb,1\n", {.label_type = LabelType::Integer}),
               {csv + ":2", "'x'", "integer"});
  expect_error(load("b.csv", "text,label\na,1\nb\xff,0\n"), {csv + ":3", "UTF-8"});
  expect_error(load("b.csv", "text,label\na,0.5\n", {.label_type = LabelType::Float, .num_labels = 3}),
               {"num_labels 1"});
  // Nothing was cached for a refused file.
  EXPECT_FALSE(fs::exists(dir / "b.csv.tessera-cache"));
  // An empty text is kept when asked.
  ExampleDatasetOptions keep;
  keep.allow_empty_text = true;
  write_text(dir / "c.csv", "text,label\n,0\n");
  EXPECT_EQ(ExampleDataset::load(dir / "c.csv", tok, keep).length(0), 2);  // [CLS] [SEP]
}
