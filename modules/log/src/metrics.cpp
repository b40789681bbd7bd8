#include "kiln/log/metrics.hpp"

#include <fstream>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"

namespace kiln::log {

std::vector<MetricsRow> read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) KILN_THROW(path, ": cannot open the metrics file");
  std::vector<MetricsRow> rows;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) KILN_THROW(path, ":", lineno, ": not a JSON object: ", line.substr(0, 80));
    MetricsRow row;
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it->is_number()) row[it.key()] = it->get<double>();
    rows.push_back(std::move(row));
  }
  return rows;
}

Points column(const std::vector<MetricsRow>& rows, const std::string& x_key, const std::string& y_key) {
  Points p;
  for (const auto& r : rows) {
    auto x = r.find(x_key), y = r.find(y_key);
    if (x == r.end() || y == r.end()) continue;
    p.x.push_back(x->second);
    p.y.push_back(y->second);
  }
  return p;
}

}  // namespace kiln::log
