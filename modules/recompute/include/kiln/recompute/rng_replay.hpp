#pragma once
// The RNG side of activation recompute, usable without a World: capture() the tracker's states when
// a checkpointed layer's forward pass begins; replay() makes those states current again for the
// recompute and, when the scope ends (normally or by an exception), puts back the states of that
// moment, so the draws after the recompute continue where they were.
//
//   RngReplay replay(tracker);
//   replay.capture(unit);                 // at the layer's forward begin
//   ...                                   // forward, other layers, backward of later layers
//   { auto scope = replay.replay(unit);   // at the layer's backward begin
//     recompute_forward(unit); }          // draws exactly what the forward drew
//
// begin()/end() are the same as an explicit pair, for callers driven by events (they nest as a stack).
#include <map>
#include <utility>
#include <vector>

#include "kiln/rng/tracker.hpp"

namespace kiln::recompute {

class RngReplay;

class [[nodiscard]] ReplayScope {
 public:
  ReplayScope(ReplayScope&& o) noexcept : replay_(std::exchange(o.replay_, nullptr)), unit_(o.unit_) {}
  ReplayScope(const ReplayScope&) = delete;
  ReplayScope& operator=(const ReplayScope&) = delete;
  ReplayScope& operator=(ReplayScope&&) = delete;
  ~ReplayScope();

 private:
  friend class RngReplay;
  ReplayScope(RngReplay* r, int unit) : replay_(r), unit_(unit) {}
  RngReplay* replay_;
  int unit_;
};

class RngReplay {
 public:
  explicit RngReplay(rng::RngStatesTracker& tracker) : tracker_(tracker) {}

  // Records every state of the tracker (the default and each named one) for `unit`.
  void capture(int unit);
  bool captured(int unit) const { return saved_.count(unit) != 0; }
  // Sets the states captured for `unit`; the scope's end restores the states of now. Errors when
  // `unit` was never captured.
  ReplayScope replay(int unit);
  void begin(int unit);
  // Ends the innermost replay, which must be `unit`'s.
  void end(int unit);
  int depth() const { return static_cast<int>(resume_.size()); }

 private:
  rng::RngStatesTracker& tracker_;
  std::map<int, rng::RngSnapshot> saved_;
  std::vector<std::pair<int, rng::RngSnapshot>> resume_;  // (unit, states to restore), innermost last
};

}  // namespace kiln::recompute
