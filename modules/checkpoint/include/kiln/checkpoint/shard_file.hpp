#pragma once
// One rank's shard file of a checkpoint: the pieces of tensors and the blobs the rank saves, one
// after the other, each at a 64-byte boundary, with an XXH3-64 of each and of the whole file.
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/checkpoint/manifest.hpp"

namespace kiln::checkpoint {

inline constexpr std::uint64_t kRecordAlign = 64;

class ShardFile {
 public:
  // `data` (numel() f32 values) must stay valid until write() returns.
  void add_piece(const std::string& tensor, const std::vector<std::int64_t>& shape, const Piece& piece,
                 const float* data);
  void add_blob(const std::string& name, std::string bytes);
  std::uint64_t bytes() const;  // the file's size once written

  // Writes and fsyncs `dir`/`name`, and returns this rank's manifest (its file at index 0, its
  // pieces, and a rank entry with its blobs and `coords`). Throws a FileError (a full disk included).
  Manifest write(const std::string& dir, const std::string& name, int rank, const std::map<std::string, int>& coords) const;

 private:
  struct Record {
    std::string name;  // tensor or blob
    std::vector<std::int64_t> shape;
    Piece piece;
    const void* data = nullptr;
    std::uint64_t bytes = 0;
    bool blob = false;
    std::string owned;  // a blob's bytes
  };
  std::vector<Record> records_;
};

}  // namespace kiln::checkpoint
