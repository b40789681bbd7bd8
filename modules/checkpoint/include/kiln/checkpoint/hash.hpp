#pragma once
// Checksums of checkpoint files: XXH3-64 (xxHash). Why not CRC32C: Debian packages xxHash
// (libxxhash-dev) but no CRC32C library, XXH3 hashes at memory speed on one core (so verifying a
// checkpoint never costs more than reading it), and its 64 bits make an undetected corruption of a
// multi-gigabyte file far less likely than CRC32C's 32. It detects corruption, not tampering.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace kiln::checkpoint {

std::uint64_t hash64(const void* data, std::size_t bytes);

// Streaming XXH3-64 (same value as hash64 over the concatenated input).
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(Hasher&&) noexcept;
  Hasher& operator=(Hasher&&) noexcept;
  void update(const void* data, std::size_t bytes);
  std::uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

std::string to_hex(std::uint64_t v);                            // 16 lower-case hex digits
bool from_hex(const std::string& text, std::uint64_t& value);  // false if not exactly that

}  // namespace kiln::checkpoint
