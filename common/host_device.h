// ATTND_HD marks small accessors that both host code and CUDA kernels call (the page table, the
// cache rows): __host__ __device__ under nvcc, nothing for the host compiler.
#pragma once

#if defined(__CUDACC__)
#define ATTND_HD __host__ __device__
#else
#define ATTND_HD
#endif
