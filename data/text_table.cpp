#include "tessera/data/text_table.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/pretokenizer.h"

namespace tessera::data {
namespace {

constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";

// The 1-based line holding byte `offset` (\n, \r\n and a lone \r each end a line).
int64_t line_of_offset(std::string_view bytes, size_t offset) {
  int64_t line = 1;
  for (size_t i = 0; i < offset && i < bytes.size(); ++i)
    if (bytes[i] == '\n' || (bytes[i] == '\r' && (i + 1 >= bytes.size() || bytes[i + 1] != '\n')))
      ++line;
  return line;
}

// The bytes without a leading byte-order mark, refused when they are not UTF-8.
std::string_view checked_utf8(std::string_view bytes, const std::string& source) {
  if (bytes.starts_with(kUtf8Bom)) bytes.remove_prefix(kUtf8Bom.size());
  const size_t bad = find_invalid_utf8(bytes);
  TESSERA_CHECK(bad == std::string_view::npos, source, ":", line_of_offset(bytes, bad),
                ": invalid UTF-8 (byte ", bad, " of the text); the file must be UTF-8");
  return bytes;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out.empty() ? "none" : out;
}

// csv's state machine (Modules/_csv.c), the states a reader can be in between bytes.
enum class CsvState { StartRecord, StartField, InField, InQuotedField, QuoteInQuotedField };

class DelimitedParser {
 public:
  DelimitedParser(std::string_view bytes, char delimiter, const std::string& source)
      : bytes_(bytes), delimiter_(delimiter), source_(source) {}

  std::vector<DelimitedRecord> parse() {
    for (size_t i = 0; i < bytes_.size(); ++i) {
      const char c = bytes_[i];
      const bool newline = c == '\n' || c == '\r';
      // \r\n is one line break; inside a quoted field both bytes are kept.
      const bool crlf = c == '\r' && i + 1 < bytes_.size() && bytes_[i + 1] == '\n';
      step(c, newline);
      if (crlf) {
        if (state_ == CsvState::InQuotedField) field_ += '\n';
        ++i;
      }
      if (newline) ++line_;
    }
    TESSERA_CHECK(state_ != CsvState::InQuotedField, source_, ":", record_line_,
                  ": a quoted field opened in this record is never closed");
    if (state_ != CsvState::StartRecord) end_record();
    return std::move(records_);
  }

 private:
  void step(char c, bool newline) {
    switch (state_) {
      case CsvState::StartRecord:
        if (newline) return;  // a blank line: no record
        record_line_ = line_;
        state_ = CsvState::StartField;
        [[fallthrough]];
      case CsvState::StartField:
        if (newline) {
          end_record();
        } else if (c == '"') {
          state_ = CsvState::InQuotedField;
        } else if (c == delimiter_) {
          end_field();
        } else {
          field_ += c;
          state_ = CsvState::InField;
        }
        return;
      case CsvState::InField:
        if (newline) {
          end_record();
        } else if (c == delimiter_) {
          end_field();
        } else {
          field_ += c;
        }
        return;
      case CsvState::InQuotedField:
        if (c == '"') {
          state_ = CsvState::QuoteInQuotedField;
        } else {
          field_ += c;
        }
        return;
      case CsvState::QuoteInQuotedField:
        if (c == '"') {  // "" is one quote
          field_ += '"';
          state_ = CsvState::InQuotedField;
        } else if (c == delimiter_) {
          end_field();
        } else if (newline) {
          end_record();
        } else {  // text after the closing quote joins the field, as csv does
          field_ += c;
          state_ = CsvState::InField;
        }
        return;
    }
  }
  void end_field() {
    fields_.push_back(std::move(field_));
    field_.clear();
    state_ = CsvState::StartField;
  }
  void end_record() {
    end_field();
    records_.push_back({record_line_, std::move(fields_)});
    fields_.clear();
    state_ = CsvState::StartRecord;
  }

