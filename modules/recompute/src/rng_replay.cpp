#include "kiln/recompute/rng_replay.hpp"

#include "kiln/core/error.hpp"

namespace kiln::recompute {

ReplayScope::~ReplayScope() {
  if (replay_) replay_->end(unit_);
}

void RngReplay::capture(int unit) { saved_[unit] = tracker_.get_states(); }

ReplayScope RngReplay::replay(int unit) {
  begin(unit);
  return ReplayScope(this, unit);
}

void RngReplay::begin(int unit) {
  auto it = saved_.find(unit);
  KILN_CHECK(it != saved_.end(), "activation recompute of layer unit ", unit,
             ": no RNG states were captured in its forward pass");
  resume_.emplace_back(unit, tracker_.get_states());
  tracker_.set_states(it->second);
}

void RngReplay::end(int unit) {
  KILN_CHECK(!resume_.empty() && resume_.back().first == unit, "activation recompute of layer unit ", unit,
             " ended, but ", resume_.empty() ? std::string("no recompute") : cat("unit ", resume_.back().first, "'s"),
             " is the innermost one running");
  tracker_.set_states(resume_.back().second);
  resume_.pop_back();
}

}  // namespace kiln::recompute
