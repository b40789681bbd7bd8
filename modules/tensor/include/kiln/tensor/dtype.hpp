#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kiln {

// u8: raw bytes (an FP8 tensor's codes moved or stored without their format).
enum class DType : std::uint8_t { f32, bf16, e4m3, e5m2, i32, u16, u8 };

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::e4m3: return 1;
    case DType::e5m2: return 1;
    case DType::i32: return 4;
    case DType::u16: return 2;
    case DType::u8: return 1;
  }
  return 0;
}

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
    case DType::i32: return "i32";
    case DType::u16: return "u16";
    case DType::u8: return "u8";
  }
  return "?";
}

enum class Device : std::uint8_t { cpu, cuda };

constexpr std::string_view name_of(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

}  // namespace kiln
