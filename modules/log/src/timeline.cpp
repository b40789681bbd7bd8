#include "kiln/log/timeline.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"

namespace kiln::log {

std::vector<TimedPass> read_timeline(const std::vector<std::string>& paths) {
  std::vector<TimedPass> out;
  for (const auto& path : paths) {
    std::ifstream in(path);
    if (!in) KILN_FILE_ERROR(path, ": cannot open the timeline file");
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      try {
        const auto j = nlohmann::json::parse(line);
        TimedPass p;
        p.rank = j.at("rank").get<int>();
        p.pp_rank = j.at("pp_rank").get<int>();
        p.forward = j.at("pass").get<std::string>() == "F";
        p.micro_batch = j.at("micro_batch").get<int>();
        p.chunk = j.at("chunk").get<int>();
        p.start_s = j.at("start_s").get<double>();
        p.end_s = j.at("end_s").get<double>();
        out.push_back(p);
      } catch (const nlohmann::json::exception& e) {
        KILN_FILE_ERROR(path, ":", n, ": not a timeline line (", e.what(), ")");
      }
    }
  }
  if (out.empty()) KILN_FILE_ERROR("no timed pass in the timeline files");
  return out;
}

TimelineSummary summarize_timeline(const std::vector<TimedPass>& passes) {
  TimelineSummary s;
  std::set<int> ranks, pps;
  double first = passes.front().start_s, last = passes.front().end_s, busy = 0;
  for (const auto& p : passes) {
    ranks.insert(p.rank);
    pps.insert(p.pp_rank);
    s.vpp = std::max(s.vpp, p.chunk + 1);
    s.micro_batches = std::max(s.micro_batches, p.micro_batch + 1);
    first = std::min(first, p.start_s);
    last = std::max(last, p.end_s);
    busy += p.end_s - p.start_s;
  }
  s.ranks = static_cast<int>(ranks.size());
  s.pp = static_cast<int>(pps.size());
  s.makespan_s = last - first;
  s.bubble = s.makespan_s > 0 ? 1.0 - busy / (s.ranks * s.makespan_s) : 0.0;
  s.formula = static_cast<double>(s.pp - 1) / (static_cast<double>(s.vpp) * s.micro_batches + s.pp - 1);
  return s;
}

std::string timeline_svg(const std::vector<TimedPass>& passes, const std::string& title) {
  KILN_CHECK(!passes.empty(), "a timeline without passes");
  const TimelineSummary sum = summarize_timeline(passes);
  std::map<int, int> row;  // rank -> row
  for (const auto& p : passes) row[p.rank] = 0;
  int r = 0;
  for (auto& [rank, at] : row) at = r++;
  double t0 = passes.front().start_s;
  for (const auto& p : passes) t0 = std::min(t0, p.start_s);
  const double ms = sum.makespan_s * 1e3;
  const int left = 90, top = 50, height = 34, width = 1000;
  const int H = top + height * static_cast<int>(row.size()) + 50;
  auto x = [&](double s) { return left + (s - t0) * 1e3 / (ms > 0 ? ms : 1) * width; };
  std::ostringstream o;
  char b[256];
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 20 << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  std::snprintf(b, sizeof b, "%s (pp %d x vpp %d, %d micro-batches: bubble %.1f%%, formula %.1f%%)", title.c_str(),
                sum.pp, sum.vpp, sum.micro_batches, 100 * sum.bubble, 100 * sum.formula);
  std::string t = b;
  std::string esc;
  for (char c : t) esc += c == '<' ? std::string("&lt;") : c == '&' ? std::string("&amp;") : std::string(1, c);
  o << "<text x=\"" << left << "\" y=\"24\" font-size=\"14\">" << esc << "</text>\n";
  for (const auto& [rank, at] : row) {
    const int y = top + at * height;
    o << "<text x=\"8\" y=\"" << y + height / 2 + 4 << "\">rank " << rank << "</text>\n";
  }
  for (const auto& p : passes) {
    const int y = top + row[p.rank] * height + 4;
    const double x0 = x(p.start_s), x1 = x(p.end_s);
    std::snprintf(b, sizeof b, "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" stroke=\"white\"/>\n",
                  x0, y, std::max(0.5, x1 - x0), height - 8, p.forward ? "#4c78a8" : "#59a14f");
    o << b;
    const std::string label = (p.forward ? "F" : "B") + std::to_string(p.micro_batch) +
                              (p.chunk > 0 ? "." + std::to_string(p.chunk) : "");
    if (x1 - x0 > 7.0 * static_cast<double>(label.size()))
      o << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"" << y + height / 2 << "\" fill=\"white\" text-anchor=\"middle\">"
        << label << "</text>\n";
  }
  const int axis = top + height * static_cast<int>(row.size()) + 14;
  std::snprintf(b, sizeof b, "<text x=\"%d\" y=\"%d\">0 ms</text><text x=\"%d\" y=\"%d\" text-anchor=\"end\">%.1f ms</text>\n",
                left, axis, left + width, axis, ms);
  o << b << "</svg>\n";
  return o.str();
}

}  // namespace kiln::log
