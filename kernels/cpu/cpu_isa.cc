#include "kernels/cpu/cpu_isa.h"

#include <array>

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
#endif

absl::string_view IsaName(Isa isa) { return isa == Isa::kAvx2 ? "avx2" : "generic"; }

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out = {Isa::kGeneric};
#if defined(__x86_64__)
  __builtin_cpu_init();
  // F16C by CPUID (leaf 1, ECX bit 29): clang's __builtin_cpu_supports does not know it.
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)
    out.push_back(Isa::kAvx2);
#endif
  return out;
}

Isa BestIsa() {
  static const Isa best = SupportedIsas().back();
  return best;
}

const Kernels& GetKernels(Isa isa) {
  static const Kernels kGeneric = {
      &generic::Gemm,        &generic::GemmAtScaled, &generic::ExpInplace,
      &generic::SoftmaxTile, &generic::Bf16ToF32,    &generic::E4M3ToF32,
      &generic::ReluDot,     &generic::FmaLoop,      generic::kFmaChains * generic::kVW * 2};
#if defined(__x86_64__)
  static const Kernels kAvx2 = {
      &avx2::Gemm,        &avx2::GemmAtScaled, &avx2::ExpInplace,
      &avx2::SoftmaxTile, &avx2::Bf16ToF32,    &avx2::E4M3ToF32,
      &avx2::ReluDot,     &avx2::FmaLoop,      avx2::kFmaChains * avx2::kVW * 2};
  if (isa == Isa::kAvx2) return kAvx2;
#endif
  return kGeneric;
}

}  // namespace attnd::cpu
