// safetensors on its own: round trips, alignment, atomic writes, and every malformed header the
// reader must refuse (each error names the file and the tensor).
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include "kiln/interop/safetensors.hpp"
#include "kiln/core/error.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using interop::SafetensorsEntry;
using interop::SafetensorsFile;

namespace {

template <class T>
SafetensorsEntry entry(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape,
                       const std::vector<T>& data) {
  return {name, dtype, std::move(shape), data.data(), data.size() * sizeof(T)};
}

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

template <class T>
bool same_bytes(std::span<const std::byte> b, const std::vector<T>& v) {
  return b.size() == v.size() * sizeof(T) && (v.empty() || std::memcmp(b.data(), v.data(), b.size()) == 0);
}

// A file of an 8-byte size, the header text as given, and `buffer` bytes of zeros.
std::string raw_file(const test::TempDir& dir, const std::string& header, std::size_t buffer,
                     std::uint64_t n = ~std::uint64_t{0}) {
  if (n == ~std::uint64_t{0}) n = header.size();
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return dir.file("bad.safetensors", s + header + std::string(buffer, '\0'));
}

// The error message opening `path` raises ("" if it opens).
std::string open_error(const std::string& path) {
  try {
    SafetensorsFile f(path);
  } catch (const FileError& e) {
    CHECK(!e.where().empty());
    return e.what();
  }
  return "";
}

std::string header_error(const std::string& header, std::size_t buffer) {
  test::TempDir dir("st-bad");
  return open_error(raw_file(dir, header, buffer));
}

std::string entry_json(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

}  // namespace

TEST_CASE("a written file reads back bit for bit with its dtypes, shapes and metadata") {
  test::TempDir dir("st-roundtrip");
  const auto f32 = random_floats(3 * 5 * 7, 1);
  std::vector<std::uint16_t> bf16(13);
  const auto src = random_floats(bf16.size(), 2);
  for (std::size_t i = 0; i < bf16.size(); ++i) bf16[i] = float_to_bf16_bits(src[i]);
  const std::vector<std::int64_t> i64 = {-1, 1LL << 40, 7};
  const std::vector<std::uint8_t> u8 = {1, 2, 3, 4, 5};
  const std::vector<float> scalar = {42.5f};
  const std::vector<float> empty;
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "größe \"quoted\""}};
  const std::string path = (dir.path() / "model.safetensors").string();
  interop::write_safetensors(
      path,
      {entry("w.f32", "F32", {3, 5, 7}, f32), entry("w.bf16", "BF16", {1, 13}, bf16), entry("ids", "I64", {3}, i64),
       entry("bytes", "U8", {5}, u8), entry("scalar", "F32", {}, scalar), entry("none", "F32", {0, 4}, empty)},
      meta);

  SafetensorsFile file(path);
  CHECK(file.tensors().size() == 6);
  CHECK(file.metadata() == meta);
  CHECK(same_bytes(file.bytes("w.f32"), f32));
  CHECK(same_bytes(file.bytes("w.bf16"), bf16));
  CHECK(same_bytes(file.bytes("ids"), i64));
  CHECK(same_bytes(file.bytes("bytes"), u8));
  CHECK(same_bytes(file.bytes("scalar"), scalar));
  CHECK(file.bytes("none").empty());
  CHECK(file.find("w.bf16")->dtype == "BF16");
  CHECK(file.find("w.bf16")->shape == std::vector<std::int64_t>{1, 13});
  CHECK(file.find("scalar")->shape.empty());
  CHECK(file.find("scalar")->numel() == 1);
  CHECK(file.find("none")->numel() == 0);
  CHECK(file.find("absent") == nullptr);
  CHECK(interop::read_f32(file, "w.f32") == f32);
}

