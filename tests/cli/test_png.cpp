// The PNG encoder, checked by an independent decoder: Python's zlib and struct.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/train/plot.h"

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
  // 1x1, odd sizes, and one image larger than a 65535-byte deflate block.
  for (auto [w, h] : std::vector<std::pair<int, int>>{{1, 1}, {7, 33}, {257, 100}}) {
    std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
    for (auto& v : rgb) v = static_cast<uint8_t>(rng());
    const auto path = temp_dir() / ("img_" + std::to_string(w) + "x" + std::to_string(h) + ".png");
    tessera::write_file_atomically(path, tessera::train::encode_png(w, h, rgb));
    EXPECT_EQ(python_decode(path), std::to_string(w) + " " + std::to_string(h) + " " + hex(rgb) + "\n");
  }
  EXPECT_THROW(tessera::train::encode_png(2, 2, std::vector<uint8_t>(11)), tessera::Error);
}

TEST(Png, LossCurveIsAValidImageWithBothSeries) {
  tessera::train::LossCurves curves;
  for (int s = 1; s <= 50; ++s) curves.train.emplace_back(s, 5.0 / s + 1.0);
  curves.val = {{10, 1.8}, {20, 1.5}, {50, 1.2}};
  const auto path = temp_dir() / "loss.png";
  tessera::train::write_loss_curve_png(path.string(), curves, 200, 120);
  const std::string decoded = python_decode(path);
  ASSERT_EQ(decoded.rfind("200 120 ", 0), 0u) << decoded.substr(0, 200);
  // Both colours appear: train blue (1f77b4) and validation orange (ff7f0e).
  EXPECT_NE(decoded.find("1f77b4"), std::string::npos);
  EXPECT_NE(decoded.find("ff7f0e"), std::string::npos);
}

TEST(Png, TenThousandStepCurveIsSmallAndDecodesExactly) {
  // A noisy 10,000-step run with an evaluation every 100 steps, at the default 800x480.
  std::mt19937 rng(3);
  std::normal_distribution<double> noise(0.0, 0.05);
  tessera::train::LossCurves curves;
  for (int s = 1; s <= 10000; ++s) curves.train.emplace_back(s, 4.0 * std::exp(-s / 2500.0) + 1.5 + noise(rng));
  for (int s = 100; s <= 10000; s += 100) curves.val.emplace_back(s, 4.0 * std::exp(-s / 2500.0) + 1.6);
  const tessera::train::LossPlot plot = tessera::train::render_loss_curve(curves);
  const std::string png = tessera::train::encode_png(plot.width, plot.height, plot.rgb);
  EXPECT_LT(png.size(), 50000u) << "zlib-compressed loss.png";
  std::printf("loss.png of a 10,000-step run: %zu bytes\n", png.size());
  const auto path = temp_dir() / "loss_10000.png";
  tessera::write_file_atomically(path, png);
  EXPECT_EQ(python_decode(path), std::to_string(plot.width) + " " + std::to_string(plot.height) + " " + hex(plot.rgb) + "\n");
}

// --- Text on the loss plot: tick labels, axis titles and legend. ---

namespace {
using tessera::train::LossPlot;
using tessera::train::PlotBox;

constexpr uint32_t kWhitePixel = 0xFFFFFF;

uint32_t pixel(const LossPlot& p, int x, int y) {
  const uint8_t* q = &p.rgb[(static_cast<size_t>(y) * p.width + x) * 3];
  return uint32_t{q[0]} << 16 | uint32_t{q[1]} << 8 | q[2];
}

// Pixels of `color` inside the box (clipped to the image).
int count_pixels(const LossPlot& p, const PlotBox& b, uint32_t color) {
  int n = 0;
  for (int y = std::max(0, b.y0); y <= std::min(p.height - 1, b.y1); ++y)
    for (int x = std::max(0, b.x0); x <= std::min(p.width - 1, b.x1); ++x) n += pixel(p, x, y) == color;
  return n;
}

bool inside(const PlotBox& b, int x, int y) { return x >= b.x0 && x <= b.x1 && y >= b.y0 && y <= b.y1; }

// The ink pattern (non-white pixels) of a box, relative to its corner, as a string.
std::string ink(const LossPlot& p, const PlotBox& b) {
  std::string s;
  for (int y = b.y0; y <= b.y1; ++y) {
    for (int x = b.x0; x <= b.x1; ++x) s += pixel(p, x, y) == kWhitePixel ? '.' : '#';
    s += '\n';
  }
  return s;
}

tessera::train::LossCurves decaying_curves() {
  tessera::train::LossCurves curves;
  for (int s = 1; s <= 50; ++s) curves.train.emplace_back(s, 5.0 / s + 1.0);  // 6 .. 1.1
  curves.val = {{10, 1.8}, {20, 1.5}, {50, 1.2}};
  return curves;
}

std::vector<std::string> labels_of(const std::vector<tessera::train::PlotTick>& ticks) {
  std::vector<std::string> out;
  for (const auto& t : ticks) out.push_back(t.label);
  return out;
}
}  // namespace

