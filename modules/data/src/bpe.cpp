#include "kiln/data/bpe.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <queue>
#include <unordered_map>

#include "kiln/core/error.hpp"

namespace kiln::data {

namespace {

constexpr std::uint32_t kNoRank = 0xffffffffu;

// Token pair -> its merge, open addressing (the lookup in the inner loop of encoding).
class PairTable {
 public:
  struct Entry {
    std::uint64_t key = kEmpty;
    std::uint32_t rank = kNoRank, result = 0;
  };
  void build(const std::vector<BpeVocabulary::Merge>& merges) {
    std::size_t cap = 16;
    while (cap < merges.size() * 2) cap *= 2;
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
    for (const auto& m : merges) {
      Entry& e = slot(key(m.left, m.right));
      if (e.key == kEmpty || m.rank < e.rank) e = {key(m.left, m.right), m.rank, m.result};
    }
  }
  const Entry* find(std::uint32_t left, std::uint32_t right) const {
    const std::uint64_t k = key(left, right);
    for (std::size_t i = hash(k);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == k) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr std::uint64_t kEmpty = ~0ull;
  static std::uint64_t key(std::uint32_t l, std::uint32_t r) { return (std::uint64_t{l} << 32) | r; }
  std::size_t hash(std::uint64_t k) const { return static_cast<std::size_t>((k * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  Entry& slot(std::uint64_t k) {
    std::size_t i = hash(k);
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask_;
    return slots_[i];
  }
  std::vector<Entry> slots_;
  std::size_t mask_ = 0;
};

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Merges in place, the leftmost pair of lowest rank first: rescans the (few) pair ranks after each
// merge. Quadratic in the piece length, fastest for the short pieces of ordinary text.
void merge_scan(const PairTable& pairs, std::vector<std::uint32_t>& parts) {
  std::vector<const PairTable::Entry*> at(parts.size() - 1);
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) at[i] = pairs.find(parts[i], parts[i + 1]);
  while (!at.empty()) {
    std::size_t best = at.size();
    std::uint32_t best_rank = kNoRank;
    for (std::size_t i = 0; i < at.size(); ++i)
      if (at[i] && at[i]->rank < best_rank) best_rank = at[i]->rank, best = i;
    if (best == at.size()) break;
    parts[best] = at[best]->result;
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    at.erase(at.begin() + static_cast<std::ptrdiff_t>(best));
    if (best > 0) at[best - 1] = pairs.find(parts[best - 1], parts[best]);
    if (best < at.size()) at[best] = pairs.find(parts[best], parts[best + 1]);
  }
}

// The same merges in O(n log n): a linked list of parts and a heap of candidate pairs ordered by
// (rank, position); entries made stale by an earlier merge are recognised and dropped when popped.
void merge_heap(const PairTable& pairs, std::vector<std::uint32_t>& parts) {
  const std::size_t n = parts.size();
  constexpr std::size_t kEnd = ~std::size_t{0};
  std::vector<std::size_t> next(n), prev(n);
  std::vector<char> alive(n, 1);
  for (std::size_t i = 0; i < n; ++i) next[i] = i + 1 < n ? i + 1 : kEnd, prev[i] = i ? i - 1 : kEnd;
  struct Candidate {
    std::uint32_t rank;
    std::size_t left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](std::size_t l) {
    if (l == kEnd || next[l] == kEnd) return;
    if (const auto* e = pairs.find(parts[l], parts[next[l]])) heap.push({e->rank, l, next[l]});
  };
  for (std::size_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right) continue;
    const auto* e = pairs.find(parts[c.left], parts[c.right]);
    if (!e || e->rank != c.rank) continue;
    parts[c.left] = e->result;
    alive[c.right] = 0;
    next[c.left] = next[c.right];
    if (next[c.left] != kEnd) prev[next[c.left]] = c.left;
    push(prev[c.left]);
    push(c.left);
  }
  std::size_t w = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (alive[i]) parts[w++] = parts[i];
  parts.resize(w);
}

constexpr std::size_t kHeapFrom = 128;          // pieces of at least this many bytes merge by heap
constexpr std::size_t kCacheMaxPiece = 256;     // longer pieces are not cached
constexpr std::size_t kCacheMaxEntries = 1u << 20;

// Piece -> its ids, for the words that repeat through a corpus: one flat table of slots probing
// linearly, the pieces' bytes and ids in two arenas (a lookup touches one slot and the arenas, no
// nodes). Emptied when full.
class PieceCache {
 public:
  PieceCache() { slots_.resize(1u << 12); }
  bool append(std::string_view piece, std::size_t hash, std::vector<std::uint32_t>& out) const {
    for (std::size_t i = hash & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.n == 0) return false;
      if (s.hash == hash && s.key_len == piece.size() && std::memcmp(keys_.data() + s.key, piece.data(), piece.size()) == 0) {
        for (std::uint32_t k = 0; k < s.n; ++k) out.push_back(ids_[s.ids + k]);
        return true;
      }
    }
  }
  void insert(std::string_view piece, std::size_t hash, const std::uint32_t* ids, std::size_t n) {
    if (used_ >= kCacheMaxEntries) clear();
    if (2 * (used_ + 1) > slots_.size()) grow();
    place({hash, static_cast<std::uint32_t>(keys_.size()), static_cast<std::uint32_t>(ids_.size()),
           static_cast<std::uint16_t>(piece.size()), static_cast<std::uint16_t>(n)});
    keys_.append(piece);
    ids_.insert(ids_.end(), ids, ids + n);
    ++used_;
  }

 private:
  struct Slot {
    std::size_t hash = 0;
    std::uint32_t key = 0, ids = 0;
    std::uint16_t key_len = 0, n = 0;  // n = 0: empty (every piece has at least one id)
  };
  void place(const Slot& slot) {
    std::size_t i = slot.hash & (slots_.size() - 1);
    while (slots_[i].n != 0) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = slot;
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.n != 0) place(s);
  }
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    used_ = 0;
  }
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<std::uint32_t> ids_;
  std::size_t used_ = 0;
};

}  // namespace

