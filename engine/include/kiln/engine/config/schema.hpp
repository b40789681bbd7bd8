#pragma once
// ConfigSchema: everything the engine needs to know about one module's config struct, built by
// reflection (Boost.PFR walks the fields, KILN_CONFIG names and documents them) and type-erased
// so the registry can hold the schemas of unrelated modules.
#include <any>
#include <functional>
#include <ostream>
#include <sstream>
#include <string>
#include <typeindex>
#include <vector>

#include "kiln/engine/config/codec.hpp"
#include "kiln/engine/config/node.hpp"
#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/type_name.hpp"

namespace kiln::config {

// Validation. A config struct may define `void validate(kiln::config::Checks&) const`; each
// failed expectation names the field, and the loader turns it into file:line:column.
class Checks {
 public:
  struct Failure {
    std::string field;  // dotted path inside the section, e.g. "steps" or "adam.beta1"
    std::string message;
  };
  void expect(bool ok, std::string_view field, std::string message) {
    if (!ok) failures_.push_back({prefix_ + std::string(field), std::move(message)});
  }
  const std::vector<Failure>& failures() const { return failures_; }
  // Nested structs validate under a prefix.
  struct Scope {
    Checks& c;
    std::string saved;
    Scope(Checks& checks, const std::string& name) : c(checks), saved(checks.prefix_) { c.prefix_ += name + "."; }
    ~Scope() { c.prefix_ = saved; }
  };

