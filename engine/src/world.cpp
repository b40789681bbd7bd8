#include "kiln/engine/world.hpp"

namespace kiln {

World::~World() {
  // Systems first (their closures may point at anything), then components in reverse order of
  // their first use, then resources in reverse order of creation (a CUDA context made early must
  // outlive the buffers made later).
  systems_.clear();
  for (auto it = pool_order_.rbegin(); it != pool_order_.rend(); ++it) pools_.erase(*it);
  while (!resources_.empty()) resources_.pop_back();
}

Entity World::create(std::string name) {
  auto e = static_cast<Entity>(alive_.size());
  alive_.push_back(true);
  if (!name.empty()) emplace<Name>(e, Name{std::move(name)});
  return e;
}

void World::destroy(Entity e) {
  check_alive(e);
  for (auto& [_, p] : pools_) p->erase(e);
  alive_[static_cast<std::size_t>(e)] = false;
}

bool World::alive(Entity e) const {
  auto i = static_cast<std::size_t>(e);
  return i < alive_.size() && alive_[i];
}

std::size_t World::entity_count() const {
  std::size_t n = 0;
  for (bool a : alive_) n += a;
  return n;
}

std::string World::describe(Entity e) const {
  std::string s = cat("entity ", static_cast<std::uint32_t>(e));
  if (alive(e))
    if (auto* n = const_cast<World*>(this)->try_get<Name>(e)) s += cat(" '", n->value, "'");
  return s;
}

void World::check_alive(Entity e) const {
  if (!alive(e)) KILN_THROW(describe(e), " does not exist or was destroyed");
}

}  // namespace kiln
