// libFuzzer target: the JSON Lines / CSV / TSV readers of labelled examples
// (data/text_table). The first byte picks the format, the rest is the file. A bad file must
// be a tessera::Error; a CSV/TSV file that parses must parse to the same records again after
// being written back with every field quoted (the quoting rules invert), and every row of a
// table must have one cell per requested column and a line inside the file.
#include <algorithm>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/data/text_table.h"
#include "fuzz/fuzz_input.h"

namespace {

std::string quoted_again(const std::vector<tessera::data::DelimitedRecord>& records, char d) {
  std::string out;
  for (const auto& record : records) {
    for (size_t i = 0; i < record.fields.size(); ++i) {
      if (i) out += d;
      out += '"';
      for (char c : record.fields[i]) out += c == '"' ? std::string("\"\"") : std::string(1, c);
      out += '"';
    }
    out += "\r\n";
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera::data;
  if (size == 0) return 0;
  const TableFormat formats[] = {TableFormat::JsonLines, TableFormat::Csv, TableFormat::Tsv};
  const TableFormat format = formats[data[0] % 3];
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  const auto path = tessera::fuzz::write_input("table", data + 1, size - 1);
  tessera::fuzz::expect_clean_error([&] {
    const Table table = read_table(path, format, {"text", "label"});
    const int64_t lines = 1 + std::count(bytes.begin(), bytes.end(), '\n') +
                          std::count(bytes.begin(), bytes.end(), '\r');
    for (const TableRow& row : table.rows)
      if (row.cells.size() != 2 || row.line < 1 || row.line > lines) __builtin_trap();
  });
  if (format == TableFormat::JsonLines) return 0;
  const char delimiter = format == TableFormat::Csv ? ',' : '\t';
  tessera::fuzz::expect_clean_error([&] {
    const std::vector<DelimitedRecord> records = parse_delimited(bytes, delimiter, "fuzz");
    const std::vector<DelimitedRecord> again =
        parse_delimited(quoted_again(records, delimiter), delimiter, "again");
    if (again.size() != records.size()) __builtin_trap();
    for (size_t i = 0; i < records.size(); ++i)
      if (again[i].fields != records[i].fields) __builtin_trap();
  });
  return 0;
}
