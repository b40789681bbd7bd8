#pragma once
// Line plots as standalone SVG (for loss curves in docs/): axes with round ticks, grid, one polyline
// per series, a legend. No dependencies; the text is escaped for XML.
#include <string>
#include <vector>

namespace kiln::log {

struct Series {
  std::string label;
  std::vector<double> x, y;
};

struct PlotOptions {
  std::string title;
  std::string x_label = "step";
  std::string y_label = "loss";
  int width = 900, height = 520;
};

// Moving average over a centred window of `window` points (1: unchanged), for noisy curves.
std::vector<double> smooth(const std::vector<double>& y, int window);

// About `count` round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int count = 6);

// The SVG document. Errors on no series, a series without points, or x and y of different sizes.
std::string line_plot_svg(const std::vector<Series>& series, const PlotOptions& options);

}  // namespace kiln::log
