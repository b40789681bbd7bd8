#include "kiln/engine/scheduler.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "kiln/core/error.hpp"
#include "kiln/engine/world.hpp"

namespace kiln {

namespace {
constexpr std::array<std::string_view, kPhaseCount> kPhaseNames = {
    "setup", "step_begin", "data", "forward", "backward",
    "grad_sync", "optimizer", "step_end", "checkpoint", "shutdown"};
}

std::string_view phase_name(Phase p) { return kPhaseNames[static_cast<std::size_t>(p)]; }

std::optional<Phase> phase_from_name(std::string_view name) {
  for (std::size_t i = 0; i < kPhaseCount; ++i)
    if (kPhaseNames[i] == name) return static_cast<Phase>(i);
  return std::nullopt;
}

const std::array<Phase, kPhaseCount>& all_phases() {
  static constexpr std::array<Phase, kPhaseCount> phases = {
      Phase::setup, Phase::step_begin, Phase::data, Phase::forward, Phase::backward,
      Phase::grad_sync, Phase::optimizer, Phase::step_end, Phase::checkpoint, Phase::shutdown};
  return phases;
}

void Scheduler::add(SystemDesc desc) {
  if (desc.name.empty()) KILN_THROW("a system needs a name");
  if (!desc.run) KILN_THROW("system '", desc.name, "' has no function");
  for (auto& s : systems_)
    if (s.name == desc.name) KILN_THROW("system '", desc.name, "' is registered twice");
  systems_.push_back(std::move(desc));
  built_ = false;
}

void Scheduler::clear() {
  systems_.clear();
  for (auto& o : order_) o.clear();
  built_ = false;
}

void Scheduler::build() {
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < systems_.size(); ++i) index[systems_[i].name] = i;

  // Edges u -> v mean "u runs before v". Constraints across phases must agree with phase order.
  std::vector<std::vector<std::size_t>> succ(systems_.size());
  std::vector<std::string> problems;
  auto edge = [&](std::size_t u, std::size_t v) {
    const auto pu = systems_[u].phase, pv = systems_[v].phase;
    if (pu == pv) {
      succ[u].push_back(v);
    } else if (pu > pv) {
      problems.push_back(cat("system '", systems_[v].name, "' (phase ", phase_name(pv),
                             ") cannot run after '", systems_[u].name, "' (phase ", phase_name(pu), ")"));
    }
  };
  auto wants = [](const std::vector<std::string>& names) {
    return std::find(names.begin(), names.end(), kAllSystems) != names.end();
  };
  for (std::size_t i = 0; i < systems_.size(); ++i) {
    const auto& s = systems_[i];
    for (std::size_t j = 0; j < systems_.size(); ++j) {  // "*": every other system of the phase
      if (j == i || systems_[j].phase != s.phase) continue;
      if (wants(s.after) && !wants(systems_[j].after)) edge(j, i);
      if (wants(s.before) && !wants(systems_[j].before)) edge(i, j);
    }
    for (auto& a : s.after) {
      if (a == kAllSystems) continue;
      auto it = index.find(a);
      if (it == index.end())
        problems.push_back(cat("system '", s.name, "' wants to run after unknown system '", a, "'"));
      else
        edge(it->second, i);
    }
    for (auto& b : s.before) {
      if (b == kAllSystems) continue;
      auto it = index.find(b);
      if (it == index.end())
        problems.push_back(cat("system '", s.name, "' wants to run before unknown system '", b, "'"));
      else
        edge(i, it->second);
    }
  }
  if (!problems.empty()) {
    std::string msg = "system order is invalid:";
    for (auto& p : problems) msg += "\n  " + p;
    KILN_THROW(msg);
  }

  for (auto phase : all_phases()) {
    auto& out = order_[static_cast<std::size_t>(phase)];
    out.clear();
    std::vector<std::size_t> members;
    for (std::size_t i = 0; i < systems_.size(); ++i)
      if (systems_[i].phase == phase) members.push_back(i);
    std::map<std::size_t, int> indegree;
    for (auto u : members) indegree[u];
    for (auto u : members)
      for (auto v : succ[u]) ++indegree[v];
    // Kahn's algorithm; ties broken by registration order so the result is deterministic.
    std::set<std::size_t> ready;
    for (auto [u, d] : indegree)
      if (d == 0) ready.insert(u);
    while (!ready.empty()) {
      auto u = *ready.begin();
      ready.erase(ready.begin());
      out.push_back(u);
      for (auto v : succ[u])
        if (--indegree[v] == 0) ready.insert(v);
    }
    if (out.size() != members.size()) {
      // Everything left has a positive in-degree: walk predecessors to print one cycle.
      std::set<std::size_t> left;
      for (auto [u, d] : indegree)
        if (d > 0) left.insert(u);
      std::map<std::size_t, std::size_t> pred;
      for (auto u : left)
        for (auto v : succ[u])
          if (left.count(v)) pred[v] = u;
      std::size_t cur = *left.begin();
      std::vector<std::size_t> seen_order;
      std::set<std::size_t> seen;
      while (!seen.count(cur)) {
        seen.insert(cur);
        seen_order.push_back(cur);
        cur = pred[cur];
      }
      std::string cycle;
      auto start = std::find(seen_order.begin(), seen_order.end(), cur);
      std::vector<std::size_t> loop(start, seen_order.end());
      std::reverse(loop.begin(), loop.end());
      for (auto u : loop) cycle += "'" + systems_[u].name + "' -> ";
      cycle += "'" + systems_[loop.front()].name + "'";
      KILN_THROW("cycle in the order of phase ", phase_name(phase), ": ", cycle);
    }
  }
  built_ = true;
}

void Scheduler::run(Phase phase, World& world) {
  if (!built_) build();
  for (auto i : order_[static_cast<std::size_t>(phase)]) systems_[i].run(world);
}

std::vector<std::string> Scheduler::order(Phase phase) const {
  std::vector<std::string> names;
  for (auto i : order_[static_cast<std::size_t>(phase)]) names.push_back(systems_[i].name);
  return names;
}

bool Scheduler::has(std::string_view name) const {
  return std::any_of(systems_.begin(), systems_.end(), [&](const SystemDesc& s) { return s.name == name; });
}

std::optional<std::string> Scheduler::not_replayable(Phase phase) const {
  for (auto i : order_[static_cast<std::size_t>(phase)])
    if (!systems_[i].replayable) return systems_[i].name;
  return std::nullopt;
}

}  // namespace kiln
