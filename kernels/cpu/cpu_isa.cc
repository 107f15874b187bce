#include "kernels/cpu/cpu_isa.h"

#include <array>

#include "common/enum_names.h"
#include "common/fp8.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace attnd::cpu {

namespace generic {
#define ATTND_VW 4
#include "kernels/cpu/cpu_isa_impl.inc"
#undef ATTND_VW
}  // namespace generic

#if defined(__x86_64__)
// The AVX2 copy of the same code, compiled for AVX2+FMA+F16C only here (picked at run time;
// every AVX2 processor has F16C).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#define ATTND_VW 8
#include "kernels/cpu/cpu_isa_impl.inc"
#undef ATTND_VW
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// The AVX-512 copy: 16-float vectors and 32 registers (F, BW for the 16-bit lanes of the e4m3
// decode, VL and DQ as every AVX-512 server processor has them).
#if defined(__clang__)
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12's own AVX-512 headers start conversions from _mm512_undefined_*(), which its flow
// analysis then reports as maybe uninitialised.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {
#define ATTND_VW 16
#include "kernels/cpu/cpu_isa_impl.inc"
#undef ATTND_VW
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
#endif

absl::string_view IsaName(Isa isa) {
  static constexpr NamedValue<Isa> kNames[] = {
      {Isa::kGeneric, "generic"}, {Isa::kAvx2, "avx2"}, {Isa::kAvx512, "avx512"}};
  return NameIn(kNames, isa, "generic");
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out = {Isa::kGeneric};
#if defined(__x86_64__)
  __builtin_cpu_init();
  // F16C by CPUID (leaf 1, ECX bit 29): clang's __builtin_cpu_supports does not know it.
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    out.push_back(Isa::kAvx2);
    // __builtin_cpu_supports reports AVX-512 only where the OS saves the zmm state (XCR0).
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      out.push_back(Isa::kAvx512);
  }
#endif
  return out;
}

Isa BestIsa() {
  static const Isa best = SupportedIsas().back();
  return best;
}

std::optional<Isa> SupportedIsaNamed(absl::string_view name) {
  for (Isa isa : SupportedIsas())
    if (IsaName(isa) == name) return isa;
  return std::nullopt;
}

const Kernels& GetKernels(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx2) return avx2::kKernels;
  if (isa == Isa::kAvx512) return avx512::kKernels;
#endif
  return generic::kKernels;
}

}  // namespace attnd::cpu
