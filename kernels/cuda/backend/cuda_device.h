// The CUDA backend as a Device: one GPU's paged caches in device memory (nothing mapped on the
// host) and the per-layer DSA operations (cache writes, indexer scores, exact radix top-k, page
// selection, sparse and dense MLA). Plain C++: nothing of CUDA or gRPC leaks out of this header.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/backend/kernel_choice.h"
#include "kernels/device.h"
#include "kv_store/host_tier.h"

namespace attnd::cuda {

class NcclPeers;

// The number of usable CUDA devices: 0 only where there is no GPU (no NVIDIA driver installed, or
// the driver sees no device); UNAVAILABLE naming the CUDA error for anything else (a driver
// too old for this runtime, missing device nodes, a failed initialisation), so a broken GPU
// stack is never mistaken for a CPU-only machine.
absl::StatusOr<int> ProbeDevices();
// GPU `ordinal`'s free and total memory in bytes (cudaMemGetInfo), FAILED_PRECONDITION for a GPU
// that is not there.
struct GpuMemory {
  size_t free = 0, total = 0;
};
absl::StatusOr<GpuMemory> QueryGpuMemory(int ordinal);
class CudaDevice final : public Device {
 public:
  // Allocates the cache (cudaMalloc, sized by `layout`) and streams on GPU `ordinal`, after
  // checking that the cache and `scratch_bytes` of per-step working memory fit in its free
  // memory (RESOURCE_EXHAUSTED otherwise).
  absl::string_view backend() const override { return "cuda"; }
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(std::string name, int ordinal,
                                                            const ModelSpec& spec,
                                                            const CacheLayout& layout,
                                                            size_t scratch_bytes);
  ~CudaDevice() override;
  int ordinal() const { return ordinal_; }

  absl::StatusOr<std::unique_ptr<DeviceStep>> BeginStep(const StepShare& share) override;
  absl::Status SelectedPositions(const StepShare& share, DeviceStep& step,
                                 std::vector<std::vector<int32_t>>* out) override;
  absl::Status ReadRows(int layer, int slot, int32_t page, int first, int rows, uint8_t* latent,
                        uint8_t* index) override;
  absl::Status ReadPage(int32_t page, int rows, uint8_t* staged) override;
  absl::Status WritePage(int32_t page, int rows, const uint8_t* staged) override;
  // A tier move's whole pages to and from host buffers (pinned slots of the host tier, or the
  // disk tier's staging): per staging chunk one span kernel and one copy per page, on the copy
  // stream (the compute streams' kernels go on meanwhile), waited for once (PlanPageStaging).
  absl::Status ReadPages(const std::vector<int32_t>& pages,
                         const std::vector<uint8_t*>& staged) override;
  absl::Status WritePages(const std::vector<int32_t>& pages,
                          const std::vector<const uint8_t*>& staged) override;
  // To another GPU: NCCL when connected (ConnectPeers), else peer copies; to a CPU device
  // through host staging.
  absl::Status CopyPages(Device& dst, const std::vector<PageCopy>& copies) override;
  absl::StatusOr<bool> ReservedPageUntouched() override;
  // Copies every layer's W_UK and W_UV^T to this GPU (fp32; RESOURCE_EXHAUSTED when they do not
  // fit beside the cache).
  absl::Status PrepareAbsorption(const Absorption& weights) override;
  bool SupportsContextParallel() const override { return true; }

 protected:
  absl::StatusOr<std::unique_ptr<LayerRun>> StartLayer(const StepShare& share, DeviceStep& step,
                                                       const LayerCall& call) override;

 private:
  friend void ConnectPeers(const std::vector<CudaDevice*>& gpus);
  struct State;
  struct Step;
  struct Call;
  CudaDevice(std::string name, const ModelSpec& spec, const CacheLayout& layout);
  int ordinal_ = 0;
  std::unique_ptr<State> s_;
  std::shared_ptr<NcclPeers> nccl_;
  int nccl_rank_ = -1;
};

// Pinned, portable host memory (cudaHostAlloc) for the host tier: every GPU's copy engine reads
// and writes it directly.
HostAllocator PinnedHostMemory();

// Lets the GPUs of one server move pages to each other with NCCL. Without NCCL (it is loaded at
// run time) they use peer copies, and a line on stderr says why.
void ConnectPeers(const std::vector<CudaDevice*>& gpus);

}  // namespace attnd::cuda
