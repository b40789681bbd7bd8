#include "kiln/engine/config/node.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "kiln/core/error.hpp"

namespace kiln::config {

std::string Source::str() const {
  if (line <= 0) return file;
  return cat(file, ":", line, ":", column);
}

const Node* Node::find(std::string_view key) const {
  for (auto& [k, v] : table)
    if (k == key) return &v;
  return nullptr;
}

Node* Node::find(std::string_view key) {
  return const_cast<Node*>(std::as_const(*this).find(key));
}

Node& Node::child(std::string_view key, Source src) {
  if (Node* n = find(key)) return *n;
  Node n;
  n.kind = Kind::table;
  n.source = std::move(src);
  table.emplace_back(std::string(key), std::move(n));
  return table.back().second;
}

std::string_view Node::kind_name() const {
  switch (kind) {
    case Kind::boolean: return "boolean";
    case Kind::integer: return "integer";
    case Kind::floating: return "float";
    case Kind::string: return "string";
    case Kind::array: return "array";
    case Kind::table: return "table";
    case Kind::raw: return "text";
  }
  return "?";
}

void Errors::add(const Source& where, std::string message) {
  auto at = where.str();
  messages_.push_back(at.empty() ? std::move(message) : at + ": " + message);
}

void Errors::throw_if_any() const {
  if (messages_.empty()) return;
  std::string all;
  for (std::size_t i = 0; i < messages_.size(); ++i) {
    if (i) all += "\n";
    all += messages_[i];
  }
  throw ConfigError(all);
}

std::string toml_quote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string toml_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);  // shortest form that round-trips
  std::string s(buf, end);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  // TOML wants a digit after the point and before an exponent: "1e-05" is fine, "1.e5" is not.
  return s;
}

std::string toml_key(std::string_view key) {
  bool bare = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
  return bare ? std::string(key) : toml_quote(key);
}

namespace {
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

std::string nearest(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_d = std::max<std::size_t>(2, word.size() / 3) + 1;
  for (auto& c : candidates) {
    auto d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

}  // namespace kiln::config
