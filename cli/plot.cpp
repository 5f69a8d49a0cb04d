#include "cli/plot.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "data/file_io.h"

namespace tessera::cli {

namespace {

void put_u32_be(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xFF));
}

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

void append_chunk(std::string& png, const char type[5], const std::string& payload) {
  put_u32_be(png, static_cast<uint32_t>(payload.size()));
  const std::string typed = std::string(type, 4) + payload;
  png += typed;
  put_u32_be(png, data::crc32(bytes_of(typed)));  // CRC covers type and data
}

}  // namespace

std::string encode_png(int width, int height, const std::vector<uint8_t>& rgb) {
  TESSERA_CHECK(width > 0 && height > 0 && rgb.size() == static_cast<size_t>(width) * height * 3,
                "encode_png: ", rgb.size(), " bytes do not make a ", width, "x", height, " RGB image");
  // Raw scanlines, each prefixed with filter type 0 (none).
  std::string raw;
  raw.reserve(static_cast<size_t>(height) * (1 + 3 * width));
  for (int y = 0; y < height; ++y) {
    raw.push_back('\0');
    raw.append(reinterpret_cast<const char*>(rgb.data()) + static_cast<size_t>(y) * width * 3, width * 3);
  }
  // zlib stream: header (deflate, 32K window, no preset dictionary, check bits), stored
  // blocks of at most 65535 bytes (BFINAL on the last), Adler-32 of the raw data.
  std::string z = {'\x78', '\x01'};
  size_t pos = 0;
  do {
    const size_t n = std::min<size_t>(65535, raw.size() - pos);
    const bool last = pos + n == raw.size();
    z.push_back(last ? '\x01' : '\x00');
    z.push_back(static_cast<char>(n & 0xFF));
    z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xFF));
    z.push_back(static_cast<char>((~n >> 8) & 0xFF));
    z.append(raw, pos, n);
    pos += n;
  } while (pos < raw.size());
  put_u32_be(z, data::adler32(bytes_of(raw)));

  std::string png = "\x89PNG\r\n\x1a\n";
  std::string ihdr;
  put_u32_be(ihdr, static_cast<uint32_t>(width));
  put_u32_be(ihdr, static_cast<uint32_t>(height));
  ihdr += std::string{'\x08', '\x02', '\x00', '\x00', '\x00'};  // 8-bit, RGB, deflate, filter 0, no interlace
  append_chunk(png, "IHDR", ihdr);
  append_chunk(png, "IDAT", z);
  append_chunk(png, "IEND", "");
  return png;
}

namespace {

struct Canvas {
  int w, h;
  std::vector<uint8_t> rgb;
  Canvas(int width, int height) : w(width), h(height), rgb(static_cast<size_t>(width) * height * 3, 255) {}
  void set(int x, int y, uint32_t color) {
    if (x < 0 || y < 0 || x >= w || y >= h) return;
    uint8_t* p = &rgb[(static_cast<size_t>(y) * w + x) * 3];
    p[0] = color >> 16, p[1] = (color >> 8) & 0xFF, p[2] = color & 0xFF;
  }
  // Bresenham, `thickness` pixels wide.
  void line(int x0, int y0, int x1, int y1, uint32_t color, int thickness = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    while (true) {
      for (int a = 0; a < thickness; ++a)
        for (int b = 0; b < thickness; ++b) set(x0 + a - thickness / 2, y0 + b - thickness / 2, color);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  void dot(int x, int y, uint32_t color, int radius) {
    for (int a = -radius; a <= radius; ++a)
      for (int b = -radius; b <= radius; ++b)
        if (a * a + b * b <= radius * radius) set(x + a, y + b, color);
  }
};

}  // namespace

void write_loss_curve_png(const std::string& path, const LossCurves& curves, int width, int height) {
  Canvas c(width, height);
  const int left = 50, right = width - 20, top = 20, bottom = height - 40;
  double x_min = INFINITY, x_max = -INFINITY, y_min = INFINITY, y_max = -INFINITY;
  for (const auto* series : {&curves.train, &curves.val})
    for (const auto& [x, y] : *series) {
      if (!std::isfinite(y)) continue;
      x_min = std::min(x_min, x), x_max = std::max(x_max, x);
      y_min = std::min(y_min, y), y_max = std::max(y_max, y);
    }
  if (!std::isfinite(x_min)) x_min = 0, x_max = 1, y_min = 0, y_max = 1;
  if (x_max == x_min) x_max = x_min + 1;
  y_min = std::floor(y_min), y_max = std::ceil(y_max);
  if (y_max == y_min) y_max = y_min + 1;
  auto px = [&](double x) { return left + static_cast<int>(std::lround((x - x_min) / (x_max - x_min) * (right - left))); };
  auto py = [&](double y) { return bottom - static_cast<int>(std::lround((y - y_min) / (y_max - y_min) * (bottom - top))); };

  const int y_step = std::max(1, static_cast<int>((y_max - y_min) / 10));  // at most ~10 grid lines
  for (double y = y_min; y <= y_max; y += y_step) c.line(left, py(y), right, py(y), 0xE0E0E0);
  c.line(left, bottom, right, bottom, 0x000000);
  c.line(left, top, left, bottom, 0x000000);
  for (int i = 0; i <= 10; ++i) {  // ticks on the step axis
    const int x = left + (right - left) * i / 10;
    c.line(x, bottom, x, bottom + 5, 0x000000);
  }

  auto draw = [&](const std::vector<std::pair<double, double>>& series, uint32_t color, bool dots) {
    bool have_prev = false;
    int prev_x = 0, prev_y = 0;
    for (const auto& [x, y] : series) {
      if (!std::isfinite(y)) {
        have_prev = false;
        continue;
      }
      const int cx = px(x), cy = py(y);
      if (have_prev) c.line(prev_x, prev_y, cx, cy, color, 2);
      if (dots) c.dot(cx, cy, color, 3);
      prev_x = cx, prev_y = cy, have_prev = true;
    }
  };
  draw(curves.train, 0x1F77B4, false);
  draw(curves.val, 0xFF7F0E, true);
  data::write_file_atomically(path, encode_png(width, height, c.rgb));
}

}  // namespace tessera::cli