TEST_CASE("read_f32 widens BF16 and F16 exactly and refuses other dtypes") {
  test::TempDir dir("st-widen");
  const auto src = random_floats(100, 3);
  std::vector<std::uint16_t> bf16(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) bf16[i] = float_to_bf16_bits(src[i]);
  // 1, -2, the smallest subnormal, the largest finite, +inf, a quiet NaN.
  const std::vector<std::uint16_t> f16 = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00, 0x7e00};
  const std::vector<std::int32_t> i32 = {1, 2};
  const std::string path = (dir.path() / "w.safetensors").string();
  interop::write_safetensors(
      path, {entry("b", "BF16", {10, 10}, bf16), entry("h", "F16", {6}, f16), entry("i", "I32", {2}, i32)});
  SafetensorsFile file(path);
  const auto b = interop::read_f32(file, "b");
  for (std::size_t i = 0; i < src.size(); ++i) CHECK(b[i] == round_bf16(src[i]));
  const auto h = interop::read_f32(file, "h");
  CHECK(h[0] == 1.0f);
  CHECK(h[1] == -2.0f);
  CHECK(h[2] == std::ldexp(1.0f, -24));
  CHECK(h[3] == 65504.0f);
  CHECK(std::isinf(h[4]));
  CHECK(std::isnan(h[5]));
  CHECK_THROWS_WITH(interop::read_f32(file, "i"),
                    doctest::Contains("tensor 'i': dtype I32 cannot be read as floats"));
  CHECK_THROWS_WITH(interop::read_f32(file, "x"), doctest::Contains("w.safetensors: tensor 'x': no such tensor"));
}

TEST_CASE("the writer starts the buffer 8-byte aligned and every tensor at a multiple of its element size") {
  test::TempDir dir("st-align");
  const std::vector<std::uint8_t> u8(3, 1);
  const std::vector<std::uint16_t> u16(5, 2);
  const std::vector<double> f64(3, 3.0);
  const std::vector<float> f32(7, 4.0f);
  for (const std::string name : {"a", "bb", "ccc", "dddd", "eeeee", "ffffff", "ggggggg"}) {
    const std::string path = (dir.path() / (name + ".safetensors")).string();
    interop::write_safetensors(path, {entry(name + ".u8", "U8", {3}, u8), entry(name, "BF16", {5}, u16),
                                         entry("x", "F64", {3}, f64), entry("y", "F32", {7}, f32)});
    std::ifstream in(path, std::ios::binary);
    std::uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    CHECK((8 + n) % 8 == 0);
    std::string header(n, '\0');
    in.read(header.data(), static_cast<std::streamsize>(n));
    CHECK(header.front() == '{');
    CHECK(header.substr(header.rfind('}') + 1).find_first_not_of(' ') == std::string::npos);
    SafetensorsFile file(path);
    for (const auto& t : file.tensors()) {
      const std::uint64_t size = t.dtype == "F64" ? 8 : t.dtype == "F32" ? 4 : t.dtype == "BF16" ? 2 : 1;
      CHECK(t.begin % size == 0);
      CHECK(reinterpret_cast<std::uintptr_t>(file.bytes(t.name).data()) % size == 0);
    }
  }
}

TEST_CASE("the writer replaces an existing file and leaves no temp file behind") {
  test::TempDir dir("st-atomic");
  const std::string path = (dir.path() / "m.safetensors").string();
  const std::vector<float> a = {1, 2}, b = {3, 4, 5};
  interop::write_safetensors(path, {entry("a", "F32", {2}, a)});
  interop::write_safetensors(path, {entry("b", "F32", {3}, b)});
  SafetensorsFile file(path);
  CHECK(file.find("a") == nullptr);
  CHECK(same_bytes(file.bytes("b"), b));
  CHECK(!std::filesystem::exists(path + ".tmp"));
}

TEST_CASE("a write that runs out of space throws naming the path and leaves neither file") {
  test::TempDir dir("st-full");
  const std::string path = (dir.path() / "big.safetensors").string();
  const std::vector<float> big(1 << 16, 1.0f);
  // A file size limit fails the write with EFBIG as a full disk fails it with ENOSPC.
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
  auto* old_handler = signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string message;
  try {
    interop::write_safetensors(path, {entry("w", "F32", {1 << 16}, big)});
  } catch (const Error& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);
  CHECK(message.find("no space left writing " + path + ".tmp") != std::string::npos);
  CHECK(!std::filesystem::exists(path));
  CHECK(!std::filesystem::exists(path + ".tmp"));
}

TEST_CASE("writing into a missing directory throws naming the path") {
  CHECK_THROWS_AS(interop::write_safetensors("/nonexistent-kiln-dir/m.safetensors", {}), FileError);
  CHECK_THROWS_WITH(interop::write_safetensors("/nonexistent-kiln-dir/m.safetensors", {}),
                    doctest::Contains("cannot create /nonexistent-kiln-dir/m.safetensors.tmp"));
}

