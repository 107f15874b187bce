// Run-time dispatch of the CPU backend's inner loops to the widest vector ISA the host has.
// The default build targets baseline x86-64; AVX2+FMA and AVX-512 code is compiled alongside it
// with function-level target attributes and chosen at run time, never with -march=native. AVX2
// and AVX-512 compute the same bits (each output one FMA chain in the same order; the indexer's
// reduction in 8-lane vectors on both): the wider ISA only changes the speed.
#pragma once

#include <optional>
#include <vector>

#include "absl/strings/string_view.h"

namespace attnd::cpu {

enum class Isa { kGeneric, kAvx2, kAvx512 };

absl::string_view IsaName(Isa isa);  // "generic", "avx2", "avx512"
// Every ISA this host can run, widest last.
std::vector<Isa> SupportedIsas();
// The widest supported ISA (what the backend uses unless told otherwise).
Isa BestIsa();
// The supported ISA whose IsaName is `name`; nullopt for an unknown name or one this host lacks.
std::optional<Isa> SupportedIsaNamed(absl::string_view name);

// The inner loops, one table per ISA. All pointers are fp32, row-major.
struct Kernels {
  // C[M,N] = A[M,D] · B[D,N] (accumulate=false) or C += A·B (accumulate=true).
  // lda/ldb/ldc are row strides in elements.
  void (*gemm)(int M, int N, int D, const float* A, int lda, const float* B, int ldb, float* C,
               int ldc, bool accumulate);
  // C[m,:] = c_scale[m] * C[m,:] + sum_d At[d*lda + m] * B[d*ldb + :] for m < M: A given
  // transposed ([D, M]) and each row of C rescaled as it is loaded (MLA's P·V with the online
  // softmax's correction). Bit-identical to scaling C's rows, then gemm(accumulate) on A = At^T,
  // where both take their vector paths (N a multiple of 16).
  void (*gemm_at_scaled)(int M, int N, int D, const float* At, int lda, const float* B, int ldb,
                         float* C, int ldc, const float* c_scale);
  // x[i] = exp(x[i]); relative error below 2e-7 for x in [-87, 88]; -inf gives 0. The exp that
  // softmax_tile uses, in the table so that its accuracy is tested over the whole range.
  void (*exp_inplace)(float* x, int n);
  // One key tile of MLA's online softmax over keys-major scores s[j * ld + h] (j < rows keys,
  // h < cols score rows, cols a multiple of 16): updates the running max m and denominator l,
  // turns s into probabilities and gives each row's rescale of the running output in corr.
  void (*softmax_tile)(float* s, int rows, int cols, int ld, float* m, float* l, float* corr);
  // dst[i] = float(src[i]) for n bf16 values.
  void (*bf16_to_f32)(const unsigned short* src, float* dst, int n);
  // dst[i] = e4m3(src[i]) * scales[i / tile] for n float8_e4m3fn values (NaN codes excepted).
  void (*e4m3_to_f32)(const unsigned char* src, const float* scales, int tile, float* dst, int n);
  // out[j] = sum_h w[h] * max(s[j * ld + h], 0) for rows j < rows, h < n (the indexer's reduction).
  void (*relu_dot)(const float* s, int rows, int n, int ld, const float* w, float* out);
  // A register-only FMA loop for measuring this core's arithmetic peak: runs `iters` rounds of
  // kFmaLoopFlops / 2 fused multiply-adds and returns a value that depends on all of them.
  float (*fma_loop)(long iters);
  int fma_loop_flops;  // flops per round
};

const Kernels& GetKernels(Isa isa);

}  // namespace attnd::cpu
