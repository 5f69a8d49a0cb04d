#include "tessera/train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <zlib.h>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"

namespace tessera::train {

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
  put_u32_be(png, crc32(bytes_of(typed)));  // CRC covers type and data
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
  // zlib stream (header, deflate at the best level, Adler-32): plots are mostly flat colour
  // and compress about a hundredfold.
  uLongf z_size = compressBound(static_cast<uLong>(raw.size()));
  std::string z(z_size, '\0');
  const int status = compress2(reinterpret_cast<Bytef*>(z.data()), &z_size,
                               reinterpret_cast<const Bytef*>(raw.data()), static_cast<uLong>(raw.size()),
                               Z_BEST_COMPRESSION);
  TESSERA_CHECK(status == Z_OK, "encode_png: zlib compress2 failed with status ", status);
  z.resize(z_size);

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

constexpr uint32_t kWhite = 0xFFFFFF, kBlack = 0x000000, kGrid = 0xE0E0E0;
constexpr uint32_t kTrainColor = 0x1F77B4, kValColor = 0xFF7F0E;

// A 5x7 bitmap font with just the characters plot labels use: each glyph is 7 rows,
// bit 4 of a row is its leftmost column.
constexpr int kGlyphW = 5, kGlyphH = 7, kAdvance = kGlyphW + 1;
struct Glyph {
  char c;
  uint8_t rows[kGlyphH];
};
constexpr Glyph kFont[] = {
    {'0', {0b01110, 0b10001, 0b10011, 0b10101, 0b11001, 0b10001, 0b01110}},
    {'1', {0b00100, 0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110}},
    {'2', {0b01110, 0b10001, 0b00001, 0b00010, 0b00100, 0b01000, 0b11111}},
    {'3', {0b11111, 0b00010, 0b00100, 0b00010, 0b00001, 0b10001, 0b01110}},
    {'4', {0b00010, 0b00110, 0b01010, 0b10010, 0b11111, 0b00010, 0b00010}},
    {'5', {0b11111, 0b10000, 0b11110, 0b00001, 0b00001, 0b10001, 0b01110}},
    {'6', {0b00110, 0b01000, 0b10000, 0b11110, 0b10001, 0b10001, 0b01110}},
    {'7', {0b11111, 0b00001, 0b00010, 0b00100, 0b01000, 0b01000, 0b01000}},
    {'8', {0b01110, 0b10001, 0b10001, 0b01110, 0b10001, 0b10001, 0b01110}},
    {'9', {0b01110, 0b10001, 0b10001, 0b01111, 0b00001, 0b00010, 0b01100}},
    {'.', {0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b01100, 0b01100}},
    {'-', {0b00000, 0b00000, 0b00000, 0b11111, 0b00000, 0b00000, 0b00000}},
    {'+', {0b00000, 0b00100, 0b00100, 0b11111, 0b00100, 0b00100, 0b00000}},
    {' ', {0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b00000}},
    {'a', {0b00000, 0b00000, 0b01110, 0b00001, 0b01111, 0b10001, 0b01111}},
    {'e', {0b00000, 0b00000, 0b01110, 0b10001, 0b11111, 0b10000, 0b01110}},
    {'i', {0b00100, 0b00000, 0b01100, 0b00100, 0b00100, 0b00100, 0b01110}},
    {'l', {0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110}},
    {'n', {0b00000, 0b00000, 0b10110, 0b11001, 0b10001, 0b10001, 0b10001}},
    {'o', {0b00000, 0b00000, 0b01110, 0b10001, 0b10001, 0b10001, 0b01110}},
    {'p', {0b00000, 0b00000, 0b11110, 0b10001, 0b11110, 0b10000, 0b10000}},
    {'r', {0b00000, 0b00000, 0b10110, 0b11001, 0b10000, 0b10000, 0b10000}},
    {'s', {0b00000, 0b00000, 0b01111, 0b10000, 0b01110, 0b00001, 0b11110}},
    {'t', {0b01000, 0b01000, 0b11100, 0b01000, 0b01000, 0b01001, 0b00110}},
    {'v', {0b00000, 0b00000, 0b10001, 0b10001, 0b10001, 0b01010, 0b00100}},
};

const Glyph& glyph(char c) {
  for (const Glyph& g : kFont)
    if (g.c == c) return g;
  TESSERA_FAIL("plot: the built-in font has no glyph for '", std::string(1, c), "'");
}

// Width of a line of text in image pixels (no trailing gap after the last glyph).
int text_width(const std::string& text, int scale) {
  return text.empty() ? 0 : (static_cast<int>(text.size()) * kAdvance - 1) * scale;
}

struct Canvas {
  int w, h;
  std::vector<uint8_t> rgb;
  Canvas(int width, int height) : w(width), h(height), rgb(static_cast<size_t>(width) * height * 3, 255) {}
  void set(int x, int y, uint32_t color) {
    if (x < 0 || y < 0 || x >= w || y >= h) return;
    uint8_t* p = &rgb[(static_cast<size_t>(y) * w + x) * 3];
    p[0] = color >> 16, p[1] = (color >> 8) & 0xFF, p[2] = color & 0xFF;
  }
  void fill(int x0, int y0, int x1, int y1, uint32_t color) {  // inclusive corners
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, color);
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
  // Text with its top-left corner at (x, y); `upward` turns it 90 degrees counter-clockwise
  // (reading bottom to top, for the loss-axis title), then (x, y) is its bottom-left.
  // Returns the rectangle the text spans.
  PlotBox text(int x, int y, const std::string& s, uint32_t color, int scale, bool upward = false) {
    for (size_t i = 0; i < s.size(); ++i) {
      const Glyph& g = glyph(s[i]);
      for (int row = 0; row < kGlyphH; ++row)
        for (int col = 0; col < kGlyphW; ++col) {
          if (!(g.rows[row] >> (kGlyphW - 1 - col) & 1)) continue;
          const int along = (static_cast<int>(i) * kAdvance + col) * scale, across = row * scale;
          const int px = upward ? x + across : x + along, py = upward ? y - along - scale + 1 : y + across;
          fill(px, py, px + scale - 1, py + scale - 1, color);
        }
    }
    const int length = text_width(s, scale), thickness = kGlyphH * scale;
    return upward ? PlotBox{x, y - length + 1, x + thickness - 1, y} : PlotBox{x, y, x + length - 1, y + thickness - 1};
  }
};

// A tick spacing of 1, 2 or 5 times a power of ten giving about `target` intervals.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * magnitude >= raw * 0.999) return m * magnitude;
  return 10.0 * magnitude;
}