TEST_CASE("the writer refuses entries whose byte count does not match their shape") {
  const std::vector<float> v(5);
  CHECK_THROWS_WITH(interop::write_safetensors("x.safetensors", {entry("w", "F32", {2, 3}, v)}),
                    doctest::Contains("x.safetensors: tensor 'w': 20 bytes given but shape [2, 3] of F32 needs 24"));
  CHECK_THROWS_WITH(interop::write_safetensors("x.safetensors", {entry("w", "F31", {5}, v)}),
                    doctest::Contains("tensor 'w': unknown dtype 'F31'"));
  CHECK_THROWS_WITH(
      interop::write_safetensors("x.safetensors", {entry("w", "F32", {5}, v), entry("w", "F32", {5}, v)}),
      doctest::Contains("tensor 'w': the name is given twice"));
}

TEST_CASE("an empty file with no tensors and no metadata round-trips") {
  test::TempDir dir("st-empty");
  const std::string path = (dir.path() / "e.safetensors").string();
  interop::write_safetensors(path, {});
  SafetensorsFile file(path);
  CHECK(file.tensors().empty());
  CHECK(file.metadata().empty());
  CHECK(std::filesystem::file_size(path) == 16);  // 8 + "{}" padded to 8
}

TEST_CASE("a file shorter than the header size is refused") {
  test::TempDir dir("st-short");
  CHECK(open_error(dir.file("bad.safetensors", "abc")).find("bad.safetensors: not a safetensors file: 3 bytes") !=
        std::string::npos);
  CHECK(open_error((dir.path() / "missing.safetensors").string())
            .find("cannot open " + (dir.path() / "missing.safetensors").string()) != std::string::npos);
}

TEST_CASE("a header size over the limit or past the end of the file is refused") {
  test::TempDir dir("st-size");
  CHECK(open_error(raw_file(dir, "{}", 0, 200'000'000)).find("bad.safetensors: header size 200000000 is larger than") !=
        std::string::npos);
  CHECK(open_error(raw_file(dir, "{}", 0, 3))
            .find("bad.safetensors: header size 3 runs past the end of the 10-byte file") != std::string::npos);
}

TEST_CASE("a header that is not a JSON object is refused") {
  CHECK(header_error(" {}", 0).find("bad.safetensors: the header does not begin with '{'") != std::string::npos);
  CHECK(header_error("[]", 0).find("does not begin with '{'") != std::string::npos);
  CHECK(header_error(R"({"w": )", 0).find("bad.safetensors: the header is not valid JSON") != std::string::npos);
  CHECK(header_error(std::string("{}\0\0", 4), 0).find("not valid JSON") != std::string::npos);
}

TEST_CASE("a tensor entry with a missing key or a wrong type is refused, naming the tensor") {
  CHECK(header_error(R"({"w": 3})", 0).find("bad.safetensors: tensor 'w': entry is not an object") !=
        std::string::npos);
  CHECK(header_error(R"({"w": {"dtype": "F32", "shape": [1]}})", 4)
            .find("bad.safetensors: tensor 'w': missing key 'data_offsets'") != std::string::npos);
  CHECK(header_error(R"({"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}})", 4)
            .find("tensor 'w': dtype is not a string") != std::string::npos);
  CHECK(header_error(R"({"w": )" + entry_json("F32", "\"x\"", "[0, 4]") + "}", 4)
            .find("tensor 'w': shape is not an array") != std::string::npos);
  CHECK(header_error(R"({"w": )" + entry_json("F32", "[1.5]", "[0, 4]") + "}", 4)
            .find("tensor 'w': shape [1.5] holds a non-integer") != std::string::npos);
  CHECK(header_error(R"({"w": )" + entry_json("F32", "[1]", "[0]") + "}", 4)
            .find("tensor 'w': data_offsets must be two non-negative integers, got [0]") != std::string::npos);
  CHECK(header_error(R"({"w": )" + entry_json("F32", "[1]", "[-4, 0]") + "}", 4)
            .find("tensor 'w': data_offsets must be two non-negative integers") != std::string::npos);
}

TEST_CASE("an unknown dtype is refused, naming the tensor") {
  CHECK(header_error(R"({"w": )" + entry_json("F128", "[1]", "[0, 16]") + "}", 16)
            .find("bad.safetensors: tensor 'w': unknown dtype 'F128'") != std::string::npos);
}

