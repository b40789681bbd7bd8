#include "kiln/checkpoint/shard_file.hpp"

#include <algorithm>

#include "kiln/checkpoint/files.hpp"
#include "kiln/checkpoint/hash.hpp"

namespace kiln::checkpoint {

namespace {
std::uint64_t aligned(std::uint64_t x) { return (x + kRecordAlign - 1) / kRecordAlign * kRecordAlign; }
}  // namespace

void ShardFile::add_piece(const std::string& tensor, const std::vector<std::int64_t>& shape, const Piece& piece,
                          const float* data) {
  records_.push_back({tensor, shape, piece, data, static_cast<std::uint64_t>(piece.numel()) * 4, false, {}});
}

void ShardFile::add_blob(const std::string& name, std::string bytes) {
  Record r;
  r.name = name;
  r.blob = true;
  r.owned = std::move(bytes);
  r.bytes = r.owned.size();
  records_.push_back(std::move(r));
}

std::uint64_t ShardFile::bytes() const {
  std::uint64_t at = 0;
  for (auto& r : records_) at = aligned(at) + r.bytes;
  return at;
}

Manifest ShardFile::write(const std::string& dir, const std::string& name, int rank,
                          const std::map<std::string, int>& coords) const {
  OutputFile out(dir + "/" + name);
  Hasher whole;
  Manifest m;
  RankEntry me{rank, coords, {}};
  // Chunks small enough that the second hash reads what the first left in the cache.
  constexpr std::uint64_t kChunk = 4 << 20;
  for (auto& r : records_) {
    const std::uint64_t pad = aligned(out.size()) - out.size();
    if (pad) {
      static const std::vector<char> zeros(kRecordAlign, 0);
      whole.update(zeros.data(), pad);
      out.write_zeros(pad);
    }
    const std::uint64_t offset = out.size();
    const char* p = r.blob ? r.owned.data() : static_cast<const char*>(r.data);
    Hasher own;
    for (std::uint64_t done = 0; done < r.bytes;) {
      const std::uint64_t n = std::min(kChunk, r.bytes - done);
      own.update(p + done, n);
      whole.update(p + done, n);
      out.write(p + done, n);
      done += n;
    }
    if (r.blob) {
      me.blobs.push_back({r.name, 0, offset, r.bytes, own.digest()});
      continue;
    }
    auto it = std::find_if(m.tensors.begin(), m.tensors.end(), [&](auto& t) { return t.name == r.name; });
    if (it == m.tensors.end()) it = m.tensors.insert(m.tensors.end(), TensorEntry{r.name, "f32", r.shape, {}});
    it->pieces.push_back({r.piece, 0, offset, own.digest()});
  }
  const std::uint64_t size = out.size();
  out.close();
  m.files.push_back({name, rank, size, whole.digest()});
  m.ranks.push_back(std::move(me));
  return m;
}

}  // namespace kiln::checkpoint
