#include "kiln/parallel/thread_ranks.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/runner.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::parallel {

std::vector<RankOutcome> run_thread_ranks(int nproc, const config::PipelineConfig& cfg, const ModuleRegistry& registry,
                                          const std::function<void(World&)>& before_run,
                                          const std::function<void(World&)>& after_run) {
  KILN_CHECK(nproc > 0, "--nproc must be positive, got ", nproc);
  double timeout_s = 300;
  if (cfg.enabled("parallel")) timeout_s = cfg.get<ParallelConfig>("parallel").timeout_s;
  auto hub = std::make_shared<InProcessHub>(
      nproc, std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000.0)));
  std::vector<RankOutcome> outcomes(static_cast<std::size_t>(nproc));
  std::vector<std::thread> threads;
  for (int r = 0; r < nproc; ++r)
    threads.emplace_back([&, r] {
      auto& out = outcomes[static_cast<std::size_t>(r)];
      out.rank = r;
      try {
        World world;
        world.emplace_resource<RankInfo>(RankInfo{r, nproc, r, cfg.file, nproc});
        world.emplace_resource<LaunchContext>(LaunchContext{hub});
        install_pipeline(world, cfg, registry);
        if (before_run) before_run(world);
        run_pipeline(world);
        out.stop_reason = world.resource<RunControl>().stop_reason;
        if (after_run) after_run(world);
      } catch (const std::exception& e) {
        out.ok = false;
        out.config_error = dynamic_cast<const ConfigError*>(&e) != nullptr;
        out.file_error = dynamic_cast<const FileError*>(&e) != nullptr;
        out.error = e.what();
        // The first failure is the root cause; later ones are the others stopping because of it.
        hub->abort(cat("rank ", r, " failed: ", e.what()));
      }
    });
  for (auto& t : threads) t.join();
  return outcomes;
}

std::string describe_failures(const std::vector<RankOutcome>& outcomes) {
  std::vector<const RankOutcome*> failed;
  for (auto& o : outcomes)
    if (!o.ok) failed.push_back(&o);
  // Ranks that stopped because of another rank come after the ones that failed on their own.
  auto secondary = [](const RankOutcome* o) {
    return o->error.find("because rank") != std::string::npos || o->error.find("stopped in") != std::string::npos;
  };
  std::stable_sort(failed.begin(), failed.end(),
                   [&](const RankOutcome* a, const RankOutcome* b) { return !secondary(a) && secondary(b); });
  std::string s;
  for (auto* o : failed) s += cat(s.empty() ? "" : "\n", "[rank ", o->rank, "] ", o->error);
  return s;
}

}  // namespace kiln::parallel
