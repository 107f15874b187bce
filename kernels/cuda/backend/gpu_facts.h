// What the launchers ask the driver about the current GPU (its compute capability, multiprocessor
// count and opt-in shared memory a block), read once per device and then remembered: a layer's
// launches asked for them up to six times each.
#pragma once

#include <cuda_runtime.h>

namespace attnd::cuda {

struct GpuFacts {
  int ordinal = -1;
  int cc_major = 0;
  int cc_minor = 0;
  int sms = 0;
  int smem_optin = 0;  // bytes of dynamic shared memory a block may opt in to
};

// The facts of the current device (cudaGetDevice); on a failed CUDA call its error, *f untouched
// and the error cleared where it can be (cudaGetLastError; not a missing driver's).
cudaError_t CurrentGpuFacts(GpuFacts* f);

}  // namespace attnd::cuda
