#include "kernels/cuda/backend/gpu_facts.h"

#include <cuda_runtime.h>

#include <array>
#include <mutex>

namespace attnd::cuda {
namespace {

constexpr int kMaxDevices = 64;

struct Cache {
  std::mutex mu;
  std::array<bool, kMaxDevices> known{};
  std::array<GpuFacts, kMaxDevices> facts{};
};

Cache& TheCache() {
  static Cache* c = new Cache();  // never destroyed: launches may run during exit
  return *c;
}

cudaError_t Read(int ordinal, GpuFacts* f) {
  GpuFacts g;
  g.ordinal = ordinal;
  cudaError_t e = cudaDeviceGetAttribute(&g.cc_major, cudaDevAttrComputeCapabilityMajor, ordinal);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&g.cc_minor, cudaDevAttrComputeCapabilityMinor, ordinal);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, ordinal);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&g.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return e;
  }
  *f = g;
  return cudaSuccess;
}

}  // namespace

cudaError_t CurrentGpuFacts(GpuFacts* f) {
  int ordinal = 0;
  cudaError_t e = cudaGetDevice(&ordinal);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return e;
  }
  if (ordinal < 0 || ordinal >= kMaxDevices) return Read(ordinal, f);  // answered, not cached
  Cache& c = TheCache();
  std::lock_guard<std::mutex> lock(c.mu);
  if (!c.known[ordinal]) {
    if ((e = Read(ordinal, &c.facts[ordinal])) != cudaSuccess) return e;
    c.known[ordinal] = true;
  }
  *f = c.facts[ordinal];
  return cudaSuccess;
}

}  // namespace attnd::cuda
