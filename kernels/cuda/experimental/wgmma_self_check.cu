// The wgmma self-check: wgmma_probe.h on one warpgroup against float64, once per process
// (kernels/cuda/experimental/wgmma_self_check.h). Moved out of mla.cu, unchanged.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <vector>

#include "kernels/cuda/backend/gpu_facts.h"
#include "kernels/cuda/experimental/wgmma_probe.h"
#include "kernels/cuda/experimental/wgmma_self_check.h"
#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/simt.cuh"

namespace attnd::cuda {
namespace {

// MlaWgmmaSelfCheck's verdict: -1 not run, 0 failed, 1 passed. Only a passed check lets
// MlaUsesWgmma say yes; it never runs the check itself (that would happen inside a step).
std::mutex g_probe_mu;
std::atomic<int> g_probe{-1};

#ifdef ATTND_CUDA_SM90A
// wgmma_probe.h on one warpgroup (sm_90a image only, as the MLA).
__global__ void __launch_bounds__(wgmma::kGroupThreads)
    WgmmaProbeKernel(const uint16_t* a, const uint16_t* b, const uint16_t* b2, float* out) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  GpuThread g{smem_raw};
  WgmmaProbeBlock(g, a, b, b2, out);
}

// The probe on the current GPU against float64: whether wgmma computes what the simulation does
// (descriptors, core-matrix layouts, fragments, both operand forms). Any CUDA error is a failure.
bool RunWgmmaProbe() {
  std::vector<uint16_t> a(64 * 16), b(16 * 32), b2(16 * 32);
  uint32_t x = 12345;
  for (auto* v : {&a, &b, &b2})
    for (uint16_t& e : *v) {
      x = x * 1664525u + 1013904223u;
      e = F32ToBF16(static_cast<float>(static_cast<int>(x >> 8) % 4001 - 2000) / 997.0f);
    }
  uint16_t *da = nullptr, *db = nullptr, *db2 = nullptr;
  float* dout = nullptr;
  cudaStream_t st = nullptr;
  std::vector<float> out(64 * 32, 0.0f);
  const size_t bytes = out.size() * 4;
  bool ok =
      cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess &&
      cudaMalloc(&da, a.size() * 2) == cudaSuccess &&
      cudaMalloc(&db, b.size() * 2) == cudaSuccess &&
      cudaMalloc(&db2, b2.size() * 2) == cudaSuccess && cudaMalloc(&dout, bytes) == cudaSuccess &&
      cudaMemcpyAsync(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice, st) == cudaSuccess &&
      cudaMemcpyAsync(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice, st) == cudaSuccess &&
      cudaMemcpyAsync(db2, b2.data(), b2.size() * 2, cudaMemcpyHostToDevice, st) == cudaSuccess &&
      cudaMemsetAsync(dout, 0xff, bytes, st) == cudaSuccess;  // NaN: unwritten shows
  if (ok) {
    WgmmaProbeKernel<<<1, wgmma::kGroupThreads, WgmmaProbeSmem::kBytes, st>>>(da, db, db2, dout);
    ok = cudaGetLastError() == cudaSuccess &&
         cudaMemcpyAsync(out.data(), dout, bytes, cudaMemcpyDeviceToHost, st) == cudaSuccess &&
         cudaStreamSynchronize(st) == cudaSuccess;
  }
  if (!ok) cudaGetLastError();  // this probe's own error (a sticky one stays: the caller checks)
  for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(db2),
                  static_cast<void*>(dout)})
    if (p != nullptr) cudaFree(p);
  if (st != nullptr) cudaStreamDestroy(st);
  for (int m = 0; ok && m < 64; ++m)
    for (int n = 0; ok && n < 32; ++n) {
      double want = 0;
      for (int k = 0; k < 16; ++k)
        want += double(BF16ToF32(a[m * 16 + k])) *
                (double(BF16ToF32(b[k * 32 + n])) + double(BF16ToF32(b2[k * 32 + n])));
      const double got = out[m * 32 + n];
      ok = !std::isnan(got) && std::fabs(got - want) <= 1e-3 * (1 + std::fabs(want));
    }
  return ok;
}
#endif  // ATTND_CUDA_SM90A

}  // namespace

bool CurrentGpuIsCc90(int* device) {
  GpuFacts g;
  if (CurrentGpuFacts(&g) != cudaSuccess) return false;
  *device = g.ordinal;
  return g.cc_major == 9 && g.cc_minor == 0;
}

bool WgmmaSelfCheckPassed() { return g_probe.load() == 1; }

bool MlaWgmmaSelfCheck() {
#ifdef ATTND_CUDA_SM90A
  int device = 0;
  if (!CurrentGpuIsCc90(&device)) return false;  // not latched: another GPU may be 9.0
  std::lock_guard<std::mutex> lock(g_probe_mu);
  if (g_probe.load() < 0) {
    const bool passed = RunWgmmaProbe();
    std::fprintf(stderr,
                 passed ? "attnd: wgmma self-check passed on cuda:%d\n"
                        : "attnd: wgmma self-check FAILED on cuda:%d: the MLA keeps its mma.sync "
                          "kernel\n",
                 device);
    g_probe = passed ? 1 : 0;
  }
  return g_probe.load() == 1;
#else
  return false;
#endif
}

}  // namespace attnd::cuda
