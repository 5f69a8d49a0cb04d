// Checksums of a saved state folder: checksums.json records the size and CRC-32 of every
// file in it. Written last, so its presence marks the other files as complete; verified
// before anything is read, so a damaged file is refused with its name, never half-loaded.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

namespace tessera::dist {

inline constexpr const char* kChecksumFile = "checksums.json";

// Records every regular file of `dir` (except checksums.json) in dir/checksums.json,
// atomically; `extra` (a JSON object's text, may be empty) is kept beside "files".
void write_checksums(const std::filesystem::path& dir, const std::string& extra = "");

// Checks every file that checksums.json lists, and that each of `required` is listed.
// Errors name `what` (e.g. "checkpoint 'run/checkpoint-20'") and the damaged file: missing,
// truncated (the offset where it ends), extra bytes, or a CRC-32 mismatch.
void verify_checksums(const std::filesystem::path& dir, const std::string& what,
                      const std::vector<std::string>& required);

}  // namespace tessera::dist
