#include "kernels/cuda/backend/cublas_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <type_traits>

namespace attnd::cuda {

const CublasApi* LoadCublas(std::string* why) {
  static CublasApi api;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (lib == nullptr) {
      const char* e = dlerror();
      error = std::string("cuBLAS not loadable: ") + (e ? e : "no libcublas.so");
      return;
    }
    auto sym = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
      return *fn != nullptr;
    };
    if (!sym(&api.create, "cublasCreate_v2") || !sym(&api.destroy, "cublasDestroy_v2") ||
        !sym(&api.set_stream, "cublasSetStream_v2") ||
        !sym(&api.gemm_strided_batched, "cublasGemmStridedBatchedEx") ||
        !sym(&api.status_string, "cublasGetStatusString")) {
      error = "cuBLAS lacks cublasGemmStridedBatchedEx or cublasGetStatusString (needs >= 11.4)";
      api = CublasApi{};  // the library stays loaded: a second dlopen would cost the same
    }
  });
  if (api.create == nullptr) {
    if (why) *why = error;
    return nullptr;
  }
  return &api;
}

CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) api_->destroy(handle_);
}

cublasHandle_t CublasHandle::Get(cudaStream_t stream, std::string* why) {
  if (handle_ == nullptr) {
    api_ = LoadCublas(why);
    if (api_ == nullptr) return nullptr;
    if (const cublasStatus_t st = api_->create(&handle_); st != CUBLAS_STATUS_SUCCESS) {
      handle_ = nullptr;
      if (why) *why = std::string("cublasCreate: ") + api_->status_string(st);
      return nullptr;
    }
  }
  if (const cublasStatus_t st = api_->set_stream(handle_, stream); st != CUBLAS_STATUS_SUCCESS) {
    if (why) *why = std::string("cublasSetStream: ") + api_->status_string(st);
    return nullptr;
  }
  return handle_;
}

}  // namespace attnd::cuda
