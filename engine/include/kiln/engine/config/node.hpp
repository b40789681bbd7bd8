#pragma once
// A parsed configuration document, independent of the TOML library: toml++ stays inside one
// host-only .cpp (nvcc cannot digest it), and the reflection templates read this tree instead.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::config {

// Where a value came from: "file.toml:12:5", or the --set argument that made it.
struct Source {
  std::string file;  // file path, or e.g. "--set train.steps=5"
  int line = 0;      // 0 when there is no file position
  int column = 0;
  std::string str() const;
};

struct Node {
  enum class Kind { boolean, integer, floating, string, array, table, raw };
  Kind kind = Kind::table;
  Source source;
  bool boolean = false;
  std::int64_t integer = 0;
  double floating = 0;
  std::string string;  // string value, or the unparsed text of a --set value (Kind::raw)
  std::vector<Node> array;
  std::vector<std::pair<std::string, Node>> table;  // in document order

  // Declared here and defaulted below the class: clang (14) would otherwise instantiate the
  // vectors' constexpr destructors inside the class, where the pair's Node is still incomplete.
  Node();
  Node(const Node&);
  Node(Node&&) noexcept;
  Node& operator=(const Node&);
  Node& operator=(Node&&) noexcept;
  ~Node();

  const Node* find(std::string_view key) const;
  Node* find(std::string_view key);
  // Finds or appends a table entry (used when --set creates keys).
  Node& child(std::string_view key, Source src);
  std::string_view kind_name() const;
};
inline Node::Node() = default;
inline Node::Node(const Node&) = default;
inline Node::Node(Node&&) noexcept = default;
inline Node& Node::operator=(const Node&) = default;
inline Node& Node::operator=(Node&&) noexcept = default;
inline Node::~Node() = default;

// Collects every problem found while reading, so one run reports them all at once.
class Errors {
 public:
  void add(const Source& where, std::string message);
  bool empty() const { return messages_.empty(); }
  const std::vector<std::string>& messages() const { return messages_; }
  // Throws kiln::ConfigError with every message, one per line, if any were collected.
  void throw_if_any() const;

 private:
  std::vector<std::string> messages_;
};

// Parses a TOML file into a Node tree; throws ConfigError for a missing file or a syntax error.
Node parse_toml_file(const std::string& path);
// Parses TOML text (used by tests and for --set values); `origin` names it in errors.
Node parse_toml_text(std::string_view text, const std::string& origin);
// Parses the text of one --set value as a TOML value (number, bool, string, array).
// Returns false if it is not a valid TOML value.
bool parse_toml_value(std::string_view text, const Source& src, Node& out);

// Quoting and number formatting for the TOML writer.
std::string toml_quote(std::string_view s);
std::string toml_float(double v);
std::string toml_key(std::string_view key);

// The nearest candidate by edit distance, or "" if nothing is close enough.
std::string nearest(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace kiln::config
