#pragma once
// Typed event bus, one per World. Events are plain structs.
//  - subscribe<E>(fn) returns an RAII Subscription; destroying it unsubscribes.
//  - publish(e) delivers now, in subscription order.
//  - enqueue(e) defers; drain() delivers the queued events in FIFO order. The queue is swapped out
//    before delivery, so events enqueued by handlers during a drain wait for the next drain().
// Re-entrancy: a handler may publish, enqueue, subscribe or unsubscribe. A subscription added
// during a dispatch does not see the event being dispatched; one removed during a dispatch is not
// called again, not even later in the same dispatch. Not thread-safe: a World belongs to one rank.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kiln {

namespace detail {
struct ChannelBase {
  virtual ~ChannelBase() = default;
  virtual void unsubscribe(std::uint64_t id) = 0;
};

template <class E>
class Channel final : public ChannelBase {
 public:
  std::uint64_t add(std::function<void(const E&)> fn) {
    slots_.push_back({next_id_, std::move(fn), true});
    return next_id_++;
  }
  void unsubscribe(std::uint64_t id) override {
    for (auto& s : slots_)
      if (s.id == id) s.alive = false;
    if (depth_ == 0) compact();
  }
  void publish(const E& e) {
    struct Depth {
      Channel* c;
      explicit Depth(Channel* ch) : c(ch) { ++c->depth_; }
      ~Depth() {
        if (--c->depth_ == 0) c->compact();
      }
    } guard(this);
    // Index loop: handlers may append subscriptions (not called for this event) while we iterate.
    const std::size_t n = slots_.size();
    for (std::size_t i = 0; i < n; ++i) {
      if (!slots_[i].alive) continue;
      auto fn = slots_[i].fn;  // copy: the vector may reallocate if the handler subscribes
      fn(e);
    }
  }
  std::size_t size() const {
    std::size_t n = 0;
    for (auto& s : slots_) n += s.alive;
    return n;
  }

 private:
  struct Slot {
    std::uint64_t id;
    std::function<void(const E&)> fn;
    bool alive;
  };
  void compact() { std::erase_if(slots_, [](const Slot& s) { return !s.alive; }); }
  std::vector<Slot> slots_;
  std::uint64_t next_id_ = 1;
  int depth_ = 0;
};
}  // namespace detail

// Move-only handle; unsubscribes on destruction. Safe to outlive the bus.
class [[nodiscard]] Subscription {
 public:
  Subscription() = default;
  Subscription(std::weak_ptr<detail::ChannelBase> ch, std::uint64_t id) : channel_(std::move(ch)), id_(id) {}
  Subscription(Subscription&& o) noexcept : channel_(std::move(o.channel_)), id_(std::exchange(o.id_, 0)) {}
  Subscription& operator=(Subscription&& o) noexcept {
    if (this != &o) {
      reset();
      channel_ = std::move(o.channel_);
      id_ = std::exchange(o.id_, 0);
    }
    return *this;
  }
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;
  ~Subscription() { reset(); }

  void reset() {
    if (id_ != 0)
      if (auto ch = channel_.lock()) ch->unsubscribe(id_);
    id_ = 0;
    channel_.reset();
  }
  explicit operator bool() const { return id_ != 0 && !channel_.expired(); }

 private:
  std::weak_ptr<detail::ChannelBase> channel_;
  std::uint64_t id_ = 0;
};

class EventBus {
 public:
  template <class E, class F>
  Subscription subscribe(F&& fn) {
    auto ch = channel<E>();
    auto id = ch->add(std::function<void(const E&)>(std::forward<F>(fn)));
    return Subscription(ch, id);
  }

  template <class E>
  void publish(const E& e) {
    auto it = channels_.find(std::type_index(typeid(E)));
    if (it == channels_.end()) return;
    // Hold a reference: a handler may not destroy the channel, but keep the lifetime obvious.
    auto ch = std::static_pointer_cast<detail::Channel<E>>(it->second);
    ch->publish(e);
  }

  template <class E>
  void enqueue(E e) {
    queue_.push_back([this, ev = std::move(e)] { publish(ev); });
  }

  // Delivers every event queued before this call; returns how many.
  std::size_t drain() {
    auto batch = std::exchange(queue_, {});
    for (auto& deliver : batch) deliver();
    return batch.size();
  }

  std::size_t pending() const { return queue_.size(); }

  template <class E>
  std::size_t subscribers() const {
    auto it = channels_.find(std::type_index(typeid(E)));
    return it == channels_.end() ? 0 : static_cast<detail::Channel<E>&>(*it->second).size();
  }

 private:
  template <class E>
  std::shared_ptr<detail::Channel<E>> channel() {
    auto& slot = channels_[std::type_index(typeid(E))];
    if (!slot) slot = std::make_shared<detail::Channel<E>>();
    return std::static_pointer_cast<detail::Channel<E>>(slot);
  }

  std::unordered_map<std::type_index, std::shared_ptr<detail::ChannelBase>> channels_;
  std::vector<std::function<void()>> queue_;
};

}  // namespace kiln
