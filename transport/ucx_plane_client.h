// A client's end of the UCX data plane (docs/data-plane.md): its worker, its output region (its
// own memory, registered once, where the server's outputs land), the server's input region's
// space handed out to calls in flight, and the transfer ids. Used by client/attnd_client.cc and,
// through transport/plane_c_api.h, by the Python client. Thread safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/ucx_worker.h"

namespace attnd::transport {

// First-fit space of [0, size) handed out in aligned pieces (the regions of calls in flight).
class SpaceMap {
 public:
  explicit SpaceMap(int64_t size) : size_(size) {}
  // Empties the map and makes it `size` bytes.
  void Reset(int64_t size);
  // The offset of `bytes` free bytes (aligned to 256), or -1 when they do not fit now (or
  // bytes <= 0).
  int64_t Take(int64_t bytes);
  void Give(int64_t offset);
  int64_t size() const { return size_; }

 private:
  std::mutex mu_;
  int64_t size_;
  std::map<int64_t, int64_t> used_;  // offset -> bytes
};

class UcxPlaneClient {
 public:
  // A worker and an output region of output_bytes (0: outputs come back in replies); `devices`
  // as UcxWorker::Create's (LoopbackDevices() for a server reached over loopback).
  static absl::StatusOr<std::unique_ptr<UcxPlaneClient>> Create(int64_t output_bytes,
                                                                const std::string& devices = "");
  ~UcxPlaneClient();

  int64_t output_bytes() const { return output_.size(); }
  // This end's worker address, for the handshake (the server then pushes outputs to it).
  const std::string& address() const { return worker_->address(); }

  // The handshake's reply: the plane's id and secret, the server's worker, the input region's
  // size, whether the server pushes outputs. Connects the endpoint.
  absl::Status Attach(uint64_t plane, const std::string& token, const std::string& server_address,
                      int64_t input_bytes, bool pushes = false);

  // Tells the server every `period` (the handshake's keepalive) that this end lives, so that
  // the server may close its plane soon after this process dies rather than when it stood idle
  // ten minutes. Call once, after Attach.
  void KeepAlive(absl::Duration period);

  // Space in the server's input region / this client's output region for one call.
  SpaceMap& input_space() { return input_; }
  SpaceMap& output_space() { return output_; }

  uint64_t NextTransfer() { return next_transfer_.fetch_add(1); }

  // Sends n bytes at src into [offset, offset + n) of the server's input region as `transfer`;
  // src must stay valid until the returned send's Wait.
  std::shared_ptr<UcxWorker::Pending> Put(const void* src, size_t n, int64_t offset,
                                          uint64_t transfer);
  // The pieces back to back from `offset` on, as one transfer (one message).
  std::shared_ptr<UcxWorker::Pending> PutPieces(std::vector<UcxWorker::Piece> pieces,
                                                int64_t offset, uint64_t transfer);
  // Output `transfer` is one this client asks for in a call about to be sent: from a server
  // that pushes, only such outputs are taken (one of a call given up on, or never made, is
  // dropped unread). Await and Forget end it.
  void Want(uint64_t transfer);
  // Pulls output `transfer` (which the server staged at [offset, offset + n) of the output
  // region once the reply named it; a server that pushes sent it unasked), waits until it
  // landed and returns where its bytes are
  // (valid until that space is given back; the expected buffer, if Expect named one).
  // DEADLINE_EXCEEDED when it has not by `deadline`; UNAVAILABLE when the server's endpoint failed.
  absl::StatusOr<const char*> Await(uint64_t transfer, int64_t offset, size_t n,
                                    absl::Time deadline);
  // Output `transfer` of n bytes lands at `dest` (the caller's own buffer, which must stay valid
  // until Await or Forget) instead of the output region: no copy out of the region after.
  void Expect(uint64_t transfer, char* dest, size_t n);
  // Non-OK once the endpoint to the server failed (the plane is of no further use).
  absl::Status Lost();
  // Forgets an output transfer that will not be awaited (the call failed): an expected
  // destination, or (from a server that pushes) its space in the region, is no longer written
  // once this returns (a receive into it already under way is waited for; none of another
  // transfer's is).
  void Forget(uint64_t transfer);

 private:
  explicit UcxPlaneClient(int64_t output_bytes) : input_(0), output_(output_bytes) {}
  void OnToClient(const UcxWorker::Message& m);
  // Waits for output `transfer` to land (the rest of Await).
  absl::StatusOr<const char*> AwaitLanding(uint64_t transfer, int64_t offset, size_t n,
                                           absl::Time deadline);
  void Land(uint64_t transfer, int64_t offset, int64_t length, absl::Status s);
  void LandLocked(uint64_t transfer, int64_t offset, int64_t length, absl::Status s);  // mu_ held

  std::unique_ptr<UcxWorker> worker_;
  char* out_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  SpaceMap input_, output_;
  std::atomic<uint64_t> next_transfer_{1};
  uint64_t plane_ = 0;
  std::string token_;
  uint64_t endpoint_ = 0;
  std::atomic<bool> pushes_{false};  // set by Attach

  struct Landed {
    int64_t offset = 0, length = 0;
    absl::Status status;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Landed> landed_;
  std::map<uint64_t, std::pair<char*, size_t>> expected_;  // transfer -> the caller's buffer
  std::map<uint64_t, int> receiving_;  // rendezvous receives into expected buffers, by transfer
  std::set<uint64_t> wanted_;          // Want'ed, not yet awaited or forgotten
  absl::Status lost_;
};

}  // namespace attnd::transport
