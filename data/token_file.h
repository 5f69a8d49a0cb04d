// Token files in llm.c's layout: 256 little-endian int32 header words
// (word 0 = 20240520, word 1 = version, word 2 = token count), then the tokens,
// uint16 for version 1 and uint32 for version 2 (vocabularies over 65,535).
// Written atomically, read through a read-only memory map.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

namespace tessera::data {

constexpr int32_t kTokenFileMagic = 20240520;
constexpr size_t kTokenFileHeaderBytes = 256 * sizeof(int32_t);

// Writes `tokens` to `path`. Version 1 (uint16) when every token is below 65,536 and
// `vocab_size` (when given, > 0) is at most 65,536; version 2 (uint32) otherwise.
void write_token_file(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                      int64_t vocab_size = 0);

// A memory-mapped token file. The header is checked on open: bad magic, version or
// length is an error naming the file and the offending byte offset. Copies share the map.
class TokenFile {
 public:
  explicit TokenFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  int version() const { return version_; }
  int64_t size() const { return count_; }
  // Token i, 0 <= i < size() (checked).
  uint32_t operator[](int64_t i) const;
  // Token i with no bounds check (hot loops that checked their range once).
  uint32_t at_unchecked(int64_t i) const {
    return version_ == 1 ? static_cast<const uint16_t*>(tokens_)[i]
                         : static_cast<const uint32_t*>(tokens_)[i];
  }
  // Largest token id in the file (computed once, on first call).
  uint32_t max_token() const;
  // Throws, naming the file and its expected and actual size, when the file has shrunk since
  // it was opened (truncated by another program): reading the map past its new end would
  // end the process with SIGBUS and no message. One fstat; called before each batch read.
  void check_not_shrunk() const;

 private:
  std::filesystem::path path_;
  std::shared_ptr<void> mapping_;  // unmaps when the last copy goes
  std::shared_ptr<int> descriptor_;  // kept open for check_not_shrunk; closed with the map
  int64_t bytes_ = 0;
  const void* tokens_ = nullptr;
  int version_ = 0;
  int64_t count_ = 0;
  mutable std::shared_ptr<int64_t> max_token_;  // -1 until computed; shared by copies
};

}  // namespace tessera::data
