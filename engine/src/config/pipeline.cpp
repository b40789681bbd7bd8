#include "kiln/engine/config/pipeline.hpp"

#include <algorithm>
#include <cctype>
#include <sstream>

namespace kiln::config {

namespace {
bool valid_key_part(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// The node at a dotted path, or the deepest node on the way; nullptr if not even the section.
const Node* locate(const Node& doc, const std::string& section, const std::string& field) {
  const Node* cur = doc.find(section);
  if (!cur) return nullptr;
  std::stringstream ss(field);
  std::string part;
  while (std::getline(ss, part, '.')) {
    const Node* next = cur->kind == Node::Kind::table ? cur->find(part) : nullptr;
    if (!next) break;
    cur = next;
  }
  return cur;
}
}  // namespace

Override parse_override(std::string_view arg) {
  auto eq = arg.find('=');
  if (eq == std::string_view::npos)
    throw ConfigError(cat("--set '", arg, "': expected section.key=value"));
  Override o;
  o.text = std::string(arg);
  o.value = std::string(trim(arg.substr(eq + 1)));
  std::string key(trim(arg.substr(0, eq)));
  std::stringstream ss(key);
  std::string part;
  while (std::getline(ss, part, '.')) o.path.push_back(part);
  if (key.empty() || key.back() == '.') o.path.push_back("");
  if (o.path.size() < 2)
    throw ConfigError(cat("--set '", arg, "': the key must name a section and a field, e.g. train.steps=100"));
  for (auto& p : o.path)
    if (!valid_key_part(p))
      throw ConfigError(cat("--set '", arg, "': '", key, "' is not a valid key (letters, digits, _ and - separated by dots)"));
  if (o.value.empty()) throw ConfigError(cat("--set '", arg, "': no value after '='"));
  return o;
}

Node load_document(const std::string& file, const std::vector<std::string>& set_args) {
  Node doc = file.empty() ? Node{} : parse_toml_file(file);
  apply_overrides(doc, set_args);
  return doc;
}

void apply_overrides(Node& doc, const std::vector<std::string>& set_args) {
  for (auto& arg : set_args) {
    Override o = parse_override(arg);
    Source src{"--set " + o.text, 0, 0};
    Node* cur = &doc;
    std::string walked;
    for (std::size_t i = 0; i + 1 < o.path.size(); ++i) {
      walked += (i ? "." : "") + o.path[i];
      Node* next = cur->find(o.path[i]);
      if (!next) next = &cur->child(o.path[i], src);
      if (next->kind != Node::Kind::table)
        throw ConfigError(cat(src.file, ": '", walked, "' is a value, not a table"));
      cur = next;
    }
    Node value;
    value.kind = Node::Kind::raw;
    value.string = o.value;
    value.source = src;
    if (Node* existing = cur->find(o.path.back())) {
      if (existing->kind == Node::Kind::table)
        throw ConfigError(cat(src.file, ": '", o.path.back(), "' is a table; set one of its keys instead"));
      *existing = std::move(value);
    } else {
      cur->table.emplace_back(o.path.back(), std::move(value));
    }
  }
}

std::any read_engine_section(const Node& doc, const ModuleRegistry& registry) {
  Errors errors;
  const Node* section = doc.find("engine");
  if (section && section->kind != Node::Kind::table) {
    errors.add(section->source, "'engine' must be a [section]");
    section = nullptr;
  }
  const auto& desc = registry.get("engine");
  std::any value = desc.schema.read(section, "engine", errors);
  errors.throw_if_any();
  return value;
}

PipelineConfig resolve(const Node& doc, const std::string& file, const ModuleRegistry& registry) {
  Errors errors;
  std::vector<std::string> wanted = {"engine"};
  for (auto& [key, value] : doc.table) {
    if (value.kind != Node::Kind::table) {
      errors.add(value.source, cat("top-level key '", key, "' must be inside a [section]"));
      continue;
    }
    if (!registry.find(key)) {
      auto hint = nearest(key, registry.names());
      errors.add(value.source, cat("unknown section [", key, "]",
                                   hint.empty() ? "" : cat("; did you mean [", hint, "]?"),
                                   " (`kiln modules` lists them)"));
      continue;
    }
    if (key != "engine") wanted.push_back(key);
  }

  PipelineConfig cfg;
  cfg.file = file;
  cfg.doc = doc;
  try {
    cfg.modules = registry.install_order(wanted);
  } catch (const Error& e) {
    errors.add(Source{file, 0, 0}, e.what());
    errors.throw_if_any();
  }

  for (auto& name : cfg.modules) {
    const auto& desc = registry.get(name);
    const Node* section = doc.find(name);
    Errors read_errors;
    std::any value = desc.schema.read(section, name, read_errors);
    for (auto& m : read_errors.messages()) errors.add(Source{}, m);
    if (!read_errors.empty()) continue;  // validating half-read values would only add noise
    if (desc.complete) {
      Errors complete_errors;
      desc.complete(value, doc, file, complete_errors);
      for (auto& m : complete_errors.messages()) errors.add(Source{}, m);
      if (!complete_errors.empty()) continue;
    }
    for (auto& f : desc.schema.validate(value))
      errors.add(source_of(doc, file, cat(name, ".", f.field)), cat(name, ".", f.field, ": ", f.message));
    cfg.values.emplace(name, std::move(value));
  }
  errors.throw_if_any();
  return cfg;
}

Source source_of(const Node& doc, const std::string& file, std::string_view dotted_key) {
  const auto dot = dotted_key.find('.');
  const Node* at = dot == std::string_view::npos
                       ? nullptr
                       : locate(doc, std::string(dotted_key.substr(0, dot)), std::string(dotted_key.substr(dot + 1)));
  return at ? at->source : Source{cat(file.empty() ? "(no file)" : file, " (default value)"), 0, 0};
}

std::string to_toml(const PipelineConfig& cfg, const ModuleRegistry& registry) {
  std::ostringstream os;
  os << "# kiln effective configuration: every enabled module, every field.\n";
  bool first = true;
  for (auto& name : cfg.modules) {
    const auto& desc = registry.get(name);
    os << (first ? "\n" : "\n\n");
    first = false;
    os << "# ---- " << name << ": " << desc.doc << "\n";
    if (!desc.deps.empty()) {
      os << "# depends on:";
      for (auto& d : desc.deps) os << " " << d;
      os << "\n";
    }
    desc.schema.write(cfg.values.at(name), toml_key(name), os);
  }
  return os.str();
}

}  // namespace kiln::config
