#include "tessera/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"

namespace tessera::data {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian; a big-endian host would need byte swaps");

void write_token_file(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                      int64_t vocab_size) {
  const uint32_t max_token = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  const bool narrow = max_token <= 0xFFFF && vocab_size <= 65536;
  const size_t width = narrow ? 2 : 4;
  TESSERA_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX), "write_token_file '",
                path.string(), "': ", tokens.size(),
                " tokens do not fit the header's int32 count");
  std::vector<std::byte> bytes(kTokenFileHeaderBytes + tokens.size() * width);
  int32_t header[256] = {};
  header[0] = kTokenFileMagic;
  header[1] = narrow ? 1 : 2;
  header[2] = static_cast<int32_t>(tokens.size());
  std::memcpy(bytes.data(), header, sizeof(header));
  std::byte* out = bytes.data() + kTokenFileHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (narrow) {
      const uint16_t t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(out + 2 * i, &t, 2);
    } else {
      std::memcpy(out + 4 * i, &tokens[i], 4);
    }
  }
  write_file_atomically(path, bytes);
}

TokenFile::TokenFile(const std::filesystem::path& path)
    : path_(path), max_token_(std::make_shared<int64_t>(-1)) {
  const std::string name = path.string();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "token file '", name, "': cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    TESSERA_FAIL("token file '", name, "': cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {  // mmap of a directory would fail with a puzzling "No such device"
    ::close(fd);
    if (S_ISDIR(st.st_mode))
      TESSERA_FAIL("token file '", name, "' is a directory; pass the token file itself (e.g. '",
                   (path / "train.bin").string(), "')");
    TESSERA_FAIL("token file '", name, "' is not a regular file");
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kTokenFileHeaderBytes) {
    ::close(fd);
    TESSERA_FAIL("token file '", name, "': ", file_bytes, " bytes, shorter than the ",
                 kTokenFileHeaderBytes, "-byte header (truncated at offset ", file_bytes, ")");
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  if (map == MAP_FAILED) ::close(fd);
  TESSERA_CHECK(map != MAP_FAILED, "token file '", name, "': mmap failed: ", std::strerror(map_errno));
  descriptor_ = std::shared_ptr<int>(new int(fd), [](int* d) {
    ::close(*d);
    delete d;
  });
  bytes_ = static_cast<int64_t>(file_bytes);
  mapping_ = std::shared_ptr<void>(map, [file_bytes](void* p) { ::munmap(p, file_bytes); });

  int32_t header[3];
  std::memcpy(header, map, sizeof(header));
  TESSERA_CHECK(header[0] == kTokenFileMagic, "token file '", name, "': bad magic ", header[0],
                " at offset 0 (expected ", kTokenFileMagic, "; not an llm.c token file?)");
  TESSERA_CHECK(header[1] == 1 || header[1] == 2, "token file '", name, "': unsupported version ",
                header[1], " at offset 4 (expected 1 = uint16 or 2 = uint32)");
  TESSERA_CHECK(header[2] >= 0, "token file '", name, "': negative token count ", header[2],
                " at offset 8");
  version_ = header[1];
  count_ = header[2];
  const size_t width = version_ == 1 ? 2 : 4;
  const size_t expected = kTokenFileHeaderBytes + static_cast<size_t>(count_) * width;
  TESSERA_CHECK(file_bytes == expected, "token file '", name, "': header at offset 8 says ", count_,
                " tokens of ", width, " bytes, so ", expected, " bytes in all, but the file has ",
                file_bytes, " bytes (",
                file_bytes < expected ? "truncated at offset " : "extra bytes from offset ",
                std::min(file_bytes, expected), ")");
  tokens_ = static_cast<const std::byte*>(map) + kTokenFileHeaderBytes;
}

uint32_t TokenFile::operator[](int64_t i) const {
  TESSERA_CHECK(i >= 0 && i < count_, "token file '", path_.string(), "': index ", i,
                " out of range [0, ", count_, ")");
  return at_unchecked(i);
}

void TokenFile::check_not_shrunk() const {
  if (!descriptor_) return;
  struct stat st {};
  if (::fstat(*descriptor_, &st) != 0 || st.st_size >= bytes_) return;
  TESSERA_FAIL("token file '", path_.string(), "' shrank while in use: it had ", bytes_,
               " bytes when opened but now has ", static_cast<int64_t>(st.st_size),
               " (was it truncated or rewritten in place? write a new file and rename it "
               "instead)");
}

uint32_t TokenFile::max_token() const {
  if (*max_token_ < 0) {
    uint32_t m = 0;
    for (int64_t i = 0; i < count_; ++i) m = std::max(m, at_unchecked(i));
    *max_token_ = m;
  }
  return static_cast<uint32_t>(*max_token_);
}

}  // namespace tessera::data
