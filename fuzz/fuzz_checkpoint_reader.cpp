// A whole checkpoint directory through CheckpointReader: manifest.json and one shard file.
//
// Input: the manifest's JSON, a NUL byte, then the shard file's bytes. Before writing the
// directory the harness makes the manifest's sizes and XXH3 checksums match the shard bytes (so
// the fuzzer gets past the checksums into the piece arithmetic): it parses the manifest, points
// every file entry at the one shard file, recomputes every hash and writes the manifest back.
// Then it verifies every file and reads every tensor whole, and every blob.
#include <stdlib.h>  // mkdtemp

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "fuzz_util.hpp"
#include "kiln/checkpoint/hash.hpp"
#include "kiln/checkpoint/manifest.hpp"
#include "kiln/checkpoint/reader.hpp"

namespace {

bool write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return static_cast<bool>(out);
}

// A fresh directory per process (removed at exit; never destroyed before the exit handler).
const std::string& directory() {
  static const std::string* dir = [] {
    std::string tmpl = (std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp") + std::string("/kiln-fuzz-XXXXXX");
    if (!::mkdtemp(tmpl.data())) std::abort();
    auto* d = new std::string(tmpl);
    std::atexit([] { std::filesystem::remove_all(directory()); });
    return d;
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kiln::checkpoint;
  const std::string_view in = kiln::fuzz::as_text(data, size);
  const auto nul = in.find('\0');
  if (nul == std::string_view::npos) return 0;
  const std::string_view shard = in.substr(nul + 1);
  const std::string& dir = directory();

  Manifest m;
  try {
    m = Manifest::parse(std::string(in.substr(0, nul)), dir + "/manifest.json");
  } catch (const std::exception&) {
    return 0;
  }
  // One shard file backs every file entry; sizes and hashes made to match it. File names the OS
  // cannot take (too long, a NUL inside) are skipped: the reader would only fail to open them.
  if (m.files.empty()) return 0;
  for (auto& f : m.files)
    if (f.name == "manifest.json" || f.name.size() > 200 || f.name.find('\0') != std::string::npos) return 0;
  const std::uint64_t shard_hash = hash64(shard.data(), shard.size());
  for (auto& f : m.files) {
    f.bytes = shard.size();
    f.xxh3 = shard_hash;
  }
  auto hash_range = [&](std::uint64_t offset, std::uint64_t bytes, std::uint64_t& out) {
    if (offset <= shard.size() && bytes <= shard.size() - offset) out = hash64(shard.data() + offset, bytes);
  };
  for (auto& t : m.tensors)
    for (auto& p : t.pieces) hash_range(p.offset, static_cast<std::uint64_t>(p.piece.numel()) * 4, p.xxh3);
  for (auto& r : m.ranks)
    for (auto& b : r.blobs) hash_range(b.offset, b.bytes, b.xxh3);

  std::filesystem::remove_all(dir);
  std::filesystem::create_directory(dir);
  std::string json;
  try {
    json = m.to_json();
  } catch (const std::exception&) {
    return 0;  // fuzz_manifest checks that parsed manifests write
  }
  if (!write_file(dir + "/manifest.json", json)) std::abort();
  for (auto& f : m.files)
    if (!write_file(dir + "/" + f.name, shard)) return 0;

  try {
    CheckpointReader reader(dir);
    reader.verify_all();
    for (auto& t : reader.manifest().tensors) {
      std::int64_t numel = 1;
      bool huge = false;
      for (auto d : t.shape) huge |= __builtin_mul_overflow(numel, d, &numel);
      if (huge || numel > (std::int64_t{1} << 20)) continue;  // a huge tensor only measures the allocator
      Piece whole;
      whole.offsets.assign(t.shape.size(), 0);
      whole.extents = t.shape;
      whole.flat_begin = 0;
      whole.flat_end = numel;
      std::vector<float> out(static_cast<std::size_t>(numel));
      reader.read(reader.tensor(t.name, t.shape), whole, out.data());
    }
    for (auto& r : reader.manifest().ranks)
      for (auto& b : r.blobs) (void)reader.blob(b);
  } catch (const std::exception&) {
  }
  return 0;
}
