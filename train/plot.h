// A loss-curve picture without a plotting library: a small PNG encoder (zlib-compressed
// scanlines) and a line plot of train and validation loss.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera::train {

// 8-bit RGB pixels, row-major, 3 bytes each -> the bytes of a PNG file.
std::string encode_png(int width, int height, const std::vector<uint8_t>& rgb);

struct LossCurves {
  std::vector<std::pair<double, double>> train;  // (step, loss)
  std::vector<std::pair<double, double>> val;    // (step, eval_loss)
};

// Pixel rectangle with inclusive corners, e.g. the extent of a drawn text.
struct PlotBox {
  int x0 = 0, y0 = 0, x1 = -1, y1 = -1;
};

// One labelled tick: where it sits (a pixel row for the loss axis, a column for the
// step axis), its value, the text drawn next to it and where that text went.
struct PlotTick {
  int pixel;
  double value;
  std::string label;
  PlotBox label_box;
};

// A rendered loss plot, with the layout kept so callers (and tests) can find the labels.
struct LossPlot {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;                   // width * height * 3 bytes
  int left = 0, right = 0, top = 0, bottom = 0;  // the data area, in pixels
  int text_scale = 1;                         // each font pixel is text_scale^2 image pixels
  std::vector<PlotTick> loss_ticks, step_ticks;
  PlotBox step_title, loss_title;  // "step" under the step labels, "loss" upward at the left
  PlotBox legend;  // framed box naming each non-empty series by its colour; empty if none
};

// Draws the curves (train blue line, validation orange dots joined by a line) on a grid
// with "nice" loss ticks (1, 2 or 5 times a power of ten), labelled axes, axis titles
// ("step", "loss") and a legend, using a built-in 5x7 bitmap font.
LossPlot render_loss_curve(const LossCurves& curves, int width = 800, int height = 480);

// render_loss_curve, encoded as PNG and written atomically.
void write_loss_curve_png(const std::string& path, const LossCurves& curves, int width = 800,
                          int height = 480);

}  // namespace tessera::train
