// A module in a shared library, loaded by the runner from `[engine] plugins`.
#include <kiln/engine/module.hpp>

namespace sample_plugin {
struct GreeterConfig {
  std::string greeting = "hello";
  int repeat = 1;
};
KILN_CONFIG(GreeterConfig, (greeting, "what to say"), (repeat, "how often"))

struct Greetings {
  std::vector<std::string> said;
};
}  // namespace sample_plugin

KILN_PLUGIN(registry) {
  using namespace sample_plugin;
  registry.add(kiln::make_module<GreeterConfig>("greeter", "says hello at setup", {},
                                                [](kiln::World& w, const GreeterConfig& cfg) {
                                                  w.emplace_resource<Greetings>();
                                                  w.systems().add({"greeter.say", kiln::Phase::setup,
                                                                   [cfg](kiln::World& world) {
                                                                     for (int i = 0; i < cfg.repeat; ++i)
                                                                       world.resource<Greetings>().said.push_back(cfg.greeting);
                                                                   }});
                                                }));
}
