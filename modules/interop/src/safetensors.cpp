#include "kiln/interop/safetensors.hpp"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <utility>

#include "kiln/checkpoint/files.hpp"
#include "kiln/core/error.hpp"
#include "kiln/tensor/bf16.hpp"
#include "hf_common.hpp"

namespace kiln::interop {

// The checked, atomic file operations of kiln::checkpoint.
using checkpoint::MappedFile;
using checkpoint::OutputFile;
using checkpoint::rename_path;
using checkpoint::sync_directory;
using detail::shape_str;

// The format is little-endian; the reader hands out the bytes as they are.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit

// Bits per element; 0 for a dtype the format does not define.
int dtype_bits(std::string_view d) {
  static const std::map<std::string_view, int> bits = {
      {"BOOL", 8}, {"U8", 8},   {"I8", 8},    {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"I16", 16},
      {"U16", 16}, {"F16", 16}, {"BF16", 16}, {"I32", 32},    {"U32", 32},    {"F32", 32},    {"I64", 64},
      {"U64", 64}, {"F64", 64}, {"C64", 64},  {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}};
  auto it = bits.find(d);
  return it == bits.end() ? 0 : it->second;
}

// Bytes a tensor of this shape and dtype needs; false on overflow or a fraction of a byte.
bool tensor_bytes(const std::vector<std::int64_t>& shape, int bits, std::uint64_t& out) {
  std::uint64_t n = 1;
  for (auto d : shape)
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return false;
  if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(bits), &n) || n % 8 != 0) return false;
  out = n / 8;
  return true;
}

float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
    const float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// Records duplicate keys, which nlohmann would silently collapse (the format disallows them).
struct DuplicateKeys {
  std::vector<std::set<std::string>> open;  // keys seen in each enclosing object
  std::string tensor;                       // the current top-level key
  std::string error;                        // the first duplicate, described
  bool operator()(int, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) open.emplace_back();
    if (ev == E::object_end && !open.empty()) open.pop_back();
    if (ev == E::key && !open.empty()) {
      const auto key = parsed.get<std::string>();
      if (open.size() == 1) tensor = key;
      if (!open.back().insert(key).second && error.empty())
        error = open.size() == 1 ? cat("tensor '", key, "': the name appears twice in the header")
                                 : cat("tensor '", tensor, "': key '", key, "' appears twice");
    }
    return true;
  }
};

// A JSON integer as u64; false if it is not an integer or is negative.
bool get_u64(const nlohmann::json& j, std::uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<std::uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0) {
    out = static_cast<std::uint64_t>(j.get<std::int64_t>());
    return true;
  }
  return false;
}

}  // namespace

#define KILN_TENSOR_ERROR(name, ...) KILN_FILE_ERROR(path_, ": tensor '", name, "': ", __VA_ARGS__)

