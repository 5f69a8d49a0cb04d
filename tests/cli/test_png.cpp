// The PNG encoder, checked by an independent decoder: Python's zlib and struct.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "cli/plot.h"
#include "core/error.h"
#include "data/file_io.h"

using namespace tessera;

namespace {
std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() / ("tessera_test_png_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

// Decodes a PNG with Python (chunk CRCs, zlib stream, filter bytes) and prints its
// pixels as hex, or an error line.
std::string python_decode(const std::filesystem::path& png) {
  const std::string script = R"PY(
import struct, sys, zlib
data = open(sys.argv[1], 'rb').read()
assert data[:8] == b'\x89PNG\r\n\x1a\n', 'signature'
pos, idat, ihdr = 8, b'', None
while pos < len(data):
    n, = struct.unpack('>I', data[pos:pos+4]); kind = data[pos+4:pos+8]; body = data[pos+8:pos+8+n]
    crc, = struct.unpack('>I', data[pos+8+n:pos+12+n])
    assert zlib.crc32(kind + body) & 0xffffffff == crc, 'crc of ' + kind.decode()
    if kind == b'IHDR': ihdr = struct.unpack('>IIBBBBB', body)
    if kind == b'IDAT': idat += body
    pos += 12 + n
w, h, depth, color, _, _, _ = ihdr
assert depth == 8 and color == 2, 'format'
raw = zlib.decompress(idat)
assert len(raw) == h * (1 + 3 * w), 'size'
out = bytearray()
for y in range(h):
    row = raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)]
    assert row[0] == 0, 'filter'
    out += row[1:]
print(w, h, out.hex())
)PY";
  const auto script_path = temp_dir() / "decode_png.py";
  std::ofstream(script_path) << script;
  const std::string cmd = "/usr/bin/python3 " + script_path.string() + " " + png.string() + " 2>&1";
  std::string result;
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[4096];
  while (pipe && fgets(buf, sizeof(buf), pipe)) result += buf;
  if (pipe) pclose(pipe);
  return result;
}

std::string hex(const std::vector<uint8_t>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : bytes) s += digits[b >> 4], s += digits[b & 15];
  return s;
}
// Removes this process's temporary folder when the tests are done.
class TempCleanup : public ::testing::Environment {
 public:
  void TearDown() override { std::filesystem::remove_all(temp_dir()); }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempCleanup);

}  // namespace

TEST(Png, DecodesToTheSamePixels) {
  std::mt19937 rng(1);
  // 1x1, odd sizes, and one image larger than a 65535-byte stored block.
  for (auto [w, h] : std::vector<std::pair<int, int>>{{1, 1}, {7, 33}, {257, 100}}) {
    std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
    for (auto& v : rgb) v = static_cast<uint8_t>(rng());
    const auto path = temp_dir() / ("img_" + std::to_string(w) + "x" + std::to_string(h) + ".png");
    tessera::data::write_file_atomically(path, tessera::cli::encode_png(w, h, rgb));
    EXPECT_EQ(python_decode(path), std::to_string(w) + " " + std::to_string(h) + " " + hex(rgb) + "\n");
  }
  EXPECT_THROW(tessera::cli::encode_png(2, 2, std::vector<uint8_t>(11)), tessera::Error);
}

TEST(Png, LossCurveIsAValidImageWithBothSeries) {
  tessera::cli::LossCurves curves;
  for (int s = 1; s <= 50; ++s) curves.train.emplace_back(s, 5.0 / s + 1.0);
  curves.val = {{10, 1.8}, {20, 1.5}, {50, 1.2}};
  const auto path = temp_dir() / "loss.png";
  tessera::cli::write_loss_curve_png(path.string(), curves, 200, 120);
  const std::string decoded = python_decode(path);
  ASSERT_EQ(decoded.rfind("200 120 ", 0), 0u) << decoded.substr(0, 200);
  // Both colours appear: train blue (1f77b4) and validation orange (ff7f0e).
  EXPECT_NE(decoded.find("1f77b4"), std::string::npos);
  EXPECT_NE(decoded.find("ff7f0e"), std::string::npos);
}
