#include "dist/checksums.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/file_io.h"

namespace tessera::dist {

namespace fs = std::filesystem;

void write_checksums(const fs::path& dir, const std::string& extra) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == kChecksumFile ||
        name.find(".tmp.") != std::string::npos)
      continue;
    const std::string bytes = data::read_file(entry.path());
    files[name] = {{"bytes", bytes.size()}, {"crc32", data::crc32(bytes)}};
  }
  nlohmann::json sums = extra.empty() ? nlohmann::json::object() : nlohmann::json::parse(extra);
  sums["files"] = files;
  data::write_file_atomically(dir / kChecksumFile, sums.dump(1));
}

void verify_checksums(const fs::path& dir, const std::string& what,
                      const std::vector<std::string>& required) {
  TESSERA_CHECK(fs::is_directory(dir), what, ": not a directory");
  const fs::path sums_path = dir / kChecksumFile;
  TESSERA_CHECK(fs::exists(sums_path), what, ": ", kChecksumFile,
                " is missing (the write was interrupted, or this is not a saved state)");
  nlohmann::json sums;
  try {
    sums = nlohmann::json::parse(data::read_file(sums_path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(what, ": ", kChecksumFile, " is damaged: ", e.what());
  }
  TESSERA_CHECK(sums.is_object() && sums.contains("files") && sums["files"].is_object(), what, ": ",
                kChecksumFile, " is damaged: no \"files\" object");
  for (const std::string& name : required)
    TESSERA_CHECK(sums["files"].contains(name), what, ": ", kChecksumFile, " does not list ", name);
  for (const auto& [name, expected] : sums["files"].items()) {
    const fs::path file = dir / name;
    TESSERA_CHECK(expected.is_object() && expected.contains("bytes") &&
                      expected["bytes"].is_number_unsigned() && expected.contains("crc32") &&
                      expected["crc32"].is_number_unsigned(),
                  what, ": ", kChecksumFile, " is damaged: entry \"", name,
                  "\" has no bytes/crc32");
    TESSERA_CHECK(fs::exists(file), what, ": file ", name, " is missing");
    const std::string bytes = data::read_file(file);
    const uint64_t want_bytes = expected["bytes"].get<uint64_t>();
    TESSERA_CHECK(
        bytes.size() == want_bytes, what, ": file ", file.string(), " is damaged: ", bytes.size(),
        " bytes, expected ", want_bytes,
        bytes.size() < want_bytes ? " (truncated at offset " : " (extra bytes from offset ",
        std::min<uint64_t>(bytes.size(), want_bytes), ")");
    const uint32_t crc = data::crc32(bytes);
    TESSERA_CHECK(crc == expected["crc32"].get<uint32_t>(), what, ": file ", file.string(),
                  " is damaged (checksum mismatch): CRC-32 ", crc, " does not match the recorded ",
                  expected["crc32"].get<uint32_t>());
  }
}

}  // namespace tessera::dist