std::int64_t SafetensorsTensor::numel() const {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), map_(std::make_unique<MappedFile>(path)) {
  // Only the header's bytes are read until it has been checked through.
  const auto* base = reinterpret_cast<const unsigned char*>(map_->data());
  const std::uint64_t file_bytes = map_->size();
  if (file_bytes < 8)
    KILN_FILE_ERROR(path, ": not a safetensors file: ", file_bytes, " bytes, shorter than the 8-byte header size");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | base[i];
  if (n > kMaxHeaderBytes)
    KILN_FILE_ERROR(path, ": header size ", n, " is larger than the ", kMaxHeaderBytes,
                    "-byte limit (not a safetensors file?)");
  if (n > file_bytes - 8)
    KILN_FILE_ERROR(path, ": header size ", n, " runs past the end of the ", file_bytes, "-byte file (truncated?)");
  const std::string text(reinterpret_cast<const char*>(base) + 8, n);
  if (text.empty() || text[0] != '{') KILN_FILE_ERROR(path, ": the header does not begin with '{'");
  // nlohmann stops at a NUL as at the end of input; raw NULs are never valid JSON.
  if (const auto nul = text.find('\0'); nul != std::string::npos)
    KILN_FILE_ERROR(path, ": the header is not valid JSON: a NUL byte at offset ", nul);

  DuplicateKeys dups;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, std::ref(dups));
  } catch (const nlohmann::json::exception& e) {
    KILN_FILE_ERROR(path, ": the header is not valid JSON: ", e.what());
  }
  if (!dups.error.empty()) KILN_FILE_ERROR(path, ": ", dups.error);
  if (!header.is_object()) KILN_FILE_ERROR(path, ": the header is not a JSON object");

  data_begin_ = 8 + n;
  const std::uint64_t buffer_bytes = file_bytes - data_begin_;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) KILN_FILE_ERROR(path, ": __metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m->is_string())
          KILN_FILE_ERROR(path, ": __metadata__ value of '", m.key(), "' is not a string: ", m->dump());
        metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) KILN_TENSOR_ERROR(name, "entry is not an object: ", v.dump());
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!v.contains(key)) KILN_TENSOR_ERROR(name, "missing key '", key, "'");
    SafetensorsTensor t;
    t.name = name;
    if (!v["dtype"].is_string()) KILN_TENSOR_ERROR(name, "dtype is not a string: ", v["dtype"].dump());
    t.dtype = v["dtype"].get<std::string>();
    const int bits = dtype_bits(t.dtype);
    if (bits == 0) KILN_TENSOR_ERROR(name, "unknown dtype '", t.dtype, "'");
    const auto& shape = v["shape"];
    if (!shape.is_array()) KILN_TENSOR_ERROR(name, "shape is not an array: ", shape.dump());
    for (const auto& d : shape) {
      if (!d.is_number_integer()) KILN_TENSOR_ERROR(name, "shape ", shape.dump(), " holds a non-integer");
      if (d.is_number_unsigned() ? d.get<std::uint64_t>() > INT64_MAX : d.get<std::int64_t>() < 0)
        KILN_TENSOR_ERROR(name, "shape ", shape.dump(), " has a negative or out-of-range dimension");
      t.shape.push_back(d.get<std::int64_t>());
    }
    const auto& offs = v["data_offsets"];
    if (!offs.is_array() || offs.size() != 2 || !get_u64(offs[0], t.begin) || !get_u64(offs[1], t.end))
      KILN_TENSOR_ERROR(name, "data_offsets must be two non-negative integers, got ", offs.dump());
    const std::string range = cat("data_offsets [", t.begin, ", ", t.end, "]");
    if (t.end < t.begin) KILN_TENSOR_ERROR(name, range, " end before they begin");
    std::uint64_t need = 0;
    if (!tensor_bytes(t.shape, bits, need))
      KILN_TENSOR_ERROR(name, "shape ", shape_str(t.shape), " of ", t.dtype,
                        " overflows or is not a whole number of bytes");
    if (t.end - t.begin != need)
      KILN_TENSOR_ERROR(name, range, " hold ", t.end - t.begin, " bytes but shape ", shape_str(t.shape), " of ",
                        t.dtype, " needs ", need);
    if (t.end > buffer_bytes)
      KILN_TENSOR_ERROR(name, range, " reach past the end of the ", buffer_bytes, "-byte buffer (truncated file?)");
    tensors_.push_back(std::move(t));
  }

  // The buffer must be covered exactly once, in order: no overlaps, no holes, nothing left over.
  std::sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    if (t.begin < covered) {
      const auto& p = tensors_[i - 1];
      KILN_TENSOR_ERROR(t.name, "data_offsets [", t.begin, ", ", t.end, "] overlap tensor '", p.name, "' [", p.begin,
                        ", ", p.end, "]");
    }
    if (t.begin > covered)
      KILN_TENSOR_ERROR(t.name, "bytes [", covered, ", ", t.begin, ") of the buffer before it belong to no tensor");
    covered = t.end;
  }
  if (covered != buffer_bytes)
    KILN_FILE_ERROR(path, ": the tensors cover ", covered, " bytes but the buffer has ", buffer_bytes,
                    " (the bytes after offset ", covered, " belong to no tensor)");
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const SafetensorsTensor& SafetensorsFile::at(std::string_view name) const {
  const auto* t = find(name);
  if (!t) KILN_TENSOR_ERROR(name, "no such tensor in the file");
  return *t;
}

