#pragma once
// Reading and writing one config field by its C++ type: bool, integers, floating point, strings,
// described enums (by name), std::vector and std::optional of those, and described structs
// (sub-tables). No per-field parsing code exists anywhere else.
#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "kiln/engine/config/node.hpp"
#include "kiln/engine/config/reflect.hpp"
#include "kiln/core/error.hpp"

namespace kiln::config {

template <class T>
struct Codec;

template <class T>
concept Codable = requires { Codec<T>::type_name(); };

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

// A --set value arrives as raw text: a string field takes it verbatim, every other field parses it
// as a TOML value. Returns false (and records an error) if the text is not a valid value.
bool resolve_raw(const Node& in, bool want_string, const std::string& path, Errors& errors, Node& out);

inline std::string got(const Node& n) {
  switch (n.kind) {
    case Node::Kind::string: return cat("string ", toml_quote(n.string));
    case Node::Kind::integer: return cat("integer ", n.integer);
    case Node::Kind::floating: return cat("float ", toml_float(n.floating));
    case Node::Kind::boolean: return n.boolean ? "boolean true" : "boolean false";
    default: return std::string(n.kind_name());
  }
}

// Fields whose --set text is taken verbatim rather than parsed as TOML.
template <class T>
inline constexpr bool takes_text = std::is_same_v<T, std::string> || DescribedEnum<T>;
template <class T>
inline constexpr bool takes_text<std::optional<T>> = takes_text<T>;

template <class T>
bool read_value(const Node& node, T& out, const std::string& path, Errors& errors) {
  if (node.kind == Node::Kind::raw) {
    Node resolved;
    constexpr bool want_string = takes_text<T>;
    if (!resolve_raw(node, want_string, path, errors, resolved)) return false;
    return Codec<T>::read(resolved, out, path, errors);
  }
  return Codec<T>::read(node, out, path, errors);
}

template <>
struct Codec<bool> {
  static std::string type_name() { return "bool"; }
  static bool read(const Node& n, bool& out, const std::string& path, Errors& e) {
    if (n.kind != Node::Kind::boolean) {
      e.add(n.source, cat(path, ": expected a bool (true or false), got ", got(n)));
      return false;
    }
    out = n.boolean;
    return true;
  }
  static void write(bool v, std::ostream& os) { os << (v ? "true" : "false"); }
};

template <class T>
  requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
struct Codec<T> {
  static std::string type_name() { return std::is_signed_v<T> ? "int" : "uint"; }
  static bool read(const Node& n, T& out, const std::string& path, Errors& e) {
    if (n.kind != Node::Kind::integer) {
      e.add(n.source, cat(path, ": expected an integer, got ", got(n)));
      return false;
    }
    const std::int64_t v = n.integer;
    bool fits;
    if constexpr (std::is_signed_v<T>)
      fits = v >= static_cast<std::int64_t>(std::numeric_limits<T>::min()) &&
             v <= static_cast<std::int64_t>(std::numeric_limits<T>::max());
    else
      fits = v >= 0 && static_cast<std::uint64_t>(v) <= std::numeric_limits<T>::max();
    if (!fits) {
      e.add(n.source, cat(path, ": ", v, " is out of range for ", type_name(), " [",
                          +std::numeric_limits<T>::min(), ", ", +std::numeric_limits<T>::max(), "]"));
      return false;
    }
    out = static_cast<T>(v);
    return true;
  }
  static void write(T v, std::ostream& os) { os << +v; }
};

template <class T>
  requires std::is_floating_point_v<T>
struct Codec<T> {
  static std::string type_name() { return "float"; }
  static bool read(const Node& n, T& out, const std::string& path, Errors& e) {
    if (n.kind == Node::Kind::floating)
      out = static_cast<T>(n.floating);
    else if (n.kind == Node::Kind::integer)
      out = static_cast<T>(n.integer);
    else {
      e.add(n.source, cat(path, ": expected a number, got ", got(n)));
      return false;
    }
    return true;
  }
  static void write(T v, std::ostream& os) { os << toml_float(static_cast<double>(v)); }
};

template <>
struct Codec<std::string> {
  static std::string type_name() { return "string"; }
  static bool read(const Node& n, std::string& out, const std::string& path, Errors& e) {
    if (n.kind != Node::Kind::string) {
      e.add(n.source, cat(path, ": expected a string, got ", got(n)));
      return false;
    }
    out = n.string;
    return true;
  }
  static void write(const std::string& v, std::ostream& os) { os << toml_quote(v); }
};

// An enumerator spelled with a trailing underscore (auto_) reads and prints without it (auto).
inline std::string_view enumerator_name(std::string_view n) {
  return (!n.empty() && n.back() == '_') ? n.substr(0, n.size() - 1) : n;
}

template <DescribedEnum T>
struct Codec<T> {
  static std::string names() {
    std::string s;
    boost::mp11::mp_for_each<boost::describe::describe_enumerators<T>>([&](auto d) {
      if (!s.empty()) s += ", ";
      s += enumerator_name(d.name);
    });
    return s;
  }
  static std::string type_name() {
    std::string s = names();
    for (auto& c : s)
      if (c == ',') c = '|';
    std::erase(s, ' ');
    return "enum{" + s + "}";
  }
  static bool read(const Node& n, T& out, const std::string& path, Errors& e) {
    if (n.kind != Node::Kind::string) {
      e.add(n.source, cat(path, ": expected one of ", names(), " (a string), got ", got(n)));
      return false;
    }
    bool found = false;
    boost::mp11::mp_for_each<boost::describe::describe_enumerators<T>>([&](auto d) {
      if (!found && n.string == enumerator_name(d.name)) {
        out = d.value;
        found = true;
      }
    });
    if (!found) e.add(n.source, cat(path, ": '", n.string, "' is not one of: ", names()));
    return found;
  }
  static void write(T v, std::ostream& os) {
    const char* name = nullptr;
    boost::mp11::mp_for_each<boost::describe::describe_enumerators<T>>([&](auto d) {
      if (v == d.value) name = d.name;
    });
    if (!name) KILN_THROW("enum value ", static_cast<long long>(v), " has no name");
    os << toml_quote(enumerator_name(name));
  }
};

template <Codable T>
struct Codec<std::vector<T>> {
  static std::string type_name() { return "array<" + Codec<T>::type_name() + ">"; }
  static bool read(const Node& n, std::vector<T>& out, const std::string& path, Errors& e) {
    if (n.kind != Node::Kind::array) {
      e.add(n.source, cat(path, ": expected an array, got ", got(n)));
      return false;
    }
    std::vector<T> result(n.array.size());
    bool ok = true;
    for (std::size_t i = 0; i < n.array.size(); ++i)
      ok &= read_value(n.array[i], result[i], cat(path, "[", i, "]"), e);
    if (ok) out = std::move(result);
    return ok;
  }
  static void write(const std::vector<T>& v, std::ostream& os) {
    os << "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) os << ", ";
      Codec<T>::write(v[i], os);
    }
    os << "]";
  }
};

template <Codable T>
struct Codec<std::optional<T>> {
  static std::string type_name() { return "optional<" + Codec<T>::type_name() + ">"; }
  static bool read(const Node& n, std::optional<T>& out, const std::string& path, Errors& e) {
    T value{};
    if (!read_value(n, value, path, e)) return false;
    out = std::move(value);
    return true;
  }
};

}  // namespace kiln::config
