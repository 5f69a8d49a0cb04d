// Tables of labelled examples read from JSON Lines, CSV and TSV files: the rows of the
// columns a caller names, each cell with the line it came from, so later checks (a label
// outside num_labels, an empty text) can name the file, the line and the column.
//
// CSV and TSV follow Python's csv module with its default ("excel") dialect, as
// csv.DictReader reads a file opened with newline="" and encoding="utf-8-sig": a header
// row, RFC 4180 quoting ("" inside a quoted field is one quote, quoted fields hold
// delimiters and line breaks), records ended by \n, \r\n or \r, blank lines skipped, a
// quote inside an unquoted field kept as it is, text after a closing quote appended to the
// field. Where the csv module guesses (a quoted field that never closes, a row with fewer
// or more fields than the header, which it fills with None or keeps under the key None),
// Tessera refuses the file instead, naming the line. TSV is the same with a tab delimiter.
//
// JSON Lines: one JSON object a line (blank lines skipped), as json.loads reads each line.
// A UTF-8 byte-order mark at the start of a file is skipped; any other invalid UTF-8 is an
// error naming the line.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::data {

enum class TableFormat { JsonLines, Csv, Tsv };

// "jsonl" (or "json"), "csv", "tsv"; anything else is an error naming the value.
TableFormat parse_table_format(const std::string& name);
// By extension: .jsonl/.json, .csv, .tsv; an error naming the file otherwise.
TableFormat table_format_of(const std::filesystem::path& path);
const char* table_format_name(TableFormat format);

// One value. CSV and TSV cells are always text; a JSON value keeps its kind, and numbers
// keep their JSON spelling in `text` as well.
struct Cell {
  enum class Kind { Text, Integer, Float, Boolean, Null };
  Kind kind = Kind::Text;
  std::string text;
  int64_t integer = 0;  // Kind::Integer (and Boolean: 0 or 1)
  double number = 0;    // Kind::Integer and Kind::Float
};
const char* cell_kind_name(Cell::Kind kind);

struct TableRow {
  int64_t line = 0;         // 1-based line of the file where the row starts
  std::vector<Cell> cells;  // one per requested column, in the order asked for
};

struct Table {
  std::string source;                // the file's name, for messages
  std::vector<std::string> columns;  // the requested columns
  std::vector<TableRow> rows;
};

// Reads the requested columns of every row. A column missing from the header (CSV/TSV) or
// from an object (JSON Lines) is an error naming the file, the line and the column, as are
// invalid JSON, a line that is not an object, a nested array or object in a requested
// column, invalid UTF-8 and an unterminated quote.
Table read_table(const std::filesystem::path& path, TableFormat format,
                 const std::vector<std::string>& columns);
// The same over bytes in memory; `source` names them in errors.
Table parse_table(std::string_view bytes, const std::string& source, TableFormat format,
                  const std::vector<std::string>& columns);

// The records of a CSV/TSV as csv.reader gives them (every field, header row included,
// blank lines skipped), each with the line it starts on.
struct DelimitedRecord {
  int64_t line = 0;
  std::vector<std::string> fields;
};
std::vector<DelimitedRecord> parse_delimited(std::string_view bytes, char delimiter,
                                             const std::string& source);

}  // namespace tessera::data
