// Which CUDA kernel forms run, decided in one place. Three layers, the later winning:
//   1. the flags (DeviceSettings: --cuda-mla, --cuda-indexer, --cuda-topk), set once at startup;
//   2. the environment, read once: ATTND_CUDA_MLA, ATTND_CUDA_INDEXER, ATTND_CUDA_TOPK with the
//      flags' values (gpu-check uses them to run a bundle's binaries with other forms);
//   3. a test's scoped choice (ScopedKernel, ScopedKernelChoice).
// A step reads the choice when it begins. Plain C++ (tests/unit/kernel_choice_test.cc runs it
// without a GPU); the forms themselves are described in docs/architecture.md, "Devices".
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace attnd::cuda {

// The sparse MLA's hand-written forms (bf16-precision requests; FP32/FP16 take SIMT anyway).
enum class MlaKernel { kDefault = 0, kSimt, kMma, kWgmma, kWgmmaWs };
// Its library forms (kernels/cuda/ops/mla_flashinfer.h, mla_gemm.h), where they apply; otherwise
// the hand-written one chosen above runs.
enum class LibraryMla { kOff = 0, kFlashInfer = 1, kGemm = 2 };
enum class IndexerKernel { kDefault = 0, kSimt };
enum class TopKKernel { kAttnd = 0, kFlashInfer };

struct CudaKernelChoice {
  MlaKernel mla = MlaKernel::kDefault;
  LibraryMla library_mla = LibraryMla::kOff;
  IndexerKernel indexer = IndexerKernel::kDefault;
  TopKKernel topk = TopKKernel::kAttnd;
};

// The names the flags and the environment take, and their parsers (false: not a name).
// --cuda-mla: default (the pipelined tensor-core kernel), simt, mma (the tile-per-block one),
// wgmma, wgmma-ws, flashinfer, gemm.
const std::vector<std::string>& CudaMlaNames();
const std::vector<std::string>& CudaIndexerNames();  // default, simt
const std::vector<std::string>& CudaTopKNames();     // attnd, flashinfer
bool ParseCudaMla(std::string_view name, CudaKernelChoice* c);
bool ParseCudaIndexer(std::string_view name, CudaKernelChoice* c);
bool ParseCudaTopK(std::string_view name, CudaKernelChoice* c);

// The flags' choice (layer 1), set by CreateDevices; every GPU of the process shares it.
void SetFlagKernelChoice(const CudaKernelChoice& c);
// The choice in force now: the flags', then the environment's, then a test's scope.
CudaKernelChoice CurrentKernelChoice();

// Derived from CurrentKernelChoice(), for the launch code.
bool TensorCoreMla();  // not simt
bool PipelinedMla();   // not mma (the pipelined kernel where it can)
bool WgmmaMla();       // wgmma or wgmma-ws
bool WgmmaWsMla();     // wgmma-ws
LibraryMla LibraryMlaChoice();
bool FlashInferMla();      // the library form is FlashInfer's
bool GemmMla();            // the library form is the cuBLAS floor
bool TensorCoreIndexer();  // not simt
bool FlashInferTopK();

// While it lives, the choice of one kernel family (MlaKernel, LibraryMla, IndexerKernel or
// TopKKernel) is `form`; then the choice before it is back. Scopes nest.
template <typename Kernel>
class ScopedKernel {
 public:
  explicit ScopedKernel(Kernel form);
  ~ScopedKernel();
  ScopedKernel(const ScopedKernel&) = delete;
  ScopedKernel& operator=(const ScopedKernel&) = delete;

 private:
  int before_;  // -1: no scoped choice
};
using ScopedLibraryMla = ScopedKernel<LibraryMla>;
using ScopedTopK = ScopedKernel<TopKKernel>;

// While it lives, bf16 requests take the tensor-core MLA kernel or the SIMT one (`mla`) and the
// tensor-core indexer or the SIMT one (`indexer`); `wgmma_mla` the tensor-core MLA's wgmma form,
// with `warp_specialised` its producer/consumer variant.
class ScopedKernelChoice {
 public:
  ScopedKernelChoice(bool tensor_core_mla, bool tensor_core_indexer, bool wgmma_mla = false,
                     bool warp_specialised = false);

 private:
  ScopedKernel<MlaKernel> mla_;
  ScopedKernel<IndexerKernel> indexer_;
};

}  // namespace attnd::cuda
