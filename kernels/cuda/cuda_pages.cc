// A GPU's pages to and from host memory, and between GPUs (NCCL when connected, else peer
// copies).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>

#include "common/status_macros.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_device_state.h"
#include "kernels/cuda/nccl_peer.h"

namespace attnd::cuda {

absl::Status CudaDevice::ReadRows(int layer, int slot, int32_t page, int first, int rows,
                                  uint8_t* latent, uint8_t* index) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  const int64_t at = int64_t{page} * s.layout.page_size + first;
  CUDA_RETURN(cudaMemcpyAsync(latent, s.Latent(layer).Row(at), rows * s.layout.latent_row_bytes(),
                              cudaMemcpyDeviceToHost, s.copy_stream));
  if (slot >= 0) {
    const uint8_t* page_start = s.cache + s.layout.IndexPageOffset(slot, page);
    for (const auto& r : s.layout.IndexRanges(first, rows)) {
      if (r.bytes)
        CUDA_RETURN(cudaMemcpyAsync(index, page_start + r.offset, r.bytes, cudaMemcpyDeviceToHost,
                                    s.copy_stream));
      index += r.bytes;
    }
  }
  CUDA_RETURN(cudaStreamSynchronize(s.copy_stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::State::PageToHost(int32_t page, int rows, uint8_t* staged) {
  const int64_t at = int64_t{page} * layout.page_size;
  for (int l = 0; l < layout.num_layers; ++l)
    CUDA_RETURN(cudaMemcpyAsync(staged + layout.StagedLatent(l, rows), Latent(l).Row(at),
                                rows * layout.latent_row_bytes(), cudaMemcpyDeviceToHost,
                                copy_stream));
  for (int k = 0; k < layout.num_full_layers; ++k) {
    uint8_t* to = staged + layout.StagedIndex(k, rows);
    for (const auto& r : layout.IndexRanges(0, rows)) {
      if (r.bytes)
        CUDA_RETURN(cudaMemcpyAsync(to, cache + layout.IndexPageOffset(k, page) + r.offset, r.bytes,
                                    cudaMemcpyDeviceToHost, copy_stream));
      to += r.bytes;
    }
  }
  CUDA_RETURN(cudaStreamSynchronize(copy_stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::State::HostToPage(int32_t page, int rows, const uint8_t* staged) {
  // On the copy stream, then waited for: a pageable copy may return before its DMA lands.
  const int64_t at = int64_t{page} * layout.page_size;
  for (int l = 0; l < layout.num_layers; ++l)
    CUDA_RETURN(cudaMemcpyAsync(Latent(l).MutableRow(at), staged + layout.StagedLatent(l, rows),
                                rows * layout.latent_row_bytes(), cudaMemcpyHostToDevice,
                                copy_stream));
  for (int k = 0; k < layout.num_full_layers; ++k) {
    const uint8_t* from = staged + layout.StagedIndex(k, rows);
    for (const auto& r : layout.IndexRanges(0, rows)) {
      if (r.bytes)
        CUDA_RETURN(cudaMemcpyAsync(cache + layout.IndexPageOffset(k, page) + r.offset, from,
                                    r.bytes, cudaMemcpyHostToDevice, copy_stream));
      from += r.bytes;
    }
  }
  CUDA_RETURN(cudaStreamSynchronize(copy_stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::ReadPage(int32_t page, int rows, uint8_t* staged) {
  std::lock_guard<std::mutex> lock(s_->copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  return s_->PageToHost(page, rows, staged);
}

absl::Status CudaDevice::WritePage(int32_t page, int rows, const uint8_t* staged) {
  std::lock_guard<std::mutex> lock(s_->copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  return s_->HostToPage(page, rows, staged);
}

absl::Status CudaDevice::CopyPages(Device& dst, const std::vector<PageCopy>& copies) {
  auto* to = dynamic_cast<CudaDevice*>(&dst);
  if (to == nullptr) return Device::CopyPages(dst, copies);  // to the host through staging
  State& a = *s_;
  const State& b = *to->s_;
  // Every layer's and slot's rows of each page prefix: contiguous spans.
  std::vector<NcclPeers::Transfer> spans;
  for (const PageCopy& c : copies) {
    if (c.rows <= 0) continue;
    const int64_t from = int64_t{c.src} * a.layout.page_size,
                  into = int64_t{c.dst} * a.layout.page_size;
    for (int l = 0; l < a.layout.num_layers; ++l)
      spans.push_back({a.Latent(l).Row(from), b.Latent(l).MutableRow(into),
                       c.rows * a.layout.latent_row_bytes()});
    for (int k = 0; k < a.layout.num_full_layers; ++k)
      for (const auto& r : a.layout.IndexRanges(0, c.rows))
        if (r.bytes)
          spans.push_back({a.cache + a.layout.IndexPageOffset(k, c.src) + r.offset,
                           b.cache + b.layout.IndexPageOffset(k, c.dst) + r.offset, r.bytes});
  }
  if (to != this && nccl_ && nccl_ == to->nccl_)
    return nccl_->Move(nccl_rank_, to->nccl_rank_, spans);
  std::lock_guard<std::mutex> lock(a.copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  for (const NcclPeers::Transfer& t : spans)
    CUDA_RETURN(cudaMemcpyPeerAsync(t.dst, to->ordinal_, t.src, ordinal_, t.bytes, a.copy_stream));
  CUDA_RETURN(cudaStreamSynchronize(a.copy_stream));
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaDevice::ReservedPageUntouched() {
  std::vector<uint8_t> host(layout().StagedBytes(layout().page_size));
  RETURN_IF_ERROR(ReadPage(0, layout().page_size, host.data()));
  return std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0; });
}

void ConnectPeers(const std::vector<CudaDevice*>& gpus) {
  std::vector<int> ordinals;
  for (const CudaDevice* g : gpus) ordinals.push_back(g->ordinal());
  auto peers = NcclPeers::Create(ordinals);
  if (!peers.ok()) {  // cudaMemcpyPeer still works; say why NCCL is not used
    std::fprintf(stderr, "attnd: page moves between GPUs use cudaMemcpyPeer: %s\n",
                 std::string(peers.status().message()).c_str());
    return;
  }
  std::shared_ptr<NcclPeers> shared = std::move(peers).value();
  for (size_t i = 0; i < gpus.size(); ++i) {
    gpus[i]->nccl_ = shared;
    gpus[i]->nccl_rank_ = static_cast<int>(i);
  }
}

}  // namespace attnd::cuda
