// One layer call as the engine takes it: what the caller sends (LayerRequest), what the call
// will produce once every rule passed (LayerShape), where the output goes (LayerSink) and what
// comes back besides it (LayerResult). Engine::RunLayer is the one entry point:
//
//   step looked up once -> CheckLayerRequest (every rule, once) -> LayerShape
//     -> sink->Prepare(shape) (allocate the reply or the shared-memory slot, read shm inputs)
//     -> finite and scale checks on the bytes -> compute on every device -> commit
//
// Any error after the step was found aborts the step, so every sequence is left as before it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/candidates.h"
#include "common/model_spec.h"
#include "common/tensor.h"

namespace attnd {

// What a layer call asks for. Which modes a step takes:
//
//   step kind             | full layer                      | dense / shared layer
//   ----------------------+---------------------------------+---------------------
//   ordinary              | kAttend                         | kAttend
//   write-only (import)   | kAttend (keys only, no output)  | kAttend (keys only)
//   context-parallel      | kCandidates, then kSelection    | kAttend
//   attend-only (CP)      | kCandidates, then kSelection    | kAttend (no keys)
enum class LayerMode {
  kAttend,      // the step's ordinary call (on a write-only step: write the keys, no output)
  kCandidates,  // a context-parallel full layer's first call: each query's local candidates
  kSelection,   // its second call: attend `LayerRequest::selection`, every server's merged
};
const char* LayerModeName(LayerMode mode);

struct LayerRequest {
  int layer = 0;
  LayerInputs tensors;
  LayerMode mode = LayerMode::kAttend;
  // kSelection only: every server's candidates merged (MergeCandidates); outlives the call.
  const Candidates* selection = nullptr;
  // [T, H] fp32 natural-log log-sum-exp of each query head's scaled scores (-inf: no key).
  bool want_lse = false;
  // Each query's attended key positions (LayerTrace), for tests and debugging.
  bool want_trace = false;
  // The result names the step's sequences and their new lengths when the layer commits
  // (LayerResult::committed: the replicator's commit hook).
  bool want_committed = false;
};

// What a checked call produces, known before any output is allocated.
struct LayerShape {
  int64_t tokens = 0;                // T
  int heads = 0;                     // H
  int width = 0;                     // per-head output width: L, or V when absorbed
  DType out_dtype = DType::kBF16;    // the output's datatype (never FP8: the service quantises)
  size_t out_bytes = 0;              // T * H * width * size(out_dtype); 0: no output
  size_t lse_floats = 0;             // T * H when want_lse, else 0
  int64_t trace_positions = 0;       // want_trace: at most this many positions in all, else 0
  int64_t candidates_per_query = 0;  // kCandidates: at most this many per query, else 0
  bool absorbed = false;             // the call gave q_nope: [T, H, V] out
  LayerKind kind = LayerKind::kDense;
  bool last_layer = false;  // the call commits the step when it succeeds
};

// What each query attended on a layer (for tests and debugging).
struct LayerTrace {
  std::vector<std::vector<int32_t>> keys;  // [T] attended key positions, ascending
};

// Where a call's output goes. Prepare is called once per call, after every rule passed and
// before any compute: it returns shape.out_bytes of writable memory (any pointer when there is
// no output), or an error, which aborts the step with nothing changed. It may also do the
// caller's own last checks and reads (the service reads shared-memory inputs there). The memory
// stays valid until RunLayer returns.
class LayerSink {
 public:
  virtual ~LayerSink() = default;
  virtual absl::StatusOr<void*> Prepare(const LayerShape& shape) = 0;
};

// A caller-owned buffer of `bytes`: INVALID_ARGUMENT "output buffer: ..." when the call's output
// has another size.
class BufferSink final : public LayerSink {
 public:
  BufferSink(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  absl::StatusOr<void*> Prepare(const LayerShape& shape) override;

 private:
  void* data_;
  size_t bytes_;
};

// What a successful call returns besides the output.
struct LayerResult {
  LayerShape shape;
  std::vector<float> lse;  // [T, H] when want_lse
  LayerTrace trace;        // when want_trace
  Candidates candidates;   // kCandidates: absolute keys, best first per query
  bool committed = false;  // the last layer ran: the step is committed
  // committed and want_committed: each sequence of the step, batch order, at its new length.
  struct Committed {
    std::string id;
    int64_t length = 0;
  };
  std::vector<Committed> committed_sequences;
};

}  // namespace attnd
