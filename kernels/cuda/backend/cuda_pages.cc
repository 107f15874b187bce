// A GPU's pages to and from host memory, and between GPUs (NCCL when connected, else peer
// copies).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/backend/cuda_device.h"
#include "kernels/cuda/backend/cuda_device_state.h"
#include "kernels/cuda/backend/nccl_peer.h"
#include "kernels/cuda/backend/span_chunks.h"

namespace attnd::cuda {

absl::Status CudaDevice::ReadRows(int layer, int slot, int32_t page, int first, int rows,
                                  uint8_t* latent, uint8_t* index) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  DrainOnError drain(s.copy_stream, ordinal_);  // the copies write into the caller's buffers
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
  drain.Dismiss();
  return absl::OkStatus();
}

absl::Status CudaDevice::State::PageToHost(int32_t page, int rows, uint8_t* staged) {
  DrainOnError drain(copy_stream);  // the caller made this GPU current
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
  drain.Dismiss();
  return absl::OkStatus();
}

absl::Status CudaDevice::State::HostToPage(int32_t page, int rows, const uint8_t* staged) {
  // On the copy stream, then waited for: a pageable copy may return before its DMA lands.
  DrainOnError drain(copy_stream);  // the caller made this GPU current
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
  drain.Dismiss();
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

namespace {

// A page move between GPUs goes in staged chunks of this many bytes (one transfer each); a tier
// move's pages are staged on the GPU in chunks of at most this many bytes too.
constexpr size_t kMoveChunkBytes = size_t{64} << 20;

}  // namespace

absl::Status CudaDevice::State::PagesThroughStaging(const std::vector<int32_t>& pages,
                                                    const std::vector<uint8_t*>& host,
                                                    bool to_host) {
  DrainOnError drain(copy_stream);  // the caller made this GPU current
  // 64 MiB, or one page where a page is larger.
  RETURN_IF_ERROR(move_staging.Reserve(PageStagingBytes(layout, kMoveChunkBytes)));
  uint8_t* staging = move_staging.as<uint8_t>();
  const PageStaging plan =
      PlanPageStaging(layout, cache, pages, staging, kMoveChunkBytes, /*to_staging=*/to_host);
  RETURN_IF_ERROR(Upload(move_table, plan.spans, copy_stream));
  // One stream keeps the order: a chunk's staging is reused only after the previous chunk's
  // copies out (a spill) or its scatter (a restore) ran.
  for (size_t a = 0; a < pages.size(); a += plan.per_chunk) {
    const size_t b = std::min(pages.size(), a + plan.per_chunk);
    auto kernel = [&] {
      return LaunchCopySpans(move_table.as<SpanCopy>() + plan.first[a],
                             static_cast<int64_t>(plan.first[b] - plan.first[a]), copy_stream);
    };
    if (to_host) CUDA_RETURN(kernel());
    for (size_t i = a; i < b; ++i) {
      uint8_t* staged = staging + (i - a) * plan.stride;
      CUDA_RETURN(
          cudaMemcpyAsync(to_host ? host[i] : staged, to_host ? staged : host[i], plan.page_bytes,
                          to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, copy_stream));
    }
    if (!to_host) CUDA_RETURN(kernel());
  }
  CUDA_RETURN(cudaStreamSynchronize(copy_stream));
  drain.Dismiss();
  return absl::OkStatus();
}

absl::Status CudaDevice::ReadPages(const std::vector<int32_t>& pages,
                                   const std::vector<uint8_t*>& staged) {
  if (pages.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(s_->copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  return s_->PagesThroughStaging(pages, staged, /*to_host=*/true);
}

absl::Status CudaDevice::WritePages(const std::vector<int32_t>& pages,
                                    const std::vector<const uint8_t*>& staged) {
  if (pages.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(s_->copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  std::vector<uint8_t*> from(staged.size());  // only read from: the copies go host -> device
  for (size_t i = 0; i < staged.size(); ++i) from[i] = const_cast<uint8_t*>(staged[i]);
  return s_->PagesThroughStaging(pages, from, /*to_host=*/false);
}

absl::Status CudaDevice::CopyPages(Device& dst, const std::vector<PageCopy>& copies) {
  auto* to = dynamic_cast<CudaDevice*>(&dst);
  if (to == nullptr) return Device::CopyPages(dst, copies);  // to the host through staging
  State& a = *s_;
  State& b = *to->s_;
  // Every layer's and slot's rows of each page prefix: contiguous spans.
  std::vector<SpanCopy> spans;
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
  if (spans.empty()) return absl::OkStatus();
  if (to == this) {  // on this GPU (a fork's partial page): one kernel over the span table
    std::lock_guard<std::mutex> lock(a.copy_mu);
    CUDA_RETURN(cudaSetDevice(ordinal_));
    DrainOnError drain(a.copy_stream, ordinal_);
    RETURN_IF_ERROR(Upload(a.move_table, spans, a.copy_stream));
    CUDA_RETURN(LaunchCopySpans(a.move_table.as<SpanCopy>(), static_cast<int64_t>(spans.size()),
                                a.copy_stream));
    CUDA_RETURN(cudaStreamSynchronize(a.copy_stream));
    drain.Dismiss();
    return absl::OkStatus();
  }
  // Between GPUs: per chunk, the source gathers its pieces into its staging, one transfer (NCCL
  // when connected, else a peer copy) lands them in the destination's staging, and the
  // destination scatters them; a chunk's transfer waits until the previous chunk was scattered.
  std::scoped_lock lock(a.copy_mu, b.copy_mu);
  // An error part way leaves earlier chunks queued on both streams: they end before the caller
  // frees the destination pages (b's drained first, as its scatters wait on a's transfers).
  DrainOnError drain_a(a.copy_stream, ordinal_), drain_b(b.copy_stream, to->ordinal_);
  const SpanChunks plan = PlanSpanChunks(spans, kMoveChunkBytes);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  RETURN_IF_ERROR(a.move_staging.Reserve(kMoveChunkBytes));
  RETURN_IF_ERROR(
      Upload(a.move_table, plan.GatherTable(a.move_staging.as<uint8_t>()), a.copy_stream));
  CUDA_RETURN(cudaSetDevice(to->ordinal_));
  RETURN_IF_ERROR(b.move_staging.Reserve(kMoveChunkBytes));
  RETURN_IF_ERROR(
      Upload(b.move_table, plan.ScatterTable(b.move_staging.as<uint8_t>()), b.copy_stream));
  const bool nccl = nccl_ && nccl_ == to->nccl_;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const SpanChunks::Chunk& c = plan.chunks[i];
    CUDA_RETURN(cudaSetDevice(ordinal_));
    CUDA_RETURN(LaunchCopySpans(a.move_table.as<SpanCopy>() + c.first,
                                static_cast<int64_t>(c.count), a.copy_stream));
    if (nccl) {  // the receive is ordered after the previous scatter on b's stream
      RETURN_IF_ERROR(nccl_->SendRecv(nccl_rank_, to->nccl_rank_, a.move_staging.ptr,
                                      b.move_staging.ptr, c.bytes, a.copy_stream, b.copy_stream));
    } else {
      if (i > 0) CUDA_RETURN(cudaStreamWaitEvent(a.copy_stream, b.move_done.e, 0));
      CUDA_RETURN(cudaMemcpyPeerAsync(b.move_staging.ptr, to->ordinal_, a.move_staging.ptr,
                                      ordinal_, c.bytes, a.copy_stream));
      CUDA_RETURN(cudaEventRecord(a.move_done.e, a.copy_stream));
      CUDA_RETURN(cudaSetDevice(to->ordinal_));
      CUDA_RETURN(cudaStreamWaitEvent(b.copy_stream, a.move_done.e, 0));
    }
    CUDA_RETURN(cudaSetDevice(to->ordinal_));
    CUDA_RETURN(LaunchCopySpans(b.move_table.as<SpanCopy>() + c.first,
                                static_cast<int64_t>(c.count), b.copy_stream));
    CUDA_RETURN(cudaEventRecord(b.move_done.e, b.copy_stream));
  }
  CUDA_RETURN(cudaSetDevice(to->ordinal_));
  CUDA_RETURN(cudaStreamSynchronize(b.copy_stream));
  CUDA_RETURN(cudaSetDevice(ordinal_));
  CUDA_RETURN(cudaStreamSynchronize(a.copy_stream));
  drain_a.Dismiss();
  drain_b.Dismiss();
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaDevice::ReservedPageUntouched() {
  std::vector<uint8_t> host(layout().StagedBytes(layout().page_size));
  RETURN_IF_ERROR(ReadPage(0, layout().page_size, host.data()));
  return std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0; });
}

HostAllocator PinnedHostMemory() {
  return [](size_t bytes) -> absl::StatusOr<HostBlock> {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("host tier: cannot pin ", bytes, " bytes: ", cudaGetErrorString(e)));
    }
    return HostBlock{p, bytes, [](void* q, size_t) { cudaFreeHost(q); }};
  };
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
