// The part of NCCL's C API that nccl_peer.cc calls, declared here: NCCL is loaded at run time
// with dlopen/dlsym, so neither the build nor a single-GPU server needs NCCL installed. Types
// and values as NCCL (>= 2.7) defines them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace attnd::cuda::nccl {

using Comm = struct ncclComm*;  // ncclComm_t
using Result = int;             // ncclResult_t
constexpr Result kSuccess = 0;  // ncclSuccess
using DataType = int;           // ncclDataType_t
constexpr DataType kUint8 = 1;  // ncclUint8

using CommInitAllFn = Result (*)(Comm* comms, int ndev, const int* devlist);
using CommDestroyFn = Result (*)(Comm comm);
using GroupFn = Result (*)();
using SendFn = Result (*)(const void* buf, size_t count, DataType type, int peer, Comm comm,
                          cudaStream_t stream);
using RecvFn = Result (*)(void* buf, size_t count, DataType type, int peer, Comm comm,
                          cudaStream_t stream);
using ErrorStringFn = const char* (*)(Result result);

}  // namespace attnd::cuda::nccl
