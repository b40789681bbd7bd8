#include <fnmatch.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <set>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/log/metrics.hpp"
#include "kiln/log/plot.hpp"
#include "kiln/log/timeline.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_plot(const Args& args) {
  po::options_description opts(
      "kiln plot METRICS[=LABEL]... -o OUT.svg [--y loss] [--x step] [--smooth N] [--title T]\n\nDraws one curve "
      "per metrics file (the JSONL files of log.metrics) and y field as an SVG line plot: --y against --x, rows "
      "without either left out (--y val_loss plots the validation points). --y may repeat and may hold * "
      "wildcards: --y 'blocks.*.mlp.tokens_cv' draws a mixture of experts' load, one curve per layer.\n\n"
      "kiln plot --timeline TIMELINE.rank0 TIMELINE.rank1 ... -o OUT.svg draws the passes log.timeline timed, a "
      "row per rank, and prints the pipeline bubble they show against (pp - 1) / (vpp m + pp - 1).\n\noptions");
  std::vector<std::string> files, y_keys;
  std::string out, x_key = "step", title;
  int smooth = 1;
  bool timeline = false;
  opts.add_options()("help,h", "show this help")("timeline", po::bool_switch(&timeline),
                                                  "the files are log.timeline's: draw the passes")("files", po::value(&files), "metrics files, each optionally =LABEL")(
      "output,o", po::value(&out), "the SVG file to write")("x", po::value(&x_key), "x field (default step)")(
      "y", po::value(&y_keys)->composing(), "y field or * pattern, repeatable (default loss)")("smooth", po::value(&smooth),
                                                        "moving average over this many points (default 1: none)")(
      "title", po::value(&title), "plot title");
  po::positional_options_description pos;
  pos.add("files", -1);
  if (!parse_args(args, opts, pos)) return 0;
  if (files.empty()) throw po::error("at least one METRICS file is required");
  if (out.empty()) throw po::error("-o OUT.svg is required");
  if (smooth < 1) throw po::error("--smooth must be at least 1");
  if (timeline) {
    const auto passes = log::read_timeline(files);
    const auto sum = log::summarize_timeline(passes);
    std::ofstream f(out);
    if (!(f << log::timeline_svg(passes, title.empty() ? "passes" : title))) KILN_THROW(out, ": cannot write the plot");
    std::printf("wrote %s: %d ranks, pp %d x vpp %d, %d micro-batches, step %.2f ms, bubble %.1f%% (formula %.1f%%)\n",
                out.c_str(), sum.ranks, sum.pp, sum.vpp, sum.micro_batches, sum.makespan_s * 1e3, 100 * sum.bubble,
                100 * sum.formula);
    return 0;
  }

  if (y_keys.empty()) y_keys = {"loss"};
  std::vector<log::Series> series;
  for (const auto& spec : files) {
    const auto eq = spec.find('=');
    const std::string path = spec.substr(0, eq), label = eq == std::string::npos ? path : spec.substr(eq + 1);
    const auto rows = log::read_metrics(path);
    for (const auto& pattern : y_keys) {
      // The fields the pattern names, in order (a plain name names itself).
      std::set<std::string> keys;
      for (const auto& row : rows)
        for (const auto& [key, value] : row)
          if (fnmatch(pattern.c_str(), key.c_str(), 0) == 0) keys.insert(key);
      if (keys.empty()) keys.insert(pattern);
      for (const auto& y_key : keys) {
        auto pts = log::column(rows, x_key, y_key);
        if (pts.x.empty()) KILN_THROW(path, ": no row has both '", x_key, "' and '", y_key, "'");
        const bool one = files.size() == 1, only = y_keys.size() == 1 && keys.size() == 1;
        series.push_back({only ? label : one ? y_key : cat(label, ": ", y_key), pts.x, log::smooth(pts.y, smooth)});
      }
    }
  }
  std::string y_label;
  for (const auto& k : y_keys) y_label += (y_label.empty() ? "" : ", ") + k;
  log::PlotOptions po;
  po.title = title;
  po.x_label = x_key;
  po.y_label = smooth > 1 ? cat(y_label, " (moving average of ", smooth, ")") : y_label;
  const std::string svg = log::line_plot_svg(series, po);
  std::ofstream f(out);
  if (!(f << svg)) KILN_THROW(out, ": cannot write the plot");
  std::cout << "wrote " << out << " (" << series.size() << " series)\n";
  return 0;
}

}  // namespace kiln::app
