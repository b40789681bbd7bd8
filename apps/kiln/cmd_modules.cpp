#include <iomanip>
#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/builtin.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_modules(const Args& args) {
  po::options_description opts("kiln modules [--plugin LIB]...\n\nLists the registered modules, their "
                               "dependencies and their config fields.\n\noptions");
  std::vector<std::string> plugins;
  opts.add_options()("help,h", "show this help")("plugin", po::value(&plugins)->composing(),
                                                 "also load modules from this shared library");
  if (!parse_args(args, opts, {})) return 0;
  ModuleRegistry reg;
  register_builtin_modules(reg);
  PluginLoader loader;
  for (auto& lib : plugins) loader.load(lib, reg);
  reg.check();
  for (auto& name : reg.names()) {
    const auto& m = reg.get(name);
    std::cout << "[" << name << "] " << m.doc << "\n";
    std::cout << "  depends on: ";
    if (m.deps.empty()) std::cout << "-";
    for (std::size_t i = 0; i < m.deps.size(); ++i) std::cout << (i ? ", " : "") << m.deps[i];
    std::cout << "\n";
    std::size_t wn = 4, wt = 4, wd = 7;
    for (auto& f : m.schema.fields()) {
      wn = std::max(wn, f.name.size());
      wt = std::max(wt, f.type.size());
      wd = std::max(wd, f.default_value.size());
    }
    for (auto& f : m.schema.fields())
      std::cout << "  " << std::left << std::setw(static_cast<int>(wn)) << f.name << "  "
                << std::setw(static_cast<int>(wt)) << f.type << "  "
                << std::setw(static_cast<int>(wd)) << (f.default_value.empty() ? "(unset)" : f.default_value) << "  "
                << f.doc << "\n";
    std::cout << "\n";
  }
  return 0;
}

}  // namespace kiln::app
