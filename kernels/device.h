// The device interface every backend implements (kernels/cpu/cpu_device.h, kernels/cuda/
// cuda_device.h): a device owns its caches and runs one layer of a step's plan on them. The
// engine drives every device the same way and never knows which backend one is; only
// kernels/device_factory.cc creates them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/absorption.h"
#include "common/model_spec.h"
#include "common/tensor.h"
#include "kv_store/cache_layout.h"
#include "kv_store/page_table.h"

namespace attnd {

// A block of consecutive queries of one sequence at consecutive positions, each attending a
// contiguous range of keys: the CPU backend shares each converted key tile across the block.
struct QueryBlock {
  int32_t first = 0;  // local token index of the first query
  int32_t count = 0;
};

// One device's share of a step, built once at BeginStep by the engine (plan once, run per layer).
// Tokens are local: token i of the share is row rows[i] of the step's layer tensors.
struct StepShare {
  std::vector<int64_t> rows;  // [n] rows of the layer tensors (step token index), ascending
  std::vector<int64_t> pos;   // [n] absolute positions
  std::vector<int32_t> seq;   // [n] the token's sequence in the page table
  std::vector<int32_t> slot;  // [n] the token's own slot (where its new key rows go)
  // [n] 1 when the query's selection could miss a visible key: full layers run the indexer and
  // top-k for it; 0 when it attends every visible key (short history, or dense prefill).
  std::vector<uint8_t> needs_index;
  std::vector<int32_t> indptr;  // [sequences + 1] CSR page tables of the share's sequences
  std::vector<int32_t> pages;   // [indptr.back()]
  int32_t page_size = 0;
  // Range-attending queries grouped for key-tile sharing: every query on dense layers, the
  // queries that need no indexer on sparse layers. Each list covers its queries in order.
  std::vector<QueryBlock> dense_blocks, sparse_blocks;
  // Longest selection a query can have: the selected-slot buffer's row length.
  int64_t max_selected = 0;
  // An import (write_only step): the share writes key rows and attends nothing, so it needs no
  // query, score, selection or output scratch; needs_index is 0 and there are no query blocks.
  bool write_only = false;
  // Context parallelism (docs/numerics.md): the sequence's other positions live on other servers.
  // Positions above stay local (key 0 is the slice's first); [n] each query's absolute position
  // and its sequence's absolute position of local key 0. Empty on ordinary steps.
  std::vector<int64_t> query_pos, offset;

  int64_t size() const { return static_cast<int64_t>(rows.size()); }
  PageTable table() const { return {indptr.data(), pages.data(), page_size}; }
};

// One layer of a step for a device's share. `in` holds the whole step's tensors (any wire dtype);
// the device reads its rows and writes its rows of `out` ([T, H, L] in out_dtype, or [T, H, V]
// when absorbed).
struct LayerCall {
  int layer = 0;
  const LayerInputs* in = nullptr;
  // Full layers: run the indexer and top-k and keep the selection (as physical slot ids) for the
  // layers that follow (IndexShare); other layers attend the kept one. The engine decides.
  bool select = false;
  DType out_dtype = DType::kBF16;
  uint8_t* out = nullptr;  // null: write-only (write the keys, compute nothing)
  // Optional [T, H] fp32: each query head's natural-log log-sum-exp of its scaled scores over the
  // keys it attended (-inf: none), so attention over disjoint key sets merges exactly.
  float* lse = nullptr;
  // Set when the call gives q_nope instead of q_latent (server-side absorption): the device
  // forms q_latent[t, h] = q_nope[t, h] · W_UK[h] in fp32, attends, and writes
  // out[t, h] = out_latent[t, h] · W_UV[h]^T ([T, H, V]). Prepared by PrepareAbsorption.
  const Absorption* absorb = nullptr;
  // Context parallelism, full layers (Device::SupportsContextParallel). `candidates` set: write
  // the key rows given, run the indexer for the tokens that need it and put each one's best
  // local keys there ([n]; local positions, or local page ids under page_budget, best first,
  // ties to the lower key), attending nothing. `selection` set: keep these local positions
  // ([n], ascending; empty for tokens that need no indexer) instead of selecting, then attend.
  struct LocalCandidates {
    std::vector<int32_t> keys;
    std::vector<float> scores;
  };
  std::vector<LocalCandidates>* candidates = nullptr;
  const std::vector<std::vector<int32_t>>* selection = nullptr;
};

// What a layer call makes a device do (Device::RunLayer's policy, written once): write the call's
// key rows, run the indexer (for candidates, or to select), attend. A backend that stages the
// call's inputs up front (the CUDA one) stages exactly these.
struct LayerNeeds {
  bool keys = false;     // kv_latent, k_rope (index_k on full layers) into the caches
  bool indexer = false;  // index_q and index_w: the indexer's scores
  bool attend = false;   // q_latent (or q_nope) and q_rope: MLA into call.out
};
LayerNeeds NeedsOf(const LayerCall& call);

// A step's state on one device (its uploaded plan, its kept selection, its scratch). Created by
// Device::BeginStep, destroyed when the step ends.
class DeviceStep {
 public:
  virtual ~DeviceStep() = default;
};

// One Device::RunLayer call on one device: the backend's steps, which RunLayer calls in the order
// its policy says. Device::StartLayer creates one per call; it is destroyed when the call returns
// (a backend may hold a lock, and its per-call state, for that long).
class LayerRun {
 public:
  virtual ~LayerRun() = default;
  // The call's key rows into the layer's caches (latent rows; indexer rows on full layers).
  virtual absl::Status WriteKeys() = 0;
  // The indexer: each share token that needs it gets its scores over its `visible` keys (host
  // memory, valid during the call) through sink(token, scores, visible). Calls of the sink may
  // run concurrently, for different tokens.
  using ScoreSink = std::function<void(int64_t token, const float* scores, int64_t visible)>;
  virtual absl::Status Score(const ScoreSink& sink) = 0;
  // The indexer and the selection (kernels/selection.h's rule) for the tokens that need it, kept
  // for the layers that follow.
  virtual absl::Status Select() = 0;
  // Keeps a given selection (per share token, local positions ascending) as Select keeps its own.
  virtual absl::Status Keep(const std::vector<std::vector<int32_t>>& selection) = 0;
  // MLA for the share's queries into call.out (and call.lse): the kept selection for the tokens
  // that need the indexer on sparse layers, key ranges otherwise.
  virtual absl::Status Attend() = 0;
  // The call's work done before RunLayer returns (a GPU waits for its stream).
  virtual absl::Status Finish() { return absl::OkStatus(); }
};

class Device {
 public:
  virtual ~Device() = default;
  const std::string& name() const { return name_; }
  const ModelSpec& spec() const { return spec_; }
  const CacheLayout& layout() const { return layout_; }
  // Which backend this is ("cpu", "cuda"): for ServerInfo and the logs, never for a branch.
  virtual absl::string_view backend() const = 0;

