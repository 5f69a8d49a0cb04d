// Small file helpers every layer above core uses: whole-file reads, atomic
// writes (temporary file, fsync, rename, so a crash leaves the old file or the
// new one, never a mix), CRC-32 / Adler-32 checksums (zlib's) and checksummed folders.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace tessera {

// Reads a whole file; error names the file when it cannot be opened or read.
std::string read_file(const std::filesystem::path& path);

// Writes `bytes` to `path` atomically: `path.tmp.<pid>` is written, fsynced and
// renamed over `path`, then the directory is fsynced. Parent folders are created.
void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes);
inline void write_file_atomically(const std::filesystem::path& path, const std::string& text) {
  write_file_atomically(path, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

// A whole regular file mapped read-only (copies share the map; it stays valid when the file
// is replaced by a rename). Error names the file and why it cannot be mapped.
struct MappedFile {
  std::shared_ptr<const void> mapping;
  size_t size = 0;
  const std::byte* data() const { return static_cast<const std::byte*>(mapping.get()); }
};
MappedFile map_file(const std::filesystem::path& path);

// Makes renames and creations in `dir` durable (best effort: some file systems refuse).
void fsync_directory(const std::filesystem::path& dir);

// CRC-32 (IEEE 802.3, the one zlib/PNG/gzip use); pass the previous value to continue.
uint32_t crc32(std::span<const std::byte> bytes, uint32_t previous = 0);
inline uint32_t crc32(const std::string& s, uint32_t previous = 0) {
  return crc32(std::as_bytes(std::span<const char>(s.data(), s.size())), previous);
}
// Adler-32 (the zlib stream checksum).
uint32_t adler32(std::span<const std::byte> bytes, uint32_t previous = 1);

// A checksummed folder: checksums.json lists the size and CRC-32 of every other regular
// file in it, {"files": {"name": {"bytes": N, "crc32": C}, ...}} (checkpoints add more
// keys beside "files"). Written last and atomically, so its presence marks the folder
// complete.
inline constexpr const char* kFolderChecksumFile = "checksums.json";
void write_folder_checksums(const std::filesystem::path& dir);
// Checks every file checksums.json lists (and that each of `required` is listed); the
// error names the folder, the damaged file and how it differs.
void verify_folder_checksums(const std::filesystem::path& dir, const std::vector<std::string>& required = {});

}  // namespace tessera
