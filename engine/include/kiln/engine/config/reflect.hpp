#pragma once
// Config structs are plain aggregates with defaults. KILN_CONFIG names their fields and gives each
// a one-line doc:
//
//   struct TrainConfig { std::int64_t steps = 100; std::uint64_t seed = 1337; };
//   KILN_CONFIG(TrainConfig,
//     (steps, "optimizer steps to run"),
//     (seed,  "master seed"))
//
// It expands to BOOST_DESCRIBE_STRUCT (field names) plus a doc table, and static_asserts that
// the names, the docs and Boost.PFR's field count agree. Fields are then walked with Boost.PFR.
// Enums used in configs are declared with BOOST_DESCRIBE_ENUM so they read and print by name.
// Place KILN_CONFIG at namespace scope, in the struct's namespace.
#include <array>
#include <boost/describe.hpp>
#include <boost/pfr.hpp>
#include <boost/preprocessor/seq/enum.hpp>
#include <boost/preprocessor/seq/for_each.hpp>
#include <boost/preprocessor/seq/size.hpp>
#include <boost/preprocessor/seq/transform.hpp>
#include <boost/preprocessor/tuple/elem.hpp>
#include <boost/preprocessor/variadic/to_seq.hpp>
#include <string_view>
#include <type_traits>

#define KILN_DETAIL_FIELD_NAME(s, data, pair) BOOST_PP_TUPLE_ELEM(2, 0, pair)
#define KILN_DETAIL_FIELD_DOC(r, data, pair) std::string_view(BOOST_PP_TUPLE_ELEM(2, 1, pair)),

#define KILN_DETAIL_CONFIG_SEQ(T, seq)                                                         \
  BOOST_DESCRIBE_STRUCT(T, (), (BOOST_PP_SEQ_ENUM(BOOST_PP_SEQ_TRANSFORM(KILN_DETAIL_FIELD_NAME, _, seq)))) \
  [[maybe_unused]] inline constexpr std::array<std::string_view, BOOST_PP_SEQ_SIZE(seq)>             \
  kiln_config_docs(const T*) {                                                                  \
    return {BOOST_PP_SEQ_FOR_EACH(KILN_DETAIL_FIELD_DOC, _, seq)};                              \
  }                                                                                             \
  static_assert(::boost::pfr::tuple_size_v<T> == BOOST_PP_SEQ_SIZE(seq),                        \
                "KILN_CONFIG(" #T ") must list every field of the struct, in order");

#define KILN_CONFIG(T, ...) KILN_DETAIL_CONFIG_SEQ(T, BOOST_PP_VARIADIC_TO_SEQ(__VA_ARGS__))

namespace kiln::config {

template <class T>
concept Described = boost::describe::has_describe_members<T>::value;

template <class T>
concept DescribedEnum = std::is_enum_v<T> && boost::describe::has_describe_enumerators<T>::value;

template <Described T>
constexpr auto field_docs() {
  return kiln_config_docs(static_cast<const T*>(nullptr));
}

template <Described T>
constexpr auto field_names() {
  using Members = boost::describe::describe_members<T, boost::describe::mod_public>;
  std::array<std::string_view, boost::mp11::mp_size<Members>::value> names{};
  std::size_t i = 0;
  boost::mp11::mp_for_each<Members>([&](auto m) { names[i++] = m.name; });
  return names;
}

}  // namespace kiln::config
