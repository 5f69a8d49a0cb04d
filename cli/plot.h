// A loss-curve picture without a plotting library: a tiny PNG encoder (stored, i.e.
// uncompressed, deflate blocks inside the zlib stream, so no zlib is needed) and a
// line plot of train and validation loss.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera::cli {

// 8-bit RGB pixels, row-major, 3 bytes each -> the bytes of a PNG file.
std::string encode_png(int width, int height, const std::vector<uint8_t>& rgb);

struct LossCurves {
  std::vector<std::pair<double, double>> train;  // (step, loss)
  std::vector<std::pair<double, double>> val;    // (step, val_loss)
};

// Draws the curves (train blue, validation orange with dots) on a grid with a light
// line at every integer loss, and writes the PNG atomically.
void write_loss_curve_png(const std::string& path, const LossCurves& curves, int width = 800,
                          int height = 480);

}  // namespace tessera::cli
