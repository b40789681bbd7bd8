// model.report_activations: what each block keeps for its backward pass, as the activation table
// holds it (blocks with the same rows printed once).
#include "activation_report.hpp"

#include <cstdio>
#include <map>
#include <sstream>
#include <tuple>

#include "kiln/core/error.hpp"

namespace kiln::model {

namespace {
std::string mib(std::size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}
}  // namespace

std::string activation_report(const ActivationTable& table, const TensorView& residual) {
  // Each block's rows, then the blocks grouped by identical rows.
  std::map<int, std::vector<const ActivationTable::SavedRow*>> by_block;
  for (const auto& r : table.saved_rows())
    if (r.block >= 0) by_block[r.block].push_back(&r);
  auto same = [](const std::vector<const ActivationTable::SavedRow*>& a,
                 const std::vector<const ActivationTable::SavedRow*>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (std::tie(a[i]->key, a[i]->dtype, a[i]->shape, a[i]->shared, a[i]->offload_slot) !=
          std::tie(b[i]->key, b[i]->dtype, b[i]->shape, b[i]->shared, b[i]->offload_slot))
        return false;
    return true;
  };
  std::vector<std::pair<std::vector<int>, std::vector<const ActivationTable::SavedRow*>>> groups;
  for (const auto& [block, rows] : by_block) {
    bool placed = false;
    for (auto& g : groups)
      if (same(g.second, rows)) {
        g.first.push_back(block);
        placed = true;
        break;
      }
    if (!placed) groups.push_back({{block}, rows});
  }
  std::ostringstream os;
  for (const auto& [blocks, rows] : groups) {
    os << "activations kept for the backward pass by " << (blocks.size() == 1 ? "block " : "each of blocks ");
    for (std::size_t i = 0; i < blocks.size() && i < 6; ++i) os << (i ? ", " : "") << blocks[i];
    if (blocks.size() > 6) os << ", ... (" << blocks.size() << " blocks)";
    os << ":\n";
    std::size_t own = 0;
    for (const auto* r : rows) {
      char line[224];
      const std::string where = r->shared ? "  (recomputed: one copy for every block)"
                                : r->offload_slot >= 0
                                    ? cat("  (in host memory: offload slot ", r->offload_slot, " on the device)")
                                    : std::string();
      std::snprintf(line, sizeof(line), "  %-22s %-5s %-20s %12s%s\n", r->key.c_str(),
                    std::string(name_of(r->dtype)).c_str(), r->shape.str().c_str(), mib(r->bytes()).c_str(),
                    where.c_str());
      os << line;
      if (!r->shared && r->offload_slot < 0) own += r->bytes();
    }
    os << "  its own: " << mib(own) << " a block, " << mib(own * blocks.size()) << " for these blocks\n";
  }
  if (residual)
    os << "and each block's input (the residual stream, read by its norm's backward): " << name_of(residual.dtype)
       << " " << residual.shape.str() << ", " << mib(residual.bytes()) << " a block\n";
  return os.str();
}

}  // namespace kiln::model
