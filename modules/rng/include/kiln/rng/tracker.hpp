#pragma once
// The RNG states tracker (Megatron's "CudaRNGStatesTracker"), one per rank: a default state and
// named states ("model-parallel-rng", ...). A state is (seed, offset) of a Philox stream, so
// forking, saving and restoring are cheap and exact. Usable without a World.
//
//   tracker.add("model-parallel-rng", seed);
//   {
//     auto scope = tracker.fork("model-parallel-rng");   // draws now come from that state
//     auto args = tracker.draw(n);                       // {seed, offset}; offset advances by ceil(n/4)
//   }                                                    // previous state current again
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/rng/philox.hpp"

namespace kiln::rng {

inline constexpr const char* kModelParallelRng = "model-parallel-rng";
inline constexpr const char* kDataParallelRng = "data-parallel-rng";
inline constexpr const char* kExpertParallelRng = "expert-parallel-rng";

struct RngState {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;  // in Philox blocks of 4 words
  bool operator==(const RngState&) const = default;
};

// Every state of a tracker, by value: what checkpoints save and recompute restores.
struct RngSnapshot {
  RngState default_state;
  std::vector<std::pair<std::string, RngState>> states;  // in the order they were added
  bool operator==(const RngSnapshot&) const = default;
  std::string serialize() const;                         // one line per state, text
  static RngSnapshot deserialize(std::string_view text);  // throws on malformed input
};

// A CUDA graph's view of the tracker (graph-safe mode, as PyTorch's graph-safe generator): while a
// graph is captured, draws return offsets relative to the capture's start and a pointer to the
// state's base offset in `bases` (device memory the caller owns: one uint64 per state, the default
// state first, then the named ones in the order they were added). Kernels read base + relative
// offset when they run, so each replay draws fresh numbers once next_replay()'s values are copied
// into `bases` before its launch.
struct GraphCapture {
  std::uint64_t* bases = nullptr;
  std::vector<std::uint64_t> start;      // each state's offset when the capture began
  std::vector<std::uint64_t> increment;  // what one replay of the graph draws from each state
};

class RngStatesTracker;

// Makes a named state current for its lifetime; restores the previous current state on
// destruction (normal exit or exception). Scopes nest.
class [[nodiscard]] ForkScope {
 public:
  ForkScope(ForkScope&& o) noexcept : tracker_(std::exchange(o.tracker_, nullptr)), previous_(o.previous_) {}
  ForkScope(const ForkScope&) = delete;
  ForkScope& operator=(const ForkScope&) = delete;
  ForkScope& operator=(ForkScope&&) = delete;
  ~ForkScope();

 private:
  friend class RngStatesTracker;
  ForkScope(RngStatesTracker* t, int previous) : tracker_(t), previous_(previous) {}
  RngStatesTracker* tracker_;
  int previous_;
};

class RngStatesTracker {
 public:
  explicit RngStatesTracker(std::uint64_t default_seed = 0) { default_.seed = default_seed; }

  // Adds a named state at offset 0. A repeated name or seed is an error.
  void add(const std::string& name, std::uint64_t seed);
  bool has(std::string_view name) const;
  // Removes every named state (the default state stays); errors while a fork is active.
  void reset();
  ForkScope fork(std::string_view name = kModelParallelRng);

  // The state draws come from now: the innermost forked state, else the default.
  RngState& current();
  std::string current_name() const;  // "" for the default state
  RngState& default_state() { return default_; }
  RngState& state(std::string_view name);

  // Reserves n elements from the current state: returns where they start and advances the state.
  PhiloxArgs draw(std::uint64_t n);

  // Every state's value, copied (also while a graph is being captured: a snapshot never aliases
  // the device offsets, so it can be restored into any later capture or eager run).
  RngSnapshot get_states() const;
  // Replaces every state's value; the snapshot must hold exactly the same names.
  void set_states(const RngSnapshot& s);

  // Graph-safe draws (see GraphCapture). begin: draws now return {seed, offset - start, &bases[i]}.
  void begin_graph_capture(std::uint64_t* bases);
  // Ends the capture; the states go back to where it began (the captured draws have not run yet).
  GraphCapture end_graph_capture();
  bool capturing() const { return capture_.bases != nullptr; }
  // The values to copy into g.bases right before launching the graph once more; advances every
  // state by what the graph draws, so a replay draws exactly what the captured code would have
  // drawn eagerly now, and the next draw (eager or replay) continues after it.
  std::vector<std::uint64_t> next_replay(const GraphCapture& g);
  int num_states() const { return static_cast<int>(states_.size()) + 1; }

 private:
  friend class ForkScope;
  RngState default_;
  std::vector<std::pair<std::string, RngState>> states_;
  int current_ = -1;  // index into states_, -1 = default
  int depth_ = 0;
  GraphCapture capture_;
  RngState& by_index(int i) { return i == 0 ? default_ : states_[static_cast<std::size_t>(i - 1)].second; }
};

}  // namespace kiln::rng
