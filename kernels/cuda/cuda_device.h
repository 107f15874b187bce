// The CUDA backend: one GPU's paged caches in device memory and the per-layer DSA operations
// (cache writes, indexer scores, exact radix top-k, page selection, sparse and dense MLA).
// Plain C++: nothing of CUDA or gRPC leaks out of this header.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/tensor.h"
#include "kv_store/kv_cache.h"

namespace attnd::cuda {

// Number of CUDA devices visible (0 without a driver or GPU).
int DeviceCount();

// One step's share of tokens on this GPU, built once per step (plan once, run per layer).
struct StepPlan {
  std::vector<int64_t> rows;           // [n] rows of the layer tensors (step token index)
  std::vector<int64_t> pos;            // [n] absolute positions
  std::vector<uint8_t> dense_prefill;  // [n] 1 = attend every visible key (prefill=dense, q_len>1)
  std::vector<int32_t> table_offset;   // [n] offset of the token's page table in `tables`
  std::vector<int32_t> tables;         // page tables of this device's sequences, concatenated
};

// One layer for the plan's tokens. Inputs are the whole step's host tensors (any wire dtype);
// the device reads its rows. `out` is the whole [T, H, L] host output in out_dtype.
struct LayerCall {
  int layer = 0;
  const LayerInputs* in = nullptr;
  DType out_dtype = DType::kBF16;
  uint8_t* out = nullptr;
  // Optional: [T] attended positions per token, filled for this device's rows.
  std::vector<std::vector<int32_t>>* trace = nullptr;
};

class CudaDevice {
 public:
  // Allocates the caches (cudaMalloc, sized by config) and a stream on GPU `ordinal`.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(int ordinal, const ModelSpec& spec,
                                                            const KvCacheConfig& config);
  ~CudaDevice();
  int ordinal() const { return ordinal_; }

  // Uploads the plan and sizes the step's buffers; replaces any previous step's state. Calls for
  // one device are serialised by the engine (one step runs a layer at a time per device).
  absl::Status BeginStep(uint64_t step, const StepPlan& plan);
  absl::Status RunLayer(uint64_t step, const LayerCall& call);
  void EndStep(uint64_t step);

  // Copies the first `rows` rows of page src to page dst in every layer and slot.
  absl::Status CopyPagePrefix(int32_t src, int32_t dst, int rows);
  // Host staging for moves to and from other devices: [layers*rows*(L+R) | slots*rows*Di] bytes.
  absl::Status ReadPage(int32_t page, int rows, std::vector<uint8_t>* host);
  absl::Status WritePage(int32_t page, int rows, const std::vector<uint8_t>& host);
  // Device-to-device (NVLink/PCIe peer, NCCL-free path) copy of a page prefix to another GPU.
  absl::Status CopyPagePrefixTo(CudaDevice& dst, int32_t src, int32_t dst_page, int rows);
  bool ReservedPageUntouched();

  // The contiguous byte ranges of copying a page prefix to `dst` (every layer and slot), for
  // moving pages with NCCL instead of CopyPagePrefixTo.
  struct Span {
    const void* src;
    void* dst;
    size_t bytes;
  };
  std::vector<Span> PageCopySpans(CudaDevice& dst, int32_t src, int32_t dst_page, int rows);

 private:
  struct State;
  CudaDevice() = default;
  int ordinal_ = 0;
  std::unique_ptr<State> s_;
};

}  // namespace attnd::cuda
