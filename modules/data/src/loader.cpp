#include "kiln/data/loader.hpp"

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/rng/philox.hpp"

namespace kiln::data {

WindowIndex::WindowIndex(std::vector<TokenShard> shards, int T) : shards_(std::move(shards)), T_(T) {
  KILN_CHECK(T > 0, "sequence length must be positive");
  // Loss masks: every shard has one, or none does.
  std::size_t with = 0;
  for (auto& s : shards_) with += std::filesystem::exists(mask_path_of(s.path())) ? 1 : 0;
  if (with > 0) {
    for (auto& s : shards_) {
      if (!std::filesystem::exists(mask_path_of(s.path())))
        KILN_FILE_ERROR(s.path(), ": has no loss mask (", mask_path_of(s.path()), ") though ", with,
                        " other shard(s) of the set have one: give every shard its mask, or none");
      masks_.emplace_back(mask_path_of(s.path()), s.size());
    }
  }
  for (auto& s : shards_) {
    first_.push_back(total_);
    if (s.size() >= static_cast<std::size_t>(T) + 1) total_ += (s.size() - 1) / T;
  }
  if (total_ == 0) {
    std::string names;
    for (auto& s : shards_) names += cat(names.empty() ? "" : ", ", s.path(), " (", s.size(), " tokens)");
    KILN_THROW("no window of ", T + 1, " tokens fits in ", names);
  }
}

std::pair<std::size_t, std::size_t> WindowIndex::locate(std::uint64_t w) const {
  KILN_CHECK(w < total_, "window ", w, " of ", total_);
  std::size_t s = static_cast<std::size_t>(std::upper_bound(first_.begin(), first_.end(), w) - first_.begin()) - 1;
  // Skip shards too short to hold a window (their first_ equals the next one's).
  while (s + 1 < first_.size() && first_[s + 1] <= w) ++s;
  return {s, static_cast<std::size_t>(w - first_[s]) * T_};
}

int WindowIndex::trained_targets(std::uint64_t w) const {
  if (masks_.empty()) return T_;
  const auto [s, start] = locate(w);
  std::vector<std::uint8_t> flags(static_cast<std::size_t>(T_) + 1);
  masks_[s].read(start, flags.size(), flags.data());
  int n = 0;
  for (int t = 1; t <= T_; ++t) n += (flags[t] & kTrained) ? 1 : 0;
  return n;
}

void WindowIndex::read(std::uint64_t w, std::int32_t* inputs, std::int32_t* targets, int vocab_limit,
                       std::int32_t* doc_start) const {
  const auto [s, start] = locate(w);
  std::vector<std::uint32_t> tok(static_cast<std::size_t>(T_) + 1);
  shards_[s].read(start, tok.size(), tok.data());
  std::vector<std::uint8_t> flags;
  if (!masks_.empty()) {
    flags.resize(tok.size());
    masks_[s].read(start, flags.size(), flags.data());
  }
  for (int t = 0; t < T_; ++t) {
    inputs[t] = static_cast<std::int32_t>(tok[t]);
    targets[t] = flags.empty() || (flags[t + 1] & kTrained) ? static_cast<std::int32_t>(tok[t + 1]) : -1;
  }
  if (doc_start) {
    std::int32_t start = 0;
    for (int t = 0; t < T_; ++t) {
      if (!flags.empty() && (flags[t] & kDocumentStart)) start = t;
      doc_start[t] = start;
    }
  }
  if (vocab_limit > 0)
    for (int t = 0; t <= T_; ++t)
      if (tok[t] >= static_cast<std::uint32_t>(vocab_limit))
        KILN_FILE_ERROR(shards_[s].path(), ": token ", tok[t], " at position ", start + t,
                        " is outside the model's vocabulary of ", vocab_limit);
}

SampleOrder::SampleOrder(std::uint64_t windows, std::uint64_t seed, bool shuffle)
    : windows_(windows), seed_(seed), shuffle_(shuffle) {
  KILN_CHECK(windows > 0, "no samples");
}

std::uint64_t SampleOrder::window(std::uint64_t sample) {
  const std::uint64_t e = sample / windows_;
  if (!shuffle_) return sample % windows_;
  if (e != epoch_) build(e);
  return perm_[sample % windows_];
}

void SampleOrder::build(std::uint64_t epoch) {
  perm_.resize(windows_);
  std::iota(perm_.begin(), perm_.end(), 0ull);
  const std::uint64_t key = seed_ ^ (0x9e3779b97f4a7c15ull * (epoch + 1));
  for (std::uint64_t i = windows_ - 1; i > 0; --i) {
    rng::Philox4 b = rng::philox_block(key, i);
    const std::uint64_t r = (static_cast<std::uint64_t>(b.v[0]) << 32) | b.v[1];
    std::swap(perm_[i], perm_[r % (i + 1)]);  // modulo bias below 2^-30 for any realistic size
  }
  epoch_ = epoch;
}

}  // namespace kiln::data