struct BpeTokenizer::Impl {
  BpeVocabulary v;
  Pretokenizer pre;
  PairTable pairs;
  std::uint32_t byte_token[256] = {};
  StringMap<std::uint32_t> whole;                  // tiktoken's whole-piece lookup
  PieceCache cache;
  // Added tokens as Hugging Face matches them: those not normalized in the text as given, the
  // others (their content normalized) in each normalized stretch between those.
  AddedTokenFinder raw_added, normalized_added;
  StringMap<std::uint32_t> added_id;               // content -> id
  bool plain_needs_added = false;                  // an added token that is not special exists
  std::string normalized;                          // normalize()'s buffer
  explicit Impl(BpeVocabulary vocabulary)
      : v(std::move(vocabulary)), pre(v.regex.empty() ? Pretokenizer(v.pattern) : Pretokenizer(v.regex)) {}
};

BpeTokenizer::BpeTokenizer(BpeVocabulary vocabulary) : impl_(std::make_unique<Impl>(std::move(vocabulary))) {
  auto& v = impl_->v;
  const std::string& what = v.description;
  if (v.tokens.size() >= kNoRank) KILN_FILE_ERROR(what, ": too many tokens (", v.tokens.size(), ")");
  bool have[256] = {};
  for (std::uint32_t id = 0; id < v.tokens.size(); ++id)
    if (v.tokens[id].size() == 1) {
      const auto b = static_cast<unsigned char>(v.tokens[id][0]);
      if (!have[b]) impl_->byte_token[b] = id;
      have[b] = true;
    }
  for (int b = 0; b < 256; ++b)
    if (!have[b]) KILN_FILE_ERROR(what, ": no token for the byte 0x", std::hex, b, " (byte-level BPE needs all 256)");
  for (const auto& m : v.merges) {
    const auto n = v.tokens.size();
    if (m.left >= n || m.right >= n || m.result >= n || v.tokens[m.result] != v.tokens[m.left] + v.tokens[m.right])
      KILN_FILE_ERROR(what, ": merge ", m.left, " + ", m.right, " -> ", m.result, " does not join two tokens into a third");
  }
  impl_->pairs.build(v.merges);
  if (v.whole_piece_tokens)
    for (std::uint32_t id = 0; id < v.tokens.size() && id < v.specials_from; ++id)
      if (!v.tokens[id].empty()) impl_->whole.emplace(v.tokens[id], id);
  std::vector<AddedToken> raw, normalized;
  for (const auto& t : v.added_tokens) {
    if (t.id >= v.tokens.size() || v.tokens[t.id].empty())
      KILN_FILE_ERROR(what, ": the added token \"", t.content, "\" has the id ", t.id, ", which has no token");
    impl_->added_id.emplace(t.content, t.id);
    impl_->plain_needs_added |= !t.special;
    if (!t.normalized) {
      raw.push_back(t);
    } else {
      normalized.push_back(t);
      std::string buffer;
      normalized.back().content = std::string(normalize(v.normalization, t.content, buffer));
    }
  }
  impl_->raw_added = AddedTokenFinder(raw);
  impl_->normalized_added = AddedTokenFinder(normalized);
}

