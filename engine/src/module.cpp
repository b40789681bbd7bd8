#include "kiln/engine/module.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "kiln/engine/config/node.hpp"

namespace kiln {

void ModuleRegistry::add(ModuleDesc desc) {
  if (desc.name.empty()) KILN_THROW("a module needs a name");
  if (find(desc.name)) KILN_THROW("module '", desc.name, "' is registered twice");
  if (!desc.install) KILN_THROW("module '", desc.name, "' has no install function");
  modules_.push_back(std::move(desc));
}

const ModuleDesc* ModuleRegistry::find(std::string_view name) const {
  for (auto& m : modules_)
    if (m.name == name) return &m;
  return nullptr;
}

const ModuleDesc& ModuleRegistry::get(std::string_view name) const {
  if (auto* m = find(name)) return *m;
  auto hint = config::nearest(name, names());
  KILN_THROW("no module named '", name, "'", hint.empty() ? "" : cat(" (did you mean '", hint, "'?)"));
}

std::vector<std::string> ModuleRegistry::names() const {
  std::vector<std::string> n;
  for (auto& m : modules_) n.push_back(m.name);
  return n;
}

std::vector<std::string> ModuleRegistry::install_order(const std::vector<std::string>& wanted) const {
  // Closure over dependencies.
  std::set<std::string> closure;
  std::vector<std::string> stack;
  for (auto& w : wanted) {
    if (!find(w)) KILN_THROW("no module named '", w, "'");
    stack.push_back(w);
  }
  while (!stack.empty()) {
    auto name = stack.back();
    stack.pop_back();
    if (!closure.insert(name).second) continue;
    for (auto& d : get(name).deps) {
      if (!find(d)) KILN_THROW("module '", name, "' depends on '", d, "', which is not registered");
      stack.push_back(d);
    }
  }
  // Kahn's algorithm over the closure, ties broken by registration order.
  std::map<std::string, int> pending;
  for (auto& n : closure) pending[n] = static_cast<int>(get(n).deps.size());
  std::vector<std::string> order;
  bool progress = true;
  while (progress && order.size() < closure.size()) {
    progress = false;
    for (auto& m : modules_) {
      auto it = pending.find(m.name);
      if (it == pending.end() || it->second != 0) continue;
      order.push_back(m.name);
      it->second = -1;
      for (auto& other : modules_)
        if (pending.count(other.name) && pending[other.name] > 0)
          for (auto& d : other.deps)
            if (d == m.name) --pending[other.name];
      progress = true;
      break;  // restart so the earliest-registered ready module always comes next
    }
  }
  if (order.size() < closure.size()) {
    // Walk dependencies among the blocked modules until one repeats: that is a cycle.
    std::string cur;
    for (auto& [n, c] : pending)
      if (c > 0) {
        cur = n;
        break;
      }
    std::vector<std::string> path;
    while (std::find(path.begin(), path.end(), cur) == path.end()) {
      path.push_back(cur);
      for (auto& d : get(cur).deps)
        if (pending[d] > 0) {
          cur = d;
          break;
        }
    }
    std::string cycle;
    for (auto it = std::find(path.begin(), path.end(), cur); it != path.end(); ++it) cycle += "'" + *it + "' -> ";
    cycle += "'" + cur + "'";
    KILN_THROW("module dependency cycle: ", cycle, " (each depends on the next)");
  }
  return order;
}

void ModuleRegistry::check() const { install_order(names()); }

}  // namespace kiln
