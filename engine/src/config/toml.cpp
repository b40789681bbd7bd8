// The only translation unit that includes toml++ (nvcc cannot compile toml++ 3.3).
#include <toml++/toml.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/engine/config/codec.hpp"
#include "kiln/engine/config/node.hpp"
#include "kiln/core/error.hpp"

namespace kiln::config {

namespace {

Source source_of(const toml::source_region& r, const std::string& file) {
  return Source{file, static_cast<int>(r.begin.line), static_cast<int>(r.begin.column)};
}

Node convert(const toml::node& n, const Source& src, const std::string& file) {
  Node out;
  out.source = src;
  if (auto* t = n.as_table()) {
    out.kind = Node::Kind::table;
    for (auto&& [key, value] : *t) {
      Source ks = source_of(key.source(), file);
      if (ks.line == 0) ks = source_of(value.source(), file);
      out.table.emplace_back(std::string(key.str()), convert(value, ks, file));
    }
    // toml++ keeps keys sorted by name; restore document order for messages and printing.
    std::stable_sort(out.table.begin(), out.table.end(), [](auto& a, auto& b) {
      return std::pair(a.second.source.line, a.second.source.column) <
             std::pair(b.second.source.line, b.second.source.column);
    });
  } else if (auto* a = n.as_array()) {
    out.kind = Node::Kind::array;
    for (auto& el : *a) {
      Source es = source_of(el.source(), file);
      if (es.line == 0) es = src;
      out.array.push_back(convert(el, es, file));
    }
  } else if (auto* s = n.as_string()) {
    out.kind = Node::Kind::string;
    out.string = s->get();
  } else if (auto* i = n.as_integer()) {
    out.kind = Node::Kind::integer;
    out.integer = i->get();
  } else if (auto* f = n.as_floating_point()) {
    out.kind = Node::Kind::floating;
    out.floating = f->get();
  } else if (auto* b = n.as_boolean()) {
    out.kind = Node::Kind::boolean;
    out.boolean = b->get();
  } else {
    throw ConfigError(cat(src.str(), ": dates and times are not supported in kiln configs"));
  }
  return out;
}

Node parse(std::string_view text, const std::string& origin) {
  try {
    toml::table t = toml::parse(text, std::string_view(origin));
    Node root = convert(t, Source{origin, 0, 0}, origin);
    return root;
  } catch (const toml::parse_error& e) {
    throw ConfigError(cat(source_of(e.source(), origin).str(), ": TOML syntax error: ", e.description()));
  }
}

// Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF), as TOML requires.
bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n;
    std::uint32_t cp;
    if (c < 0x80) n = 0, cp = c;
    else if ((c & 0xE0) == 0xC0) n = 1, cp = c & 0x1Fu;
    else if ((c & 0xF0) == 0xE0) n = 2, cp = c & 0x0Fu;
    else if ((c & 0xF8) == 0xF0) n = 3, cp = c & 0x07u;
    else return false;
    if (i + static_cast<std::size_t>(n) >= s.size() && n > 0) return false;
    for (int k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3Fu);
    }
    static constexpr std::uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<std::size_t>(n) + 1;
  }
  return true;
}

}  // namespace

Node parse_toml_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw ConfigError(cat(path, ": pipeline file not found"));
  if (std::filesystem::is_directory(path, ec)) throw ConfigError(cat(path, ": is a directory, not a pipeline file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(cat(path, ": cannot open the pipeline file"));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

Node parse_toml_text(std::string_view text, const std::string& origin) { return parse(text, origin); }

bool parse_toml_value(std::string_view text, const Source& src, Node& out) {
  std::string doc = "v = " + std::string(text);
  try {
    toml::table t = toml::parse(std::string_view(doc), std::string_view("--set"));
    auto* n = t.get("v");
    if (!n) return false;
    out = convert(*n, src, src.file);
    // Positions inside the synthetic document mean nothing to the user.
    out.source = src;
    for (auto& el : out.array) el.source = src;
    return true;
  } catch (const toml::parse_error&) {
    return false;
  } catch (const ConfigError&) {
    return false;
  }
}

bool resolve_raw(const Node& in, bool want_string, const std::string& path, Errors& errors, Node& out) {
  out = Node{};
  out.source = in.source;
  if (want_string) {
    // A config file is UTF-8 (toml++ checks); a --set value must be too, or `kiln config` would
    // print a file that does not read back.
    if (!valid_utf8(in.string)) {
      errors.add(in.source, cat(path, ": the value is not valid UTF-8"));
      return false;
    }
    // Accept both --set k=text and --set k='"text"'.
    Node parsed;
    if (parse_toml_value(in.string, in.source, parsed) && parsed.kind == Node::Kind::string) {
      out = parsed;
    } else {
      out.kind = Node::Kind::string;
      out.string = in.string;
    }
    return true;
  }
  if (!parse_toml_value(in.string, in.source, out)) {
    errors.add(in.source, cat(path, ": '", in.string, "' is not a valid value (write it as in TOML: 12, 0.5, true, [1, 2])"));
    return false;
  }
  return true;
}

}  // namespace kiln::config
