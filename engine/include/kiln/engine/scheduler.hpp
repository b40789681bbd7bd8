#pragma once
// Systems run in named phases of a training step. Inside a phase their order follows the
// before/after constraints, then registration order. build() checks the constraints once at
// startup: unknown system names and cycles are errors naming the systems involved.
#include <array>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

class World;

enum class Phase {
  setup,
  step_begin,
  data,
  forward,
  backward,
  grad_sync,
  optimizer,
  step_end,
  checkpoint,
  shutdown,
};
inline constexpr std::size_t kPhaseCount = 10;

std::string_view phase_name(Phase p);
std::optional<Phase> phase_from_name(std::string_view name);
const std::array<Phase, kPhaseCount>& all_phases();

// In SystemDesc::after (before): every other system of the phase, except those that ask the same.
inline constexpr const char* kAllSystems = "*";

struct SystemDesc {
  std::string name;                  // unique, e.g. "model.forward"
  Phase phase = Phase::step_begin;
  std::function<void(World&)> run;
  std::vector<std::string> after;    // systems that must run before this one
  std::vector<std::string> before;   // systems that must run after this one
  // Its work may be recorded once in a CUDA graph and replayed in later steps instead of running
  // (backend.cuda_graph): device work on the compute stream only, the same every step, no wait for
  // the device and no allocation; host bookkeeping a replay skips is restored by the module from
  // nn::PassesReplayed. A phase is replayed only when all its systems are.
  bool replayable = false;
};

class Scheduler {
 public:
  // Adds a system; a duplicate name is an error. Invalidates a previous build().
  void add(SystemDesc desc);
  // Resolves the order of every phase; throws kiln::Error on unknown names or cycles.
  void build();
  bool built() const { return built_; }
  // Runs the systems of one phase in order (builds first if needed).
  void run(Phase phase, World& world);
  // System names of one phase in execution order (after build()).
  std::vector<std::string> order(Phase phase) const;
  bool has(std::string_view name) const;  // registered (built or not)
  // The first system of `phase` (in order) that is not SystemDesc::replayable, if any.
  std::optional<std::string> not_replayable(Phase phase) const;
  std::size_t size() const { return systems_.size(); }
  void clear();

 private:
  std::vector<SystemDesc> systems_;
  std::array<std::vector<std::size_t>, kPhaseCount> order_{};
  bool built_ = false;
};

}  // namespace kiln
