#include "kiln/checkpoint/manifest.hpp"

#include <set>

#include <nlohmann/json.hpp>

#include "kiln/checkpoint/hash.hpp"
#include "kiln/core/error.hpp"

namespace kiln::checkpoint {

using nlohmann::ordered_json;

const BlobEntry* RankEntry::blob(const std::string& name) const {
  for (auto& b : blobs)
    if (b.name == name) return &b;
  return nullptr;
}

const TensorEntry* Manifest::tensor(const std::string& name) const {
  for (auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const RankEntry* Manifest::rank(int r) const {
  for (auto& e : ranks)
    if (e.rank == r) return &e;
  return nullptr;
}

std::string Manifest::to_json() const {
  ordered_json j;
  j["format"] = "kiln-checkpoint";
  j["version"] = version;
  j["kiln_version"] = kiln_version;
  j["step"] = step;
  j["topology"] = topology;
  j["counters"] = counters;
  j["files"] = ordered_json::array();
  for (auto& f : files) j["files"].push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"xxh3", to_hex(f.xxh3)}});
  j["tensors"] = ordered_json::array();
  for (auto& t : tensors) {
    ordered_json pieces = ordered_json::array();
    for (auto& p : t.pieces)
      pieces.push_back({{"file", p.file},
                        {"offset", p.offset},
                        {"box_offsets", p.piece.offsets},
                        {"box_extents", p.piece.extents},
                        {"flat", {p.piece.flat_begin, p.piece.flat_end}},
                        {"xxh3", to_hex(p.xxh3)}});
    j["tensors"].push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"pieces", pieces}});
  }
  j["ranks"] = ordered_json::array();
  for (auto& r : ranks) {
    ordered_json blobs = ordered_json::array();
    for (auto& b : r.blobs)
      blobs.push_back({{"name", b.name}, {"file", b.file}, {"offset", b.offset}, {"bytes", b.bytes}, {"xxh3", to_hex(b.xxh3)}});
    j["ranks"].push_back({{"rank", r.rank}, {"coords", r.coords}, {"blobs", blobs}});
  }
  j["config"] = config;
  return j.dump(1) + "\n";
}

Manifest Manifest::merge(std::vector<Manifest> parts) {
  KILN_CHECK(!parts.empty(), "merging no manifests");
  Manifest m = parts.front();
  m.files.clear();
  m.tensors.clear();
  m.ranks.clear();
  std::map<std::string, std::size_t> at;
  for (auto& part : parts) {
    const int base = static_cast<int>(m.files.size());
    for (auto& f : part.files) m.files.push_back(f);
    for (auto& t : part.tensors) {
      auto [it, fresh] = at.emplace(t.name, m.tensors.size());
      if (fresh) m.tensors.push_back({t.name, t.dtype, t.shape, {}});
      auto& into = m.tensors[it->second];
      KILN_CHECK(into.shape == t.shape && into.dtype == t.dtype, "ranks disagree on the shape of tensor '", t.name, "'");
      for (auto p : t.pieces) {
        p.file += base;
        into.pieces.push_back(std::move(p));
      }
    }
    for (auto r : part.ranks) {
      for (auto& b : r.blobs) b.file += base;
      m.ranks.push_back(std::move(r));
    }
  }
  for (auto& t : m.tensors) {
    std::int64_t want = 1, have = 0;
    for (auto d : t.shape) want *= d;
    for (auto& p : t.pieces) have += p.piece.numel();
    KILN_CHECK(have == want, "the ranks saved ", have, " elements of tensor '", t.name, "', which has ", want);
  }
  return m;
}

