#pragma once
// A Hugging Face model directory's weights, as transformers' save_pretrained writes them: one
// model.safetensors, or shards model-00001-of-0000N.safetensors that model.safetensors.index.json
// maps tensor by tensor ({"metadata": {"total_size"}, "weight_map": {name: file}}). A shard is
// opened (mapped) when a tensor of it is first read, so a reader touches only the files holding
// what it reads.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/interop/safetensors.hpp"

namespace kiln::interop {

inline constexpr const char* kHfWeightsFile = "model.safetensors";
inline constexpr const char* kHfIndexFile = "model.safetensors.index.json";

class HfCheckpoint {
 public:
  // `dir` holds model.safetensors or model.safetensors.index.json (the single file first, as
  // transformers looks); neither, an index that is not JSON or names no weights, or a shard it
  // names that does not exist is a FileError naming the file.
  explicit HfCheckpoint(const std::string& dir);
  HfCheckpoint(HfCheckpoint&&) noexcept;
  ~HfCheckpoint();

  const std::string& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  // Every tensor's name, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return file_of_.count(name) != 0; }
  // The tensor's header entry (opening its file); a FileError naming the directory if absent, or
  // naming the shard if the index puts it in a file that does not hold it.
  const SafetensorsTensor& tensor(const std::string& name);
  // Values [begin, begin + count) of the flattened tensor as f32 (F32, BF16 or F16 on disk).
  void read(const std::string& name, std::int64_t begin, std::int64_t count, float* out);
  // The file holding `name`, for messages.
  std::string path_of(const std::string& name) const;

 private:
  SafetensorsFile& open(const std::string& file);

  std::string dir_;
  bool sharded_ = false;
  std::map<std::string, std::string> file_of_;                       // tensor -> file name in dir
  std::map<std::string, std::unique_ptr<SafetensorsFile>> opened_;  // file name -> its reader
};

// Writes `entries` into `dir` as save_pretrained does: one model.safetensors when they total at
// most `max_shard_bytes`, else shards of at most that size (a larger tensor alone in its shard),
// in the entries' order, and the index. Files of an earlier export left in `dir`
// (model.safetensors, the index, model-*-of-*.safetensors) that this one did not write are removed,
// since transformers would read a stale model.safetensors before the index. Returns the files
// written.
std::vector<std::string> write_hf_weights(const std::string& dir, const std::vector<SafetensorsEntry>& entries,
                                          std::uint64_t max_shard_bytes);

// transformers' default max_shard_size ("5GB").
inline constexpr std::uint64_t kHfMaxShardBytes = 5'000'000'000ull;

}  // namespace kiln::interop
