// The thread interface of kernel bodies written once for the GPU and for the CPU simulation
// (kernels/cuda/simt_sim.h's SimtThread is the CPU's): GpuThread is the GPU's, a thin layer over
// threadIdx, __syncthreads, shared memory, cp.async, shuffles and mma.sync. A body is a template
// over the thread type, called by every thread of the block (kernels/cuda/indexer_stream.h).
#pragma once

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace attnd::cuda {
namespace {

struct GpuThread {
  uint8_t* smem;  // the block's dynamic shared memory
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int lane() const { return static_cast<int>(threadIdx.x & 31); }
  __device__ int warp() const { return static_cast<int>(threadIdx.x >> 5); }
  __device__ void Sync() { __syncthreads(); }
  template <typename T>
  __device__ T Ld(uint32_t off) const {
    return *reinterpret_cast<const T*>(smem + off);
  }
  template <typename T>
  __device__ void St(uint32_t off, T v) {
    *reinterpret_cast<T*>(smem + off) = v;
  }
  // cp.async.cg: 16 bytes global -> shared, bypassing registers and L1; !valid zero-fills.
  __device__ void CpAsync16(uint32_t off, const void* src, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem + off));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
  }
  __device__ void CpCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
  // Waits until at most `pending` of this thread's committed groups are in flight (0 to 3).
  __device__ void CpWait(int pending) {
    switch (pending) {
      case 0:
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        break;
      case 1:
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        break;
      case 2:
        asm volatile("cp.async.wait_group 2;\n" ::: "memory");
        break;
      default:
        asm volatile("cp.async.wait_group 3;\n" ::: "memory");
        break;
    }
  }
  __device__ float ShflXor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
  __device__ void Mma(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    Mma16816(c, a[0], a[1], a[2], a[3], b[0], b[1]);
  }
  // ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: this lane names row lane % 8 of matrix
  // lane / 8 (simt_sim.h has the layout).
  __device__ void LdMatrixX4(uint32_t r[4], uint32_t row_off, bool trans) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem + row_off));
    if (trans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(a));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(a));
    }
  }
  template <typename T>
  __device__ T Gld(const T* p) const {
    return *p;
  }
  template <typename T>
  __device__ void Gst(T* p, T v) {
    *p = v;
  }
};

}  // namespace
}  // namespace attnd::cuda
