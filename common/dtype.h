// Element types on the wire and in the caches, and conversions to and from fp32. Free of Abseil:
// CUDA code includes it for DType (kernel parameters carry a DType, dispatched once per launch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

#include "common/host_device.h"

namespace attnd {

// kFP8E4M3 is float8_e4m3fn (common/fp8.h): the fp8 cache's values and, on the wire, keys already
// quantised as an fp8 cache holds them (with their fp32 scales); never a query or an output.
enum class DType : uint8_t { kF32, kBF16, kF16, kFP8E4M3 };

// Bytes per element.
ATTND_HD constexpr size_t DTypeSize(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kFP8E4M3 ? 1 : 2;
}

// The Open Inference Protocol name: "FP32", "BF16", "FP16", "FP8_E4M3".
const char* DTypeName(DType t);

// Parses an OIP datatype string (upper case, as on the wire); nullopt for anything else.
std::optional<DType> ParseDType(std::string_view name);

ATTND_HD inline float BF16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
ATTND_HD inline uint16_t F32ToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

// Rounds an fp32 value through `t` and back (for kFP8E4M3: unscaled, saturating at +-448).
float RoundTo(DType t, float f);

// dst[i] = float(src[i]) for n elements of type `t` (fp8: unscaled).
void ConvertToF32(DType t, const void* src, float* dst, size_t n);

// dst[i] = t(src[i]) for n elements, round to nearest even.
void ConvertFromF32(DType t, const float* src, void* dst, size_t n);

}  // namespace attnd
