#include "kiln/log/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "kiln/core/error.hpp"

namespace kiln::log {

namespace {

std::string xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

// Tick labels without float noise: as many decimals as the tick step needs.
std::string tick_label(double v, double step) {
  const int decimals = step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  char b[32];
  std::snprintf(b, sizeof b, "%.*f", decimals, std::fabs(v) < step * 1e-9 ? 0.0 : v);
  return b;
}

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"};

}  // namespace

std::vector<double> smooth(const std::vector<double>& y, int window) {
  if (window <= 1 || y.empty()) return y;
  const int half = window / 2, n = static_cast<int>(y.size());
  std::vector<double> out(y.size());
  for (int i = 0; i < n; ++i) {
    const int lo = std::max(0, i - half), hi = std::min(n - 1, i + half);
    double s = 0;
    for (int k = lo; k <= hi; ++k) s += y[static_cast<std::size_t>(k)];
    out[static_cast<std::size_t>(i)] = s / (hi - lo + 1);
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int count) {
  KILN_CHECK(std::isfinite(lo) && std::isfinite(hi) && count > 0, "nice_ticks(", lo, ", ", hi, ")");
  if (hi < lo) std::swap(lo, hi);
  if (hi == lo) hi = lo + 1;
  const double raw = (hi - lo) / count, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag, step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
  std::vector<double> t;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) t.push_back(v);
  return t;
}

std::string line_plot_svg(const std::vector<Series>& series, const PlotOptions& o) {
  KILN_CHECK(!series.empty(), "a plot needs at least one series");
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series) {
    KILN_CHECK(s.x.size() == s.y.size(), "series '", s.label, "': ", s.x.size(), " x values but ", s.y.size(), " y values");
    KILN_CHECK(!s.x.empty(), "series '", s.label, "' has no points");
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, s.x[i]), x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, s.y[i]), y1 = std::max(y1, s.y[i]);
    }
  }
  KILN_CHECK(std::isfinite(x0) && std::isfinite(y0), "the series have no finite points");
  const auto xt = nice_ticks(x0, x1), yt = nice_ticks(y0, y1);
  x0 = std::min(x0, xt.front()), x1 = std::max(x1, xt.back());
  y0 = std::min(y0, yt.front()), y1 = std::max(y1, yt.back());
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double L = 70, R = 20, T = o.title.empty() ? 20 : 45, B = 55;
  const double W = o.width - L - R, H = o.height - T - B;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * W; };
  auto py = [&](double y) { return T + (1 - (y - y0) / (y1 - y0)) * H; };

  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << o.width << "\" height=\"" << o.height
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  if (!o.title.empty())
    s << "<text x=\"" << o.width / 2 << "\" y=\"25\" text-anchor=\"middle\" font-size=\"15\">" << xml(o.title)
      << "</text>\n";
  const double xs = xt.size() > 1 ? xt[1] - xt[0] : 1, ys = yt.size() > 1 ? yt[1] - yt[0] : 1;
  for (double v : xt)
    s << "<line x1=\"" << num(px(v)) << "\" y1=\"" << T << "\" x2=\"" << num(px(v)) << "\" y2=\"" << T + H
      << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << num(px(v)) << "\" y=\"" << T + H + 17
      << "\" text-anchor=\"middle\">" << tick_label(v, xs) << "</text>\n";
  for (double v : yt)
    s << "<line x1=\"" << L << "\" y1=\"" << num(py(v)) << "\" x2=\"" << L + W << "\" y2=\"" << num(py(v))
      << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << L - 6 << "\" y=\"" << num(py(v) + 4) << "\" text-anchor=\"end\">"
      << tick_label(v, ys) << "</text>\n";
  s << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W << "\" height=\"" << H
    << "\" fill=\"none\" stroke=\"#444\"/>\n";
  s << "<text x=\"" << L + W / 2 << "\" y=\"" << o.height - 12 << "\" text-anchor=\"middle\">" << xml(o.x_label)
    << "</text>\n";
  s << "<text transform=\"translate(16," << T + H / 2 << ") rotate(-90)\" text-anchor=\"middle\">" << xml(o.y_label)
    << "</text>\n";
  for (std::size_t k = 0; k < series.size(); ++k) {
    const auto& sr = series[k];
    const char* color = kColors[k % (sizeof kColors / sizeof kColors[0])];
    s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
    for (std::size_t i = 0; i < sr.x.size(); ++i)
      if (std::isfinite(sr.x[i]) && std::isfinite(sr.y[i])) s << num(px(sr.x[i])) << "," << num(py(sr.y[i])) << " ";
    s << "\"/>\n";
    const double ly = T + 14 + 18.0 * static_cast<double>(k);
    s << "<line x1=\"" << L + W - 190 << "\" y1=\"" << ly << "\" x2=\"" << L + W - 165 << "\" y2=\"" << ly
      << "\" stroke=\"" << color << "\" stroke-width=\"2\"/>\n<text x=\"" << L + W - 158 << "\" y=\"" << ly + 4
      << "\">" << xml(sr.label) << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace kiln::log
