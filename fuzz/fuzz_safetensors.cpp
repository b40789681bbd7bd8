// The safetensors reader: the 8-byte header size, the JSON header, the byte ranges, and the
// float conversions of read_f32. The input is the whole file.
#include "fuzz_util.hpp"
#include "kiln/interop/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static kiln::fuzz::MemFile file("fuzz.safetensors");
  const std::string& path = file.set(kiln::fuzz::as_text(data, size));
  try {
    kiln::interop::SafetensorsFile st(path);
    for (const auto& t : st.tensors()) {
      if (st.find(t.name) != &t) kiln::fuzz::fuzz_fail("find() does not return the listed tensor '" + t.name + "'");
      const auto bytes = st.bytes(t.name);
      if (bytes.size() != t.end - t.begin) kiln::fuzz::fuzz_fail("bytes() of '" + t.name + "' has the wrong size");
      if (t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16") {
        const auto values = kiln::interop::read_f32(st, t.name);
        if (static_cast<std::int64_t>(values.size()) != t.numel()) kiln::fuzz::fuzz_fail("read_f32 size");
      }
    }
    for (const auto& [k, v] : st.metadata()) (void)k, (void)v;
  } catch (const std::exception&) {
  }
  return 0;
}
