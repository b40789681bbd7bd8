#pragma once
// The JSONL metrics files the log module writes (log.metrics): reading them back.
#include <map>
#include <string>
#include <vector>

namespace kiln::log {

// One object per line; numeric fields only (null, e.g. a non-finite value, is left out).
using MetricsRow = std::map<std::string, double>;

// Reads a metrics file; a missing file or a line that is not a JSON object is an error naming
// file:line.
std::vector<MetricsRow> read_metrics(const std::string& path);

// The (x, y) pairs of the rows that have both fields, in file order.
struct Points {
  std::vector<double> x, y;
};
Points column(const std::vector<MetricsRow>& rows, const std::string& x_key, const std::string& y_key);

}  // namespace kiln::log
