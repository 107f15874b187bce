// cuBLAS, loaded at run time (dlopen of the toolkit's libcublas.so.13, as NCCL is): neither a
// server without cuBLAS installed nor the GPU bundle has to carry its 600 MB, and only the GEMM
// MLA (mla_gemm.h) needs it. One load per process; a handle per GPU (CublasHandle).
#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

namespace attnd::cuda {

// The cuBLAS entry points the GEMM MLA calls (C symbols of the v2 API).
struct CublasApi {
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t) = nullptr;
  cublasStatus_t (*gemm_strided_batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                         int, int, const void*, const void*, cudaDataType, int,
                                         long long, const void*, cudaDataType, int, long long,
                                         const void*, void*, cudaDataType, int, long long, int,
                                         cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  const char* (*status_string)(cublasStatus_t) = nullptr;
};

// The process's cuBLAS, or null with *why set (not installed, too old): loaded on first call.
const CublasApi* LoadCublas(std::string* why);

// A cuBLAS handle on the current GPU, made on first use and destroyed with its owner (a
// CudaDevice's state); not thread-safe (the device's layer lock guards it).
class CublasHandle {
 public:
  CublasHandle() = default;
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  // The handle bound to `stream`, or null with *why set.
  cublasHandle_t Get(cudaStream_t stream, std::string* why);

 private:
  const CublasApi* api_ = nullptr;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace attnd::cuda
