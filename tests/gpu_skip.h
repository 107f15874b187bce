// How a GPU test skips: with the reason where no GPU is usable, or, with ATTND_REQUIRE_GPU=1
// (scripts/gpu-check.sh sets it whenever nvidia-smi lists a GPU), as a failure, so a run on a GPU
// machine can never read as green when nothing ran.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "kernels/device_factory.h"

namespace attnd::testing {

// Empty when a GPU is usable, else why not.
inline std::string GpuUnavailable() {
  if (!CudaBackendBuilt()) return "this build has no CUDA backend (nvcc not found)";
  auto gpus = GpuDeviceNames();
  if (!gpus.ok()) return std::string(gpus.status().message());
  if (gpus->empty()) return "no CUDA device visible";
  return "";
}

inline bool GpuRequired() {
  const char* v = std::getenv("ATTND_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace attnd::testing

#define ATTND_SKIP_WITHOUT_GPU()                                               \
  do {                                                                         \
    const std::string attnd_why_ = ::attnd::testing::GpuUnavailable();         \
    if (!attnd_why_.empty()) {                                                 \
      if (::attnd::testing::GpuRequired())                                     \
        FAIL() << attnd_why_ << " (ATTND_REQUIRE_GPU=1: a GPU test must run)"; \
      GTEST_SKIP() << attnd_why_ << ": GPU test skipped";                      \
    }                                                                          \
  } while (0)
