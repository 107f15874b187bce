// The thread interface of kernel bodies written once for the GPU and for the CPU simulation
// (tests/sim/simt_sim.h's SimtThread is the CPU's): GpuThread is the GPU's, a thin layer over
// threadIdx, __syncthreads and named barriers, shared memory, cp.async, shuffles, mma.sync and
// (sm_90a) wgmma and mbarriers. A body is a template over the thread type, called by every
// thread of the block (kernels/cuda/ops/indexer_stream.h).
#pragma once

#include <cstdint>

#include "kernels/cuda/ops/cuda_common.cuh"

namespace attnd::cuda {
namespace {

struct GpuThread {
  uint8_t* smem;  // the block's dynamic shared memory
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int lane() const { return static_cast<int>(threadIdx.x & 31); }
  __device__ int warp() const { return static_cast<int>(threadIdx.x >> 5); }
  __device__ void Sync() { __syncthreads(); }
  // bar.sync id, count: the named barrier of `count` threads (whole warps; 0 is Sync's).
  __device__ void NamedSync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
  }
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
  // lane / 8 (tests/sim/simt_sim.h has the layout).
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
  // wgmma (sm_90a; kernels/cuda/experimental/wgmma_layout.h): m64n32k16, bf16 in, fp32
  // accumulators, the accumulators always added to. Compiled only into the sm_90a image; elsewhere
  // a trap (the host launches a wgmma kernel only on compute capability 9.0, where that image
  // runs).
  __device__ uint32_t SmemAddr(uint32_t off) const {
    return static_cast<uint32_t>(__cvta_generic_to_shared(smem + off));
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __device__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
  __device__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
  __device__ void WgmmaWait(int pending) {
    if (pending == 0) {
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    } else {
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    }
  }
  __device__ void FenceProxyAsync() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  // setmaxnreg (warpgroup-wide): this warpgroup's registers a thread, down (a producer's) or up
  // (consumers'), within the block's register file.
  template <int kRegs>
  __device__ void RegsDown() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  }
  template <int kRegs>
  __device__ void RegsUp() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  }
  // mbarrier (tests/sim/simt_sim.h has the semantics the kernels rely on): init by one thread
  // before a Sync, arrive (release.cta), wait for the phase of `parity` (acquire.cta; try_wait
  // suspends the thread for a while in hardware before it reports, so the loop does not spin hot).
  __device__ void MbarInit(uint32_t off, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(off)), "r"(count)
                 : "memory");
  }
  __device__ void MbarArrive(uint32_t off) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                     SmemAddr(off))
                 : "memory");
  }
  __device__ void MbarWait(uint32_t off, int parity) {
    asm volatile(
        "{\n.reg .pred done;\nTRY_AGAIN:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra TRY_AGAIN;\n}\n" ::"r"(SmemAddr(off)),
        "r"(parity)
        : "memory");
  }
  // Keeps the compiler from moving accesses to the accumulators across a wgmma issue or wait.
  __device__ void WgmmaHold(float* d, int n) {
    for (int i = 0; i < n; ++i) asm volatile("" : "+f"(d[i])::"memory");
  }
  // The same for A's registers (their packing stays before wgmma.fence).
  __device__ void WgmmaHoldA(uint32_t* a, int n) {
    for (int i = 0; i < n; ++i) asm volatile("" : "+r"(a[i])::"memory");
  }
  // After wgmma.wait_group: no access to the registers moves above the wait (the same barrier;
  // the simulation tells the two apart).
  __device__ void WgmmaLanded(float* d, int n) { WgmmaHold(d, n); }
  __device__ void WgmmaLandedA(uint32_t* a, int n) { WgmmaHoldA(a, n); }
#define ATTND_WGMMA_D                                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15])
#define ATTND_WGMMA_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
  __device__ void Wgmma(float d[16], uint64_t a, uint64_t b, bool trans_b) {
    if (trans_b) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " ATTND_WGMMA_REGS
          ", %16, %17, p, 1, 1, 0, 1;\n}\n"
          : ATTND_WGMMA_D
          : "l"(a), "l"(b), "r"(1)
          : "memory");
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " ATTND_WGMMA_REGS
          ", %16, %17, p, 1, 1, 0, 0;\n}\n"
          : ATTND_WGMMA_D
          : "l"(a), "l"(b), "r"(1)
          : "memory");
    }
  }
  __device__ void WgmmaRegA(float d[16], const uint32_t a[4], uint64_t b, bool trans_b) {
    if (trans_b) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " ATTND_WGMMA_REGS
          ", {%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
          : ATTND_WGMMA_D
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)
          : "memory");
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " ATTND_WGMMA_REGS
          ", {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
          : ATTND_WGMMA_D
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)
          : "memory");
    }
  }
#undef ATTND_WGMMA_D
#undef ATTND_WGMMA_REGS
#else
  __device__ void WgmmaFence() { __trap(); }
  __device__ void WgmmaCommit() { __trap(); }
  __device__ void WgmmaWait(int) { __trap(); }
  __device__ void FenceProxyAsync() { __trap(); }
  template <int kRegs>
  __device__ void RegsDown() {}
  template <int kRegs>
  __device__ void RegsUp() {}
  __device__ void MbarInit(uint32_t, int) { __trap(); }
  __device__ void MbarArrive(uint32_t) { __trap(); }
  __device__ void MbarWait(uint32_t, int) { __trap(); }
  __device__ void WgmmaHold(float*, int) {}
  __device__ void WgmmaHoldA(uint32_t*, int) {}
  __device__ void WgmmaLanded(float*, int) {}
  __device__ void WgmmaLandedA(uint32_t*, int) {}
  __device__ void Wgmma(float*, uint64_t, uint64_t, bool) { __trap(); }
  __device__ void WgmmaRegA(float*, const uint32_t*, uint64_t, bool) { __trap(); }
#endif
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