TEST(Png, LossPlotLabelsTicksTitlesAndLegend) {
  // A small image (1x font) and the default size (2x font).
  for (auto [w, h] : std::vector<std::pair<int, int>>{{401, 301}, {800, 480}}) {
    SCOPED_TRACE(std::to_string(w) + "x" + std::to_string(h));
    const LossPlot p = tessera::train::render_loss_curve(decaying_curves(), w, h);
    ASSERT_EQ(p.rgb.size(), static_cast<size_t>(w) * h * 3);
    const int s = p.text_scale;
    // Loss 1.1..6 -> ticks every 1 from 1 to 6; steps 1..50 -> ticks every 10.
    EXPECT_EQ(labels_of(p.loss_ticks), (std::vector<std::string>{"1", "2", "3", "4", "5", "6"}));
    EXPECT_EQ(labels_of(p.step_ticks), (std::vector<std::string>{"10", "20", "30", "40", "50"}));

    for (const auto& t : p.loss_ticks) {
      SCOPED_TRACE("loss tick " + t.label);
      // The label is in the left margin, right-aligned against the tick, centred on its row.
      EXPECT_LT(t.label_box.x1, p.left - 2 * s);
      EXPECT_GE(t.label_box.x0, 0);
      EXPECT_LE(std::abs((t.label_box.y0 + t.label_box.y1) / 2 - t.pixel), s);
      EXPECT_EQ(t.label_box.x1 - t.label_box.x0 + 1, (6 * static_cast<int>(t.label.size()) - 1) * s);
      // And it is drawn: black ink inside it, glyph-sized (a 5x7 digit has 10..20 pixels).
      const int black = count_pixels(p, t.label_box, 0x000000);
      EXPECT_GE(black, 8 * s * s);
      EXPECT_LE(black, 20 * s * s * static_cast<int>(t.label.size()));
    }
    for (const auto& t : p.step_ticks) {
      SCOPED_TRACE("step tick " + t.label);
      // Under the axis, horizontally centred on the tick.
      EXPECT_GT(t.label_box.y0, p.bottom);
      EXPECT_LT(t.label_box.y1, p.height);
      EXPECT_LE(std::abs((t.label_box.x0 + t.label_box.x1) / 2 - t.pixel), s);
      EXPECT_GE(count_pixels(p, t.label_box, 0x000000), 16 * s * s);  // two digits
    }
    // Different digits draw different pixels (real glyphs, not blocks).
    EXPECT_NE(ink(p, p.loss_ticks[0].label_box), ink(p, p.loss_ticks[1].label_box));
    auto second_digit = [&](const PlotBox& b) { return PlotBox{b.x0 + 6 * s, b.y0, b.x1, b.y1}; };
    EXPECT_EQ(ink(p, second_digit(p.step_ticks[0].label_box)), ink(p, second_digit(p.step_ticks[1].label_box)))
        << "the '0' of \"10\" and \"20\" look the same";

    // Everything drawn in the left margin (left of the tick marks) is a loss label or the
    // "loss" title; everything under the step labels is the "step" title.
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < p.left - 6 * s; ++x) {
        if (pixel(p, x, y) == kWhitePixel) continue;
        bool explained = inside(p.loss_title, x, y);
        for (const auto& t : p.loss_ticks) explained |= inside(t.label_box, x, y);
        ASSERT_TRUE(explained) << "stray ink at (" << x << ", " << y << ")";
      }
    // Titles: "loss" upward (taller than wide) left of the labels; "step" under the labels.
    EXPECT_GT(p.loss_title.y1 - p.loss_title.y0, p.loss_title.x1 - p.loss_title.x0);
    EXPECT_LT(p.loss_title.x1, p.loss_ticks[0].label_box.x0);
    EXPECT_GT(p.step_title.y0, p.step_ticks[0].label_box.y1);
    EXPECT_LT(p.step_title.y1, h);
    EXPECT_GE(count_pixels(p, p.loss_title, 0x000000), 30 * s * s);
    EXPECT_GE(count_pixels(p, p.step_title, 0x000000), 30 * s * s);

    // Legend inside the data area, with the series colours and text.
    EXPECT_GT(p.legend.x0, p.left);
    EXPECT_LE(p.legend.x1, p.right);
    EXPECT_GE(p.legend.y0, p.top);
    EXPECT_GT(count_pixels(p, p.legend, 0x1F77B4), 0);
    EXPECT_GT(count_pixels(p, p.legend, 0xFF7F0E), 0);
    EXPECT_GE(count_pixels(p, p.legend, 0x000000), 50 * s * s);  // "train" and "val"
  }
}

