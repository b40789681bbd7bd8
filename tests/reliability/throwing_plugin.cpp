// A plugin whose registration function throws something that is not a kiln error.
#include <stdexcept>

#include <kiln/engine/module.hpp>

KILN_PLUGIN(registry) {
  (void)registry;
  throw std::runtime_error("the plugin's registration failed on purpose");
}