// Loss labels: 3 significant digits ("%.3g": 0.25, 1.5, 12, 1e+03), more only where
// neighbouring ticks would otherwise read the same (a narrow range far from zero).
std::vector<std::string> loss_labels(const std::vector<double>& values) {
  std::vector<std::string> labels;
  for (int digits = 3; digits <= 12; ++digits) {
    labels.clear();
    for (double v : values) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.*g", digits, v);
      labels.push_back(buf);
    }
    if (std::adjacent_find(labels.begin(), labels.end()) == labels.end()) break;
  }
  return labels;
}
std::string step_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

// Tick values: the multiples of `step` within [lo, hi].
std::vector<double> ticks_between(double lo, double hi, double step) {
  std::vector<double> values;
  // The count cap only guards against a degenerate step; callers ask for about 6 ticks.
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + 1e-9 * step && values.size() < 100; ++k)
    values.push_back(k * step + 0.0);  // + 0.0 turns -0 into 0, which prints as "0"
  return values;
}

}  // namespace

LossPlot render_loss_curve(const LossCurves& curves, int width, int height) {
  TESSERA_CHECK(width >= 120 && height >= 80, "render_loss_curve: a ", width, "x", height,
                " image is too small for a labelled plot (need at least 120x80)");
  double x_min = INFINITY, x_max = -INFINITY, y_min = INFINITY, y_max = -INFINITY;
  for (const auto* series : {&curves.train, &curves.val})
    for (const auto& [x, y] : *series) {
      if (!std::isfinite(y) || !std::isfinite(x)) continue;
      x_min = std::min(x_min, x), x_max = std::max(x_max, x);
      y_min = std::min(y_min, y), y_max = std::max(y_max, y);
    }
  if (!std::isfinite(x_min)) x_min = 0, x_max = 1, y_min = 0, y_max = 1;
  if (x_max == x_min) x_max = x_min + 1;
  // A flat loss (or one varying only in its last bits) gets a band around its value, so
  // the ticks are few and readable.
  if (y_max - y_min <= 1e-6 * std::max(std::abs(y_min), std::abs(y_max))) {
    const double mid = (y_min + y_max) / 2, half = mid != 0 ? 0.1 * std::abs(mid) : 0.5;
    y_min = mid - half, y_max = mid + half;
  }
  // The loss axis is widened to whole tick steps so the top and bottom lines are labelled.
  const double y_step = nice_step(y_max - y_min, 5);
  y_min = std::floor(y_min / y_step + 1e-9) * y_step, y_max = std::ceil(y_max / y_step - 1e-9) * y_step;

  LossPlot plot;
  plot.width = width, plot.height = height;
  const int s = plot.text_scale = height >= 400 && width >= 600 ? 2 : 1;
  const int text_h = kGlyphH * s, gap = 3 * s, tick_len = 2 + 2 * s;
  std::vector<double> loss_values = ticks_between(y_min, y_max, y_step);
  for (double& v : loss_values)
    if (std::abs(v) < 1e-9 * y_step) v = 0;  // "0", not "-2.2e-17"
  const std::vector<std::string> loss_texts = loss_labels(loss_values);
  int widest_loss_label = 0;
  for (const auto& t : loss_texts) widest_loss_label = std::max(widest_loss_label, text_width(t, s));

  // Margins: left holds the upward title, the loss labels and the ticks; bottom holds the
  // ticks, the step labels and the title; the right leaves room for a centred last label.
  plot.left = gap + text_h + gap + widest_loss_label + gap + tick_len;
  plot.right = width - 1 - std::max(10, text_width(step_label(x_max), s) / 2 + gap);
  plot.top = gap + text_h / 2 + 2;
  plot.bottom = height - 1 - (tick_len + gap + text_h + gap + text_h + gap);
  TESSERA_CHECK(plot.right - plot.left >= 20 && plot.bottom - plot.top >= 20, "render_loss_curve: a ", width, "x",
                height, " image leaves no room for the data between the labels");

  // Step ticks: about 6, fewer where the labels would run into each other.
  std::vector<double> step_values;
  for (int target = 6; target >= 1; --target) {
    const double x_step = std::max(1.0, nice_step(x_max - x_min, target));
    step_values = ticks_between(x_min, x_max, x_step);
    const double spacing = x_step / (x_max - x_min) * (plot.right - plot.left);
    const int widest = std::max(text_width(step_label(x_min), s), text_width(step_label(x_max), s));
    if (spacing >= widest + 2 * gap) break;
  }
  const int left = plot.left, right = plot.right, top = plot.top, bottom = plot.bottom;
  auto px = [&](double x) { return left + static_cast<int>(std::lround((x - x_min) / (x_max - x_min) * (right - left))); };
  auto py = [&](double y) { return bottom - static_cast<int>(std::lround((y - y_min) / (y_max - y_min) * (bottom - top))); };

  Canvas c(width, height);
  for (size_t i = 0; i < loss_values.size(); ++i) {
    PlotTick tick{py(loss_values[i]), loss_values[i], loss_texts[i], {}};
    c.line(left, tick.pixel, right, tick.pixel, kGrid);
    c.line(left - tick_len, tick.pixel, left, tick.pixel, kBlack);
    tick.label_box = c.text(left - tick_len - gap - text_width(tick.label, s), tick.pixel - text_h / 2, tick.label, kBlack, s);
    plot.loss_ticks.push_back(tick);
  }
  for (double v : step_values) {
    PlotTick tick{px(v), v, step_label(v), {}};
    c.line(tick.pixel, bottom, tick.pixel, bottom + tick_len, kBlack);
    tick.label_box = c.text(tick.pixel - text_width(tick.label, s) / 2, bottom + tick_len + gap, tick.label, kBlack, s);
    plot.step_ticks.push_back(tick);
  }
  c.line(left, bottom, right, bottom, kBlack);
  c.line(left, top, left, bottom, kBlack);
  plot.step_title = c.text((left + right - text_width("step", s)) / 2, height - 1 - gap - text_h + 1, "step", kBlack, s);
  plot.loss_title = c.text(gap, (top + bottom + text_width("loss", s)) / 2, "loss", kBlack, s, /*upward=*/true);

  auto draw = [&](const std::vector<std::pair<double, double>>& series, uint32_t color, bool dots) {
    bool have_prev = false;
    int prev_x = 0, prev_y = 0;
    for (const auto& [x, y] : series) {
      if (!std::isfinite(y) || !std::isfinite(x)) {
        have_prev = false;
        continue;
      }
      const int cx = px(x), cy = py(y);
      if (have_prev) c.line(prev_x, prev_y, cx, cy, color, 2);
      if (dots) c.dot(cx, cy, color, 3);
      prev_x = cx, prev_y = cy, have_prev = true;
    }
  };
  draw(curves.train, kTrainColor, false);
  draw(curves.val, kValColor, true);

  // Legend in the top-right corner of the data area, drawn last so curves don't hide it:
  // a sample of each non-empty series (line, plus a dot for val) on a framed white box.
  struct Entry {
    const char* name;
    uint32_t color;
    bool dot;
  };
  std::vector<Entry> entries;
  if (!curves.train.empty()) entries.push_back({"train", kTrainColor, false});
  if (!curves.val.empty()) entries.push_back({"val", kValColor, true});
  if (!entries.empty()) {
    const int sample = 8 * s, row_h = text_h + gap;
    const int box_w = gap + sample + gap + text_width("train", s) + gap;
    const int box_h = gap + static_cast<int>(entries.size()) * row_h;
    const int bx = right - 4 - box_w, by = top + 4;
    plot.legend = {bx, by, bx + box_w, by + box_h};
    c.fill(bx, by, bx + box_w, by + box_h, kWhite);
    c.line(bx, by, bx + box_w, by, kGrid), c.line(bx, by + box_h, bx + box_w, by + box_h, kGrid);
    c.line(bx, by, bx, by + box_h, kGrid), c.line(bx + box_w, by, bx + box_w, by + box_h, kGrid);
    for (size_t i = 0; i < entries.size(); ++i) {
      const int row = by + gap + static_cast<int>(i) * row_h, mid = row + text_h / 2;
      c.line(bx + gap, mid, bx + gap + sample, mid, entries[i].color, 2);
      if (entries[i].dot) c.dot(bx + gap + sample / 2, mid, entries[i].color, 1 + s);
      c.text(bx + gap + sample + gap, row, entries[i].name, kBlack, s);
    }
  }

  plot.rgb = std::move(c.rgb);
  return plot;
}

void write_loss_curve_png(const std::string& path, const LossCurves& curves, int width, int height) {
  const LossPlot plot = render_loss_curve(curves, width, height);
  write_file_atomically(path, encode_png(plot.width, plot.height, plot.rgb));
}

}  // namespace tessera::train
