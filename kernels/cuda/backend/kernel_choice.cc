#include "kernels/cuda/backend/kernel_choice.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <type_traits>

namespace attnd::cuda {
namespace {

// Layer 1 and layer 3, each family's value in an atomic of its own (a step reads the choice
// when it begins, from any thread, without a lock). Layer 3: -1 none, else the enum's value.
// Each family's place in a layer's array.
template <typename Kernel>
constexpr size_t kFamily = std::is_same_v<Kernel, MlaKernel>       ? 0
                           : std::is_same_v<Kernel, LibraryMla>    ? 1
                           : std::is_same_v<Kernel, IndexerKernel> ? 2
                                                                   : 3;
using Layer = std::array<std::atomic<int>, 4>;
Layer g_flags{{{0}, {0}, {0}, {0}}};
Layer g_scoped{{{-1}, {-1}, {-1}, {-1}}};

template <typename Kernel>
void Set(Layer& l, Kernel k) {
  l[kFamily<Kernel>] = static_cast<int>(k);
}
// The layer's value for the family, or `fallback` where it has none (-1).
template <typename Kernel>
Kernel Get(const Layer& l, Kernel fallback) {
  const int v = l[kFamily<Kernel>].load();
  return v < 0 ? fallback : static_cast<Kernel>(v);
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
  Set(g_flags, c.mla);
  Set(g_flags, c.library_mla);
  Set(g_flags, c.indexer);
  Set(g_flags, c.topk);
}

CudaKernelChoice CurrentKernelChoice() {
  CudaKernelChoice c;
  c.mla = Get(g_flags, c.mla);
  c.library_mla = Get(g_flags, c.library_mla);
  c.indexer = Get(g_flags, c.indexer);
  c.topk = Get(g_flags, c.topk);
  const EnvChoice& env = Env();
  if (env.mla) {
    c.mla = env.value.mla;
    c.library_mla = env.value.library_mla;
  }
  if (env.indexer) c.indexer = env.value.indexer;
  if (env.topk) c.topk = env.value.topk;
  c.mla = Get(g_scoped, c.mla);
  c.library_mla = Get(g_scoped, c.library_mla);
  c.indexer = Get(g_scoped, c.indexer);
  c.topk = Get(g_scoped, c.topk);
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
    : before_(g_scoped[kFamily<Kernel>].exchange(static_cast<int>(form))) {}
template <typename Kernel>
ScopedKernel<Kernel>::~ScopedKernel() {
  g_scoped[kFamily<Kernel>] = before_;
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
