#pragma once
// A pipeline file is TOML with one [section] per module. A module is enabled when its section is
// present (even empty) or when an enabled module depends on it; `engine` is always enabled.
// Loading reads the file, applies `--set section.key=value` overrides, and resolves every enabled
// module's config through its reflected schema. All problems are reported at once, each with its
// file:line:column, as one kiln::ConfigError.
#include <any>
#include <map>
#include <string>
#include <vector>

#include "kiln/engine/config/node.hpp"
#include "kiln/core/error.hpp"
#include "kiln/engine/module.hpp"

namespace kiln::config {

struct Override {
  std::vector<std::string> path;  // {"train", "steps"}
  std::string value;              // raw text
  std::string text;               // the whole argument, for messages
};

// Parses "section.key=value" (nested: "section.sub.key=value"); throws ConfigError if malformed.
Override parse_override(std::string_view arg);

// Applies `--set section.key=value` overrides to a document; throws ConfigError if malformed.
void apply_overrides(Node& doc, const std::vector<std::string>& set_args);

// The file (or an empty document if `file` is empty) with the overrides applied.
Node load_document(const std::string& file, const std::vector<std::string>& set_args);

struct PipelineConfig {
  std::string file;
  Node doc;                                // the document the values were read from (overrides applied)
  std::vector<std::string> modules;       // install order; "engine" first
  std::map<std::string, std::any> values;  // module name -> its config struct

  bool enabled(const std::string& module) const { return values.count(module) != 0; }
  template <class T>
  const T& get(const std::string& module) const {
    auto it = values.find(module);
    if (it == values.end()) KILN_THROW("module '", module, "' is not enabled in ", file);
    return std::any_cast<const T&>(it->second);
  }
};

// Reads only the [engine] section (the plugins must be loaded before the rest can be resolved).
std::any read_engine_section(const Node& doc, const ModuleRegistry& registry);

PipelineConfig resolve(const Node& doc, const std::string& file, const ModuleRegistry& registry);

// Where the value of `section.key` (dotted, nested keys too) came from: its file:line:column, the
// --set argument that made it, or "FILE (default value)" when the document does not have it.
Source source_of(const Node& doc, const std::string& file, std::string_view dotted_key);

// The complete effective config as TOML: every enabled module, every field, defaults filled in,
// docs as comments. Reading the output back gives the same text.
std::string to_toml(const PipelineConfig& cfg, const ModuleRegistry& registry);

}  // namespace kiln::config
