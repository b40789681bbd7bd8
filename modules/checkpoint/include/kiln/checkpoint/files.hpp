#pragma once
// POSIX file operations for checkpoints, each failure a FileError naming the path: writes that
// check every byte (a full disk is an error, not a short file), fsync of files and directories,
// atomic replacement by rename, and read-only mappings.
#include <cstddef>
#include <cstdint>
#include <string>

namespace kiln::checkpoint {

// A file written from the start; close() fsyncs it. Destroyed unclosed, it is closed unsynced.
class OutputFile {
 public:
  explicit OutputFile(std::string path);  // created or truncated
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  void write(const void* data, std::size_t bytes);
  void write_zeros(std::size_t bytes);
  std::uint64_t size() const { return written_; }
  void close();  // fsync + close
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t written_ = 0;
};

// fsync of a directory: makes the names created, renamed or removed in it durable.
void sync_directory(const std::string& path);
// Writes `text` to `path` so that readers see the old content or the new, never a mix:
// path.tmp, fsync, rename, fsync of the directory.
void write_file_atomically(const std::string& path, const std::string& text);
void rename_path(const std::string& from, const std::string& to);
std::string read_text_file(const std::string& path);  // FileError if missing or unreadable

// A whole file mapped read-only.
class MappedFile {
 public:
  explicit MappedFile(std::string path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const std::byte* data() const { return data_; }
  std::uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

}  // namespace kiln::checkpoint
