// A plugin module that injects faults into a running pipeline (tests/reliability): it throws from
// its install, or truncates or removes a file at the start of a chosen step.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>

#include <kiln/engine/engine_module.hpp>
#include <kiln/engine/module.hpp>

namespace fault_plugin {
struct FaultConfig {
  std::string throw_at_install;  // non-empty: install throws a std::runtime_error with this text
  std::string kiln_error_at_install;  // non-empty: install throws a kiln::Error with this text
  std::string truncate_file;
  int truncate_at_step = 0;
  std::int64_t truncate_to = 0;
  std::string remove_file;
  int remove_at_step = 0;
};
KILN_CONFIG(FaultConfig, (throw_at_install, "install throws std::runtime_error(this) when set"),
            (kiln_error_at_install, "install throws kiln::Error(this) when set"),
            (truncate_file, "a file to truncate while the run goes on"),
            (truncate_at_step, "the step at whose start it is truncated"),
            (truncate_to, "its size afterwards, in bytes"), (remove_file, "a file to delete while the run goes on"),
            (remove_at_step, "the step at whose start it is deleted"))
}  // namespace fault_plugin

KILN_PLUGIN(registry) {
  using namespace fault_plugin;
  registry.add(kiln::make_module<FaultConfig>(
      "fault", "injects faults (tests)", {}, [](kiln::World& w, const FaultConfig& cfg) {
        if (!cfg.throw_at_install.empty()) throw std::runtime_error(cfg.throw_at_install);
        if (!cfg.kiln_error_at_install.empty()) KILN_THROW(cfg.kiln_error_at_install);
        w.systems().add({"fault.inject", kiln::Phase::step_begin, [cfg](kiln::World& world) {
                           const auto step = world.resource<kiln::RunControl>().step;
                           if (!cfg.truncate_file.empty() && step == cfg.truncate_at_step &&
                               ::truncate(cfg.truncate_file.c_str(), cfg.truncate_to) != 0)
                             KILN_THROW("fault: cannot truncate ", cfg.truncate_file);
                           if (!cfg.remove_file.empty() && step == cfg.remove_at_step)
                             std::filesystem::remove(cfg.remove_file);
                         }});
      }));
}
