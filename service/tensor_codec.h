// Wire tensors (attnd.v1.Tensor) to engine views and back. Bytes sent in the request are viewed
// in place; bytes in a registered shared-memory region are read into a buffer of the request
// only after the layer's shapes have been checked (validate, then allocate), and an output bound
// for a region is written there after the layer ran.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "common/tensor.h"
#include "service/shm_registry.h"

namespace attnd {

// The shared-memory side of one request: the regions it uses (held open until it finishes) and
// the copies made of them. Filled by ViewOf and PrepareOutput.
struct ShmTransfers {
  // Points every pending input's view at its bytes: in place where the region lets it be read
  // there (a data plane's input region, once the transfer landed), else read into a buffer.
  absl::Status ReadInputs();
  // Fails when an output region no longer covers its bytes (checked before a layer runs).
  absl::Status CheckOutputRegions() const;
  // Writes (sends) each output into its region (outputs bound to one).
  absl::Status WriteOutputs();

  struct Pending {
    std::shared_ptr<const Region> region;
    int64_t offset = 0;
    size_t bytes = 0;
    uint64_t transfer = 0;          // a data plane region's transfer id
    const void** target = nullptr;  // inputs: the view's pointer to aim at the bytes once read
    char* staged = nullptr;         // outputs: where the output is built
  };
  std::vector<Pending> inputs;
  std::vector<std::unique_ptr<std::string>> buffers;
  // Outputs bound for regions (one per shard of a sharded step); the buffers of those whose
  // region offers no staging of its own.
  std::vector<Pending> outputs;
  std::vector<std::unique_ptr<std::string>> output_buffers;
  // Time spent reading inputs from regions and writing outputs to them (the wait for data plane
  // transfers to land comes before the call runs, and is not counted):
  // LayerOutput.transfer_seconds.
  double seconds = 0;
};

// The input tensors of a layer message by name, in the order ViewOf reads them (the data plane's
// wait for their transfers walks the same list: AttentionService::AfterLandings).
std::array<std::pair<const char*, const v1::Tensor*>, 8> InputTensors(const v1::LayerInputs& in);

// Views of the seven tensors of a layer message, into *out (valid while `in` and `transfers`
// live; *out must stay where it is until transfers->ReadInputs() ran). An unset tensor is
// `present == false`. INVALID_ARGUMENT names the tensor for a bad datatype string, rank, or both
// data and shm; NOT_FOUND for an unknown region. A shared-memory tensor's data points at nothing
// readable until transfers->ReadInputs() ran. Shapes and byte counts are checked by the engine.
absl::Status ViewOf(const v1::LayerInputs& in, const ShmAccess& shm, ShmTransfers* transfers,
                    LayerInputs* out);

// Sizes `out` for [tokens, heads, latent] in `dtype` and returns where to write it: the reply's
// bytes, or a buffer that transfers->WriteOutputs() copies into `out_shm`'s region (the reply then
// carries that reference). INVALID_ARGUMENT when out_shm's size is not the output's, or when an
// output sent as bytes would not fit in a message of max_message_bytes.
absl::StatusOr<void*> PrepareOutput(const v1::LayerInputs& in, v1::Tensor* out, DType dtype,
                                    int64_t tokens, int heads, int latent,
                                    int64_t max_message_bytes, const ShmAccess& shm,
                                    ShmTransfers* transfers);

// LayerInputs.out_datatype into views->out_dtype: true when the reply is FP8_E4M3 (the engine
// then writes FP32, which QuantizeReply encodes). INVALID_ARGUMENT for an unknown datatype, any
// on a write-only step, or FP8_E4M3 with out_shm.
absl::StatusOr<bool> ReplyDType(const v1::LayerInputs& in, bool write_only, LayerInputs* views);

// `out` as FP8_E4M3 [tokens, heads, width]: each (token, head) row's e4m3 codes with one FP32
// power-of-two scale (scales [tokens, heads, 1]), from the fp32 rows `values`.
void QuantizeReply(const float* values, int64_t tokens, int heads, int width, v1::Tensor* out);

// Bytes a message may need beyond its tensors' payloads (tags, lengths, small fields).
inline constexpr int64_t kMessageFramingBytes = 1024;

}  // namespace attnd
