#include <fstream>
#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/log/metrics.hpp"
#include "kiln/log/plot.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_plot(const Args& args) {
  po::options_description opts(
      "kiln plot METRICS[=LABEL]... -o OUT.svg [--y loss] [--x step] [--smooth N] [--title T]\n\nDraws one curve "
      "per metrics file (the JSONL files of log.metrics) as an SVG line plot: --y against --x, rows without "
      "either left out (--y val_loss plots the validation points).\n\noptions");
  std::vector<std::string> files;
  std::string out, x_key = "step", y_key = "loss", title;
  int smooth = 1;
  opts.add_options()("help,h", "show this help")("files", po::value(&files), "metrics files, each optionally =LABEL")(
      "output,o", po::value(&out), "the SVG file to write")("x", po::value(&x_key), "x field (default step)")(
      "y", po::value(&y_key), "y field (default loss)")("smooth", po::value(&smooth),
                                                        "moving average over this many points (default 1: none)")(
      "title", po::value(&title), "plot title");
  po::positional_options_description pos;
  pos.add("files", -1);
  if (!parse_args(args, opts, pos)) return 0;
  if (files.empty()) throw po::error("at least one METRICS file is required");
  if (out.empty()) throw po::error("-o OUT.svg is required");
  if (smooth < 1) throw po::error("--smooth must be at least 1");

  std::vector<log::Series> series;
  for (const auto& spec : files) {
    const auto eq = spec.find('=');
    const std::string path = spec.substr(0, eq), label = eq == std::string::npos ? path : spec.substr(eq + 1);
    auto pts = log::column(log::read_metrics(path), x_key, y_key);
    if (pts.x.empty()) KILN_THROW(path, ": no row has both '", x_key, "' and '", y_key, "'");
    series.push_back({label, pts.x, log::smooth(pts.y, smooth)});
  }
  log::PlotOptions po;
  po.title = title;
  po.x_label = x_key;
  po.y_label = smooth > 1 ? cat(y_key, " (moving average of ", smooth, ")") : y_key;
  const std::string svg = log::line_plot_svg(series, po);
  std::ofstream f(out);
  if (!(f << svg)) KILN_THROW(out, ": cannot write the plot");
  std::cout << "wrote " << out << " (" << series.size() << " series)\n";
  return 0;
}

}  // namespace kiln::app