  std::string_view bytes_;
  char delimiter_;
  const std::string& source_;
  CsvState state_ = CsvState::StartRecord;
  int64_t line_ = 1, record_line_ = 1;
  std::string field_;
  std::vector<std::string> fields_;
  std::vector<DelimitedRecord> records_;
};

Table delimited_table(std::string_view bytes, const std::string& source, char delimiter,
                      const std::vector<std::string>& columns) {
  std::vector<DelimitedRecord> records = parse_delimited(bytes, delimiter, source);
  TESSERA_CHECK(!records.empty(), source, ": empty file; a header row naming the columns (",
                joined(columns), ") is expected");
  const DelimitedRecord& header = records.front();
  std::vector<size_t> positions;
  for (const std::string& column : columns) {
    const auto first = std::find(header.fields.begin(), header.fields.end(), column);
    TESSERA_CHECK(first != header.fields.end(), source, ":", header.line, ": no column '", column,
                  "' in the header (it has ", joined(header.fields), ")");
    TESSERA_CHECK(std::find(first + 1, header.fields.end(), column) == header.fields.end(), source,
                  ":", header.line, ": column '", column, "' appears twice in the header");
    positions.push_back(static_cast<size_t>(first - header.fields.begin()));
  }
  Table table{source, columns, {}};
  table.rows.reserve(records.size() - 1);
  for (size_t r = 1; r < records.size(); ++r) {
    DelimitedRecord& record = records[r];
    if (record.fields.size() != header.fields.size()) {
      const size_t n = record.fields.size();
      const std::string missing = n < header.fields.size() ? header.fields[n] : "";
      TESSERA_FAIL(source, ":", record.line, ": ", n, " field", n == 1 ? "" : "s",
                   ", the header has ", header.fields.size(),
                   missing.empty() ? std::string(" (an unquoted delimiter in a field?)")
                                   : " (no value for column '" + missing + "')");
    }
    TableRow row{record.line, {}};
    for (size_t p : positions) row.cells.push_back({Cell::Kind::Text, std::move(record.fields[p])});
    table.rows.push_back(std::move(row));
  }
  return table;
}

Cell json_cell(const nlohmann::json& value, const std::string& source, int64_t line,
               const std::string& column) {
  using J = nlohmann::json::value_t;
  switch (value.type()) {
    case J::string:
      return {Cell::Kind::Text, value.get<std::string>()};
    case J::number_integer:
      return {Cell::Kind::Integer, value.dump(), value.get<int64_t>(), value.get<double>()};
    case J::number_unsigned:
      if (value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return {Cell::Kind::Integer, value.dump(), value.get<int64_t>(), value.get<double>()};
      return {Cell::Kind::Float, value.dump(), 0, value.get<double>()};
    case J::number_float:
      return {Cell::Kind::Float, value.dump(), 0, value.get<double>()};
    case J::boolean:
      return {Cell::Kind::Boolean, value.dump(), value.get<bool>() ? 1 : 0, 0};
    case J::null:
      return {Cell::Kind::Null, "null"};
    default:
      TESSERA_FAIL(source, ":", line, ": key '", column, "' holds a JSON ", value.type_name(),
                   "; a string or a number is expected");
  }
}

Table json_lines_table(std::string_view bytes, const std::string& source,
                       const std::vector<std::string>& columns) {
  Table table{source, columns, {}};
  int64_t line = 0;
  for (size_t start = 0; start < bytes.size();) {
    const size_t end = std::min(bytes.find('\n', start), bytes.size());
    const std::string_view text = bytes.substr(start, end - start);
    start = end + 1;
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range (1e999)
      TESSERA_FAIL(source, ":", line, ": invalid JSON: ", e.what());
    }
    TESSERA_CHECK(object.is_object(), source, ":", line, ": a JSON ", object.type_name(),
                  ", not an object; JSON Lines holds one object a line");
    TableRow row{line, {}};
    for (const std::string& column : columns) {
      const auto found = object.find(column);
      if (found == object.end()) {
        std::vector<std::string> keys;
        for (const auto& item : object.items()) keys.push_back(item.key());
        TESSERA_FAIL(source, ":", line, ": no key '", column, "' (the object has ", joined(keys),
                     ")");
      }
      row.cells.push_back(json_cell(*found, source, line, column));
    }
    table.rows.push_back(std::move(row));
  }
  return table;
}

}  // namespace

TableFormat parse_table_format(const std::string& name) {
  if (name == "jsonl" || name == "json") return TableFormat::JsonLines;
  if (name == "csv") return TableFormat::Csv;
  if (name == "tsv") return TableFormat::Tsv;
  TESSERA_FAIL("unknown table format '", name, "'; expected jsonl, csv or tsv");
}

TableFormat table_format_of(const std::filesystem::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  if (ext == ".jsonl" || ext == ".json") return TableFormat::JsonLines;
  if (ext == ".csv") return TableFormat::Csv;
  if (ext == ".tsv") return TableFormat::Tsv;
  TESSERA_FAIL("'", path.string(), "': cannot tell the format from the extension '", ext,
               "'; name it (jsonl, csv or tsv)");
}

const char* table_format_name(TableFormat format) {
  switch (format) {
    case TableFormat::JsonLines: return "jsonl";
    case TableFormat::Csv: return "csv";
    case TableFormat::Tsv: return "tsv";
  }
  return "?";
}

const char* cell_kind_name(Cell::Kind kind) {
  switch (kind) {
    case Cell::Kind::Text: return "string";
    case Cell::Kind::Integer: return "integer";
    case Cell::Kind::Float: return "number";
    case Cell::Kind::Boolean: return "boolean";
    case Cell::Kind::Null: return "null";
  }
  return "?";
}

std::vector<DelimitedRecord> parse_delimited(std::string_view bytes, char delimiter,
                                             const std::string& source) {
  return DelimitedParser(checked_utf8(bytes, source), delimiter, source).parse();
}

Table parse_table(std::string_view bytes, const std::string& source, TableFormat format,
                  const std::vector<std::string>& columns) {
  switch (format) {
    case TableFormat::Csv: return delimited_table(bytes, source, ',', columns);
    case TableFormat::Tsv: return delimited_table(bytes, source, '\t', columns);
    case TableFormat::JsonLines: break;
  }
  return json_lines_table(checked_utf8(bytes, source), source, columns);
}

Table read_table(const std::filesystem::path& path, TableFormat format,
                 const std::vector<std::string>& columns) {
  TESSERA_CHECK(std::filesystem::is_regular_file(path), "dataset file '", path.string(),
                "' does not exist or is not a file");
  return parse_table(read_file(path), path.string(), format, columns);
}

}  // namespace tessera::data
