// Uses kiln's RNG tracker without a World: named states, forks, snapshots, Philox draws.
#include <cstdio>

#include <kiln/rng/philox.hpp>
#include <kiln/rng/tracker.hpp>

int main() {
  kiln::rng::RngStatesTracker tracker(/*default seed*/ 1234);
  tracker.add(kiln::rng::kModelParallelRng, 5678);
  auto saved = tracker.get_states();
  float first = 0;
  {
    auto scope = tracker.fork(kiln::rng::kModelParallelRng);
    auto draw = tracker.draw(8);
    first = kiln::rng::philox_normal(draw.seed, draw.start(), 0);
  }
  tracker.set_states(saved);  // replay: the same numbers again
  auto scope = tracker.fork();
  auto again = tracker.draw(8);
  float replay = kiln::rng::philox_normal(again.seed, again.start(), 0);
  std::printf("normal draw %.6f, replayed %.6f: %s\n", first, replay, first == replay ? "identical" : "DIFFERENT");
  return first == replay ? 0 : 1;
}
