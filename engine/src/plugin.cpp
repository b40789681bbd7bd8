#include "kiln/engine/plugin.hpp"

#include <dlfcn.h>

namespace kiln {

PluginLoader::~PluginLoader() {
  // Plugins are deliberately not dlclose'd: code from them may still be referenced by handlers and
  // std::function objects that are destroyed later; the OS unmaps them at exit.
}

void PluginLoader::load(const std::string& path, ModuleRegistry& registry) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) KILN_THROW("cannot load plugin '", path, "': ", dlerror());
  using Fn = void (*)(ModuleRegistry&);
  auto fn = reinterpret_cast<Fn>(dlsym(handle, "kiln_register_modules"));
  if (!fn) KILN_THROW("plugin '", path, "' does not export kiln_register_modules (define it with KILN_PLUGIN)");
  handles_.push_back(handle);
  try {
    fn(registry);
  } catch (const std::exception& e) {  // a plugin may throw anything: name it either way
    KILN_THROW("plugin '", path, "': ", e.what());
  }
}

}  // namespace kiln