BpeTokenizer::~BpeTokenizer() = default;

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<std::uint32_t>& out, MergeMethod method) const {
  std::vector<std::uint32_t> parts(piece.size());
  for (std::size_t i = 0; i < piece.size(); ++i) parts[i] = impl_->byte_token[static_cast<unsigned char>(piece[i])];
  if (parts.size() > 1) {
    if (method == MergeMethod::heap || (method == MergeMethod::auto_ && parts.size() >= kHeapFrom))
      merge_heap(impl_->pairs, parts);
    else
      merge_scan(impl_->pairs, parts);
  }
  out.insert(out.end(), parts.begin(), parts.end());
}

void BpeTokenizer::encode(std::string_view text, std::vector<std::uint32_t>& out) {
  if (impl_->plain_needs_added || impl_->v.normalization != Normalization::none)
    encode_around_added(text, false, out);
  else
    encode_ordinary(text, out);
}

void BpeTokenizer::encode_with_special_tokens(std::string_view text, std::vector<std::uint32_t>& out) {
  if (!impl_->v.added_tokens.empty() || impl_->v.normalization != Normalization::none)
    encode_around_added(text, true, out);
  else
    encode_ordinary(text, out);
}

void BpeTokenizer::encode_around_added(std::string_view text, bool with_special, std::vector<std::uint32_t>& out) {
  Impl& m = *impl_;
  auto token = [&](std::uint32_t id) { out.push_back(id); };
  m.raw_added.split(text, with_special, [&](std::string_view stretch) {
    const std::string_view normal = normalize(m.v.normalization, stretch, m.normalized);
    m.normalized_added.split(normal, with_special, [&](std::string_view part) { encode_ordinary(part, out); }, token);
  }, token);
}

void BpeTokenizer::encode_ordinary(std::string_view text, std::vector<std::uint32_t>& out) {
  Impl& m = *impl_;
  m.pre.split(text, [&](std::string_view piece) {
    if (piece.size() == 1) {
      out.push_back(m.byte_token[static_cast<unsigned char>(piece[0])]);
      return;
    }
    if (m.v.whole_piece_tokens) {
      if (auto it = m.whole.find(piece); it != m.whole.end()) {
        out.push_back(it->second);
        return;
      }
    }
    if (piece.size() > kCacheMaxPiece) {
      encode_piece(piece, out);
      return;
    }
    const std::size_t hash = std::hash<std::string_view>{}(piece);
    if (m.cache.append(piece, hash, out)) return;
    const std::size_t first = out.size();
    encode_piece(piece, out);
    m.cache.insert(piece, hash, out.data() + first, out.size() - first);
  });
}

std::string_view BpeTokenizer::token(std::uint32_t id) const {
  const auto& t = impl_->v.tokens;
  if (id >= t.size() || t[id].empty())
    KILN_THROW("token id ", id, " is not in the vocabulary of ", impl_->v.description);
  return t[id];
}

std::string BpeTokenizer::decode(std::span<const std::uint32_t> ids) const {
  std::string out;
  for (auto id : ids) out += token(id);
  return out;
}

std::uint32_t BpeTokenizer::vocab_size() const { return static_cast<std::uint32_t>(impl_->v.tokens.size()); }
std::optional<std::uint32_t> BpeTokenizer::document_separator() const { return impl_->v.document_separator; }
std::string BpeTokenizer::description() const { return impl_->v.description; }

std::optional<std::uint32_t> BpeTokenizer::token_id(std::string_view name) const {
  if (auto it = impl_->added_id.find(name); it != impl_->added_id.end()) return it->second;
  return std::nullopt;
}

}  // namespace kiln::data
