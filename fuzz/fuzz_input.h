// Shared by the fuzz targets: the readers under test take file paths, so each input is
// written to a scratch file (in $TMPDIR, one folder per fuzzing process) first.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tessera/core/error.h"

namespace tessera::fuzz {

inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    auto d =
        std::filesystem::temp_directory_path() / ("tessera_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

// Writes the input to scratch_dir()/name and returns its path.
inline std::filesystem::path write_input(const std::string& name, const uint8_t* data,
                                         size_t size) {
  const std::filesystem::path path = scratch_dir() / name;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

// Runs `read` (the reader under test) and accepts what a bad input should give: a
// tessera::Error. A JSON library exception escaping a reader names no file or key, a defect
// of its message rather than of memory safety: accepted unless TESSERA_FUZZ_STRICT=1. Any
// other exception (std::bad_alloc from trusting a size, std::out_of_range, ...) is a
// finding: it is reported and the process aborts, which libFuzzer records as a crash.
template <class Read>
void expect_clean_error(Read&& read) {
  try {
    read();
  } catch (const tessera::Error&) {
  } catch (const nlohmann::json::exception& e) {
    static const bool strict = std::getenv("TESSERA_FUZZ_STRICT") != nullptr;
    if (strict) {
      std::fprintf(stderr, "fuzz finding: bare JSON exception: %s\n", e.what());
      std::abort();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz finding: unexpected exception: %s\n", e.what());
    std::abort();
  }
}

}  // namespace tessera::fuzz
