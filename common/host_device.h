// ATTND_HD marks small accessors that both host code and CUDA kernels call (the page table, the
// cache rows): __host__ __device__ under nvcc, nothing for the host compiler.
#pragma once

#if defined(__CUDACC__)
#define ATTND_HD __host__ __device__
#else
#define ATTND_HD
#endif

// ATTND_UNROLL asks nvcc to unroll the loop that follows, so that a register array it indexes
// (mma accumulators, fragments) keeps constant indices and stays in registers instead of local
// memory; the host compiler ignores it.
#if defined(__CUDA_ARCH__)
#define ATTND_UNROLL _Pragma("unroll")
#else
#define ATTND_UNROLL
#endif
