#include "common/dtype.h"

#include "common/enum_names.h"
#include "common/fp8.h"

namespace attnd {

namespace {
constexpr NamedValue<DType> kDTypeNames[] = {{DType::kF32, "FP32"},
                                             {DType::kBF16, "BF16"},
                                             {DType::kF16, "FP16"},
                                             {DType::kFP8E4M3, "FP8_E4M3"}};
}  // namespace

const char* DTypeName(DType t) { return NameIn(kDTypeNames, t); }

std::optional<DType> ParseDType(std::string_view name) { return ValueNamed(kDTypeNames, name); }

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow (incl. rounding up) -> inf
  if (abs < 0x33000001u) return sign;             // below half the smallest subnormal -> 0
  int exp = static_cast<int>(abs >> 23) - 127 + 15;
  uint32_t man = (abs & 0x7fffffu) | 0x800000u;
  uint32_t shift = exp >= 1 ? 13u : static_cast<uint32_t>(14 - exp);
  if (exp < 1) exp = 0;
  uint32_t half = 1u << (shift - 1);
  uint32_t rest = man & ((1u << shift) - 1);
  uint32_t out = man >> shift;
  if (rest > half || (rest == half && (out & 1u))) ++out;
  // For normals `out` holds the implicit bit; adding the exponent field carries correctly.
  uint32_t result = exp >= 1 ? ((static_cast<uint32_t>(exp) << 10) + (out - 0x400u)) : out;
  return static_cast<uint16_t>(sign | result);
}

float RoundTo(DType t, float f) {
  switch (t) {
    case DType::kF32:
      return f;
    case DType::kBF16:
      return BF16ToF32(F32ToBF16(f));
    case DType::kF16:
      return F16ToF32(F32ToF16(f));
    case DType::kFP8E4M3:
      return fp8::E4M3ToF32(fp8::F32ToE4M3(f));
  }
  return f;
}

void ConvertToF32(DType t, const void* src, float* dst, size_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = BF16ToF32(s[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = F16ToF32(s[i]);
      return;
    }
    case DType::kFP8E4M3: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = fp8::E4M3ToF32(s[i]);
      return;
    }
  }
}

void ConvertFromF32(DType t, const float* src, void* dst, size_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = F32ToBF16(src[i]);
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = F32ToF16(src[i]);
      return;
    }
    case DType::kFP8E4M3: {
      uint8_t* d = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = fp8::F32ToE4M3(src[i]);
      return;
    }
  }
}

}  // namespace attnd