namespace {

// Reads typed values out of the manifest's JSON, every failure naming the file and the key.
class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path) {}
  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    KILN_FILE_ERROR(path_, ": ", key, ": ", what);
  }
  const ordered_json& at(const ordered_json& j, const std::string& key, const std::string& where) const {
    if (!j.is_object()) fail(where, "must be an object");
    auto it = j.find(key);
    if (it == j.end()) fail(join(where, key), "missing");
    return *it;
  }
  std::int64_t integer(const ordered_json& j, const std::string& key, const std::string& where, std::int64_t lo = 0) const {
    const auto& v = at(j, key, where);
    if (!v.is_number_integer()) fail(join(where, key), "must be an integer");
    const auto x = v.get<std::int64_t>();
    if (x < lo) fail(join(where, key), cat("must be >= ", lo, ", not ", x));
    return x;
  }
  std::string string(const ordered_json& j, const std::string& key, const std::string& where) const {
    const auto& v = at(j, key, where);
    if (!v.is_string()) fail(join(where, key), "must be a string");
    return v.get<std::string>();
  }
  std::uint64_t hash(const ordered_json& j, const std::string& where) const {
    std::uint64_t h = 0;
    if (!from_hex(string(j, "xxh3", where), h)) fail(join(where, "xxh3"), "must be 16 hex digits");
    return h;
  }
  const ordered_json& array(const ordered_json& j, const std::string& key, const std::string& where) const {
    const auto& v = at(j, key, where);
    if (!v.is_array()) fail(join(where, key), "must be an array");
    return v;
  }
  std::vector<std::int64_t> integers(const ordered_json& j, const std::string& key, const std::string& where) const {
    std::vector<std::int64_t> out;
    for (auto& v : array(j, key, where)) {
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0) fail(join(where, key), "must hold integers >= 0");
      out.push_back(v.get<std::int64_t>());
    }
    return out;
  }
  std::map<std::string, std::int64_t> integer_map(const ordered_json& j, const std::string& key, const std::string& where) const {
    const auto& v = at(j, key, where);
    if (!v.is_object()) fail(join(where, key), "must be an object");
    std::map<std::string, std::int64_t> out;
    for (auto& [k, x] : v.items()) {
      if (x.is_boolean()) out[k] = x.get<bool>();
      else if (x.is_number_integer()) out[k] = x.get<std::int64_t>();
      else fail(join(join(where, key), k), "must be an integer");
    }
    return out;
  }
  static std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }
  static std::string index(const std::string& a, std::size_t i) { return cat(a, "[", i, "]"); }

 private:
  const std::string& path_;
};

}  // namespace

