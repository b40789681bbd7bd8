#include <iostream>

#include "commands.hpp"
#include "kiln/builtin.hpp"
#include "kiln/engine/engine_module.hpp"

namespace kiln::app {

bool parse_args(const Args& args, const boost::program_options::options_description& opts,
                const boost::program_options::positional_options_description& positional) {
  namespace po = boost::program_options;
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(opts).positional(positional).run(), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return false;
  }
  po::notify(vm);
  return true;
}

std::unique_ptr<LoadedPipeline> load_pipeline(const std::string& file, const std::vector<std::string>& sets) {
  auto p = std::make_unique<LoadedPipeline>();
  register_builtin_modules(p->registry);
  p->plugins = std::make_unique<PluginLoader>();
  config::Node doc = config::load_document(file, sets);
  // Plugins first: their modules' sections can only be read once they are registered.
  auto engine = std::any_cast<EngineConfig>(config::read_engine_section(doc, p->registry));
  for (auto& lib : engine.plugins) {
    try {
      p->plugins->load(lib, p->registry);
    } catch (const Error& e) {
      throw ConfigError(cat(file, ": engine.plugins: ", e.what()));
    }
  }
  p->config = config::resolve(doc, file, p->registry);
  return p;
}

}  // namespace kiln::app
