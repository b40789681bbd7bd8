#include "kiln/checkpoint/hash.hpp"

#define XXH_INLINE_ALL  // header-only: no runtime library to ship with kiln
#include <xxhash.h>

#include <cstdio>

namespace kiln::checkpoint {

std::uint64_t hash64(const void* data, std::size_t bytes) { return XXH3_64bits(data, bytes); }

struct Hasher::State {
  XXH3_state_t st;
};

Hasher::Hasher() : s_(std::make_unique<State>()) { XXH3_64bits_reset(&s_->st); }
Hasher::~Hasher() = default;
Hasher::Hasher(Hasher&&) noexcept = default;
Hasher& Hasher::operator=(Hasher&&) noexcept = default;
void Hasher::update(const void* data, std::size_t bytes) { XXH3_64bits_update(&s_->st, data, bytes); }
std::uint64_t Hasher::digest() const { return XXH3_64bits_digest(&s_->st); }

std::string to_hex(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool from_hex(const std::string& text, std::uint64_t& value) {
  if (text.size() != 16) return false;
  value = 0;
  for (char c : text) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    value = value << 4 | static_cast<std::uint64_t>(d);
  }
  return true;
}

}  // namespace kiln::checkpoint
