#include "kiln/rng/tracker.hpp"

#include <sstream>

#include "kiln/core/error.hpp"

namespace kiln::rng {

ForkScope::~ForkScope() {
  if (!tracker_) return;
  tracker_->current_ = previous_;
  --tracker_->depth_;
}

void RngStatesTracker::add(const std::string& name, std::uint64_t seed) {
  if (name.empty()) KILN_THROW("an RNG state needs a name");
  if (capturing()) KILN_THROW("cannot add RNG state '", name, "' during a graph capture");
  for (auto& [n, s] : states_) {
    if (n == name) KILN_THROW("RNG state '", name, "' already exists");
    if (s.seed == seed) KILN_THROW("RNG state '", name, "' would reuse seed ", seed, " of state '", n, "'");
  }
  states_.emplace_back(name, RngState{seed, 0});
}

bool RngStatesTracker::has(std::string_view name) const {
  for (auto& [n, _] : states_)
    if (n == name) return true;
  return false;
}

void RngStatesTracker::reset() {
  if (depth_ != 0) KILN_THROW("cannot reset the RNG tracker inside a fork");
  if (capturing()) KILN_THROW("cannot reset the RNG tracker during a graph capture");
  states_.clear();
  current_ = -1;
}

ForkScope RngStatesTracker::fork(std::string_view name) {
  for (std::size_t i = 0; i < states_.size(); ++i)
    if (states_[i].first == name) {
      int previous = current_;
      current_ = static_cast<int>(i);
      ++depth_;
      return ForkScope(this, previous);
    }
  KILN_THROW("RNG state '", name, "' is not in the tracker (add it first)");
}

RngState& RngStatesTracker::current() { return current_ < 0 ? default_ : states_[current_].second; }

std::string RngStatesTracker::current_name() const { return current_ < 0 ? "" : states_[current_].first; }

RngState& RngStatesTracker::state(std::string_view name) {
  for (auto& [n, s] : states_)
    if (n == name) return s;
  KILN_THROW("RNG state '", name, "' is not in the tracker");
}

PhiloxArgs RngStatesTracker::draw(std::uint64_t n) {
  RngState& s = current();
  PhiloxArgs args{s.seed, s.offset, nullptr};
  if (capturing()) {
    const int i = current_ + 1;
    const std::uint64_t begin = capture_.start[static_cast<std::size_t>(i)];
    KILN_CHECK(s.offset >= begin, "RNG state '", current_name(), "' was set back before the start of the graph capture");
    args.offset = s.offset - begin;
    args.offset_ptr = capture_.bases + i;
  }
  s.offset += blocks_for(n);
  return args;
}

void RngStatesTracker::begin_graph_capture(std::uint64_t* bases) {
  KILN_CHECK(bases, "graph capture needs device memory for the base offsets");
  KILN_CHECK(!capturing(), "a graph capture is already running");
  capture_ = GraphCapture{bases, {}, {}};
  for (int i = 0; i < num_states(); ++i) capture_.start.push_back(by_index(i).offset);
}

GraphCapture RngStatesTracker::end_graph_capture() {
  KILN_CHECK(capturing(), "end_graph_capture without begin_graph_capture");
  GraphCapture g = std::move(capture_);
  capture_ = GraphCapture{};
  for (int i = 0; i < num_states(); ++i) {
    RngState& s = by_index(i);
    g.increment.push_back(s.offset - g.start[static_cast<std::size_t>(i)]);
    s.offset = g.start[static_cast<std::size_t>(i)];
  }
  return g;
}

std::vector<std::uint64_t> RngStatesTracker::next_replay(const GraphCapture& g) {
  KILN_CHECK(!capturing(), "next_replay during a capture");
  KILN_CHECK(static_cast<int>(g.increment.size()) == num_states(), "the graph was captured with ",
             g.increment.size(), " RNG states, the tracker has ", num_states());
  std::vector<std::uint64_t> bases(g.increment.size());
  for (int i = 0; i < num_states(); ++i) {
    RngState& s = by_index(i);
    bases[static_cast<std::size_t>(i)] = s.offset;
    s.offset += g.increment[static_cast<std::size_t>(i)];
  }
  return bases;
}

RngSnapshot RngStatesTracker::get_states() const { return RngSnapshot{default_, states_}; }

void RngStatesTracker::set_states(const RngSnapshot& snap) {
  if (snap.states.size() != states_.size())
    KILN_THROW("RNG snapshot holds ", snap.states.size(), " named states, the tracker ", states_.size());
  for (std::size_t i = 0; i < states_.size(); ++i)
    if (snap.states[i].first != states_[i].first)
      KILN_THROW("RNG snapshot state ", i, " is '", snap.states[i].first, "', the tracker's is '", states_[i].first, "'");
  default_ = snap.default_state;
  for (std::size_t i = 0; i < states_.size(); ++i) states_[i].second = snap.states[i].second;
}

std::string RngSnapshot::serialize() const {
  std::ostringstream os;
  os << "default " << default_state.seed << " " << default_state.offset << "\n";
  for (auto& [n, s] : states) os << n << " " << s.seed << " " << s.offset << "\n";
  return os.str();
}

RngSnapshot RngSnapshot::deserialize(std::string_view text) {
  RngSnapshot snap;
  std::istringstream is{std::string(text)};
  std::string line;
  int lineno = 0;
  bool have_default = false;
  while (std::getline(is, line)) {
    ++lineno;
    if (line.empty()) continue;
    std::istringstream ls(line);
    std::string name;
    RngState s;
    if (!(ls >> name >> s.seed >> s.offset) || !(ls >> std::ws).eof())
      KILN_THROW("RNG snapshot line ", lineno, " is malformed: '", line, "'");
    if (name == "default") {
      snap.default_state = s;
      have_default = true;
    } else {
      snap.states.emplace_back(name, s);
    }
  }
  if (!have_default) KILN_THROW("RNG snapshot has no default state");
  return snap;
}

}  // namespace kiln::rng
