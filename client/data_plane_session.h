// A C++ client's use of the server's UCX data plane (docs/data-plane.md): Stage moves a layer
// call's tensors into the server's input region (UCX, from the caller's own bytes: no copy) and
// names them in the message instead; Finish waits for the sends and puts an output the server
// sent into the client's output region back into the reply, so callers see an ordinary
// LayerOutput. Calls in flight at once each get their own space in both regions. Thread safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "transport/ucx_worker.h"

namespace attnd::transport {
class UcxPlaneClient;
}  // namespace attnd::transport

namespace attnd::client {

class DataPlaneSession {
 public:
  // Connects a plane on `stub`'s server (ConnectDataPlane) with regions of `region_bytes` each;
  // FAILED_PRECONDITION when the server has none. `info` is the server's ServerInfo (the output
  // widths: kv_lora_rank, and v_head_dim for absorbed calls). `prepare` readies each call's
  // context (credentials, deadline). `local`: the server is reached on this host (IsLocalTarget),
  // and this end's UCX listens on the loopback interfaces only.
  static absl::StatusOr<std::unique_ptr<DataPlaneSession>> Connect(
      v1::Attention::Stub* stub, const v1::ServerInfoResponse& info, int64_t region_bytes,
      const std::function<void(grpc::ClientContext*)>& prepare, bool local = false);
  ~DataPlaneSession();

  // One call's use of the plane.
  struct Call {
    std::vector<int64_t> input_space;  // offsets to give back
    std::vector<std::shared_ptr<transport::UcxWorker::Pending>> sends;
    int64_t output_offset = -1;
    uint64_t output_transfer = 0;
    size_t output_bytes = 0;
    bool to_dest = false;  // the output lands in the caller's buffer
    DataPlaneSession* session = nullptr;
    ~Call();  // waits for the sends (bounded) and gives the space back unless the plane broke
  };
  // `in` as the message to send (*wire) with its tensors' bytes sent by the plane, and the output
  // asked for in the output region when the reply would carry one. False when the call is
  // better sent as it is: the plane broke, nothing to move, or the regions are full now.
  // With `dest`: the output lands there (dest_bytes, the caller's buffer) rather than in the
  // output region.
  bool Stage(const v1::LayerInputs& in, v1::LayerInputs* wire, Call* call, char* dest = nullptr,
             size_t dest_bytes = 0);
  // After the reply: waits for the sends, then for the output (when the plane carried it) and
  // moves it into out->out().data (or leaves it in the caller's buffer, data empty).
  absl::Status Finish(Call* call, v1::LayerOutput* out);

  const std::string& plane() const { return plane_; }
  // A call that used the plane failed with `s`: when it says the server holds the plane no more
  // (closed, or idle too long), the session is of no further use; so it is when the call's
  // outcome is unknown (a deadline, a cancel, the connection lost: the server may still be using
  // the call's space, which then goes to no other call). Before the call's Call goes.
  void Failed(const absl::Status& s);
  // The plane can no longer carry calls (its endpoint failed, a send never completed, the server
  // dropped it): the client connects a new one, or sends bytes.
  bool broken() const;

 private:
  DataPlaneSession() = default;
  std::unique_ptr<transport::UcxPlaneClient> ends_;
  std::string plane_, input_region_, output_region_;
  int kv_lora_rank_ = 0, v_head_dim_ = 0;
  std::atomic<bool> broken_{false};
};

// The reply's output copied into the caller's buffer (dest, `bytes` long) when the plane did not
// land it there, its data then cleared; INVALID_ARGUMENT when the sizes differ or it is FP8.
absl::Status IntoCallerBuffer(v1::LayerOutput* out, void* dest, size_t bytes);

}  // namespace attnd::client
