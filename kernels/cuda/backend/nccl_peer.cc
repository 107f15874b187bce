#include "kernels/cuda/backend/nccl_peer.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <mutex>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/backend/nccl_api.h"

namespace attnd::cuda {

struct NcclPeers::Impl {
  void* lib = nullptr;
  nccl::CommInitAllFn init_all = nullptr;
  nccl::CommDestroyFn destroy = nullptr;
  nccl::GroupFn group_start = nullptr;
  nccl::GroupFn group_end = nullptr;
  nccl::SendFn send = nullptr;
  nccl::RecvFn recv = nullptr;
  nccl::ErrorStringFn error_string = nullptr;
  std::vector<int> ordinals;
  std::vector<nccl::Comm> comms;
  std::mutex mu;  // one group at a time: a communicator is not safe for concurrent groups
};

absl::StatusOr<std::unique_ptr<NcclPeers>> NcclPeers::Create(const std::vector<int>& ordinals) {
  auto impl = std::make_unique<Impl>();
  impl->lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!impl->lib) return absl::UnavailableError(absl::StrCat("NCCL not loadable: ", dlerror()));
  auto sym = [&](const char* name) { return dlsym(impl->lib, name); };
  impl->init_all = reinterpret_cast<nccl::CommInitAllFn>(sym("ncclCommInitAll"));
  impl->destroy = reinterpret_cast<nccl::CommDestroyFn>(sym("ncclCommDestroy"));
  impl->group_start = reinterpret_cast<nccl::GroupFn>(sym("ncclGroupStart"));
  impl->group_end = reinterpret_cast<nccl::GroupFn>(sym("ncclGroupEnd"));
  impl->send = reinterpret_cast<nccl::SendFn>(sym("ncclSend"));
  impl->recv = reinterpret_cast<nccl::RecvFn>(sym("ncclRecv"));
  impl->error_string = reinterpret_cast<nccl::ErrorStringFn>(sym("ncclGetErrorString"));
  if (!impl->init_all || !impl->destroy || !impl->group_start || !impl->group_end || !impl->send ||
      !impl->recv || !impl->error_string) {
    dlclose(impl->lib);
    return absl::UnavailableError("NCCL library lacks send/recv (needs NCCL >= 2.7)");
  }
  impl->ordinals = ordinals;
  impl->comms.resize(ordinals.size());
  const nccl::Result r =
      impl->init_all(impl->comms.data(), static_cast<int>(ordinals.size()), ordinals.data());
  if (r != nccl::kSuccess) {
    const std::string why = impl->error_string(r);
    dlclose(impl->lib);
    return absl::UnavailableError(absl::StrCat("ncclCommInitAll: ", why));
  }
  std::unique_ptr<NcclPeers> p(new NcclPeers());
  p->impl_ = std::move(impl);  // from here the destructor releases what was made
  return p;
}

NcclPeers::~NcclPeers() {
  if (!impl_) return;
  for (size_t i = 0; i < impl_->comms.size(); ++i) {
    cudaSetDevice(impl_->ordinals[i]);
    impl_->destroy(impl_->comms[i]);
  }
  dlclose(impl_->lib);
}

absl::Status NcclPeers::SendRecv(int from, int to, const void* src, void* dst, size_t bytes,
                                 cudaStream_t from_stream, cudaStream_t to_stream) {
  Impl& m = *impl_;
  if (from < 0 || to < 0 || from >= static_cast<int>(m.comms.size()) ||
      to >= static_cast<int>(m.comms.size()) || from == to)
    return absl::InvalidArgumentError(absl::StrCat("NCCL move: ranks ", from, " -> ", to));
  std::lock_guard<std::mutex> lock(m.mu);
  nccl::Result r = m.group_start();
  if (r != nccl::kSuccess)
    return absl::InternalError(absl::StrCat("ncclGroupStart: ", m.error_string(r)));
  // Both calls are issued even after a failure, so the group can end cleanly.
  cudaError_t cuda = cudaSetDevice(m.ordinals[from]);
  nccl::Result first = m.send(src, bytes, nccl::kUint8, to, m.comms[from], from_stream);
  if (cuda == cudaSuccess) cuda = cudaSetDevice(m.ordinals[to]);
  r = m.recv(dst, bytes, nccl::kUint8, from, m.comms[to], to_stream);
  if (first == nccl::kSuccess) first = r;
  r = m.group_end();
  if (first == nccl::kSuccess) first = r;
  if (cuda != cudaSuccess) {
    cudaGetLastError();  // not left for this thread's next CUDA call to report
    return absl::InternalError(absl::StrCat("NCCL move: ", cudaGetErrorString(cuda)));
  }
  if (first != nccl::kSuccess)
    return absl::InternalError(absl::StrCat("NCCL move: ", m.error_string(first)));
  return absl::OkStatus();
}

}  // namespace attnd::cuda
