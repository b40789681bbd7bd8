#pragma once
// A training-state checkpoint's manifest (manifest.json): what every file holds and where. One per
// checkpoint directory, written last, after every rank's shard file is on disk; a directory without
// one is not a checkpoint. docs/CHECKPOINTS.md describes the format.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/checkpoint/pieces.hpp"

namespace kiln::checkpoint {

inline constexpr int kManifestVersion = 1;

// One rank's shard file: its size and XXH3-64 of all its bytes.
struct FileEntry {
  std::string name;  // relative to the checkpoint directory
  int rank = 0;
  std::uint64_t bytes = 0, xxh3 = 0;
};

// A piece of a tensor in a file: numel() * dtype-size bytes from `offset`, and their XXH3-64.
struct PieceEntry {
  Piece piece;
  int file = 0;  // index into Manifest::files
  std::uint64_t offset = 0, xxh3 = 0;
};

struct TensorEntry {
  std::string name;           // "model/blocks.0.attn.qkv.weight", "optimizer/exp_avg/wte", ...
  std::string dtype = "f32";  // only f32 is written today
  std::vector<std::int64_t> shape;  // the global shape
  std::vector<PieceEntry> pieces;
};

// A rank's own values (an RNG tracker's states, FP8 scaling state), as bytes in its file.
struct BlobEntry {
  std::string name;
  int file = 0;
  std::uint64_t offset = 0, bytes = 0, xxh3 = 0;
};

struct RankEntry {
  int rank = 0;
  std::map<std::string, int> coords;  // tp, dp, pp, cp, ep
  std::vector<BlobEntry> blobs;
  const BlobEntry* blob(const std::string& name) const;
};

struct Manifest {
  int version = kManifestVersion;
  std::string kiln_version;
  std::int64_t step = 0;
  std::map<std::string, std::int64_t> topology;  // world, tp, dp, pp, cp, ep, fsdp_shards, ...
  std::map<std::string, std::int64_t> counters;  // module counters: data.position, optimizer.steps, ...
  std::string config;                            // the run's effective configuration (TOML)
  std::vector<FileEntry> files;
  std::vector<TensorEntry> tensors;
  std::vector<RankEntry> ranks;

  const TensorEntry* tensor(const std::string& name) const;
  const RankEntry* rank(int r) const;
  std::string to_json() const;
  // Parses and checks the structure (every key present with its type, piece boxes inside their
  // tensors, file indices valid); errors are FileErrors naming `path` and the key.
  static Manifest parse(const std::string& text, const std::string& path);
  // The manifest of a whole checkpoint from each rank's own (its file, its pieces, its rank entry;
  // file indices local to it): files in rank order, each tensor's pieces together. Throws if a
  // tensor's shapes disagree or its pieces do not add up to the whole tensor.
  static Manifest merge(std::vector<Manifest> parts);
};

}  // namespace kiln::checkpoint