Manifest Manifest::parse(const std::string& text, const std::string& path) {
  ordered_json j;
  try {
    j = ordered_json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    KILN_FILE_ERROR(path, ": not valid JSON (", e.what(), "); the checkpoint's manifest is damaged");
  }
  Reader r(path);
  Manifest m;
  if (r.string(j, "format", "") != "kiln-checkpoint") r.fail("format", "is not \"kiln-checkpoint\"");
  m.version = static_cast<int>(r.integer(j, "version", "", 1));
  if (m.version > kManifestVersion)
    r.fail("version", cat(m.version, ": written by a newer kiln (this one reads version ", kManifestVersion, ")"));
  m.kiln_version = r.string(j, "kiln_version", "");
  m.step = r.integer(j, "step", "");
  m.topology = r.integer_map(j, "topology", "");
  m.counters = r.integer_map(j, "counters", "");
  m.config = r.string(j, "config", "");

  const auto& files = r.array(j, "files", "");
  std::set<std::string> file_names;
  for (std::size_t i = 0; i < files.size(); ++i) {
    const std::string w = Reader::index("files", i);
    FileEntry f{r.string(files[i], "name", w), static_cast<int>(r.integer(files[i], "rank", w)),
                static_cast<std::uint64_t>(r.integer(files[i], "bytes", w)), r.hash(files[i], w)};
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name == "." || f.name == "..")
      r.fail(w + ".name", cat("'", f.name, "' is not a file name inside the checkpoint directory"));
    if (!file_names.insert(f.name).second) r.fail(w + ".name", cat("'", f.name, "' is listed twice"));
    m.files.push_back(f);
  }
  auto check_range = [&](const std::string& w, std::int64_t file, std::uint64_t offset, std::uint64_t bytes) {
    if (file < 0 || file >= static_cast<std::int64_t>(m.files.size()))
      r.fail(w + ".file", cat(file, " is not an index into files (", m.files.size(), " of them)"));
    const auto size = m.files[static_cast<std::size_t>(file)].bytes;
    if (offset > size || bytes > size - offset)
      r.fail(w, cat("bytes [", offset, ", ", offset + bytes, ") lie outside ", m.files[static_cast<std::size_t>(file)].name,
                    " (", size, " bytes)"));
  };

  const auto& tensors = r.array(j, "tensors", "");
  std::set<std::string> tensor_names;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string w = Reader::index("tensors", i);
    TensorEntry t;
    t.name = r.string(tensors[i], "name", w);
    const std::string tw = cat("tensor '", t.name, "'");
    if (!tensor_names.insert(t.name).second) r.fail(tw, "is listed twice");
    t.dtype = r.string(tensors[i], "dtype", tw);
    if (t.dtype != "f32") r.fail(tw + ".dtype", cat("'", t.dtype, "' (only f32 is read)"));
    t.shape = r.integers(tensors[i], "shape", tw);
    if (t.shape.empty() || t.shape.size() > 2) r.fail(tw + ".shape", "must have 1 or 2 dimensions");
    // At most 2^61 elements, so that element and byte counts below never overflow.
    std::int64_t numel = 1;
    for (auto d : t.shape)
      if (__builtin_mul_overflow(numel, d, &numel) || numel > (std::int64_t{1} << 61))
        r.fail(tw + ".shape", "has more elements than any file holds");
    const auto& pieces = r.array(tensors[i], "pieces", tw);
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const std::string pw = Reader::index(tw + ".pieces", k);
      PieceEntry p;
      p.file = static_cast<int>(r.integer(pieces[k], "file", pw));
      p.offset = static_cast<std::uint64_t>(r.integer(pieces[k], "offset", pw));
      p.piece.offsets = r.integers(pieces[k], "box_offsets", pw);
      p.piece.extents = r.integers(pieces[k], "box_extents", pw);
      const auto flat = r.integers(pieces[k], "flat", pw);
      p.xxh3 = r.hash(pieces[k], pw);
      if (p.piece.offsets.size() != t.shape.size() || p.piece.extents.size() != t.shape.size())
        r.fail(pw, cat("a box of ", p.piece.offsets.size(), " dimensions in a ", t.shape.size(), "-D tensor"));
      std::int64_t box = 1;
      for (std::size_t d = 0; d < t.shape.size(); ++d) {
        if (p.piece.offsets[d] > t.shape[d] || p.piece.extents[d] > t.shape[d] - p.piece.offsets[d])
          r.fail(pw, cat("the box (offset ", p.piece.offsets[d], ", extent ", p.piece.extents[d], ") reaches past ",
                         t.shape[d], " in dimension ", d));
        box *= p.piece.extents[d];
      }
      if (flat.size() != 2 || flat[0] > flat[1] || flat[1] > box)
        r.fail(pw + ".flat", cat("must be [begin, end] inside the box's ", box, " elements"));
      p.piece.flat_begin = flat[0];
      p.piece.flat_end = flat[1];
      check_range(pw, p.file, p.offset, static_cast<std::uint64_t>(p.piece.numel()) * 4);
      t.pieces.push_back(std::move(p));
    }
    m.tensors.push_back(std::move(t));
  }

  const auto& ranks = r.array(j, "ranks", "");
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const std::string w = Reader::index("ranks", i);
    RankEntry e;
    e.rank = static_cast<int>(r.integer(ranks[i], "rank", w));
    for (auto& [k, v] : r.integer_map(ranks[i], "coords", w)) e.coords[k] = static_cast<int>(v);
    const auto& blobs = r.array(ranks[i], "blobs", w);
    for (std::size_t k = 0; k < blobs.size(); ++k) {
      const std::string bw = Reader::index(w + ".blobs", k);
      BlobEntry b;
      b.name = r.string(blobs[k], "name", bw);
      b.file = static_cast<int>(r.integer(blobs[k], "file", bw));
      b.offset = static_cast<std::uint64_t>(r.integer(blobs[k], "offset", bw));
      b.bytes = static_cast<std::uint64_t>(r.integer(blobs[k], "bytes", bw));
      b.xxh3 = r.hash(blobs[k], bw);
      check_range(bw, b.file, b.offset, b.bytes);
      e.blobs.push_back(std::move(b));
    }
    m.ranks.push_back(std::move(e));
  }
  return m;
}

}  // namespace kiln::checkpoint
