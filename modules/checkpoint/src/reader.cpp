#include "kiln/checkpoint/reader.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "kiln/checkpoint/hash.hpp"
#include "kiln/core/error.hpp"

namespace kiln::checkpoint {

namespace fs = std::filesystem;

namespace {
std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string t = "[";
  for (std::size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}
}  // namespace

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  const std::string path = dir_ + "/manifest.json";
  if (!fs::is_directory(dir_)) KILN_FILE_ERROR("checkpoint ", dir_, ": no such directory");
  if (!fs::exists(path))
    KILN_FILE_ERROR("checkpoint ", dir_, " has no manifest.json: it is not a complete checkpoint (a save that did not "
                    "finish leaves a directory without one)");
  m_ = Manifest::parse(read_text_file(path), path);
}

std::string CheckpointReader::describe(int file) const {
  const auto& f = m_.files[static_cast<std::size_t>(file)];
  return cat(dir_, "/", f.name, " (rank ", f.rank, "'s shard file)");
}

const MappedFile& CheckpointReader::file(int index) {
  auto it = files_.find(index);
  if (it != files_.end()) return *it->second;
  const auto& f = m_.files[static_cast<std::size_t>(index)];
  const std::string path = dir_ + "/" + f.name;
  if (!fs::exists(path)) KILN_FILE_ERROR(describe(index), " is missing");
  auto mapped = std::make_unique<MappedFile>(path);
  if (mapped->size() != f.bytes)
    KILN_FILE_ERROR(describe(index), " is ", mapped->size(), " bytes, the manifest says ", f.bytes,
                    mapped->size() < f.bytes ? ": truncated" : ": not the file that was written");
  // Each record first, so that damage is reported with the tensor it hit; then the whole file.
  for (auto& t : m_.tensors)
    for (auto& p : t.pieces)
      if (p.file == index &&
          hash64(mapped->data() + p.offset, static_cast<std::size_t>(p.piece.numel()) * 4) != p.xxh3)
        KILN_FILE_ERROR(describe(index), ": checksum mismatch in tensor '", t.name, "' (bytes ", p.offset, " to ",
                        p.offset + static_cast<std::uint64_t>(p.piece.numel()) * 4, "): the file is damaged");
  for (auto& r : m_.ranks)
    for (auto& b : r.blobs)
      if (b.file == index && hash64(mapped->data() + b.offset, b.bytes) != b.xxh3)
        KILN_FILE_ERROR(describe(index), ": checksum mismatch in rank ", r.rank, "'s '", b.name,
                        "' state: the file is damaged");
  if (hash64(mapped->data(), mapped->size()) != f.xxh3)
    KILN_FILE_ERROR(describe(index), ": checksum mismatch (outside any tensor): the file is damaged");
  return *files_.emplace(index, std::move(mapped)).first->second;
}

void CheckpointReader::verify_all() {
  for (int i = 0; i < static_cast<int>(m_.files.size()); ++i) file(i);
}

const TensorEntry& CheckpointReader::tensor(const std::string& name, const std::vector<std::int64_t>& shape) const {
  const TensorEntry* t = m_.tensor(name);
  if (!t) KILN_FILE_ERROR("checkpoint ", dir_, " has no tensor '", name, "': saved from another model?");
  if (t->shape != shape)
    KILN_FILE_ERROR("checkpoint ", dir_, ": tensor '", name, "' has shape ", shape_text(t->shape),
                    ", this model's is ", shape_text(shape), ": saved from another model configuration");
  return *t;
}

void CheckpointReader::read(const TensorEntry& t, const Piece& dst, float* out) {
  const std::vector<Run> want = runs_of(dst, t.shape);
  std::vector<std::pair<std::int64_t, std::int64_t>> covered;  // [begin, end) of dst positions written
  for (auto& src : t.pieces) {
    const std::vector<Run> have = runs_of(src.piece, t.shape);
    bool touched = false;
    for_each_overlap(want, have, [&](std::int64_t d, std::int64_t s, std::int64_t n) {
      if (!touched) {
        file(src.file);
        touched = true;
      }
      std::memcpy(out + d, files_.at(src.file)->data() + src.offset + static_cast<std::uint64_t>(s) * 4,
                  static_cast<std::size_t>(n) * 4);
      covered.emplace_back(d, d + n);
    });
  }
  std::sort(covered.begin(), covered.end());
  std::int64_t reach = 0;
  for (auto [b, e] : covered) {
    if (b > reach) break;
    reach = std::max(reach, e);
  }
  if (reach < dst.numel())
    KILN_FILE_ERROR("checkpoint ", dir_, ": no saved piece holds element ", reach, " of this rank's part of tensor '",
                    t.name, "' (a rank's shard missing from the manifest?)");
}

std::string CheckpointReader::blob(const BlobEntry& b) {
  const auto& f = file(b.file);
  return std::string(reinterpret_cast<const char*>(f.data() + b.offset), b.bytes);
}

std::string step_directory_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%06lld", static_cast<long long>(step));
  return buf;
}

std::vector<FoundCheckpoint> complete_checkpoints(const std::string& root) {
  std::vector<FoundCheckpoint> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.size() <= 5) continue;
    const std::string digits = name.substr(5);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (!fs::exists(e.path() / "manifest.json", ec)) continue;
    out.push_back({e.path().string(), std::stoll(digits)});
  }
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.step < b.step; });
  return out;
}

std::string latest_checkpoint(const std::string& root) {
  std::error_code ec;
  const fs::path pointer = fs::path(root) / "latest";
  if (fs::exists(pointer, ec)) {
    std::string name = read_text_file(pointer.string());
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    const fs::path dir = fs::path(root) / name;
    if (!name.empty() && name.find('/') == std::string::npos && fs::exists(dir / "manifest.json", ec))
      return dir.string();
  }
  auto all = complete_checkpoints(root);
  return all.empty() ? std::string() : all.back().path;
}

std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / "manifest.json", ec)) return path;
  if (!fs::is_directory(path, ec)) KILN_FILE_ERROR("checkpoint ", path, ": no such directory");
  std::string latest = latest_checkpoint(path);
  if (latest.empty())
    KILN_FILE_ERROR("checkpoint ", path, " has no manifest.json and holds no complete checkpoint (step_NNNNNN "
                    "directories with one)");
  return latest;
}

}  // namespace kiln::checkpoint
