#include "kernels/cuda/backend/kernel_choice.h"

#include <atomic>
#include <cstdlib>

namespace attnd::cuda {
namespace {

// Layer 1 and layer 3, each family's value in an atomic of its own (a step reads the choice
// when it begins, from any thread, without a lock). Layer 3: -1 none, else the enum's value.
struct Layer {
  std::atomic<int> mla, library, indexer, topk;
};
Layer g_flags{{0}, {0}, {0}, {0}};
Layer g_scoped{{-1}, {-1}, {-1}, {-1}};

template <typename Kernel>
std::atomic<int>& Field(Layer& l);
template <>
std::atomic<int>& Field<MlaKernel>(Layer& l) {
  return l.mla;
}
template <>
std::atomic<int>& Field<LibraryMla>(Layer& l) {
  return l.library;
}
template <>
std::atomic<int>& Field<IndexerKernel>(Layer& l) {
  return l.indexer;
}
template <>
std::atomic<int>& Field<TopKKernel>(Layer& l) {
  return l.topk;
}

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

// The form at `name`'s place in `names` (forms[i] for names[i]).
template <typename Kernel, size_t N>
bool ParseName(std::string_view name, const std::vector<std::string>& names,
               const Kernel (&forms)[N], Kernel* out) {
  for (size_t i = 0; i < names.size() && i < N; ++i)
    if (name == names[i]) {
      *out = forms[i];
      return true;
    }
  return false;
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
  static const IndexerKernel forms[] = {IndexerKernel::kDefault, IndexerKernel::kSimt};
  return ParseName(name, CudaIndexerNames(), forms, &c->indexer);
}
bool ParseCudaTopK(std::string_view name, CudaKernelChoice* c) {
  static const TopKKernel forms[] = {TopKKernel::kAttnd, TopKKernel::kFlashInfer};
  return ParseName(name, CudaTopKNames(), forms, &c->topk);
}

void SetFlagKernelChoice(const CudaKernelChoice& c) {
  g_flags.mla = static_cast<int>(c.mla);
  g_flags.library = static_cast<int>(c.library_mla);
  g_flags.indexer = static_cast<int>(c.indexer);
  g_flags.topk = static_cast<int>(c.topk);
}

CudaKernelChoice CurrentKernelChoice() {
  CudaKernelChoice c;
  c.mla = static_cast<MlaKernel>(g_flags.mla.load());
  c.library_mla = static_cast<LibraryMla>(g_flags.library.load());
  c.indexer = static_cast<IndexerKernel>(g_flags.indexer.load());
  c.topk = static_cast<TopKKernel>(g_flags.topk.load());
  const EnvChoice& env = Env();
  if (env.mla) {
    c.mla = env.value.mla;
    c.library_mla = env.value.library_mla;
  }
  if (env.indexer) c.indexer = env.value.indexer;
  if (env.topk) c.topk = env.value.topk;
  if (const int v = g_scoped.mla.load(); v >= 0) c.mla = static_cast<MlaKernel>(v);
  if (const int v = g_scoped.library.load(); v >= 0) c.library_mla = static_cast<LibraryMla>(v);
  if (const int v = g_scoped.indexer.load(); v >= 0) c.indexer = static_cast<IndexerKernel>(v);
  if (const int v = g_scoped.topk.load(); v >= 0) c.topk = static_cast<TopKKernel>(v);
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

template <typename Kernel>
ScopedKernel<Kernel>::ScopedKernel(Kernel form)
    : before_(Field<Kernel>(g_scoped).exchange(static_cast<int>(form))) {}
template <typename Kernel>
ScopedKernel<Kernel>::~ScopedKernel() {
  Field<Kernel>(g_scoped) = before_;
}
template class ScopedKernel<MlaKernel>;
template class ScopedKernel<LibraryMla>;
template class ScopedKernel<IndexerKernel>;
template class ScopedKernel<TopKKernel>;

ScopedKernelChoice::ScopedKernelChoice(bool tensor_core_mla, bool tensor_core_indexer,
                                       bool wgmma_mla, bool warp_specialised)
    : mla_(!tensor_core_mla   ? MlaKernel::kSimt
           : !wgmma_mla       ? MlaKernel::kDefault
           : warp_specialised ? MlaKernel::kWgmmaWs
                              : MlaKernel::kWgmma),
      indexer_(tensor_core_indexer ? IndexerKernel::kDefault : IndexerKernel::kSimt) {}

}  // namespace attnd::cuda