std::span<const std::byte> SafetensorsFile::bytes(std::string_view name) const {
  const auto& t = at(name);
  return {map_->data() + data_begin_ + t.begin, static_cast<std::size_t>(t.end - t.begin)};
}

std::vector<float> read_f32(const SafetensorsFile& file, std::string_view name) {
  const auto* t = file.find(name);
  if (!t) KILN_FILE_ERROR(file.path(), ": tensor '", name, "': no such tensor in the file");
  std::vector<float> out(static_cast<std::size_t>(t->numel()));
  read_f32(file, name, 0, t->numel(), out.data());
  return out;
}

void read_f32(const SafetensorsFile& file, std::string_view name, std::int64_t begin, std::int64_t count, float* out) {
  const auto* t = file.find(name);
  if (!t) KILN_FILE_ERROR(file.path(), ": tensor '", name, "': no such tensor in the file");
  if (begin < 0 || count < 0 || begin + count > t->numel())
    KILN_THROW(file.path(), ": tensor '", name, "': values [", begin, ", ", begin + count, ") outside its ", t->numel());
  if (count == 0) return;
  const auto b = file.bytes(name);
  const auto first = static_cast<std::size_t>(begin), n = static_cast<std::size_t>(count);
  if (t->dtype == "F32") {
    std::memcpy(out, b.data() + 4 * first, 4 * n);
  } else if (t->dtype == "BF16" || t->dtype == "F16") {
    const bool bf = t->dtype == "BF16";
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, b.data() + 2 * (first + i), 2);
      out[i] = bf ? bf16_bits_to_float(h) : f16_to_float(h);
    }
  } else {
    KILN_FILE_ERROR(file.path(), ": tensor '", name, "': dtype ", t->dtype,
                    " cannot be read as floats (F32, BF16 or F16)");
  }
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  std::set<std::string_view> names;
  for (const auto& e : entries) {
    const auto fail = [&](auto&&... what) { KILN_THROW(path, ": tensor '", e.name, "': ", what...); };
    if (e.name == "__metadata__") fail("the name is reserved for the metadata");
    if (!names.insert(e.name).second) fail("the name is given twice");
    const int bits = dtype_bits(e.dtype);
    if (bits == 0) fail("unknown dtype '", e.dtype, "'");
    for (auto d : e.shape)
      if (d < 0) fail("shape ", shape_str(e.shape), " has a negative dimension");
    std::uint64_t need = 0;
    if (!tensor_bytes(e.shape, bits, need))
      fail("shape ", shape_str(e.shape), " of ", e.dtype, " overflows or is not a whole number of bytes");
    if (need != e.bytes) fail(e.bytes, " bytes given but shape ", shape_str(e.shape), " of ", e.dtype, " needs ", need);
    if (e.bytes > 0 && !e.data) fail("no data");
  }

  // Larger elements first: each tensor then starts at a multiple of its element size.
  std::vector<std::size_t> order(entries.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](auto a, auto b) { return dtype_bits(entries[a].dtype) > dtype_bits(entries[b].dtype); });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (auto i : order) {
    const auto& e = entries[i];
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    KILN_THROW(path, ": cannot write the header (a name or metadata that is not UTF-8?): ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // 8 + N is then a multiple of 8
  if (text.size() > kMaxHeaderBytes)
    KILN_THROW(path, ": the header would be ", text.size(), " bytes, over the format's limit");

  unsigned char size_le[8];
  for (int i = 0; i < 8; ++i)
    size_le[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  const std::string tmp = path + ".tmp";
  try {
    OutputFile out(tmp);
    out.write(size_le, 8);
    out.write(text.data(), text.size());
    for (auto i : order) out.write(entries[i].data, entries[i].bytes);
    out.close();
    rename_path(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());  // a partial file is never left to be mistaken for a checkpoint
    throw;
  }
  const auto dir = std::filesystem::path(path).parent_path();
  sync_directory(dir.empty() ? "." : dir.string());
}

}  // namespace kiln::interop
