// The wgmma self-check (kernels/cuda/experimental/wgmma_self_check.cu): one warpgroup runs
// wgmma_probe.h, wgmma as the wgmma MLA issues it, against float64 on the current GPU, once per
// process, before the wgmma MLA may launch (MlaWgmmaSelfCheck in cuda_kernels.h is its public
// face).
#pragma once

namespace attnd::cuda {

// Whether the current GPU (its ordinal in *device) is compute capability 9.0, where the sm_90a
// image runs.
bool CurrentGpuIsCc90(int* device);
// Whether MlaWgmmaSelfCheck has run in this process and passed (it never runs it).
bool WgmmaSelfCheckPassed();

}  // namespace attnd::cuda
