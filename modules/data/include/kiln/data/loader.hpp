#pragma once
// Streaming training windows: every window of T+1 tokens that starts at a multiple of T inside a
// shard is one sample (inputs = first T tokens, targets = last T). A seeded permutation per epoch
// orders them; the position (samples consumed) is all that is needed to resume exactly. Shards
// with loss masks beside them (shard.hpp's TokenMask) give target -1 (no loss) where the target
// token is not trained on.
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/data/shard.hpp"

namespace kiln::data {

class WindowIndex {
 public:
  // Throws an error naming the files if no window of T+1 tokens fits, or if some shards have loss
  // masks and others not (naming one without).
  WindowIndex(std::vector<TokenShard> shards, int T);
  std::uint64_t windows() const { return total_; }
  int seq_len() const { return T_; }
  // Writes window w's T inputs and T targets (-1 where masked); throws if a token is >= vocab_limit
  // (when > 0).
  // With `doc_start` (masked shards), each input token's document start: the position in the
  // window of the nearest token at or before it that starts a document (kDocumentStart), 0 where the
  // window begins inside one.
  void read(std::uint64_t w, std::int32_t* inputs, std::int32_t* targets, int vocab_limit = 0,
            std::int32_t* doc_start = nullptr) const;
  // Whether the shards carry loss masks, and window w's targets that are trained on (T without).
  bool masked() const { return !masks_.empty(); }
  int trained_targets(std::uint64_t w) const;
  const std::vector<TokenShard>& shards() const { return shards_; }

 private:
  // The shard holding window w and the window's first token in it.
  std::pair<std::size_t, std::size_t> locate(std::uint64_t w) const;
  std::vector<TokenShard> shards_;
  std::vector<TokenMask> masks_;  // one per shard, or none
  std::vector<std::uint64_t> first_;  // first window of each shard
  std::uint64_t total_ = 0;
  int T_;
};

// Sample i of the run is window perm_e[i mod W] with e = i / W; perm_e is a Fisher-Yates shuffle
// driven by Philox keyed with (seed, e), identical on every platform and every rank.
class SampleOrder {
 public:
  SampleOrder(std::uint64_t windows, std::uint64_t seed, bool shuffle);
  std::uint64_t window(std::uint64_t sample);
  std::uint64_t epoch_of(std::uint64_t sample) const { return sample / windows_; }

 private:
  void build(std::uint64_t epoch);
  std::uint64_t windows_, seed_;
  bool shuffle_;
  std::uint64_t epoch_ = ~0ull;
  std::vector<std::uint64_t> perm_;
};

}  // namespace kiln::data