  // Prepares a step's share (uploads its page table, sizes its selection buffers).
  virtual absl::StatusOr<std::unique_ptr<DeviceStep>> BeginStep(const StepShare& share) = 0;
  // One layer for the share: writes its new key rows (when the call has them), then either puts
  // each indexed token's local candidates in call.candidates, or unless write-only keeps
  // call.selection or selects (when call.select) and attends. Every backend's policy, written
  // once over the backend's LayerRun (StartLayer). Different steps may run layers concurrently;
  // one step's layers come one at a time.
  absl::Status RunLayer(const StepShare& share, DeviceStep& step, const LayerCall& call);
  // The kept selection as key positions, per share token (ascending; empty for tokens that need
  // no indexer or before any selection). For traces.
  virtual absl::Status SelectedPositions(const StepShare& share, DeviceStep& step,
                                         std::vector<std::vector<int32_t>>* out) = 0;

  // Rows [first, first + rows) of one page of one layer: latent rows (L+R each) to `latent` and,
  // on full layers (slot >= 0), indexer rows to `index`. Bytes as the cache stores them.
  virtual absl::Status ReadRows(int layer, int slot, int32_t page, int first, int rows,
                                uint8_t* latent, uint8_t* index) = 0;
  // A page's first `rows` rows in every layer and slot, staged as CacheLayout::StagedBytes says.
  virtual absl::Status ReadPage(int32_t page, int rows, uint8_t* staged) = 0;
  virtual absl::Status WritePage(int32_t page, int rows, const uint8_t* staged) = 0;
  // Whole pages (page_size rows) to and from staged[i] at once: a tier move's spill and restore.
  // The default stages them one by one; a GPU issues every copy and waits once.
  virtual absl::Status ReadPages(const std::vector<int32_t>& pages,
                                 const std::vector<uint8_t*>& staged);
  virtual absl::Status WritePages(const std::vector<int32_t>& pages,
                                  const std::vector<const uint8_t*>& staged);
  // Copies page prefixes to `dst` (this device or another with the same layout). The default
  // stages each page through host memory; backends override it for their own kind.
  virtual absl::Status CopyPages(Device& dst, const std::vector<PageCopy>& copies);
  // Whether no byte of the reserved page 0 was ever written, in any layer or indexer slot.
  virtual absl::StatusOr<bool> ReservedPageUntouched() = 0;
  // Makes the absorption weights usable by RunLayer (a GPU copies them to its memory;
  // RESOURCE_EXHAUSTED when they do not fit). Called once, before any call carries them; the
  // weights outlive the device. The default (host backends) keeps nothing.
  virtual absl::Status PrepareAbsorption(const Absorption& weights) { return absl::OkStatus(); }
  // Whether RunLayer serves LayerCall::candidates and ::selection and calls without key rows
  // (context parallelism).
  virtual bool SupportsContextParallel() const { return false; }

 protected:
  Device(std::string name, const ModelSpec& spec, const CacheLayout& layout)
      : name_(std::move(name)), spec_(spec), layout_(layout) {}
  // The backend's steps for one RunLayer call (the share has tokens).
  virtual absl::StatusOr<std::unique_ptr<LayerRun>> StartLayer(const StepShare& share,
                                                               DeviceStep& step,
                                                               const LayerCall& call) = 0;

 private:
  std::string name_;
  ModelSpec spec_;
  CacheLayout layout_;
};

}  // namespace attnd
