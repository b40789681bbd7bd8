// Inputs the sanitizers and fuzzers found kiln's readers mishandling (docs/RELIABILITY.md), kept as
// regression tests.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>

#include "kiln/checkpoint/manifest.hpp"
#include "kiln/interop/safetensors.hpp"
#include "kiln/core/error.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::checkpoint;
using namespace kiln::interop;

namespace {
std::string manifest_with(const std::string& shape, const std::string& offsets, const std::string& extents,
                          const std::string& flat) {
  return R"({"format":"kiln-checkpoint","version":1,"kiln_version":"x","step":1,"topology":{},"counters":{},)"
         R"("config":"","files":[{"name":"a","rank":0,"bytes":100,"xxh3":"0000000000000000"}],)"
         R"("tensors":[{"name":"t","dtype":"f32","shape":)" + shape +
         R"(,"pieces":[{"file":0,"offset":0,"box_offsets":)" + offsets + R"(,"box_extents":)" + extents +
         R"(,"flat":)" + flat + R"(,"xxh3":"0000000000000000"}]}],"ranks":[]})";
}
}  // namespace

TEST_CASE("a manifest box whose offset plus extent overflows is refused, naming the piece") {
  CHECK_THROWS_WITH_AS(Manifest::parse(manifest_with("[4,4]", "[9223372036854775807,0]", "[1,4]", "[0,1]"), "m.json"),
                       doctest::Contains("m.json: tensor 't'.pieces[0]: the box (offset 9223372036854775807, extent 1) "
                                         "reaches past 4 in dimension 0"),
                       FileError);
  CHECK_NOTHROW(Manifest::parse(manifest_with("[4,4]", "[3,0]", "[1,4]", "[0,4]"), "m.json"));
}

TEST_CASE("a manifest tensor whose byte count wraps 64 bits is refused") {
  CHECK_THROWS_WITH_AS(
      Manifest::parse(manifest_with("[4611686018427387904]", "[0]", "[4611686018427387904]", "[0,4611686018427387904]"),
                      "m.json"),
      doctest::Contains("m.json: tensor 't'.shape: has more elements than any file holds"), FileError);
  CHECK_THROWS_AS(Manifest::parse(manifest_with("[4294967296,4294967296]", "[0,0]", "[1,1]", "[0,1]"), "m.json"),
                  FileError);
}

TEST_CASE("an empty F32 tensor in a safetensors file reads as no values") {
  test::TempDir dir("st-empty");
  const auto path = (dir.path() / "e.safetensors").string();
  write_safetensors(path, {{"z", "F32", {0, 5}, nullptr, 0}});
  SafetensorsFile f(path);
  CHECK(read_f32(f, "z").empty());
}
