#include "tessera/core/file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>
#include <zlib.h>

#include "tessera/core/error.h"

namespace tessera {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "cannot open '", path.string(), "': ", std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TESSERA_CHECK(!in.bad(), "error reading '", path.string(), "'");
  return bytes;
}

MappedFile map_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TESSERA_CHECK(fd >= 0, "cannot open '", path.string(), "': ", std::strerror(errno));
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  if (!regular || st.st_size == 0) {
    ::close(fd);
    TESSERA_FAIL("cannot map '", path.string(), "': ", regular ? "empty file" : "not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping outlives the descriptor
  TESSERA_CHECK(map != MAP_FAILED, "cannot map '", path.string(), "': ", std::strerror(map_errno));
  return {std::shared_ptr<const void>(map, [size](const void* p) { ::munmap(const_cast<void*>(p), size); }),
          size};
}

void fsync_directory(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);  // best effort: some file systems refuse fsync on directories
    ::close(fd);
  }
}

void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  const std::filesystem::path parent = path.parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  const std::filesystem::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TESSERA_CHECK(fd >= 0, "cannot create '", tmp.string(), "': ", std::strerror(errno));
  size_t written = 0;
  while (written < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      TESSERA_FAIL("error writing '", tmp.string(), "' at offset ", written, ": ",
                   std::strerror(err));
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    TESSERA_FAIL("error flushing '", tmp.string(), "': ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    TESSERA_FAIL("cannot rename '", tmp.string(), "' to '", path.string(), "': ", std::strerror(err));
  }
  fsync_directory(parent);
}

// zlib's implementations: its CRC-32 processes several bytes per step and measured six
// times faster than the byte-at-a-time table loop used before (2.18 GB/s against 358 MB/s
// on 16 MiB, benchmarks/bench_checksum.cpp).
uint32_t crc32(std::span<const std::byte> bytes, uint32_t previous) {
  uLong crc = previous;
  for (size_t pos = 0; pos < bytes.size();) {  // zlib takes uInt lengths: feed 1 GiB at a time
    const size_t n = std::min<size_t>(bytes.size() - pos, size_t{1} << 30);
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + pos), static_cast<uInt>(n));
    pos += n;
  }
  return static_cast<uint32_t>(crc);
}

uint32_t adler32(std::span<const std::byte> bytes, uint32_t previous) {
  uLong sum = previous;
  for (size_t pos = 0; pos < bytes.size();) {
    const size_t n = std::min<size_t>(bytes.size() - pos, size_t{1} << 30);
    sum = ::adler32(sum, reinterpret_cast<const Bytef*>(bytes.data() + pos), static_cast<uInt>(n));
    pos += n;
  }
  return static_cast<uint32_t>(sum);
}

namespace {
struct FileSum {
  uint64_t bytes = 0;
  uint32_t crc = 0;
};

// Size and CRC-32 of a file, read in pieces so a large weight file is never held twice.
FileSum file_sum(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "cannot open '", path.string(), "': ", std::strerror(errno));
  std::vector<char> buffer(1 << 20);
  FileSum sum;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto n = static_cast<size_t>(in.gcount());
    sum.crc = crc32(std::as_bytes(std::span<const char>(buffer.data(), n)), sum.crc);
    sum.bytes += n;
  }
  TESSERA_CHECK(!in.bad(), "error reading '", path.string(), "'");
  return sum;
}

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}
}  // namespace

void write_folder_checksums(const std::filesystem::path& dir) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == kFolderChecksumFile || name.find(".tmp.") != std::string::npos) continue;
    const FileSum sum = file_sum(entry.path());
    files[name] = {{"bytes", sum.bytes}, {"crc32", sum.crc}};
  }
  write_file_atomically(dir / kFolderChecksumFile, nlohmann::json{{"files", files}}.dump(1));
}

void verify_folder_checksums(const std::filesystem::path& dir, const std::vector<std::string>& required) {
  const std::string where = "'" + dir.string() + "'";
  const std::filesystem::path sums_path = dir / kFolderChecksumFile;
  TESSERA_CHECK(std::filesystem::is_regular_file(sums_path), where, ": ", kFolderChecksumFile,
                " is missing (an interrupted write?)");
  nlohmann::json sums = nlohmann::json::parse(read_file(sums_path), nullptr, /*allow_exceptions=*/false);
  TESSERA_CHECK(sums.is_object() && sums.contains("files") && sums["files"].is_object(), where, ": ",
                kFolderChecksumFile, " is damaged: not JSON with a \"files\" object");
  const nlohmann::json& files = sums["files"];
  for (const auto& name : required)
    TESSERA_CHECK(files.contains(name), where, ": ", name, " is not listed in ", kFolderChecksumFile);
  for (const auto& [name, expected] : files.items()) {
    TESSERA_CHECK(is_plain_file_name(name) && expected.is_object() && expected.contains("bytes") &&
                      expected["bytes"].is_number_unsigned() && expected.contains("crc32") &&
                      expected["crc32"].is_number_unsigned(),
                  where, ": ", kFolderChecksumFile, " is damaged: bad entry for \"", name, "\": ", expected.dump());
    const std::filesystem::path file = dir / name;
    TESSERA_CHECK(std::filesystem::is_regular_file(file), where, ": file ", name, " is missing");
    const FileSum sum = file_sum(file);
    const uint64_t want_bytes = expected["bytes"].get<uint64_t>();
    TESSERA_CHECK(sum.bytes == want_bytes, where, ": file ", file.string(), " is damaged: ", sum.bytes,
                  " bytes, expected ", want_bytes,
                  sum.bytes < want_bytes ? " (truncated at offset " : " (extra bytes from offset ",
                  std::min(sum.bytes, want_bytes), ")");
    const uint64_t want_crc = expected["crc32"].get<uint64_t>();
    TESSERA_CHECK(sum.crc == want_crc, where, ": file ", file.string(), " is damaged: CRC-32 ", sum.crc,
                  " does not match the recorded ", want_crc);
  }
}

}  // namespace tessera
