#pragma once
// Loads modules from shared libraries named in `[engine] plugins`. Each library exports
// `kiln_register_modules` (define it with KILN_PLUGIN). Libraries stay loaded for the loader's
// lifetime, which must outlast every World that uses their modules.
#include <memory>
#include <string>
#include <vector>

#include "kiln/engine/module.hpp"

namespace kiln {

class PluginLoader {
 public:
  PluginLoader() = default;
  PluginLoader(const PluginLoader&) = delete;
  PluginLoader& operator=(const PluginLoader&) = delete;
  ~PluginLoader();
  // Loads `path` and registers its modules; errors name the library and the reason.
  void load(const std::string& path, ModuleRegistry& registry);

 private:
  std::vector<void*> handles_;
};

}  // namespace kiln
