#pragma once
// The World: one per rank. It owns the entities and their components, the typed singleton
// resources, the event bus and the system scheduler. There is no global state, so several
// Worlds (ranks) can live in one process as threads.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/engine/event_bus.hpp"
#include "kiln/engine/scheduler.hpp"
#include "kiln/engine/type_name.hpp"

namespace kiln {

enum class Entity : std::uint32_t {};

// Every entity created with a name carries it; errors use it.
struct Name {
  std::string value;
};

namespace detail {
struct PoolBase {
  virtual ~PoolBase() = default;
  virtual void erase(Entity e) = 0;
  virtual bool contains(Entity e) const = 0;
};
template <class T>
struct Pool final : PoolBase {
  std::map<Entity, T> items;  // ordered by entity: iteration order = creation order
  void erase(Entity e) override { items.erase(e); }
  bool contains(Entity e) const override { return items.count(e) != 0; }
};
struct ResourceBase {
  virtual ~ResourceBase() = default;
};
template <class T>
struct Resource final : ResourceBase {
  template <class... A>
  explicit Resource(A&&... a) : value(std::forward<A>(a)...) {}
  T value;
};
}  // namespace detail

class World {
 public:
  World() = default;
  World(const World&) = delete;
  World& operator=(const World&) = delete;
  ~World();

  // ---- entities ----
  Entity create(std::string name = {});
  void destroy(Entity e);
  bool alive(Entity e) const;
  std::size_t entity_count() const;
  std::string describe(Entity e) const;  // "entity 7 'blocks.3.attn.qkv'"

  // ---- components ----
  template <class T, class... A>
  T& emplace(Entity e, A&&... args) {
    check_alive(e);
    auto& p = pool<T>();
    auto [it, inserted] = p.items.try_emplace(e, std::forward<A>(args)...);
    if (!inserted) KILN_THROW(describe(e), " already has component ", type_name<T>());
    return it->second;
  }
  template <class T>
  T& get(Entity e) {
    if (auto* c = try_get<T>(e)) return *c;
    KILN_THROW(describe(e), " has no component ", type_name<T>());
  }
  template <class T>
  const T& get(Entity e) const {
    return const_cast<World*>(this)->get<T>(e);
  }
  template <class T>
  T* try_get(Entity e) {
    auto* p = find_pool<T>();
    if (!p) return nullptr;
    auto it = p->items.find(e);
    return it == p->items.end() ? nullptr : &it->second;
  }
  template <class T>
  bool has(Entity e) const {
    return const_cast<World*>(this)->try_get<T>(e) != nullptr;
  }
  template <class T>
  void remove(Entity e) {
    if (auto* p = find_pool<T>()) p->items.erase(e);
  }
  // Entities that carry every component in Ts, in creation order.
  template <class First, class... Rest>
  std::vector<Entity> view() const {
    std::vector<Entity> out;
    auto* p = const_cast<World*>(this)->find_pool<First>();
    if (!p) return out;
    for (auto& [e, _] : p->items)
      if ((has<Rest>(e) && ...)) out.push_back(e);
    return out;
  }
  // Calls f(entity, First&, Rest&...) for each entity carrying all of them, in creation order.
  // The entity list is taken first, so f may add or remove components.
  template <class First, class... Rest, class F>
  void each(F&& f) {
    for (Entity e : view<First, Rest...>())
      if (has<First>(e) && (has<Rest>(e) && ...)) f(e, get<First>(e), get<Rest>(e)...);
  }

  // ---- resources (typed singletons) ----
  template <class T, class... A>
  T& emplace_resource(A&&... args) {
    auto key = std::type_index(typeid(T));
    if (resource_index_.count(key)) KILN_THROW("resource ", type_name<T>(), " already exists");
    auto holder = std::make_unique<detail::Resource<T>>(std::forward<A>(args)...);
    T& ref = holder->value;
    resource_index_[key] = resources_.size();
    resources_.push_back(std::move(holder));
    return ref;
  }
  template <class T>
  T& resource() {
    if (auto* r = try_resource<T>()) return *r;
    KILN_THROW("missing resource ", type_name<T>(), " (is the module that provides it installed?)");
  }
  template <class T>
  T* try_resource() {
    auto it = resource_index_.find(std::type_index(typeid(T)));
    if (it == resource_index_.end()) return nullptr;
    return &static_cast<detail::Resource<T>&>(*resources_[it->second]).value;
  }
  template <class T>
  bool has_resource() {
    return try_resource<T>() != nullptr;
  }

  EventBus& events() { return events_; }
  Scheduler& systems() { return systems_; }

 private:
  void check_alive(Entity e) const;
  template <class T>
  detail::Pool<T>& pool() {
    auto& slot = pools_[std::type_index(typeid(T))];
    if (!slot) {
      slot = std::make_unique<detail::Pool<T>>();
      pool_order_.push_back(std::type_index(typeid(T)));
    }
    return static_cast<detail::Pool<T>&>(*slot);
  }
  template <class T>
  detail::Pool<T>* find_pool() {
    auto it = pools_.find(std::type_index(typeid(T)));
    return it == pools_.end() ? nullptr : static_cast<detail::Pool<T>*>(it->second.get());
  }

  // Declaration order matters for destruction: the bus outlives the resources that hold
  // subscriptions, resources outlive the components that may refer to them.
  EventBus events_;
  std::vector<std::unique_ptr<detail::ResourceBase>> resources_;
  std::unordered_map<std::type_index, std::size_t> resource_index_;
  std::unordered_map<std::type_index, std::unique_ptr<detail::PoolBase>> pools_;
  std::vector<std::type_index> pool_order_;
  std::vector<bool> alive_;
  Scheduler systems_;
};

}  // namespace kiln
