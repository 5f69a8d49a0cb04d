#include "tessera/data/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "tessera/core/error.h"

namespace tessera::data {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "cannot open '", path.string(), "': ", std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TESSERA_CHECK(!in.bad(), "error reading '", path.string(), "'");
  return bytes;
}

namespace {
void fsync_directory(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);  // best effort: some file systems refuse fsync on directories
    ::close(fd);
  }
}
}  // namespace

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

namespace {
std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[n] = c;
  }
  return table;
}
}  // namespace

uint32_t crc32(std::span<const std::byte> bytes, uint32_t previous) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  uint32_t c = previous ^ 0xFFFFFFFFu;
  for (std::byte b : bytes) c = table[(c ^ static_cast<uint32_t>(b)) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t adler32(std::span<const std::byte> bytes, uint32_t previous) {
  constexpr uint32_t kMod = 65521;
  uint32_t a = previous & 0xFFFF, b = previous >> 16;
  for (std::byte x : bytes) {
    a = (a + static_cast<uint32_t>(x)) % kMod;
    b = (b + a) % kMod;
  }
  return (b << 16) | a;
}

}  // namespace tessera::data