TEST(Png, LossPlotLabelsSmallAndLargeValues) {
  tessera::train::LossCurves curves;
  for (int s = 0; s <= 7; ++s) curves.train.emplace_back(1000 * s, 0.031 - 0.001 * s);  // 0.031 .. 0.024
  const LossPlot p = tessera::train::render_loss_curve(curves, 400, 300);
  EXPECT_EQ(labels_of(p.loss_ticks), (std::vector<std::string>{"0.024", "0.026", "0.028", "0.03", "0.032"}));
  EXPECT_EQ(labels_of(p.step_ticks),
            (std::vector<std::string>{"0", "2000", "4000", "6000"}));
  // Larger ticks are drawn higher up, and the step labels don't overlap.
  for (size_t i = 1; i < p.loss_ticks.size(); ++i) EXPECT_LT(p.loss_ticks[i].pixel, p.loss_ticks[i - 1].pixel);
  for (size_t i = 1; i < p.step_ticks.size(); ++i)
    EXPECT_GT(p.step_ticks[i].label_box.x0, p.step_ticks[i - 1].label_box.x1);
  for (const auto& t : p.loss_ticks) EXPECT_GE(t.label_box.x0, 0) << t.label;

  // Train only: the legend names train and shows no val colour.
  EXPECT_GT(count_pixels(p, p.legend, 0x1F77B4), 0);
  EXPECT_EQ(count_pixels(p, p.legend, 0xFF7F0E), 0);

  EXPECT_THROW(tessera::train::render_loss_curve(curves, 50, 40), tessera::Error);
}

TEST(Png, LossPlotLabelsStayDistinctAndApart) {
  // A loss that moves only in its 6th digit still gets distinct labels, and a narrow
  // image with 7-digit step numbers gets fewer step ticks rather than overlapping ones.
  tessera::train::LossCurves narrow;
  for (int s = 0; s <= 1000000; s += 10000) narrow.train.emplace_back(s, 2.30001 + 0.00001 * std::sin(s));
  // A flat loss gets a band around its value.
  tessera::train::LossCurves flat;
  flat.train = {{1, 3.0}, {2, 3.0}, {3, 3.0}};
  for (const auto* curves : {&narrow, &flat}) {
    const LossPlot p = tessera::train::render_loss_curve(*curves, 200, 120);
    ASSERT_GE(p.loss_ticks.size(), 2u);
    ASSERT_GE(p.step_ticks.size(), 2u);
    for (size_t i = 1; i < p.loss_ticks.size(); ++i) {
      EXPECT_NE(p.loss_ticks[i].label, p.loss_ticks[i - 1].label);
      EXPECT_NEAR(std::stod(p.loss_ticks[i].label), p.loss_ticks[i].value, 1e-9);
    }
    for (size_t i = 1; i < p.step_ticks.size(); ++i)
      EXPECT_GT(p.step_ticks[i].label_box.x0, p.step_ticks[i - 1].label_box.x1 + 1);
    for (const auto& t : p.step_ticks) EXPECT_LT(t.label_box.x1, p.width) << t.label;
  }
}

TEST(Png, LabelledLossPlotFileDecodesToTheRenderedPixels) {
  const auto curves = decaying_curves();
  const auto path = temp_dir() / "labelled_loss.png";
  tessera::train::write_loss_curve_png(path.string(), curves, 320, 200);
  const LossPlot p = tessera::train::render_loss_curve(curves, 320, 200);
  EXPECT_EQ(python_decode(path), "320 200 " + hex(p.rgb) + "\n");
}
