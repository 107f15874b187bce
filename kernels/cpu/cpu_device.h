// The CPU backend as a Device: caches in host memory (KvCache) and the per-layer DSA computation
// (key writes, indexer scores, exact top-k or page selection, sparse and dense MLA) spread over a
// thread pool with the run-time selected ISA's inner loops.
#pragma once

#include <memory>
#include <string>

#include "common/thread_pool.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/device.h"
#include "kv_store/kv_cache.h"

namespace attnd {

class CpuDevice final : public Device {
 public:
  // `pool` and `kernels` outlive the device (several CPU devices share one pool).
  absl::string_view backend() const override { return "cpu"; }
  static absl::StatusOr<std::unique_ptr<CpuDevice>> Create(std::string name, const ModelSpec& spec,
                                                           const CacheLayout& layout,
                                                           ThreadPool* pool,
                                                           const cpu::Kernels* kernels);

  absl::StatusOr<std::unique_ptr<DeviceStep>> BeginStep(const StepShare& share) override;
  absl::Status SelectedPositions(const StepShare& share, DeviceStep& step,
                                 std::vector<std::vector<int32_t>>* out) override;
  absl::Status ReadRows(int layer, int slot, int32_t page, int first, int rows, uint8_t* latent,
                        uint8_t* index) override;
  absl::Status ReadPage(int32_t page, int rows, uint8_t* staged) override;
  absl::Status WritePage(int32_t page, int rows, const uint8_t* staged) override;
  // A tier move's pages: across the device's threads, with stores that bypass the cache (the
  // bytes are not read again soon; common/stream_copy.h).
  absl::Status ReadPages(const std::vector<int32_t>& pages,
                         const std::vector<uint8_t*>& staged) override;
  absl::Status WritePages(const std::vector<int32_t>& pages,
                          const std::vector<const uint8_t*>& staged) override;
  absl::Status CopyPages(Device& dst, const std::vector<PageCopy>& copies) override;
  absl::StatusOr<bool> ReservedPageUntouched() override;
  bool SupportsContextParallel() const override { return true; }

 protected:
  absl::StatusOr<std::unique_ptr<LayerRun>> StartLayer(const StepShare& share, DeviceStep& step,
                                                       const LayerCall& call) override;

 private:
  struct Step;
  struct Call;
  CpuDevice(std::string name, const ModelSpec& spec, KvCache cache, ThreadPool* pool,
            const cpu::Kernels* kernels);
  void WriteKeys(const StepShare& share, int layer, const LayerInputs& in);
  void ConvertQueries(const StepShare& share, Step& st, const LayerCall& call);
  // Row `row` of a query tensor seen as [rows, elems] to fp32 (FP8_E4M3: code x the row's scale).
  void QueryRow(const TensorView& t, int64_t row, int64_t elems, float* dst) const;
  void ConvertIndexQueries(const StepShare& share, Step& st, const LayerInputs& in);
  // The indexer's scores of the tokens that need it, in waves, each token's given to `sink`.
  void Score(const StepShare& share, Step& st, int layer, const LayerRun::ScoreSink& sink);
  void KeepSlots(const StepShare& share, Step& st, int64_t i);
  // A selection given in local positions (context parallelism), kept as Select keeps its own.
  void Keep(const StepShare& share, Step& st, const std::vector<std::vector<int32_t>>& selection);
  // MLA for the share's queries into call.out (and call.lse); absorbed calls get W_UV applied.
  void Attend(const StepShare& share, Step& st, const LayerCall& call);
  // Rows [first, first + rows) of a page of indexer rows to `to` as CacheLayout::IndexRanges
  // stages them, and a page's first `rows` rows back from there.
  void CopyIndexRows(const uint8_t* page, int first, int rows, uint8_t* to) const;
  // A page's first `rows` rows between the cache and its staged form (CacheLayout::StagedBytes),
  // to the staged form or from it, with `copy` (memcpy, or StreamCopy for a tier move's pages).
  void StagePage(int32_t page, int rows, uint8_t* staged, bool to_staged,
                 void (*copy)(void*, const void*, size_t));

  KvCache cache_;
  ThreadPool* pool_;
  const cpu::Kernels* kernels_;
};

}  // namespace attnd
