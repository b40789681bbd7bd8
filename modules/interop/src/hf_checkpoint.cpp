#include "kiln/interop/hf_checkpoint.hpp"

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "kiln/checkpoint/files.hpp"
#include "kiln/core/error.hpp"

namespace kiln::interop {

namespace fs = std::filesystem;

HfCheckpoint::HfCheckpoint(const std::string& dir) : dir_(dir) {
  const fs::path single = fs::path(dir) / kHfWeightsFile, index = fs::path(dir) / kHfIndexFile;
  std::error_code ec;
  if (fs::is_regular_file(single, ec)) {
    SafetensorsFile& f = open(kHfWeightsFile);
    for (const auto& t : f.tensors()) file_of_[t.name] = kHfWeightsFile;
    return;
  }
  if (!fs::is_regular_file(index, ec))
    KILN_FILE_ERROR(dir, ": neither ", kHfWeightsFile, " nor ", kHfIndexFile,
                    " is there (a Hugging Face model directory holds one of them)");
  sharded_ = true;
  const std::string path = index.string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(checkpoint::read_text_file(path));
  } catch (const nlohmann::json::exception& e) {
    KILN_FILE_ERROR(path, ": not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object() || j["weight_map"].empty())
    KILN_FILE_ERROR(path, ": key 'weight_map' (tensor name -> shard file) is missing or empty");
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string())
      KILN_FILE_ERROR(path, ": key 'weight_map.", name, "' must name a file, got ", file.dump());
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      KILN_FILE_ERROR(path, ": key 'weight_map.", name, "' names '", f, "', not a file in the directory");
    file_of_[name] = f;
  }
  std::set<std::string> files;
  for (const auto& [name, f] : file_of_) files.insert(f);
  for (const auto& f : files)
    if (!fs::is_regular_file(fs::path(dir) / f, ec))
      KILN_FILE_ERROR(path, ": shard '", f, "' (holding '", [&] {
        for (const auto& [name, g] : file_of_)
          if (g == f) return name;
        return std::string();
      }(), "' and others) is missing from ", dir);
}

HfCheckpoint::HfCheckpoint(HfCheckpoint&&) noexcept = default;
HfCheckpoint::~HfCheckpoint() = default;

std::vector<std::string> HfCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, f] : file_of_) out.push_back(name);
  return out;
}

SafetensorsFile& HfCheckpoint::open(const std::string& file) {
  auto& slot = opened_[file];
  if (!slot) slot = std::make_unique<SafetensorsFile>((fs::path(dir_) / file).string());
  return *slot;
}

std::string HfCheckpoint::path_of(const std::string& name) const {
  const auto it = file_of_.find(name);
  return (fs::path(dir_) / (it == file_of_.end() ? std::string(kHfWeightsFile) : it->second)).string();
}

const SafetensorsTensor& HfCheckpoint::tensor(const std::string& name) {
  const auto it = file_of_.find(name);
  if (it == file_of_.end()) KILN_FILE_ERROR(dir_, ": no tensor '", name, "' in the model's weights");
  SafetensorsFile& f = open(it->second);
  const SafetensorsTensor* t = f.find(name);
  if (!t) KILN_FILE_ERROR(f.path(), ": tensor '", name, "' is missing, though ", kHfIndexFile, " puts it here");
  return *t;
}

void HfCheckpoint::read(const std::string& name, std::int64_t begin, std::int64_t count, float* out) {
  tensor(name);  // checks it is where the index says
  read_f32(*opened_.at(file_of_.at(name)), name, begin, count, out);
}

namespace {

// HF's shard names: model-00001-of-00003.safetensors.
std::string shard_name(std::size_t k, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

bool is_export_file(const std::string& f) {
  if (f == kHfWeightsFile || f == kHfIndexFile) return true;
  return f.starts_with("model-") && f.ends_with(".safetensors") && f.find("-of-") != std::string::npos;
}

}  // namespace

std::vector<std::string> write_hf_weights(const std::string& dir, const std::vector<SafetensorsEntry>& entries,
                                          std::uint64_t max_shard_bytes) {
  KILN_CHECK(max_shard_bytes > 0, "the largest shard must be positive");
  std::uint64_t total = 0;
  for (const auto& e : entries) total += e.bytes;
  // Each shard takes entries in order while they fit; a tensor larger than a shard stands alone.
  std::vector<std::vector<SafetensorsEntry>> shards(1);
  std::uint64_t in_shard = 0;
  for (const auto& e : entries) {
    if (in_shard > 0 && in_shard + e.bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(e);
    in_shard += e.bytes;
  }
  // transformers refuses a safetensors file whose metadata lacks a known "format".
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  std::vector<std::string> written;
  if (shards.size() == 1) {
    write_safetensors((fs::path(dir) / kHfWeightsFile).string(), shards[0], meta);
    written.push_back(kHfWeightsFile);
  } else {
    nlohmann::ordered_json index;
    index["metadata"]["total_size"] = total;
    nlohmann::json map = nlohmann::json::object();  // sorted by name, as transformers writes it
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const std::string name = shard_name(k, shards.size());
      write_safetensors((fs::path(dir) / name).string(), shards[k], meta);
      for (const auto& e : shards[k]) map[e.name] = name;
      written.push_back(name);
    }
    index["weight_map"] = map;
    checkpoint::write_file_atomically((fs::path(dir) / kHfIndexFile).string(), index.dump(2) + "\n");
    written.push_back(kHfIndexFile);
  }
  const std::set<std::string> keep(written.begin(), written.end());
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string f = entry.path().filename().string();
    if (entry.is_regular_file() && is_export_file(f) && !keep.count(f)) fs::remove(entry.path(), ec);
  }
  return written;
}

}  // namespace kiln::interop
