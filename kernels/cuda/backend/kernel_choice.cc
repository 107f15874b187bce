#include "kernels/cuda/backend/kernel_choice.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace attnd::cuda {
namespace {

std::mutex g_flags_mu;
CudaKernelChoice g_flags;  // layer 1, under g_flags_mu
// Layer 3: -1 none, else the enum's value.
std::atomic<int> g_scoped_mla{-1}, g_scoped_library{-1}, g_scoped_indexer{-1}, g_scoped_topk{-1};

// Layer 2: each variable read once; an unknown value is ignored (the flags' choice stays), as
// the old switches ignored values they did not know.
struct EnvChoice {
  bool mla = false, indexer = false, topk = false;
  CudaKernelChoice value;
};
const EnvChoice& Env() {
  static const EnvChoice env = [] {
    EnvChoice e;
    if (const char* v = std::getenv("ATTND_CUDA_MLA")) e.mla = ParseCudaMla(v, &e.value);
    if (const char* v = std::getenv("ATTND_CUDA_INDEXER"))
      e.indexer = ParseCudaIndexer(v, &e.value);
    if (const char* v = std::getenv("ATTND_CUDA_TOPK")) e.topk = ParseCudaTopK(v, &e.value);
    return e;
  }();
  return env;
}

}  // namespace

const std::vector<std::string>& CudaMlaNames() {
  static const std::vector<std::string> n = {"default",  "simt",       "mma", "wgmma",
                                             "wgmma-ws", "flashinfer", "gemm"};
  return n;
}
const std::vector<std::string>& CudaIndexerNames() {
  static const std::vector<std::string> n = {"default", "simt"};
  return n;
}
const std::vector<std::string>& CudaTopKNames() {
  static const std::vector<std::string> n = {"attnd", "flashinfer"};
  return n;
}

bool ParseCudaMla(std::string_view name, CudaKernelChoice* c) {
  static const MlaKernel hand[] = {MlaKernel::kDefault, MlaKernel::kSimt, MlaKernel::kMma,
                                   MlaKernel::kWgmma, MlaKernel::kWgmmaWs};
  const auto& names = CudaMlaNames();
  for (size_t i = 0; i < names.size(); ++i) {
    if (name != names[i]) continue;
    c->mla = i < 5 ? hand[i] : MlaKernel::kDefault;
    c->library_mla = name == "flashinfer" ? LibraryMla::kFlashInfer
                     : name == "gemm"     ? LibraryMla::kGemm
                                          : LibraryMla::kOff;
    return true;
  }
  return false;
}
bool ParseCudaIndexer(std::string_view name, CudaKernelChoice* c) {
  if (name == "default")
    c->indexer = IndexerKernel::kDefault;
  else if (name == "simt")
    c->indexer = IndexerKernel::kSimt;
  else
    return false;
  return true;
}
bool ParseCudaTopK(std::string_view name, CudaKernelChoice* c) {
  if (name == "attnd")
    c->topk = TopKKernel::kAttnd;
  else if (name == "flashinfer")
    c->topk = TopKKernel::kFlashInfer;
  else
    return false;
  return true;
}

void SetFlagKernelChoice(const CudaKernelChoice& c) {
  std::lock_guard<std::mutex> lock(g_flags_mu);
  g_flags = c;
}

CudaKernelChoice CurrentKernelChoice() {
  CudaKernelChoice c;
  {
    std::lock_guard<std::mutex> lock(g_flags_mu);
    c = g_flags;
  }
  const EnvChoice& env = Env();
  if (env.mla) {
    c.mla = env.value.mla;
    c.library_mla = env.value.library_mla;
  }
  if (env.indexer) c.indexer = env.value.indexer;
  if (env.topk) c.topk = env.value.topk;
  if (const int v = g_scoped_mla.load(); v >= 0) c.mla = static_cast<MlaKernel>(v);
  if (const int v = g_scoped_library.load(); v >= 0) c.library_mla = static_cast<LibraryMla>(v);
  if (const int v = g_scoped_indexer.load(); v >= 0) c.indexer = static_cast<IndexerKernel>(v);
  if (const int v = g_scoped_topk.load(); v >= 0) c.topk = static_cast<TopKKernel>(v);
  return c;
}

bool TensorCoreMla() { return CurrentKernelChoice().mla != MlaKernel::kSimt; }
bool PipelinedMla() { return CurrentKernelChoice().mla != MlaKernel::kMma; }
bool WgmmaMla() {
  const MlaKernel m = CurrentKernelChoice().mla;
  return m == MlaKernel::kWgmma || m == MlaKernel::kWgmmaWs;
}
bool WgmmaWsMla() { return CurrentKernelChoice().mla == MlaKernel::kWgmmaWs; }
LibraryMla LibraryMlaChoice() { return CurrentKernelChoice().library_mla; }
bool FlashInferMla() { return LibraryMlaChoice() == LibraryMla::kFlashInfer; }
bool GemmMla() { return LibraryMlaChoice() == LibraryMla::kGemm; }
bool TensorCoreIndexer() { return CurrentKernelChoice().indexer != IndexerKernel::kSimt; }
bool FlashInferTopK() { return CurrentKernelChoice().topk == TopKKernel::kFlashInfer; }

ScopedKernelChoice::ScopedKernelChoice(bool tensor_core_mla, bool tensor_core_indexer,
                                       bool wgmma_mla, bool warp_specialised)
    : mla_before_(g_scoped_mla.exchange(static_cast<int>(!tensor_core_mla   ? MlaKernel::kSimt
                                                         : !wgmma_mla       ? MlaKernel::kDefault
                                                         : warp_specialised ? MlaKernel::kWgmmaWs
                                                                            : MlaKernel::kWgmma))),
      indexer_before_(g_scoped_indexer.exchange(
          static_cast<int>(tensor_core_indexer ? IndexerKernel::kDefault : IndexerKernel::kSimt))) {
}
ScopedKernelChoice::~ScopedKernelChoice() {
  g_scoped_mla = mla_before_;
  g_scoped_indexer = indexer_before_;
}

ScopedLibraryMla::ScopedLibraryMla(LibraryMla form)
    : before_(g_scoped_library.exchange(static_cast<int>(form))) {}
ScopedLibraryMla::~ScopedLibraryMla() { g_scoped_library = before_; }

ScopedFlashInferTopK::ScopedFlashInferTopK(bool on)
    : before_(g_scoped_topk.exchange(
          static_cast<int>(on ? TopKKernel::kFlashInfer : TopKKernel::kAttnd))) {}
ScopedFlashInferTopK::~ScopedFlashInferTopK() { g_scoped_topk = before_; }

}  // namespace attnd::cuda