 private:
  std::vector<Failure> failures_;
  std::string prefix_;
};

template <class T>
concept SelfValidating = requires(const T& t, Checks& c) { t.validate(c); };

struct FieldInfo {
  std::string name;  // dotted for nested fields: "adam.beta1"
  std::string type;
  std::string default_value;  // as TOML, "" when unset
  std::string doc;
};

namespace detail {

template <class T>
void write_inline(const T& v, std::ostream& os) {
  Codec<T>::write(v, os);
}

template <Described T>
void read_struct(const Node& table, T& out, const std::string& path, Errors& errors);

template <class F>
bool read_field(const Node& n, F& field, const std::string& path, Errors& errors) {
  if constexpr (Described<F>) {
    if (n.kind != Node::Kind::table) {
      errors.add(n.source, cat(path, ": expected a table, got ", got(n)));
      return false;
    }
    read_struct(n, field, path, errors);
    return true;
  } else {
    return read_value(n, field, path, errors);
  }
}

template <Described T>
void read_struct(const Node& table, T& out, const std::string& path, Errors& errors) {
  constexpr auto names = field_names<T>();
  std::vector<std::string> valid(names.begin(), names.end());
  for (auto& [key, value] : table.table) {
    bool known = false;
    for (auto n : names) known |= (n == key);
    if (!known) {
      auto hint = nearest(key, valid);
      errors.add(value.source, cat("unknown key '", key, "' in [", path, "]",
                                   hint.empty() ? "" : cat("; did you mean '", hint, "'?")));
    }
  }
  boost::pfr::for_each_field(out, [&](auto& field, std::size_t i) {
    if (const Node* n = table.find(names[i])) read_field(*n, field, path + "." + std::string(names[i]), errors);
  });
}

template <Described T>
void write_struct(const T& value, const std::string& section, std::ostream& os) {
  constexpr auto names = field_names<T>();
  constexpr auto docs = field_docs<T>();
  os << "[" << section << "]\n";
  // Scalars first: in TOML every key of a table must come before its sub-tables.
  boost::pfr::for_each_field(value, [&](const auto& field, std::size_t i) {
    using F = std::decay_t<decltype(field)>;
    if constexpr (!Described<F>) {
      os << "# " << docs[i] << "\n";
      if constexpr (is_optional<F>::value) {
        if (field) {
          os << toml_key(names[i]) << " = ";
          write_inline(*field, os);
          os << "\n";
        } else {
          os << "# " << toml_key(names[i]) << " = (unset)\n";
        }
      } else {
        os << toml_key(names[i]) << " = ";
        write_inline(field, os);
        os << "\n";
      }
    }
  });
  boost::pfr::for_each_field(value, [&](const auto& field, std::size_t i) {
    using F = std::decay_t<decltype(field)>;
    if constexpr (Described<F>) {
      os << "\n# " << docs[i] << "\n";
      write_struct(field, section + "." + std::string(names[i]), os);
    }
  });
}

template <Described T>
void describe_fields(const T& defaults, const std::string& prefix, std::vector<FieldInfo>& out) {
  constexpr auto names = field_names<T>();
  constexpr auto docs = field_docs<T>();
  boost::pfr::for_each_field(defaults, [&](const auto& field, std::size_t i) {
    using F = std::decay_t<decltype(field)>;
    std::string name = prefix + std::string(names[i]);
    if constexpr (Described<F>) {
      describe_fields(field, name + ".", out);
    } else {
      std::ostringstream def;
      if constexpr (is_optional<F>::value) {
        if (field) write_inline(*field, def);
      } else {
        write_inline(field, def);
      }
      out.push_back({name, Codec<F>::type_name(), def.str(), std::string(docs[i])});
    }
  });
}

template <Described T>
void validate_struct(const T& value, Checks& checks) {
  if constexpr (SelfValidating<T>) value.validate(checks);
  constexpr auto names = field_names<T>();
  boost::pfr::for_each_field(value, [&](const auto& field, std::size_t i) {
    using F = std::decay_t<decltype(field)>;
    if constexpr (Described<F>) {
      Checks::Scope scope(checks, std::string(names[i]));
      validate_struct(field, checks);
    }
  });
}

// Boost.Describe and Boost.PFR must see the same fields in the same order.
template <Described T>
void check_field_order() {
  T probe{};
  using Members = boost::describe::describe_members<T, boost::describe::mod_public>;
  std::size_t i = 0;
  bool ok = true;
  boost::mp11::mp_for_each<Members>([&](auto m) {
    const void* by_name = &(probe.*m.pointer);
    boost::pfr::for_each_field(probe, [&](const auto& f, std::size_t j) {
      if (j == i) ok &= (static_cast<const void*>(&f) == by_name);
    });
    ++i;
  });
  if (!ok) KILN_THROW("KILN_CONFIG(", type_name<T>(), ") lists the fields in a different order than the struct");
}

}  // namespace detail

class ConfigSchema {
 public:
  template <Described T>
  static ConfigSchema of() {
    detail::check_field_order<T>();
    ConfigSchema s;
    s.type_ = std::type_index(typeid(T));
    s.type_name_ = std::string(::kiln::type_name<T>());
    detail::describe_fields(T{}, "", s.fields_);
    s.make_default_ = [] { return std::any(T{}); };
    s.read_ = [](const Node* table, const std::string& section, Errors& errors) {
      T value{};
      if (table) detail::read_struct(*table, value, section, errors);
      return std::any(std::move(value));
    };
    s.write_ = [](const std::any& v, const std::string& section, std::ostream& os) {
      detail::write_struct(std::any_cast<const T&>(v), section, os);
    };
    s.validate_ = [](const std::any& v) {
      Checks checks;
      detail::validate_struct(std::any_cast<const T&>(v), checks);
      return checks.failures();
    };
    return s;
  }

  std::type_index type() const { return type_; }
  const std::string& type_name() const { return type_name_; }
  const std::vector<FieldInfo>& fields() const { return fields_; }
  std::any make_default() const { return make_default_(); }
  // Reads a section (nullptr: the section is absent, all defaults); problems go to `errors`.
  std::any read(const Node* table, const std::string& section, Errors& errors) const {
    return read_(table, section, errors);
  }
  void write(const std::any& value, const std::string& section, std::ostream& os) const { write_(value, section, os); }
  std::vector<Checks::Failure> validate(const std::any& value) const { return validate_(value); }

 private:
  ConfigSchema() : type_(typeid(void)) {}
  std::type_index type_;
  std::string type_name_;
  std::vector<FieldInfo> fields_;
  std::function<std::any()> make_default_;
  std::function<std::any(const Node*, const std::string&, Errors&)> read_;
  std::function<void(const std::any&, const std::string&, std::ostream&)> write_;
  std::function<std::vector<Checks::Failure>(const std::any&)> validate_;
};

}  // namespace kiln::config