TEST_CASE("a negative dimension is refused, naming the tensor") {
  CHECK(header_error(R"({"w": )" + entry_json("F32", "[-1, 2]", "[0, 0]") + "}", 0)
            .find("bad.safetensors: tensor 'w': shape [-1,2] has a negative") != std::string::npos);
}

TEST_CASE("offsets that end before they begin are refused, naming the tensor") {
  CHECK(header_error(R"({"w": )" + entry_json("F32", "[1]", "[8, 4]") + "}", 8)
            .find("bad.safetensors: tensor 'w': data_offsets [8, 4] end before they begin") != std::string::npos);
}

TEST_CASE("offsets whose length does not match shape times dtype size are refused, naming both") {
  const std::string name = "h.0.attn.c_attn.weight";
  CHECK(header_error(R"({")" + name + R"(": )" + entry_json("F32", "[768, 2304]", "[0, 100]") + "}", 100)
            .find("bad.safetensors: tensor 'h.0.attn.c_attn.weight': data_offsets [0, 100] hold 100 bytes but shape "
                  "[768, 2304] of F32 needs 7077888") != std::string::npos);
}

TEST_CASE("a shape whose byte count overflows 64 bits is refused") {
  CHECK(header_error(R"({"w": )" + entry_json("F32", "[4611686018427387904, 4]", "[0, 0]") + "}", 0)
            .find("tensor 'w': shape [4611686018427387904, 4] of F32 overflows") != std::string::npos);
}

TEST_CASE("offsets past the end of the byte buffer are refused, naming the tensor") {
  CHECK(header_error(R"({"w": )" + entry_json("F32", "[4]", "[0, 16]") + "}", 8)
            .find("bad.safetensors: tensor 'w': data_offsets [0, 16] reach past the end of the 8-byte buffer") !=
        std::string::npos);
}

TEST_CASE("overlapping tensors are refused, naming both") {
  const std::string h =
      R"({"a": )" + entry_json("F32", "[2]", "[0, 8]") + R"(, "b": )" + entry_json("F32", "[2]", "[4, 12]") + "}";
  CHECK(header_error(h, 12).find("bad.safetensors: tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]") !=
        std::string::npos);
}

TEST_CASE("a hole in the byte buffer is refused") {
  const std::string h =
      R"({"a": )" + entry_json("F32", "[1]", "[0, 4]") + R"(, "b": )" + entry_json("F32", "[1]", "[8, 12]") + "}";
  CHECK(header_error(h, 12).find(
            "bad.safetensors: tensor 'b': bytes [4, 8) of the buffer before it belong to no tensor") !=
        std::string::npos);
  const std::string first = R"({"a": )" + entry_json("F32", "[1]", "[4, 8]") + "}";
  CHECK(header_error(first, 8).find("tensor 'a': bytes [0, 4)") != std::string::npos);
  const std::string tail = R"({"a": )" + entry_json("F32", "[1]", "[0, 4]") + "}";
  CHECK(header_error(tail, 8).find("bad.safetensors: the tensors cover 4 bytes but the buffer has 8") !=
        std::string::npos);
}

TEST_CASE("a tensor name given twice is refused, naming it") {
  const std::string h =
      R"({"a": )" + entry_json("F32", "[1]", "[0, 4]") + R"(, "a": )" + entry_json("F32", "[1]", "[4, 8]") + "}";
  CHECK(header_error(h, 8).find("bad.safetensors: tensor 'a': the name appears twice") != std::string::npos);
  CHECK(header_error(R"({"a": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4)
            .find("tensor 'a': key 'dtype' appears twice") != std::string::npos);
}

TEST_CASE("metadata values that are not strings are refused") {
  CHECK(header_error(R"({"__metadata__": {"format": "pt", "step": 3}})", 0)
            .find("bad.safetensors: __metadata__ value of 'step' is not a string") != std::string::npos);
  CHECK(header_error(R"({"__metadata__": ["pt"]})", 0).find("__metadata__ is not an object") != std::string::npos);
}

TEST_CASE("a header padded with spaces and empty or scalar tensors reads") {
  const std::string h = R"({"__metadata__": {"format": "pt"}, "s": )" + entry_json("F32", "[]", "[0, 4]") +
                        R"(, "e": )" + entry_json("BF16", "[0, 3]", "[4, 4]") + "}    ";
  CHECK(header_error(h, 4).empty());
}
