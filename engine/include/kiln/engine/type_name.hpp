#pragma once
// Readable type names for error messages, without RTTI demangling at run time.
#include <string_view>

namespace kiln {

template <class T>
constexpr std::string_view type_name() {
  std::string_view p = __PRETTY_FUNCTION__;
  // GCC/Clang: "... type_name() [with T = foo::Bar; ...]" or "[T = foo::Bar]"
  auto start = p.find("T = ");
  if (start == std::string_view::npos) return p;
  start += 4;
  auto end = p.find_first_of(";]", start);
  return p.substr(start, end - start);
}

}  // namespace kiln
