#include "tessera/data/example_dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <exception>
#include <nlohmann/json.hpp>
#include <set>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/example_cache.h"

namespace tessera::data {
namespace {

std::string checksum_hex(std::string_view bytes) {
  const auto span = std::as_bytes(std::span<const char>(bytes.data(), bytes.size()));
  char out[17];
  std::snprintf(out, sizeof(out), "%08x%08x", crc32(span), adler32(span));
  return out;
}

// Everything the examples depend on, as canonical JSON: the cache's key.
std::string cache_key(const std::filesystem::path& path, std::string_view source_bytes,
                      const Tokenizer& tokenizer, const ExampleDatasetOptions& o,
                      TableFormat format) {
  struct stat st {};
  TESSERA_CHECK(::stat(path.c_str(), &st) == 0, "cannot stat '", path.string(), "'");
  std::string tokenizer_files;
  for (const auto& [name, contents] : tokenizer.files())
    tokenizer_files += name + '\0' + contents + '\0';
  const nlohmann::json key = {
      {"cache_format", 1},
      {"source",
       {{"bytes", source_bytes.size()},
        {"mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
        {"checksum", checksum_hex(source_bytes)}}},
      {"tokenizer", {{"type", tokenizer.type()}, {"checksum", checksum_hex(tokenizer_files)}}},
      {"options",
       {{"format", table_format_name(format)},
        {"text_column", o.text_column},
        {"text_pair_column", o.text_pair_column},
        {"label_column", o.label_column},
        {"label_type", label_type_name(o.label_type)},
        {"label_list", o.label_list},
        {"num_labels", o.num_labels},
        {"add_special_tokens", o.add_special_tokens},
        {"truncation", o.truncation},
        {"truncation_strategy", static_cast<int>(o.truncation_strategy)},
        {"max_length", o.max_length},
        {"allow_empty_text", o.allow_empty_text}}}};
  return key.dump();
}

bool blank(std::string_view text) {
  return text.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos;
}

void check_texts(const Table& table, size_t column, bool allow_empty) {
  const std::string& name = table.columns[column];
  for (const TableRow& row : table.rows) {
    const Cell& cell = row.cells[column];
    TESSERA_CHECK(cell.kind == Cell::Kind::Text, table.source, ":", row.line, ": column '", name,
                  "' holds a ", cell_kind_name(cell.kind), " (", cell.text,
                  "); a text must be a string");
    TESSERA_CHECK(allow_empty || !blank(cell.text), table.source, ":", row.line, ": column '",
                  name, "' is empty (allow_empty_text keeps such rows)");
  }
}

template <class T>
bool parse_number(std::string_view text, T& out) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end && !text.empty();
}

bool is_integer_cell(const Cell& c, int64_t& value) {
  if (c.kind == Cell::Kind::Integer) return (value = c.integer), true;
  return c.kind == Cell::Kind::Text && parse_number(c.text, value);
}
bool is_number_cell(const Cell& c, double& value) {
  if (c.kind == Cell::Kind::Integer || c.kind == Cell::Kind::Float) return (value = c.number), true;
  return c.kind == Cell::Kind::Text && parse_number(c.text, value);
}

LabelType detected_label_type(const Table& table, size_t column) {
  bool integers = true, numbers = true;
  for (const TableRow& row : table.rows) {
    int64_t i;
    double d;
    integers = integers && is_integer_cell(row.cells[column], i);
    numbers = numbers && is_number_cell(row.cells[column], d);
  }
  return integers ? LabelType::Integer : numbers ? LabelType::Float : LabelType::String;
}

void resolve_class_ids(const Table& table, size_t column, int64_t num_labels, ExampleColumns& out) {
  const std::string& name = table.columns[column];
  int64_t largest = -1;
  for (const TableRow& row : table.rows) {
    int64_t id = 0;
    TESSERA_CHECK(is_integer_cell(row.cells[column], id), table.source, ":", row.line,
                  ": label column '", name, "' holds '", row.cells[column].text,
                  "', not an integer class id");
    TESSERA_CHECK(id >= 0 && (num_labels == 0 || id < num_labels), table.source, ":", row.line,
                  ": label ", id, " in column '", name, "' is outside [0, ",
                  num_labels ? std::to_string(num_labels) : std::string("..."), ")");
    largest = std::max(largest, id);
    out.class_labels.push_back(id);
  }
  out.num_labels = num_labels ? num_labels : largest + 1;
}

void resolve_class_names(const Table& table, size_t column, const ExampleDatasetOptions& o,
                         ExampleColumns& out) {
  const std::string& name = table.columns[column];
  std::vector<std::string> names = o.label_list;
  if (names.empty()) {  // the sorted distinct values, as datasets' class_encode_column
    std::set<std::string> distinct;
    for (const TableRow& row : table.rows) distinct.insert(row.cells[column].text);
    names.assign(distinct.begin(), distinct.end());
  }
  std::map<std::string, int64_t> ids;
  for (size_t i = 0; i < names.size(); ++i)
    TESSERA_CHECK(ids.emplace(names[i], static_cast<int64_t>(i)).second, "label_list names '",
                  names[i], "' twice");
  TESSERA_CHECK(o.num_labels == 0 || o.label_list.empty() ||
                    o.num_labels == static_cast<int64_t>(names.size()),
                "num_labels ", o.num_labels, " but label_list has ", names.size(), " names");
  for (const TableRow& row : table.rows) {
    const std::string& value = row.cells[column].text;
    const auto found = ids.find(value);
    TESSERA_CHECK(found != ids.end(), table.source, ":", row.line, ": label '", value,
                  "' in column '", name, "' is not in label_list (", nlohmann::json(names).dump(),
                  ")");
    TESSERA_CHECK(o.num_labels == 0 || found->second < o.num_labels, table.source, ":", row.line,
                  ": label '", value, "' (class ", found->second, " of the sorted names ",
                  nlohmann::json(names).dump(), ") is outside num_labels ", o.num_labels);
    out.class_labels.push_back(found->second);
  }
  out.num_labels = o.num_labels ? o.num_labels : static_cast<int64_t>(names.size());
  out.label_names = std::move(names);
}

void resolve_labels(const Table& table, size_t column, const ExampleDatasetOptions& o,
                    ExampleColumns& out) {
  const std::string& name = table.columns[column];
  for (const TableRow& row : table.rows) {
    const Cell& c = row.cells[column];
    TESSERA_CHECK(c.kind != Cell::Kind::Null && !(c.kind == Cell::Kind::Text && c.text.empty()),
                  table.source, ":", row.line, ": label column '", name, "' is empty");
  }
  LabelType type = o.label_type;
  if (type == LabelType::Auto)
    type = !o.label_list.empty() ? LabelType::String : detected_label_type(table, column);
  switch (type) {
    case LabelType::Integer:
      out.label_kind = LabelKind::Class;
      return resolve_class_ids(table, column, o.num_labels, out);
    case LabelType::String:
      out.label_kind = LabelKind::Class;
      return resolve_class_names(table, column, o, out);
    case LabelType::Float:
    case LabelType::Auto:
      break;
  }
  TESSERA_CHECK(o.num_labels <= 1, "regression labels (floats in column '", name,
                "') take num_labels 1, not ", o.num_labels);
  out.label_kind = LabelKind::Regression;
  out.num_labels = 1;
  for (const TableRow& row : table.rows) {
    double value = 0;
    TESSERA_CHECK(is_number_cell(row.cells[column], value), table.source, ":", row.line,
                  ": label column '", name, "' holds '", row.cells[column].text,
                  "', not a number");
    out.regression_labels.push_back(value);
  }
}

// Tokenises every row (on every core; the order of the examples is the file's).
void tokenize(const Table& table, const Tokenizer& tokenizer, const ExampleDatasetOptions& o,
              bool has_pair, ExampleColumns& out) {
  const auto* wordpiece = dynamic_cast<const WordPieceTokenizer*>(&tokenizer);
  EncodeOptions eo;
  eo.add_special_tokens = o.add_special_tokens;
  eo.truncation = o.truncation;
  eo.truncation_strategy = o.truncation_strategy;
  eo.max_length = o.max_length;
  const auto n = static_cast<int64_t>(table.rows.size());
  std::vector<Encoding> encodings(table.rows.size());
  std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t i = 0; i < n; ++i) {
    try {
      const std::vector<Cell>& cells = table.rows[i].cells;
      if (wordpiece) {
        encodings[i] = has_pair ? wordpiece->encode_pair(cells[0].text, cells[1].text, eo)
                                : wordpiece->encode(cells[0].text, eo);
      } else {
        encodings[i].input_ids = tokenizer.encode(cells[0].text);
        if (o.truncation && o.max_length > 0 && encodings[i].input_ids.size() > o.max_length)
          encodings[i].input_ids.resize(o.max_length);
      }
    } catch (...) {
#pragma omp critical
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  out.has_token_types = wordpiece != nullptr;
  for (size_t i = 0; i < encodings.size(); ++i) {
    const Encoding& e = encodings[i];
    out.input_ids.insert(out.input_ids.end(), e.input_ids.begin(), e.input_ids.end());
    if (wordpiece)
      out.token_type_ids.insert(out.token_type_ids.end(), e.token_type_ids.begin(),
                                e.token_type_ids.end());
    out.offsets.push_back(out.input_ids.size());
    out.lines.push_back(table.rows[i].line);
  }
}

// Reads and checks every row, then tokenises them.
ExampleColumns build_columns(const Table& table, const Tokenizer& tokenizer,
                             const ExampleDatasetOptions& o) {
  const bool has_pair = !o.text_pair_column.empty();
  check_texts(table, 0, o.allow_empty_text);
  if (has_pair) check_texts(table, 1, o.allow_empty_text);
  ExampleColumns columns;
  if (!o.label_column.empty()) resolve_labels(table, has_pair ? 2 : 1, o, columns);
  tokenize(table, tokenizer, o, has_pair, columns);
  return columns;
}

void check_options(const std::filesystem::path& path, const Tokenizer& tokenizer,
                   const ExampleDatasetOptions& o) {
  TESSERA_CHECK(!o.text_column.empty(), "dataset '", path.string(), "': text_column is empty");
  TESSERA_CHECK(o.text_pair_column.empty() || tokenizer.type() == "wordpiece", "dataset '",
                path.string(), "': a text pair (column '", o.text_pair_column,
                "') needs a WordPiece tokenizer; this one is '", tokenizer.type(), "'");
  TESSERA_CHECK(o.num_labels >= 0, "dataset '", path.string(), "': num_labels ", o.num_labels,
                " is negative");
  TESSERA_CHECK(o.label_list.empty() || o.label_type == LabelType::Auto ||
                    o.label_type == LabelType::String,
                "dataset '", path.string(), "': label_list maps string labels; label_type is '",
                label_type_name(o.label_type), "'");
}

}  // namespace

LabelType parse_label_type(const std::string& name) {
  if (name == "auto") return LabelType::Auto;
  if (name == "int") return LabelType::Integer;
  if (name == "str" || name == "string") return LabelType::String;
  if (name == "float") return LabelType::Float;
  TESSERA_FAIL("unknown label_type '", name, "'; expected auto, int, str or float");
}

const char* label_type_name(LabelType type) {
  switch (type) {
    case LabelType::Auto: return "auto";
    case LabelType::Integer: return "int";
    case LabelType::String: return "str";
    case LabelType::Float: return "float";
  }
  return "?";
}

ExampleDataset ExampleDataset::load(const std::filesystem::path& path, const Tokenizer& tokenizer,
                                    const ExampleDatasetOptions& o) {
  check_options(path, tokenizer, o);
  const TableFormat format = o.format ? *o.format : table_format_of(path);
  TESSERA_CHECK(std::filesystem::is_regular_file(path), "dataset file '", path.string(),
                "' does not exist or is not a file");
  const std::string source_bytes = read_file(path);
  const std::string key = cache_key(path, source_bytes, tokenizer, o, format);
  ExampleDataset ds;
  ds.source_ = path;
  if (o.use_cache) {
    const std::filesystem::path dir =
        o.cache_dir.empty() ? std::filesystem::path(path.string() + ".tessera-cache") : o.cache_dir;
    ds.cache_path_ = dir / (checksum_hex(key) + ".bin");
    if (std::filesystem::exists(ds.cache_path_)) {
      try {
        MappedFile map = map_file(ds.cache_path_);
        ds.cache_rebuild_reason_ = read_cache_image(map.data(), map.size, key, ds.image_);
        if (ds.cache_rebuild_reason_.empty()) {
          ds.bytes_ = std::move(map.mapping);
          ds.loaded_from_cache_ = true;
          return ds;
        }
      } catch (const Error& e) {
        ds.cache_rebuild_reason_ = e.what();
      }
      ds.image_ = {};
    }
  }
  std::vector<std::string> wanted = {o.text_column};
  if (!o.text_pair_column.empty()) wanted.push_back(o.text_pair_column);
  if (!o.label_column.empty()) wanted.push_back(o.label_column);
  const Table table = parse_table(source_bytes, path.string(), format, wanted);
  auto image = std::make_shared<std::vector<std::byte>>(
      cache_image(build_columns(table, tokenizer, o), key));
  ds.tokenized_examples_ = static_cast<int64_t>(table.rows.size());
  if (o.use_cache) write_file_atomically(ds.cache_path_, *image);
  const std::string reason = read_cache_image(image->data(), image->size(), key, ds.image_);
  TESSERA_CHECK(reason.empty(), "dataset '", path.string(), "': built cache unreadable: ", reason);
  ds.bytes_ = std::shared_ptr<const void>(image, image->data());
  return ds;
}

Example ExampleDataset::operator[](int64_t i) const {
  TESSERA_CHECK(i >= 0 && i < image_.count, "dataset '", source_.string(), "': example ", i,
                " is outside [0, ", image_.count, ")");
  const uint64_t begin = image_.offsets[i], end = image_.offsets[i + 1];
  Example e;
  e.input_ids = {image_.input_ids + begin, end - begin};
  if (image_.token_type_ids) e.token_type_ids = {image_.token_type_ids + begin, end - begin};
  if (image_.label_kind == LabelKind::Class) e.label = image_.class_labels[i];
  if (image_.label_kind == LabelKind::Regression) e.label = image_.regression_labels[i];
  return e;
}

int64_t ExampleDataset::length(int64_t i) const {
  return static_cast<int64_t>((*this)[i].input_ids.size());
}

std::vector<int64_t> ExampleDataset::lengths() const {
  std::vector<int64_t> out(static_cast<size_t>(image_.count));
  for (int64_t i = 0; i < image_.count; ++i)
    out[i] = static_cast<int64_t>(image_.offsets[i + 1] - image_.offsets[i]);
  return out;
}

int64_t ExampleDataset::source_line(int64_t i) const {
  (void)(*this)[i];  // the bounds check
  return image_.lines[i];
}

std::map<std::string, int64_t> ExampleDataset::label2id() const {
  std::map<std::string, int64_t> out;
  for (size_t i = 0; i < image_.label_names.size(); ++i)
    out[image_.label_names[i]] = static_cast<int64_t>(i);
  return out;
}

}  // namespace tessera::data
