// The layer call on the wire: a v1::LayerInputs decoded into the engine's LayerRequest (which
// option applies to which step kind: the table in attention.proto's LayerInputs, mirrored case
// for case by DecodeLayer), the reply's size bound checked in one place, the output's sink (the
// reply's bytes, an FP32 staging buffer for an FP8 reply, or a shared-memory slot) and the
// result encoded into a v1::LayerOutput.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "engine/engine.h"
#include "engine/layer_request.h"
#include "service/shm_registry.h"
#include "service/tensor_codec.h"

namespace attnd {

// One decoded layer message. Not movable: the request's views point into its members until the
// call ends (shared-memory inputs are read into `shm`'s buffers by the sink).
struct DecodedLayer {
  DecodedLayer() = default;
  DecodedLayer(const DecodedLayer&) = delete;
  DecodedLayer& operator=(const DecodedLayer&) = delete;

  LayerRequest request;
  Candidates selection;    // request.selection points here (kSelection)
  ShmTransfers shm;        // the message's shared-memory regions and copies
  bool fp8_reply = false;  // out_datatype FP8_E4M3: the engine writes FP32, the reply e4m3
};

// Decodes `in` for an unsharded step of kind `info` (write-only, context-parallel or ordinary)
// into *out: the mode, the views (shared-memory ones readable after the sink's Prepare), the
// selection, what the reply carries. INVALID_ARGUMENT or FAILED_PRECONDITION, naming the field,
// for an option the step kind does not take.
absl::Status DecodeLayer(const v1::LayerInputs& in, const Engine::StepInfo& info,
                         const ShmAccess& shm, DecodedLayer* out);

// What a reply may hold: the message limit, and how many attended positions come back.
struct ReplyLimits {
  int64_t max_message_bytes = 0;
  int64_t max_attended_positions = 0;
};

// INVALID_ARGUMENT, naming what the caller asked for, when the reply of a call of `shape` could
// pass the limits: the output (inline unless out_shm; e4m3 codes and scales for an FP8 reply),
// its log-sum-exp, its attended positions, its candidates. The one reply-size check.
absl::Status CheckReplyFits(const LayerShape& shape, const v1::LayerInputs& in, bool fp8_reply,
                            const ReplyLimits& limits);

// The sink of an unsharded call: checks the reply's size, sizes the output in the reply (or
// stages FP32 for an FP8 reply, or a buffer for out_shm), then reads the shared-memory inputs
// and checks the output regions.
class ReplySink final : public LayerSink {
 public:
  ReplySink(const v1::LayerInputs& in, DecodedLayer* decoded, const ShmAccess& shm,
            const ReplyLimits& limits, v1::LayerOutput* out)
      : in_(in), decoded_(decoded), shm_(shm), limits_(limits), out_(out) {}
  absl::StatusOr<void*> Prepare(const LayerShape& shape) override;
  // The FP32 rows an FP8 reply is quantised from (empty otherwise).
  const std::string& staged() const { return staged_; }

 private:
  const v1::LayerInputs& in_;
  DecodedLayer* decoded_;
  const ShmAccess& shm_;
  ReplyLimits limits_;
  v1::LayerOutput* out_;
  std::string staged_;
};

// Heads [h0, h0 + hn) of a [T, H] fp32 log-sum-exp as a reply's FP32 [T, hn] tensor.
void SetLse(const std::vector<float>& lse, int64_t tokens, int heads, int h0, int hn,
            v1::Tensor* t);

// The result of a call into its reply (besides the output the sink already holds): the FP8
// reply's codes and scales, the log-sum-exp, the attended positions or the candidates, the
// layer and whether it committed.
void EncodeLayerResult(const LayerResult& result, const v1::LayerInputs& in,
                       const DecodedLayer& decoded, const ReplySink& sink, v1::LayerOutput* out);

}  // namespace attnd
