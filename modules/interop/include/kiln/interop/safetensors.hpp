#pragma once
// The safetensors format (github.com/huggingface/safetensors): an 8-byte little-endian header size
// N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the byte buffer the offsets index (every byte of it, without holes or overlaps).
//
// SafetensorsFile checks the whole header before it touches the buffer; a bad file is a
// kiln::FileError naming the file and the tensor. write_safetensors writes atomically (a temp file
// renamed into place).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::checkpoint {
class MappedFile;
}

namespace kiln::interop {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as spelled in the file: "F32", "BF16", "F8_E4M3", ...
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // byte range in the byte buffer
  std::int64_t numel() const;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // In byte-buffer order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when the file has no such tensor.
  const SafetensorsTensor* find(std::string_view name) const;
  // The tensor's bytes (little-endian, row-major); an error naming the file if it is absent.
  std::span<const std::byte> bytes(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  const SafetensorsTensor& at(std::string_view name) const;

  std::string path_;
  std::unique_ptr<checkpoint::MappedFile> map_;  // kiln::checkpoint's checked file access
  std::size_t data_begin_ = 0;  // 8 + N
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// A tensor's values as floats; F32, BF16 and F16 only (anything else is an error naming it).
std::vector<float> read_f32(const SafetensorsFile& file, std::string_view name);
// Values [begin, begin + count) of the flattened tensor into `out`.
void read_f32(const SafetensorsFile& file, std::string_view name, std::int64_t begin, std::int64_t count, float* out);

struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;  // little-endian, row-major
  std::size_t bytes = 0;       // must equal numel * the dtype's size
};

// Writes the entries (the larger element sizes first, so every tensor is aligned to its element
// size; the JSON is space-padded so the buffer starts 8-byte aligned). Atomic: path.tmp, fsync,
// rename, fsync of the directory. Any I/O failure (a full disk included) is a FileError naming the
// file, and the temp file is removed.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace kiln::interop
