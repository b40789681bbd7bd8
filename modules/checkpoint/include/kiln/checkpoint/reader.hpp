#pragma once
// Reading a checkpoint directory: its manifest, and the parts of global tensors a rank asks for,
// gathered from whichever saved pieces hold them (so a checkpoint of one layout loads into any
// other). Each file is checked once, when first needed: present, of the size the manifest says,
// and every record's and the whole file's XXH3-64 as written. Problems are FileErrors naming the
// file, the rank that wrote it and the tensor.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/checkpoint/files.hpp"
#include "kiln/checkpoint/manifest.hpp"

namespace kiln::checkpoint {

class CheckpointReader {
 public:
  explicit CheckpointReader(std::string dir);  // reads and parses dir/manifest.json
  const Manifest& manifest() const { return m_; }
  const std::string& dir() const { return dir_; }

  // The tensor's entry; a FileError unless the checkpoint has it with this global shape.
  const TensorEntry& tensor(const std::string& name, const std::vector<std::int64_t>& shape) const;
  // Writes the elements of `tensor` that piece `dst` holds (dst.numel() values, in its order) to
  // `out`. A FileError if the saved pieces do not cover them all, or a file they come from is bad.
  void read(const TensorEntry& tensor, const Piece& dst, float* out);
  // A rank's blob, checked.
  std::string blob(const BlobEntry& b);
  // Checks every file (all the reads would check only the files they touch).
  void verify_all();

 private:
  const MappedFile& file(int index);
  std::string describe(int file) const;  // "DIR/rank_00001.bin (rank 1's shard file)"
  std::string dir_;
  Manifest m_;
  std::map<int, std::unique_ptr<MappedFile>> files_;
};

// Checkpoint directories under a run's checkpoint folder: step_NNNNNN (complete: a manifest),
// step_NNNNNN.tmp (being written, or left by a process that died), and the file `latest`.
std::string step_directory_name(std::int64_t step);  // "step_000500"
struct FoundCheckpoint {
  std::string path;
  std::int64_t step = 0;
};
// The complete checkpoints (those with a manifest), by ascending step.
std::vector<FoundCheckpoint> complete_checkpoints(const std::string& root);
// The checkpoint to resume from: the one `latest` names if it is complete, else the complete one
// of the highest step; "" if there is none.
std::string latest_checkpoint(const std::string& root);
// A path given to resume from: a checkpoint directory (with manifest.json), or a folder of them
// (its latest). A FileError if it is neither.
std::string resolve_checkpoint(const std::string& path);

}  // namespace kiln::checkpoint
