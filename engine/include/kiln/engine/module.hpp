#pragma once
// A module: a name, a reflected config struct, the modules it depends on, and an install function
// that adds its systems, resources and event handlers to a World. kiln's modules, a user's modules
// in the user's own binary and modules in plugins all register the same way, into a
// ModuleRegistry object (there is no global registry).
#include <any>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/engine/config/schema.hpp"
#include "kiln/engine/world.hpp"

namespace kiln {

struct ModuleDesc {
  std::string name;  // also the pipeline's [section] name
  std::string doc;   // one line
  std::vector<std::string> deps;
  config::ConfigSchema schema;
  // Type-erased install: stores the config as a World resource, then calls the module's install.
  std::function<void(World&, const std::any&)> install;
  // Optional: completes the config from what it names outside the pipeline (the model's shape from
  // the Hugging Face config.json of model.init_from) after it is read and before it is validated,
  // so the effective config (kiln config, checkpoints) holds the completed values. Problems go to
  // `errors`, with the document's sources where a key is to blame.
  std::function<void(std::any& cfg, const config::Node& doc, const std::string& file, config::Errors& errors)> complete;
};

template <config::Described Cfg>
ModuleDesc make_module(std::string name, std::string doc, std::vector<std::string> deps,
                       std::function<void(World&, const Cfg&)> install) {
  return ModuleDesc{std::move(name), std::move(doc), std::move(deps), config::ConfigSchema::of<Cfg>(),
                    [install = std::move(install)](World& w, const std::any& cfg) {
                      const Cfg& stored = w.emplace_resource<Cfg>(std::any_cast<const Cfg&>(cfg));
                      install(w, stored);
                    }};
}

// The same with a `complete` step (ModuleDesc::complete) on the typed config.
template <config::Described Cfg>
ModuleDesc make_module(
    std::string name, std::string doc, std::vector<std::string> deps, std::function<void(World&, const Cfg&)> install,
    std::function<void(Cfg&, const config::Node& doc, const std::string& file, config::Errors& errors)> complete) {
  ModuleDesc d = make_module<Cfg>(std::move(name), std::move(doc), std::move(deps), std::move(install));
  d.complete = [complete = std::move(complete)](std::any& cfg, const config::Node& doc, const std::string& file,
                                                config::Errors& errors) {
    complete(std::any_cast<Cfg&>(cfg), doc, file, errors);
  };
  return d;
}

class ModuleRegistry {
 public:
  // A duplicate name is an error.
  void add(ModuleDesc desc);
  const ModuleDesc* find(std::string_view name) const;
  const ModuleDesc& get(std::string_view name) const;
  std::vector<std::string> names() const;  // in registration order
  // `wanted` and every module they depend on, dependencies first (ties: registration order).
  // Missing dependencies and cycles are errors naming the modules involved.
  std::vector<std::string> install_order(const std::vector<std::string>& wanted) const;
  // Checks every registered module's dependencies exist and form no cycle.
  void check() const;

 private:
  std::vector<ModuleDesc> modules_;
};

}  // namespace kiln

// A plugin shared library defines its registration function with this macro:
//   KILN_PLUGIN(registry) { registry.add(kiln::make_module<MyCfg>(...)); }
#define KILN_PLUGIN(registry_param) \
  extern "C" void kiln_register_modules(::kiln::ModuleRegistry& registry_param)
